"""The native kernels' build folder: keyed by the sources, headers and compiler flags, under torch's
extensions root; the loader says whether it built or reused a build. Nothing here compiles."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time

import torch.utils.cpp_extension

from eagle_serve.engine import kernels

KERNELS = os.path.dirname(kernels.__file__)
AVX2_FLAGS = kernels.BUILDS[1][2]


def _copy_kernels(folder) -> str:
    os.makedirs(folder)
    for path in kernels.kernel_files(KERNELS):
        shutil.copy(path, folder)
    return str(folder)


def test_kernel_files_are_the_sources_and_every_header_they_include():
    names = [os.path.basename(p) for p in kernels.kernel_files(KERNELS)]
    assert names[:len(kernels.SOURCES)] == list(kernels.SOURCES)
    for src in kernels.SOURCES:
        with open(os.path.join(KERNELS, src)) as f:
            assert set(re.findall(r'#include "([^"]+)"', f.read())) <= set(names), src


def test_build_name_keys_on_the_files_and_the_flags(tmp_path):
    a, b = _copy_kernels(tmp_path / "a"), _copy_kernels(tmp_path / "b")
    name = kernels.build_name("avx2", kernels.kernel_files(a), AVX2_FLAGS)
    assert re.fullmatch(r"eagle_serve_cpu_kernels_avx2_[0-9a-f]{16}", name)
    # the same files from another checkout share the build
    assert kernels.build_name("avx2", kernels.kernel_files(b), AVX2_FLAGS) == name
    assert kernels.build_name("avx2", kernels.kernel_files(a), [*AVX2_FLAGS, "-DEXTRA"]) != name
    with open(os.path.join(b, "simd.h"), "a") as f:  # a header differs: its own folder
        f.write("\n// another version\n")
    assert kernels.build_name("avx2", kernels.kernel_files(b), AVX2_FLAGS) != name


def test_build_directory_is_the_name_under_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernels.build_name("avx2", kernels.kernel_files(KERNELS), AVX2_FLAGS)
    assert kernels.build_directory(name) == os.path.join(str(tmp_path), name)


def test_native_logs_a_build_then_a_load_from_the_cache(tmp_path, monkeypatch, caplog):
    """The first start with these sources builds; the next one finds the library and reuses it."""
    loads = []

    class Module:
        def set_nta_streams(self, on):
            pass

    def fake_load(name, sources, extra_cflags, build_directory, verbose):
        loads.append((name, build_directory, extra_cflags))
        open(os.path.join(build_directory, name + ".so"), "w").close()
        return Module()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("EAGLE_SERVE_NATIVE_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "isa", lambda: kernels.BUILDS[1])
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    caplog.set_level(logging.INFO, logger="eagle_serve")
    for _ in range(2):
        assert isinstance(kernels.native.__wrapped__(), Module)
    (name, folder, flags), again = loads
    assert again == loads[0] and flags == AVX2_FLAGS
    assert folder == os.path.join(str(tmp_path), name) and name.startswith("eagle_serve_cpu_kernels_avx2_")
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: native CPU kernels ")]
    assert re.fullmatch(r"start-up: native CPU kernels built in \d+\.\d s", done[1]), done
    assert re.fullmatch(r"start-up: native CPU kernels loaded from cache in \d+\.\d s", done[3]), done
    assert "building in" in done[0] and "loading the cached build in" in done[2]


def test_a_lock_left_by_a_killed_build_is_cleared_once_stale(tmp_path, caplog):
    """torch's loader waits for a build folder's lock file to go; a stale one is removed, a
    fresh one (a build still running) is left alone."""
    lock = tmp_path / "lock"
    lock.write_text("")
    kernels._clear_stale_lock(str(tmp_path))
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, "eagle_serve"):
        kernels._clear_stale_lock(str(tmp_path))
    assert not lock.exists() and "did not finish" in caplog.text
    kernels._clear_stale_lock(str(tmp_path))  # no lock: nothing to do
