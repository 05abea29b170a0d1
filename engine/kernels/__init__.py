"""Optional native CPU kernels, compiled on first use with torch's C++ extension loader.

`native()` returns the compiled module or None (neither AVX-512 with bf16 nor AVX2 with FMA, no
compiler, or EAGLE_SERVE_NATIVE_KERNELS=0); callers then fall back to oneDNN / F.linear. The build is cached
under the torch extensions folder (TORCH_EXTENSIONS_DIR), in a folder named for a digest of the sources,
headers, compiler flags and torch version: only the first start with those pays for it (~40 s on the
CPUs measured, ~100 s on a 2-core Zen 3), and checkouts with other sources build beside it instead of
over it. The build is AVX-512 (with bf16 and VNNI dot products, and AMX tiles where
the CPU has them) or AVX2 + FMA, the first of BUILDS the CPU runs; EAGLE_SERVE_NATIVE_ISA=avx2 picks the AVX2
build on an AVX-512 CPU too (a name the CPU cannot run leaves the kernels off, an unknown one is refused).

EAGLE_SERVE_NTA_STREAMS=1 / 0 (or true/false, yes/no, on/off) turns the non-temporal streaming of
large weights on / off (default: on AMD CPUs only, where it measured faster; on an Intel Xeon it
cost 45% of plain decoding's speed: engine/kernels/cpu_gemv.cpp). It applies to the AVX-512 and
AVX2 loops only: products that run as AMX tiles (Intel, inputs a multiple of 32) do not stream that way.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import sys
import time

from eagle_serve.engine.config import env_flag


log = logging.getLogger(__name__)
# The module is built for one of two instruction sets, the first this CPU has (the sources are
# written once over simd.h's vector type). -fopenmp: at::parallel_for is OpenMP inline code.
BUILDS = (  # (name, CPU flags it needs, compiler flags)
    # (every CPU with AVX-512 bf16 has VNNI too: Cooper Lake, Sapphire Rapids and later, Zen 4 and later;
    # and F16C, the half-precision conversions GGUF block scales take)
    ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"},
     ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c"]),
    ("avx2", {"avx2", "fma"}, ["-O3", "-fopenmp", "-mavx2", "-mfma"]),
)
SOURCES = ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_decode.cpp", "cpu_gguf.cpp")


def kernel_files(folder: str) -> list[str]:
    """The sources the build compiles and every header beside them."""
    return [os.path.join(folder, f) for f in SOURCES] + sorted(glob.glob(os.path.join(folder, "*.h")))


def build_name(isa_name: str, files: list[str], cflags: list[str]) -> str:
    """The extension's name, and its build folder's: the instruction set and a digest of the files'
    names and contents, the compiler flags and torch's version. Other sources never share a folder
    (where each would rebuild over the other); identical ones, from any path, reuse one build."""
    import torch
    digest = hashlib.sha256()
    for path in sorted(files, key=os.path.basename):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    digest.update("\0".join([*cflags, torch.__version__]).encode())
    return f"eagle_serve_cpu_kernels_{isa_name}_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> str:
    """The folder torch's extension loader builds `name` in (made if missing): TORCH_EXTENSIONS_DIR/name,
    else name under its per-user cache, one folder per Python and CUDA version."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


def _cpuinfo(key: str) -> str:
    """The value of /proc/cpuinfo's first `key` line ("" where there is none or it is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def isa():
    """The build (name, CPU flags, compiler flags) of BUILDS this CPU runs, or None.
    EAGLE_SERVE_NATIVE_ISA=avx2 picks the AVX2 build on a CPU that has both."""
    want = os.environ.get("EAGLE_SERVE_NATIVE_ISA", "")
    names = [b[0] for b in BUILDS]
    if want and want not in names:
        raise ValueError(f"EAGLE_SERVE_NATIVE_ISA={want!r}: expected one of {', '.join(names)}")
    have = cpu_flags()
    return next((b for b in BUILDS if b[1] <= have and want in ("", b[0])), None)


def cpu_model() -> str:
    """/proc/cpuinfo's model name, or ""."""
    return _cpuinfo("model name")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel", ...), or ""."""
    return _cpuinfo("vendor_id")


def wide_packed() -> bool:
    """Whether packed bf16 products beat oneDNN's bf16 GEMM well past 16 rows here: the AVX-512
    build on an AMD CPU (VDPBF16PS at full rate, no AMX; engine/layers.py WIDE_PACKED_MAX_ROWS)."""
    build = isa()
    return build is not None and build[0] == "avx512" and cpu_vendor() == "AuthenticAMD"


@functools.cache
def native():
    """The compiled module (skinny_linear, paged_attention, add_rms_norm) or None."""
    if os.environ.get("EAGLE_SERVE_NATIVE_KERNELS", "1") == "0":
        return None
    build = isa()
    if build is None:
        want = os.environ.get("EAGLE_SERVE_NATIVE_ISA")
        log.info("native CPU kernels need %s; using oneDNN / torch",
                 f"the {want} build's CPU flags (EAGLE_SERVE_NATIVE_ISA)" if want else "AVX-512 with bf16, or AVX2 with FMA")
        return None
    try:
        mod = _load(build[0], build[2])
    except Exception as e:  # no compiler, no ninja, ...: fall back, loudly
        log.warning("native CPU kernels unavailable (%s); using oneDNN / torch", e)
        return None
    configure(mod)
    return mod


# A build holds a lock file in its folder; one killed mid-build leaves it behind, and torch's loader
# then waits for it forever. No build takes this long (a few minutes on two cores).
STALE_LOCK_SECONDS = 900.0


def _clear_stale_lock(folder: str) -> None:
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nothing builds there
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        try:
            os.remove(lock)
        except OSError:
            pass  # another process removed it first


def _load(isa_name: str, cflags: list[str]):
    """Build the module, or load the build cached for these sources and flags; logs which and how long."""
    from torch.utils.cpp_extension import load
    # the `ninja` wheel installs its binary next to the interpreter, maybe not on PATH
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    here = os.path.dirname(__file__)
    name = build_name(isa_name, kernel_files(here), cflags)
    folder = build_directory(name)
    _clear_stale_lock(folder)
    cached = os.path.exists(os.path.join(folder, name + ".so"))
    log.info("start-up: native CPU kernels (%s build): %s", isa_name, f"loading the cached build in {folder}"
             if cached else f"building in {folder} (no build of these sources and flags yet; once)")
    start = time.perf_counter()
    mod = load(name, [os.path.join(here, f) for f in SOURCES], extra_cflags=cflags, build_directory=folder,
               verbose=False)
    log.info("start-up: native CPU kernels %s in %.1f s", "loaded from cache" if cached else "built",
             time.perf_counter() - start)
    return mod


def configure(mod) -> None:
    """Apply EAGLE_SERVE_NTA_STREAMS to a compiled kernel module (the CLI's boolean spellings;
    anything else is refused: a typo would silently leave the default)."""
    try:
        on = env_flag(os.environ.get("EAGLE_SERVE_NTA_STREAMS", ""))
    except ValueError as e:
        raise ValueError(f"EAGLE_SERVE_NTA_STREAMS={e}") from None
    if on is not None:
        mod.set_nta_streams(on)


def skinny_linear():
    mod = native()
    return None if mod is None else mod.skinny_linear
