"""The engine thread: one thread per process runs every model computation.

On the CPU a model stepped on another thread than the one that built it decodes markedly
slower (the OpenMP runtime keeps a thread team per calling thread, and the teams compete for
the same cores). So the model is built, profiled and stepped on this one thread: the `LLM` front end builds through it
and runs `generate` on it, and `AsyncEngine` awaits its steps on it. It is torch-free itself:
only a single-thread executor.
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Executor, Future

_lock = threading.Lock()
_executor: "EngineThread | None" = None
_thread_ident: int | None = None


class EngineThread(Executor):
    """A single daemon thread running submitted calls in order. A daemon, so that Ctrl-C in the
    main thread (which only waits on a future) ends the process instead of waiting for the
    engine's work to finish (a ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="eagle-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        global _thread_ident
        _thread_ident = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            del fut, fn, args, kwargs, item  # drop references (tensors) before waiting again

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join()


def engine_executor() -> EngineThread:
    """The process's engine thread (started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = EngineThread()
        return _executor


def _forget_after_fork() -> None:
    """A forked child has no engine thread (threads do not survive fork): start a new one."""
    global _executor, _thread_ident, _lock
    _executor, _thread_ident, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def on_engine_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) run on the engine thread (directly when already there); its result
    or exception comes back to the caller."""
    if threading.get_ident() == _thread_ident:
        return fn(*args, **kwargs)
    return engine_executor().submit(fn, *args, **kwargs).result()
