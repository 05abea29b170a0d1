"""The engine thread: one thread per process runs every model computation.

Measured on the 2-core CPU (bench/bench_threads.py, bench/results/threads.json): a model built
on one thread and stepped on another decodes at 0.58x the speed of one built and stepped on the
same thread, and at 0.66x after another thread has merely run a few matmuls (the OpenMP runtime
keeps a thread team per calling thread, and the teams compete for the same cores). So the model is built, profiled and stepped on this one thread:
the `LLM` front end builds through it and runs `generate` on it, and `AsyncEngine` awaits its
steps on it. It is torch-free itself: only a single-thread executor.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def engine_executor() -> ThreadPoolExecutor:
    """The process's engine thread (started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="eagle-engine", initializer=_mark)
        return _executor


def _mark() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()


def on_engine_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) run on the engine thread (directly when already there); its result
    or exception comes back to the caller."""
    if threading.get_ident() == _thread_ident:
        return fn(*args, **kwargs)
    return engine_executor().submit(fn, *args, **kwargs).result()
