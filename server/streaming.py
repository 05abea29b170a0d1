"""Streamed answers (stream=true): server-sent events of chat and completion chunks, merged
from a request's sequences as their outputs come."""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from eagle_serve.server.metrics import LatencyTracker
from eagle_serve.server.protocol import ApiError, StreamOptions
from eagle_serve.server.requests import Handle, engine_error, shutdown_error, timeout_error
from eagle_serve.server.responses import TextOffsets, chat_logprobs, completion_logprobs, tool_reader, usage
from eagle_serve.server.tool_parsers import finish_reason

if TYPE_CHECKING:
    from eagle_serve.server.app import ServerState

# put into a request's merged queue in place of an output
TIMED_OUT = object()
SHUT_DOWN = object()


async def merged_outputs(state: ServerState, handle: Handle):
    """(choice index, output) from all sequences, as they come."""
    merged: asyncio.Queue = asyncio.Queue()
    done = 0

    async def pump(i, q):
        while True:
            out = await q.get()
            await merged.put((i, out))
            if isinstance(out, BaseException) or out.finished:
                return

    tasks = [asyncio.ensure_future(pump(i, q)) for i, q in enumerate(handle.queues)]
    state.stream_queues.add(merged)
    if state.shut_down:
        merged.put_nowait((None, SHUT_DOWN))
    timer = None  # one timer per request puts the timeout into the same queue as the outputs
    if handle.deadline is not None:
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + max(0.0, handle.deadline - time.monotonic()),
                             merged.put_nowait, (None, TIMED_OUT))
    try:
        while done < len(tasks):
            i, out = await merged.get()
            if out is TIMED_OUT:
                raise timeout_error(handle)
            if out is SHUT_DOWN:
                raise shutdown_error()
            if isinstance(out, BaseException):
                raise ApiError(503, str(out), code="engine_dead")
            if out.finished:
                done += 1
                handle.finished[i] = True
            yield i, out
    finally:
        state.stream_queues.discard(merged)
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()
        for i, seq_id in enumerate(handle.seq_ids):
            if not handle.finished[i]:
                state.engine.abort(seq_id)


def stream_response(state: ServerState, events, handle: Handle) -> EventSourceResponse:
    # The grace period lets running streams finish on SIGTERM, where sse-starlette would cancel
    # them at once; its half second over ours lets our error event go out first. The background
    # task aborts what is unfinished however the stream ended, also when the generator is closed
    # before `merged_outputs` starts, whose own cleanup then never runs.
    return EventSourceResponse(events, ping=15, shutdown_grace_period=state.shutdown_timeout + 0.5,
                               background=BackgroundTask(_abort_unfinished, state, handle))


def _abort_unfinished(state: ServerState, handle: Handle) -> None:
    for i, seq_id in enumerate(handle.seq_ids):
        if not handle.finished[i]:
            state.engine.abort(seq_id)


# characters SSE keeps inside a line that Python's str.splitlines (httpx's iter_lines) breaks on:
# escaped, so a client reading lines gets whole JSON (they can only occur inside JSON strings)
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})  # (json escapes < 0x20)


def sse_event(obj) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}


class UsageChunks:
    """Where a stream's usage goes: a last chunk of its own (include_usage), and with
    continuous_usage_stats the usage so far on every chunk, a null usage otherwise."""

    def __init__(self, options: StreamOptions | None):
        self.final = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)  # (needs include_usage: check_common)

    def field(self, state: ServerState, handle: Handle, latest: list) -> dict:
        if self.continuous:  # the request's tokens so far, summed over its choices as the last chunk sums them
            return {"usage": usage(state, handle, [o for o in latest if o is not None])}
        return {"usage": None} if self.final else {}


async def _sse(state: ServerState, handle: Handle, usage_chunks: UsageChunks, base: dict, opening: list[dict],
               choices_for):
    """The stream of one request: `opening` choices first, then choices_for(i, out, new_ids,
    new_logprobs) for every output of choice i, then the usage chunk and [DONE]. An error after
    the stream began is sent as an error event and ends the stream."""
    tracker = LatencyTracker(state.metrics)
    sent = [0] * len(handle.seq_ids)
    latest = [None] * len(handle.seq_ids)  # each choice's last output: the final ones once all finished
    for choice in opening:
        yield sse_event({**base, "choices": [choice], **usage_chunks.field(state, handle, latest)})
    try:
        async for i, out in merged_outputs(state, handle):
            tracker.see(out)
            if out.finish_reason == "error":
                yield sse_event(engine_error(out).body())
                return
            new_ids = out.token_ids[sent[i]:]
            lps = out.logprobs[sent[i]:] if out.logprobs is not None else None
            sent[i] = len(out.token_ids)
            latest[i] = out
            extra = usage_chunks.field(state, handle, latest)
            for choice in choices_for(i, out, new_ids, lps):
                yield sse_event({**base, "choices": [choice], **extra})
    except ApiError as e:
        yield sse_event(e.body())
        return
    if usage_chunks.final:
        yield sse_event({**base, "choices": [], "usage": usage(state, handle, latest)})
    yield {"data": "[DONE]"}


def chat_stream(state: ServerState, handle: Handle, options: StreamOptions | None):
    base = {"id": f"chatcmpl-{handle.id}", "object": "chat.completion.chunk", "created": handle.created,
            "model": state.model_name}
    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(len(handle.seq_ids))]

    readers = [tool_reader(state, handle) for _ in handle.seq_ids]  # (None: plain text)

    def choices_for(i, out, new_ids, lps):
        reader = readers[i]
        if reader is None:
            if out.text_delta or lps:
                yield {"index": i, "delta": {"content": out.text_delta},
                       "logprobs": chat_logprobs(state, new_ids, lps) if lps is not None else None,
                       "finish_reason": None}
            if out.finished:
                yield {"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason}
            return
        # tool calls: content and calls as the reader gives them (a call once its block is read);
        # the tokens' logprobs ride on the first delta of their output, or an empty one
        deltas = reader.feed(out.text_delta) + (reader.finish() if out.finished else [])
        lp = chat_logprobs(state, new_ids, lps) if lps else None
        if lp is not None and not deltas:
            deltas = [{}]
        for j, d in enumerate(deltas):
            yield {"index": i, "delta": d, "logprobs": lp if j == 0 else None, "finish_reason": None}
        if out.finished:
            yield {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason(out.finish_reason,
                                                                                              reader.calls)}
    return _sse(state, handle, UsageChunks(options), base, opening, choices_for)


def completion_stream(state: ServerState, handle: Handle, options: StreamOptions | None):
    base = {"id": f"cmpl-{handle.id}", "object": "text_completion", "created": handle.created,
            "model": state.model_name}
    echoed = handle.echo or [""] * len(handle.prompts)
    offsets = [TextOffsets(len(t)) for t in echoed]  # each choice's, across its chunks
    opening = [{"index": i, "text": t, "logprobs": None, "finish_reason": None} for i, t in enumerate(echoed) if t]

    def choices_for(i, out, new_ids, lps):
        if out.text_delta or lps or out.finished:
            lp_obj = completion_logprobs(state, new_ids, lps, offsets[i]) if lps is not None else None
            yield {"index": i, "text": out.text_delta, "logprobs": lp_obj,
                   "finish_reason": out.finish_reason if out.finished else None}
    return _sse(state, handle, UsageChunks(options), base, opening, choices_for)
