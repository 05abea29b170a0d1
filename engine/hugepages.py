"""Transparent huge pages for the tensors a CPU decode step streams through.

A decode step reads every weight once (about 270 MB for the default model in bf16). In 4 KiB
pages that is ~66,000 pages a step, far past any TLB, so the stream pays a page walk every 4
KiB, and hardware prefetchers commonly stop at 4 KiB page boundaries. Linux backs an
anonymous mapping with 2 MiB pages where the mapping asks for it (`madvise(MADV_HUGEPAGE)`, in
the `madvise` mode many distributions default to) or where the system says `always`. PyTorch's CPU allocator asks only when the
process starts with THP_MEM_ALLOC_ENABLE=1, which a library cannot count on, so the engine
allocates these tensors itself: `empty(nbytes)` maps fresh memory aligned to 2 MiB and advises
it before anything touches it, and `arena(tensors)` moves many small tensors (a model's packed
weights, 0.2-1.8 MB each, too small for a huge page on their own) into one such buffer as
views. Where the kernel offers no huge pages (`never`, not Linux) the same calls fall back to
ordinary allocations: the numbers are the same either way, only the speed differs.
"""
from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
ALIGN = 4096  # each tensor of an arena starts on its own base page (the kernels' 64-byte loads)
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_counts = {"arenas": 0, "advised_bytes": 0}


def thp_mode() -> str:
    """The kernel's transparent huge page mode: 'always', 'madvise', 'never', or 'unavailable'
    (no such file: not Linux, or a kernel without THP)."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def enabled() -> bool:
    """Whether engine buffers ask for huge pages: the kernel offers them (always / madvise) and
    EAGLE_SERVE_HUGEPAGES is not 0."""
    if os.environ.get("EAGLE_SERVE_HUGEPAGES", "1") == "0":
        return False
    return thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` bytes starting on a 2 MiB boundary in a fresh
    anonymous mapping advised for huge pages (its pages are faulted in by the first write, as
    huge pages where the kernel has them free). Falls back to torch.empty where huge pages are
    off or the mapping fails. The mapping lives as long as the tensor (or a view of it) does."""
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    base = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    off = -base.data_ptr() % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, size)
    except OSError:  # e.g. a seccomp profile refusing madvise: ordinary pages, same memory
        pass
    else:
        _counts["advised_bytes"] += size
    return base[off:off + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device): on the CPU in huge pages where `empty` gives them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for x in shape:
        n *= int(x)
    t = empty(n * dtype.itemsize).view(dtype).view(shape)
    t.zero_()
    return t


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU `tensors` (same dtypes, shapes and values) placed one after another
    in one `empty` buffer, each on its own 4 KiB boundary. Undefined / empty tensors and ones
    on other devices come back as they are."""
    movable = [i for i, t in enumerate(tensors) if t is not None and t.numel() and t.device.type == "cpu"]
    offsets, total = {}, 0
    for i in movable:
        offsets[i] = total
        total += -(-tensors[i].numel() * tensors[i].element_size() // ALIGN) * ALIGN
    if not movable:
        return list(tensors)
    buf = empty(total)
    _counts["arenas"] += 1
    out = list(tensors)
    for i in movable:
        t = tensors[i].contiguous()
        nb = t.numel() * t.element_size()
        view = buf[offsets[i]:offsets[i] + nb].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[i] = view
    return out


def trim_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading frees staging
    copies of the weights (a GGUF's packed blocks before the arena, for one), which glibc
    otherwise keeps mapped: resident memory stays near the weights' bytes plus the KV cache
    (bench/results/quantized.json). False where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def huge_bytes() -> int:
    """This process's anonymous memory in huge pages now (AnonHugePages of /proc/self/smaps_rollup),
    or -1 where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def stats() -> dict:
    """What this process asked for: THP mode, arenas built, bytes advised, bytes in huge pages."""
    return {"thp_mode": thp_mode(), "enabled": enabled(), "arenas": _counts["arenas"],
            "advised_bytes": _counts["advised_bytes"], "anon_huge_bytes": huge_bytes()}


def summary() -> str:
    """One line for a server's start-up log."""
    st = stats()
    if not st["enabled"]:
        why = "EAGLE_SERVE_HUGEPAGES=0" if st["thp_mode"] in ("always", "madvise") else f"kernel THP mode {st['thp_mode']}"
        return f"huge pages off ({why}): weights and KV cache in 4 KiB pages"
    got = st["anon_huge_bytes"]
    return (f"huge pages: {st['advised_bytes'] / 2**20:.0f} MiB of weights, KV cache and head features asked for "
            f"(kernel THP mode {st['thp_mode']}), {got / 2**20:.0f} MiB of this process in huge pages"
            if got >= 0 else f"huge pages: {st['advised_bytes'] / 2**20:.0f} MiB asked for")
