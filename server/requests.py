"""One request's way through the engine: its body parsed and validated, its sequences submitted
(a `Handle`), their final outputs collected or the request aborted."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from eagle_serve.scheduler.async_engine import EngineDead
from eagle_serve.server.metrics import LatencyTracker
from eagle_serve.server.protocol import FIELD_HELP, MESSAGE_ROLES, RESPONSE_FORMAT_TYPES, ApiError

if TYPE_CHECKING:
    from eagle_serve.server.app import ServerState

log = logging.getLogger("eagle_serve")


async def parse_request(request: Request, model, state: ServerState):
    """The body as `model` (a pydantic request class), for this server's model; 400 / 404 / 413 /
    415 otherwise."""
    # JSON only, as vLLM: text/plain and form bodies are the types a browser sends cross-origin
    # without a preflight, so any web page could start generations on a keyless local server
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the body must be JSON sent as content-type application/json (got {media or 'none'})",
                       code="unsupported_media_type")
    data = _json_object(await _read_body(request, state.max_body_bytes))
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = list(err["loc"])
        if len(where) > 2 and where[0] == "messages" and where[2] in MESSAGE_ROLES:
            del where[2]  # the message's role: the tag of its shape, not a field
        if len(where) > 1 and where[0] == "response_format" and where[1] in RESPONSE_FORMAT_TYPES:
            del where[1]  # likewise its type
        err["loc"] = tuple(where)
        loc = ".".join(str(x) for x in err["loc"])
        top = str(err["loc"][0]) if err["loc"] else ""
        if top in FIELD_HELP and err["type"] != "extra_forbidden":
            raise ApiError(400, FIELD_HELP[top], top) from None
        if len(err["loc"]) == 3 and top == "messages" and err["loc"][2] == "name":
            raise ApiError(400, f"messages[{err['loc'][1]}].name is not supported", loc) from None
        msg = "unknown or unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, f"{loc}: {msg}", loc or None) from None
    if req.model != state.model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       "model", "model_not_found")
    return req


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # bounded even without a Content-Length (chunked uploads)
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"request body over {max_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: answered quietly, as any disconnect
        raise ApiError(499, "the client closed the connection during the upload",
                       code="client_closed_request") from None
    return b"".join(chunks)


def _json_object(body: bytes) -> dict:
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except ValueError as e:  # invalid JSON, not UTF-8, or an integer past Python's digit limit
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:  # JSON escapes can carry lone surrogates, which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the body has a string that is not valid Unicode: {e.reason}") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    return data


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


class Handle:
    def __init__(self, prompts, seq_ids, queues, timeout: float | None = None):
        self.id = uuid.uuid4().hex
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.created = int(time.time())
        self.prompts, self.seq_ids, self.queues = prompts, seq_ids, queues
        # n choices share one prompt object: each prompt counts once, as OpenAI counts it
        self.prompt_tokens = sum(len(p) for p in {id(p): p for p in prompts}.values())
        self.finished = [False] * len(seq_ids)
        self.echo: list[str] | None = None  # completions with echo: each choice's prompt text
        self.plan = None  # chat: its structured output and tools (server.structured.Plan)


def submit(state: ServerState, prompts: list[list[int]], params, user: str | None) -> Handle:
    eng = state.engine
    if len(prompts) > state.max_waiting:
        raise ApiError(400, f"this request has {len(prompts)} sequences (prompts x n); the server queues at most "
                            f"{state.max_waiting}", "n")
    if eng.num_waiting + len(prompts) > state.max_waiting:
        raise ApiError(503, f"the server is busy ({eng.num_waiting} requests waiting); retry shortly",
                       code="server_busy", headers={"Retry-After": "1"})
    try:  # every sequence checked before any is added: a refused request adds none (nor counts as aborted)
        for prompt, p in zip(prompts, params):
            eng.validate(prompt, p)
    except ValueError as e:
        raise _refused(e) from None
    ids, queues = [], []
    try:
        for prompt, p in zip(prompts, params):
            seq_id, q = eng.add_request(prompt, p)
            ids.append(seq_id)
            queues.append(q)
    except EngineDead as e:
        for i in ids:
            eng.abort(i)
        raise ApiError(503, str(e), code="engine_dead", headers={"Retry-After": "5"}) from None
    except ValueError as e:  # validated above; kept so that no refusal becomes a 500
        for i in ids:
            eng.abort(i)
        raise _refused(e) from None
    handle = Handle(prompts, ids, queues, state.request_timeout)
    state.metrics.prompt_tokens.inc(handle.prompt_tokens)  # as usage counts them
    if user:
        log.info("request %s from user %r: %d sequences", ids, user, len(ids))
    return handle


def _refused(e: ValueError) -> ApiError:
    return ApiError(400, str(e), None, "context_length_exceeded" if "context length" in str(e) else None)


async def collect(request: Request, state: ServerState, handle: Handle) -> list:
    """Final outputs of all sequences; a client that goes away aborts them."""
    tracker = LatencyTracker(state.metrics)

    async def drain(q):
        while True:
            out = await q.get()
            if isinstance(out, BaseException):
                raise ApiError(503, str(out), code="engine_dead")
            tracker.see(out)
            if out.finished:
                return out

    task = asyncio.ensure_future(asyncio.gather(*(drain(q) for q in handle.queues)))
    # a timed-out request raises without awaiting the cancelled gather: retrieve its outcome, or
    # asyncio logs "_GatheringFuture exception was never retrieved" at every 408
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5 if handle.deadline is None
                               else max(0.0, min(0.5, handle.deadline - time.monotonic())))
            if task.done():
                break
            if state.shut_down:
                task.cancel()
                raise shutdown_error()
            if handle.deadline is not None and time.monotonic() >= handle.deadline:
                task.cancel()
                raise timeout_error(handle)  # (the handler below aborts the sequences)
            if await request.is_disconnected():
                task.cancel()
                # answered (to nobody) as an error: a CancelledError out of the endpoint would log
                # "Exception in ASGI application" with a traceback at every disconnect
                raise ApiError(499, "the client closed the connection; the request was aborted",
                               code="client_closed_request")
        outs = await task
    except BaseException:  # CancelledError included
        _abort_all(state, handle)
        raise
    errors = [o for o in outs if o.finish_reason == "error"]
    if errors:
        raise engine_error(errors[0])
    return outs


def _abort_all(state: ServerState, handle: Handle) -> None:
    for seq_id in handle.seq_ids:
        state.engine.abort(seq_id)


def timeout_error(handle: Handle) -> ApiError:
    return ApiError(408, f"the request ran past the server's request timeout ({handle.timeout:g} s) and was aborted",
                    code="request_timeout", type_="timeout_error")


def engine_error(out) -> ApiError:
    return ApiError(500, f"the engine failed on this request: {out.error}", code="engine_error", type_="server_error")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server shut down before the request finished; it was aborted", code="server_shutdown",
                    headers={"Retry-After": "5"})
