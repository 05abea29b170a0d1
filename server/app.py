"""The OpenAI-compatible HTTP server (FastAPI + sse-starlette) over the asyncio engine."""
from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.tokenizer import TemplateError
from scheduler.async_engine import AsyncEngine, EngineDead
from server.metrics import Metrics
from server.protocol import (FIELD_HELP, ApiError, ChatRequest, CompletionRequest, chat_inputs, check_common,
                             completion_prompts, echo_texts, sampling_params)

log = logging.getLogger("eagle_serve")
VERSION = "0.1.0"


class ServerState:
    def __init__(self, llm, served_model_name: str | None = None, api_key: str | None = None,
                 max_waiting: int = 256, max_body_bytes: int = 4 << 20, stall_seconds: float = 120.0,
                 request_timeout: float | None = None, allowed_origins: list[str] | None = None,
                 shutdown_timeout: float = 30.0):
        """request_timeout: seconds a request may run before it is aborted (None: no limit).
        allowed_origins: CORS origins (None or empty: no CORS headers at all).
        shutdown_timeout: on SIGTERM, seconds running streams may take to finish."""
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.llm = llm
        self.request_timeout = request_timeout
        self.allowed_origins = list(allowed_origins or [])
        self.shutdown_timeout = shutdown_timeout
        # set once SIGTERM's grace period is over: what still runs is answered 503 / an error
        # event before the server cancels it (it had got uvicorn's plain-text 500, a stream just ended)
        self.shut_down = False
        self._merged: set[asyncio.Queue] = set()  # running streams' queues (`_merged`), told at once
        self.tokenizer = llm.tokenizer
        self.model_name = served_model_name or llm.model_name
        self.api_key = api_key
        self.max_waiting = max_waiting
        self.max_body_bytes = max_body_bytes
        self.stall_seconds = stall_seconds
        alloc = llm.allocator
        spec = llm.engine_config.spec
        self.spec_method = spec.method
        self.metrics = Metrics(running=lambda: self.engine.num_running, waiting=lambda: self.engine.num_waiting,
                               kv_usage=lambda: alloc.num_held_blocks / alloc.num_blocks, max_depth=spec.max_depth,
                               totals=lambda: {"num_preemptions": llm.loop.scheduler.num_preemptions,
                                               "prefix_cache_queries": alloc.prefix_queried_tokens,
                                               "prefix_cache_hits": alloc.prefix_hit_tokens})
        self.engine = AsyncEngine(llm.loop, on_step=self.metrics.on_step, on_finish=self.metrics.on_finish)
        self.created = int(time.time())

    def begin_shutdown(self) -> None:
        """SIGTERM (on the event loop's thread): requests still running when shutdown_timeout has
        passed are aborted and answered 503 (streams: an error event), before the server cancels
        them (its own deadline is later: see cmd_serve)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop running: nothing is
            return
        # (from a signal handler: the thread-safe call wakes the selector to take the timer in)
        loop.call_soon_threadsafe(loop.call_later, self.shutdown_timeout, self._shut_down)

    def _shut_down(self) -> None:
        self.shut_down = True
        for q in list(self._merged):
            q.put_nowait((None, _SHUT_DOWN))


class BackgroundServer:
    """The app under uvicorn on a free loopback port, in a daemon thread (tests, benchmarks)."""

    def __init__(self, state: ServerState, timeout: float = 30.0):
        import threading
        import uvicorn
        from server.process import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()

    app = FastAPI(title="eagle-serve", version=VERSION, lifespan=lifespan)
    app.state.server = state
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        # an unknown route (404) or method (405): the OpenAI error shape, not {"detail": ...}
        e = ApiError(exc.status_code, str(exc.detail), code={404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code), type_="invalid_request_error" if exc.status_code != 404 else None)
        return JSONResponse(e.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    # a plain ASGI middleware, not @app.middleware("http"): behind Starlette's BaseHTTPMiddleware
    # the endpoint's receive channel never showed a client's disconnect, so a non-streaming
    # request whose client went away ran to its end, and so did chat streams of n >= 2 choices
    # whose client left before reading
    app.add_middleware(_LimitsAndAuth, state=state)
    if state.allowed_origins:
        # added last, so outermost: a preflight (which browsers send without credentials) is
        # answered before the API-key check, and the 401 / 413 carry the CORS headers a browser
        # needs to read them; any request header (the OpenAI SDKs send X-Stainless-*)
        app.add_middleware(CORSMiddleware, allow_origins=state.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health():
        if state.engine.healthy(state.stall_seconds):
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "error": repr(state.engine.error) if state.engine.error else None},
                            status_code=503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "eagle-serve", "max_model_len": state.llm.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, ChatRequest, state)
        n = check_common(req)
        messages, max_tokens, top = chat_inputs(req)
        if state.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer; use /v1/completions with token ids")
        try:  # off the event loop: a long prompt's tokenization stalled every stream and /health
            prompt = await asyncio.to_thread(state.tokenizer.encode_chat, messages)
        except TemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        ctx = state.llm.max_model_len
        if max_tokens is None:
            max_tokens = ctx - len(prompt)
            if max_tokens < 1:
                raise ApiError(400, f"this model's maximum context length is {ctx} tokens; the messages have "
                                    f"{len(prompt)} tokens", "messages", "context_length_exceeded")
        params = [sampling_params(req, max_tokens, top, i) for i in range(n)]
        handle = _submit(state, [prompt] * n, params, req.user)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _stream_response(state, _chat_stream(state, handle, include_usage), handle)
        outs = await _collect(request, state, handle)
        return _chat_response(state, handle, outs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest, state)
        n = check_common(req)
        if state.tokenizer is None and (isinstance(req.prompt, str) or isinstance(req.prompt[0], str)):
            raise ApiError(400, "this server has no tokenizer; send token ids", "prompt")
        prompts = await asyncio.to_thread(completion_prompts, req, state.tokenizer)  # (off the event loop)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = [sampling_params(req, max_tokens, req.logprobs, i) for i in range(n)]
        handle = _submit(state, [p for p in prompts for _ in range(n)], params * len(prompts), req.user)
        if req.echo:
            handle.echo = [t for t in echo_texts(req, prompts, state.tokenizer) for _ in range(n)]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _stream_response(state, _completion_stream(state, handle, include_usage), handle)
        outs = await _collect(request, state, handle)
        return _completion_response(state, handle, outs)

    app.openapi = lambda: _openapi(app, state)
    return app


def _bound_ints(props: dict, max_token_id: int, max_tokens: int) -> None:
    """This model's real bounds in the schema: token ids below the vocabulary size, token
    counts below the context length."""
    def walk(node, key):
        if isinstance(node, dict):
            if node.get("type") == "integer" and key in ("prompt", "max_tokens", "max_completion_tokens", "min_tokens"):
                node["maximum"] = max_token_id if key == "prompt" else max_tokens
            for v in node.values():
                walk(v, key)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
    for key, value in props.items():
        walk(value, key)


def _openapi(app: FastAPI, state: ServerState) -> dict:
    """The schema clients (and the fuzz tests) see: the request bodies are the pydantic models
    the handlers validate against, and every status a route can answer is listed."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps["ErrorResponse"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    descriptions = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
                    "408": "the request ran past the server's request timeout", "413": "request body too large",
                    "503": "server busy (Retry-After) or engine down"}
    errors = {code: {"description": d, **err} for code, d in descriptions.items()}
    for path, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        js["properties"]["model"] = {"type": "string", "enum": [state.model_name], "title": "Model",
                                     "description": "the one model this server serves (GET /v1/models)"}
        _bound_ints(js["properties"], state.llm.loop.vocab_size - 1, state.llm.max_model_len - 1)
        comps[model.__name__] = js
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        op["responses"] = {"200": {"description": "the completion (JSON), or its chunks as server-sent events",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": {
                                                   "type": "object", "required": ["data"],
                                                   "properties": {"data": {"type": "string"},
                                                                  "event": {"type": "string"}}}}}},
                           **errors}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string", "description": "Prometheus text exposition format 0.0.4"}}}
    models_op = schema["paths"]["/v1/models"]["get"]
    models_op["responses"]["401"] = errors["401"]
    schema["paths"]["/health"]["get"]["responses"]["503"] = {"description": "not loaded, stalled or stopped",
                                                              "content": {"application/json": {"schema": {"type": "object"}}}}
    if state.api_key:
        comps_root = schema["components"]
        comps_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


# ---------------------------------------------------------------------------- requests

async def _parse(request: Request, model, state: ServerState):
    # JSON only, as vLLM: text/plain and form bodies are the types a browser sends cross-origin
    # without a preflight, so any web page could start generations on a keyless local server
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the body must be JSON sent as content-type application/json (got {media or 'none'})",
                       code="unsupported_media_type")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # bounded even without a Content-Length (chunked uploads)
            size += len(chunk)
            if size > state.max_body_bytes:
                raise ApiError(413, f"request body over {state.max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: quiet, as any disconnect (was a 500 and two tracebacks)
        raise ApiError(499, "the client closed the connection during the upload",
                       code="client_closed_request") from None
    body = b"".join(chunks)
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except ValueError as e:  # invalid JSON, not UTF-8, or an integer past Python's digit limit (was a 500)
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
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
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


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


class Handle:
    def __init__(self, prompts, seq_ids, queues, timeout: float | None = None):
        self.id = uuid.uuid4().hex
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.created = int(time.time())
        self.prompts, self.seq_ids, self.queues = prompts, seq_ids, queues
        self.finished = [False] * len(seq_ids)
        self.echo: list[str] | None = None  # completions with echo: each choice's prompt text


def _submit(state: ServerState, prompts: list[list[int]], params, user: str | None) -> Handle:
    eng = state.engine
    if len(prompts) > state.max_waiting:
        raise ApiError(400, f"this request has {len(prompts)} sequences (prompts x n); the server queues at most "
                            f"{state.max_waiting}", "n")
    if eng.num_waiting + len(prompts) > state.max_waiting:
        raise ApiError(503, f"the server is busy ({eng.num_waiting} requests waiting); retry shortly",
                       code="server_busy", headers={"Retry-After": "1"})
    try:  # every sequence checked before any is added: a later prompt's 400 left the earlier
        # ones added and aborted, counted as aborted requests in the metrics
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
    state.metrics.prompt_tokens.inc(sum(len(p) for p in {id(p): p for p in prompts}.values()))  # as _usage counts
    if user:
        log.info("request %s from user %r: %d sequences", ids, user, len(ids))
    return Handle(prompts, ids, queues, state.request_timeout)


def _refused(e: ValueError) -> ApiError:
    return ApiError(400, str(e), None, "context_length_exceeded" if "context length" in str(e) else None)


class _Tracker:
    """Per-sequence latency metrics as outputs arrive."""

    def __init__(self, state: ServerState):
        self.m = state.metrics
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def see(self, out) -> None:
        now = out.output_time
        n_new = len(out.token_ids) - self.count.get(out.seq_id, 0)
        if n_new > 0:
            if out.seq_id not in self.last and out.first_token_time is not None:
                self.m.ttft.observe(out.first_token_time - out.arrival_time)
                n_new -= 1
            elif out.seq_id in self.last:
                gap = (now - self.last[out.seq_id]) / n_new
                for _ in range(n_new):
                    self.m.itl.observe(gap)
            self.last[out.seq_id] = now
            self.count[out.seq_id] = len(out.token_ids)


async def _collect(request: Request, state: ServerState, handle: Handle) -> list:
    """Final outputs of all sequences; a client that goes away aborts them."""
    tracker = _Tracker(state)

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
                raise _shutdown_error()
            if handle.deadline is not None and time.monotonic() >= handle.deadline:
                task.cancel()
                raise _timeout_error(handle)  # (the handler below aborts the sequences)
            if await request.is_disconnected():
                task.cancel()
                # answered (to nobody) as an error, not by a CancelledError out of the endpoint:
                # that logged a 60-line "Exception in ASGI application" at every disconnect
                raise ApiError(499, "the client closed the connection; the request was aborted",
                               code="client_closed_request")
        outs = await task
    except asyncio.CancelledError:
        _abort_all(state, handle)
        raise
    except BaseException:
        _abort_all(state, handle)
        raise
    errors = [o for o in outs if o.finish_reason == "error"]
    if errors:
        raise _engine_error(errors[0])
    return outs


def _timeout_error(handle: Handle) -> ApiError:
    return ApiError(408, f"the request ran past the server's request timeout ({handle.timeout:g} s) and was aborted",
                    code="request_timeout", type_="timeout_error")


def _engine_error(out) -> ApiError:
    return ApiError(500, f"the engine failed on this request: {out.error}", code="engine_error", type_="server_error")


def _abort_all(state: ServerState, handle: Handle) -> None:
    for seq_id in handle.seq_ids:
        state.engine.abort(seq_id)


def _usage(state: ServerState, handle: Handle, outs) -> dict:
    # n choices share one prompt object: each prompt counts once, as OpenAI counts it
    prompt = sum(len(p) for p in {id(p): p for p in handle.prompts}.values())
    completion = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec.verify_steps for o in outs)
    accepted = sum(o.spec.accepted_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "spec": {"method": state.spec_method, "verify_steps": steps,
                     "draft_tokens": sum(o.spec.draft_tokens for o in outs), "accepted_tokens": accepted,
                     "acceptance_length": round((accepted + steps) / steps, 4) if steps else None}}


# ---------------------------------------------------------------------------- chat

def _token_str(state: ServerState, token_id: int) -> str:
    return state.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace") if state.tokenizer else str(token_id)


def _token_key(state: ServerState, token_id: int) -> str:
    """A completions top_logprobs key: the token's text, or "bytes:\\xNN..." where its bytes are
    not whole UTF-8 (part of a character)."""
    if not state.tokenizer:
        return str(token_id)
    b = state.tokenizer.token_bytes(token_id)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _chat_logprobs(state: ServerState, token_ids, logprobs) -> dict:
    content = []
    for t, lp in zip(token_ids, logprobs):
        b = state.tokenizer.token_bytes(t) if state.tokenizer else b""
        content.append({"token": _token_str(state, t), "logprob": lp.logprob, "bytes": list(b),
                        "top_logprobs": [{"token": _token_str(state, i), "logprob": v,
                                          "bytes": list(state.tokenizer.token_bytes(i)) if state.tokenizer else []}
                                         for i, v in lp.top]})
    return {"content": content}


def _chat_response(state: ServerState, handle: Handle, outs) -> dict:
    choices = []
    for i, o in enumerate(outs):
        choices.append({"index": i, "message": {"role": "assistant", "content": o.text},
                        "logprobs": _chat_logprobs(state, o.token_ids, o.logprobs) if o.logprobs is not None else None,
                        "finish_reason": o.finish_reason})
    return {"id": f"chatcmpl-{handle.id}", "object": "chat.completion", "created": handle.created,
            "model": state.model_name, "choices": choices, "usage": _usage(state, handle, outs)}


_TIMED_OUT = object()
_SHUT_DOWN = object()


def _shutdown_error() -> ApiError:
    return ApiError(503, "the server shut down before the request finished; it was aborted", code="server_shutdown",
                    headers={"Retry-After": "5"})


async def _merged(state: ServerState, handle: Handle):
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
    state._merged.add(merged)
    if state.shut_down:
        merged.put_nowait((None, _SHUT_DOWN))
    timer = None  # one timer per request puts the timeout into the same queue as the outputs
    if handle.deadline is not None:
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + max(0.0, handle.deadline - time.monotonic()),
                             merged.put_nowait, (None, _TIMED_OUT))
    try:
        while done < len(tasks):
            i, out = await merged.get()
            if out is _TIMED_OUT:
                raise _timeout_error(handle)
            if out is _SHUT_DOWN:
                raise _shutdown_error()
            if isinstance(out, BaseException):
                raise ApiError(503, str(out), code="engine_dead")
            if out.finished:
                done += 1
                handle.finished[i] = True
            yield i, out
    finally:
        state._merged.discard(merged)
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()
        for i, seq_id in enumerate(handle.seq_ids):
            if not handle.finished[i]:
                state.engine.abort(seq_id)


def _stream_response(state: ServerState, events, handle: Handle) -> EventSourceResponse:
    # On shutdown (SIGTERM) sse-starlette would cancel streams at once; the grace period lets
    # running requests finish (uvicorn's own graceful timeout bounds the whole drain). The
    # background task runs once the stream is over, however it ended, and aborts the sequences
    # not finished by then: `_merged`'s own cleanup only runs once the generator got that far,
    # not for one closed at its opening chunks or cancelled before it started. (The chat streams
    # of n >= 2 choices seen running to their end after an early disconnect were the middleware's
    # doing, see `_LimitsAndAuth`; this covers the generator's early exits whatever the cause.)
    # (sse-starlette's grace is half a second longer than ours: our error event goes out first)
    return EventSourceResponse(events, ping=15, shutdown_grace_period=state.shutdown_timeout + 0.5,
                               background=BackgroundTask(_abort_unfinished, state, handle))


def _abort_unfinished(state: ServerState, handle: Handle) -> None:
    for i, seq_id in enumerate(handle.seq_ids):
        if not handle.finished[i]:
            state.engine.abort(seq_id)


# characters SSE keeps inside a line that Python's str.splitlines (httpx's iter_lines) breaks on:
# escaped, so a client reading lines gets whole JSON (they can only occur inside JSON strings)
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})  # (json escapes < 0x20)


def _event(obj) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}


async def _sse(state: ServerState, handle: Handle, include_usage: bool, base: dict, opening: list[dict],
               choices_for):
    """The stream of one request: `opening` choices first, then choices_for(i, out, new_ids,
    new_logprobs) for every output of choice i, then the usage chunk and [DONE]. An error after
    the stream began is sent as an error event and ends the stream."""
    usage_field = {"usage": None} if include_usage else {}
    tracker = _Tracker(state)
    sent = [0] * len(handle.seq_ids)
    finals = [None] * len(handle.seq_ids)
    for choice in opening:
        yield _event({**base, "choices": [choice], **usage_field})
    try:
        async for i, out in _merged(state, handle):
            tracker.see(out)
            if out.finish_reason == "error":
                yield _event(_engine_error(out).body())
                return
            new_ids = out.token_ids[sent[i]:]
            lps = out.logprobs[sent[i]:] if out.logprobs is not None else None
            sent[i] = len(out.token_ids)
            for choice in choices_for(i, out, new_ids, lps):
                yield _event({**base, "choices": [choice], **usage_field})
            if out.finished:
                finals[i] = out
    except ApiError as e:
        yield _event(e.body())
        return
    if include_usage:
        yield _event({**base, "choices": [], "usage": _usage(state, handle, finals)})
    yield {"data": "[DONE]"}


def _chat_stream(state: ServerState, handle: Handle, include_usage: bool):
    base = {"id": f"chatcmpl-{handle.id}", "object": "chat.completion.chunk", "created": handle.created,
            "model": state.model_name}
    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(len(handle.seq_ids))]

    def choices_for(i, out, new_ids, lps):
        if out.text_delta or lps:
            yield {"index": i, "delta": {"content": out.text_delta},
                   "logprobs": _chat_logprobs(state, new_ids, lps) if lps is not None else None, "finish_reason": None}
        if out.finished:
            yield {"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason}
    return _sse(state, handle, include_usage, base, opening, choices_for)


# ---------------------------------------------------------------------------- completions

class _TextOffsets:
    """A choice's text_offset so far: characters of its output's bytes decoded (an incomplete
    UTF-8 sequence at the end counts once complete). Counting each token's own text instead
    counted a character split over tokens once per token (offsets ran past the text), and a
    stream that advanced by the text it sent lagged while a stop string's possible start was
    held back."""

    def __init__(self, start: int = 0):
        self.chars = start
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes (then past it)."""
        at = self.chars
        self.chars += len(self.decoder.decode(token_bytes))
        return at


def _completion_logprobs(state: ServerState, token_ids, logprobs, offsets: _TextOffsets) -> dict:
    """The completions API's logprobs of `token_ids`; `offsets` carries the choice's text_offset
    from one call to the next (a stream's chunks)."""
    tokens, token_lps, tops, text_offset = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = _token_key(state, t)
        tokens.append(s)
        token_lps.append(lp.logprob)
        # keyed as OpenAI keys them, the sampled token always among them (OpenAI: "up to
        # logprobs + 1 elements"; vLLM adds it too); a token that is not whole UTF-8 on its own
        # is keyed by its bytes, or every such token would be one "\ufffd" key
        top = {_token_key(state, i): v for i, v in lp.top}
        top.setdefault(_token_key(state, t), lp.logprob)
        tops.append(top)
        text_offset.append(offsets.next(state.tokenizer.text_bytes(t) if state.tokenizer else s.encode()))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": text_offset}


def _completion_response(state: ServerState, handle: Handle, outs) -> dict:
    choices = []
    for i, o in enumerate(outs):
        prefix = handle.echo[i] if handle.echo else ""
        choices.append({"index": i, "text": prefix + o.text, "finish_reason": o.finish_reason,
                        "logprobs": _completion_logprobs(state, o.token_ids, o.logprobs, _TextOffsets(len(prefix)))
                        if o.logprobs is not None else None})
    return {"id": f"cmpl-{handle.id}", "object": "text_completion", "created": handle.created,
            "model": state.model_name, "choices": choices, "usage": _usage(state, handle, outs)}


def _completion_stream(state: ServerState, handle: Handle, include_usage: bool):
    base = {"id": f"cmpl-{handle.id}", "object": "text_completion", "created": handle.created,
            "model": state.model_name}
    echoed = handle.echo or [""] * len(handle.prompts)
    offsets = [_TextOffsets(len(t)) for t in echoed]  # each choice's, across its chunks
    opening = [{"index": i, "text": t, "logprobs": None, "finish_reason": None} for i, t in enumerate(echoed) if t]

    def choices_for(i, out, new_ids, lps):
        if out.text_delta or lps or out.finished:
            lp_obj = _completion_logprobs(state, new_ids, lps, offsets[i]) if lps is not None else None
            yield {"index": i, "text": out.text_delta, "logprobs": lp_obj,
                   "finish_reason": out.finish_reason if out.finished else None}
    return _sse(state, handle, include_usage, base, opening, choices_for)


class _LimitsAndAuth:
    """Body size (413) and API key (401 on /v1/*) checks in front of every route."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            e = ApiError(413, f"request body over {state.max_body_bytes} bytes", code="request_too_large")
            return await JSONResponse(e.body(), status_code=413)(scope, receive, send)
        if state.api_key and scope.get("path", "").startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                e = ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key")
                return await JSONResponse(e.body(), status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)
