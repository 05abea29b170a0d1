"""The asyncio front of the engine loop (torch-free): continuous batching for many clients.

One asyncio task runs the loop. Each iteration it applies aborts, plans the step on the event
loop (admission, block reservations, tree budgets), runs the engine step in a single worker
thread (`await`ed, so the event loop stays free for streaming and health checks), then applies
the results (detokenization, stop strings, finish reasons) and pushes every request's output
to its own async stream. New requests join the running batch between steps; finished ones
leave it. Only the event-loop thread touches the scheduler; the worker thread only runs the
model on the immutable steps it is given.
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.scheduler.loop import EngineLoop
from eagle_serve.scheduler.output_processor import RequestOutput
from eagle_serve.scheduler.scheduler import KVCacheTooSmall
from eagle_serve.scheduler.sequence import FinishReason
from eagle_serve.scheduler.worker import engine_executor


class EngineDead(RuntimeError):
    """The engine loop is not running (stopped, or it crashed)."""


class AsyncEngine:
    def __init__(self, loop: EngineLoop, on_step=None, on_finish=None):
        """on_step(seqs, results, outputs, step_seconds): called on the event loop after every
        step (metrics); results are the engine's SeqResults (or exceptions) of the step. Steps
        run on the process's engine thread, where `LLM` built the model (scheduler.worker)."""
        self.engine = loop
        self.on_step = on_step
        self.on_finish = on_finish  # on_finish(final RequestOutput): every request's end, aborts included
        self._pool = engine_executor()
        self._streams: dict[int, asyncio.Queue] = {}
        self._aborts: set[int] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.error: BaseException | None = None  # what killed the loop, if anything
        self.last_progress = time.monotonic()  # last step end, or last time it had nothing to do
        self._trim = _HeapTrimmer(TRIM_INTERVAL)
        self.busy_since: float | None = None  # start of the step in flight

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="eagle-engine-loop")

    async def stop(self) -> None:
        """Stop the loop: running requests end with finish reason `abort`."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            # bounded: a step stuck in the engine thread (a daemon) would hold the loop task, and
            # SIGTERM then never finished (the process needed SIGKILL)
            done, _ = await asyncio.wait({self._task}, timeout=STOP_TIMEOUT)
            if done:
                try:
                    self._task.result()
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - its error is kept in self.error
                    pass
            else:
                log.warning("the engine step in flight did not end within %.0f s of the stop: leaving it", STOP_TIMEOUT)
                self._task.cancel()
        self._task = None
        for seq_id in list(self._streams):
            self._abort_now(seq_id)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    def healthy(self, stall_seconds: float = 60.0) -> bool:
        """Alive and making progress: idle, or the step in flight started < stall_seconds ago."""
        if not self.alive:
            return False
        return self.busy_since is None or time.monotonic() - self.busy_since < stall_seconds

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[int, asyncio.Queue]:
        """Validate and queue a request (raises ValueError on bad input); returns its id and
        output queue. Call from the event loop."""
        if not self.alive:
            raise EngineDead(f"the engine loop is not running{': ' + repr(self.error) if self.error else ''}")
        seq = self.engine.add_request(prompt_token_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[seq.seq_id] = queue
        self._wake.set()
        return seq.seq_id, queue

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError where add_request would, adding nothing."""
        self.engine.validate(prompt_token_ids, params)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (the last has `finished`). Closing the iterator
        early (client gone, timeout) aborts the request."""
        seq_id, queue = self.add_request(prompt_token_ids, params)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(seq_id)

    def abort(self, seq_id: int) -> None:
        """Abort at the next iteration (its blocks are freed there)."""
        if seq_id in self._streams or self.engine.has_request(seq_id):
            self._aborts.add(seq_id)
            if self._wake is not None:
                self._wake.set()

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                for seq_id in list(self._aborts):
                    self._abort_now(seq_id)
                self._aborts.clear()
                if not self.engine.has_unfinished:
                    if self.engine.idle_due():  # e.g. the tree budget's profile again, after a contended one
                        self.busy_since = time.monotonic()
                        try:  # run_idle logs its own errors
                            await loop.run_in_executor(self._pool, self.engine.run_idle)
                        finally:
                            self.busy_since = None
                        continue
                    self._trim.maybe(idle=True)
                    self.last_progress = time.monotonic()
                    self._wake.clear()
                    due = self.engine.idle_due_in()
                    if due is None:
                        await self._wake.wait()
                    else:  # wake for the idle work too
                        try:
                            await asyncio.wait_for(self._wake.wait(), max(due, 0.0) + 0.01)
                        except asyncio.TimeoutError:
                            pass
                    continue
                try:
                    seqs, steps = self.engine.plan()
                except KVCacheTooSmall as e:  # that sequence can never fit in the KV cache
                    # (only this: any other error in planning is the loop's, not that request's)
                    self._abort_now(e.seq_id, FinishReason.ERROR, str(e))
                    continue
                if not seqs:
                    await asyncio.sleep(0.001)
                    continue
                self.busy_since = t0 = time.monotonic()
                results = await loop.run_in_executor(self._pool, self.engine.execute, seqs, steps)
                self.busy_since = None
                outputs = self.engine.complete(seqs, results)
                self.last_progress = time.monotonic()
                for out in outputs:
                    q = self._streams.get(out.seq_id)
                    if q is not None:
                        q.put_nowait(out)
                    if out.finished:
                        self._streams.pop(out.seq_id, None)
                        if out.seq_id in self._aborts and out.finish_reason != FinishReason.ERROR.value:
                            # aborted while its last step ran (a timeout, a client gone): the
                            # client was answered as aborted (408, an error event), so it is
                            # counted so, not as the finish nobody received
                            self._aborts.discard(out.seq_id)
                            out = dataclasses.replace(out, finish_reason=FinishReason.ABORT.value)
                        self._finished(out)
                if self.on_step is not None:
                    self.on_step(seqs, results, outputs, self.last_progress - t0)
                self._trim.maybe()
                await asyncio.sleep(0)  # let the streams run before the next step
        except Exception as e:  # noqa: BLE001 - a bug in the loop itself: fail every request
            self.error = e
            for seq_id, q in list(self._streams.items()):
                q.put_nowait(EngineDead(f"engine loop failed: {e!r}"))
                self._streams.pop(seq_id, None)
                # and end it in the engine: it stayed running or waiting (the gauges and KV usage
                # stuck there) and was never counted as a finished request
                try:
                    out = self.engine.abort(seq_id, FinishReason.ERROR, f"engine loop failed: {e!r}")
                    if out is not None:
                        self._finished(out)
                except Exception:  # noqa: BLE001 - the engine's state (or the metrics) may be what failed
                    pass
            raise
        finally:
            self.busy_since = None

    def _abort_now(self, seq_id: int, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        out = self.engine.abort(seq_id, reason, error)
        q = self._streams.pop(seq_id, None)
        if out is not None:
            self._finished(out)
            if q is not None:
                q.put_nowait(out)

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finish is not None:
            self.on_finish(out)


log = logging.getLogger(__name__)
STOP_TIMEOUT = 10.0  # seconds `stop` waits for the step in flight (the engine thread is a daemon)
TRIM_INTERVAL = 30.0  # seconds of work between returns of the C heap's free pages to the OS


class _HeapTrimmer:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim) every `interval`
    seconds of work and whenever the engine goes idle. Steps allocate and free tensors of many
    sizes (batch and tree shapes change every step); glibc keeps freed heap pages mapped, so
    without this the process's RSS creeps up in steps as new peak shapes appear, though nothing
    leaks (bench/soak.py watches it). A no-op
    where malloc_trim does not exist, or with interval None."""

    def __init__(self, interval: float | None):
        self.interval = interval
        self.last = time.monotonic()
        self.calls = 0
        self._fn = None
        if interval is not None:
            try:
                self._fn = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                self._fn = None

    def maybe(self, idle: bool = False) -> None:
        if self._fn is None:
            return
        now = time.monotonic()
        if idle and self.calls and now - self.last < 1.0:
            return  # idle again within a second: nothing new to return
        if idle or now - self.last >= self.interval:
            self._fn(0)
            self.last = now
            self.calls += 1
