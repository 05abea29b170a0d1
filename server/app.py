"""The OpenAI-compatible HTTP server (FastAPI + sse-starlette) over the asyncio engine: the app,
its routes and error handlers. A request is parsed, submitted and collected in `server.requests`;
its answer is built in `server.responses`, or streamed by `server.streaming`."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_serve.engine.tokenizer import TemplateError
from eagle_serve.scheduler.async_engine import AsyncEngine
from eagle_serve.server.chat_templates import check_template_tools
from eagle_serve.server.metrics import Metrics
from eagle_serve.server.openapi import openapi_schema
from eagle_serve.server.protocol import (ApiError, ChatRequest, CompletionRequest, chat_inputs, check_common,
                                         completion_prompts, echo_texts, sampling_params)
from eagle_serve.server.requests import collect, parse_request, submit
from eagle_serve.server.responses import chat_response, completion_response
from eagle_serve.server.streaming import SHUT_DOWN, chat_stream, completion_stream, stream_response
from eagle_serve.server.structured import COMPILE_TIMEOUT, TOOL_CALL_PARSERS, GrammarCompiler, plan

log = logging.getLogger("eagle_serve")
VERSION = "0.1.0"


class ServerState:
    def __init__(self, llm, served_model_name: str | None = None, api_key: str | None = None,
                 max_waiting: int = 256, max_body_bytes: int = 4 << 20, stall_seconds: float = 120.0,
                 request_timeout: float | None = None, allowed_origins: list[str] | None = None,
                 shutdown_timeout: float = 30.0, tool_call_parser: str | None = None,
                 grammar_compile_timeout: float = COMPILE_TIMEOUT):
        """request_timeout: seconds a request may run before it is aborted (None: no limit).
        allowed_origins: CORS origins (None or empty: no CORS headers at all).
        shutdown_timeout: on SIGTERM, seconds running streams may take to finish.
        tool_call_parser: how tool_choice "auto" reads calls from an answer (hermes,
        llama3_json; None: tool_choice "auto" is refused). grammar_compile_timeout: seconds a
        request's grammar may take to compile (400 past it)."""
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.llm = llm
        self.request_timeout = request_timeout
        self.allowed_origins = list(allowed_origins or [])
        self.shutdown_timeout = shutdown_timeout
        # set once SIGTERM's grace period is over: what still runs is answered 503 / an error
        # event before the server cancels it
        self.shut_down = False
        self.stream_queues: set[asyncio.Queue] = set()  # running streams' merged queues, told at once
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
        self.grammars = GrammarCompiler(llm, self.metrics, grammar_compile_timeout)
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
        for q in list(self.stream_queues):
            q.put_nowait((None, SHUT_DOWN))


class BackgroundServer:
    """The app under uvicorn on a free loopback port, in a daemon thread (tests, benchmarks)."""

    def __init__(self, state: ServerState, timeout: float = 30.0):
        import threading
        import uvicorn
        from eagle_serve.server.process import free_port
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
            state.grammars.close()

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

    # a plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hides a
    # client's disconnect from the endpoint, so requests whose client left would run to their end
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
        req = await parse_request(request, ChatRequest, state)
        n = check_common(req)
        messages, max_tokens, top = chat_inputs(req)
        if state.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer; use /v1/completions with token ids")
        check_template_tools(state.tokenizer.chat_template, req.tools, messages)
        p = plan(req, state.tool_call_parser)
        try:  # off the event loop, so that a long prompt's tokenization does not stall streams and /health
            prompt = await asyncio.to_thread(state.tokenizer.encode_chat, messages, True, p.tools)
        except TemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        await state.grammars.compile(p)
        ctx = state.llm.max_model_len
        if max_tokens is None:
            max_tokens = ctx - len(prompt)
            if max_tokens < 1:
                raise ApiError(400, f"this model's maximum context length is {ctx} tokens; the messages have "
                                    f"{len(prompt)} tokens", "messages", "context_length_exceeded")
        params = [sampling_params(req, max_tokens, top, i, state.llm.generation_defaults, p.spec) for i in range(n)]
        handle = submit(state, [prompt] * n, params, req.user)
        handle.plan = p
        if req.stream:
            return stream_response(state, chat_stream(state, handle, req.stream_options), handle)
        outs = await collect(request, state, handle)
        return chat_response(state, handle, outs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_request(request, CompletionRequest, state)
        n = check_common(req)
        if state.tokenizer is None and (isinstance(req.prompt, str) or isinstance(req.prompt[0], str)):
            raise ApiError(400, "this server has no tokenizer; send token ids", "prompt")
        prompts = await asyncio.to_thread(completion_prompts, req, state.tokenizer)  # (off the event loop)
        structured = plan(req)
        await state.grammars.compile(structured)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = [sampling_params(req, max_tokens, req.logprobs, i, state.llm.generation_defaults, structured.spec)
                  for i in range(n)]
        handle = submit(state, [p for p in prompts for _ in range(n)], params * len(prompts), req.user)
        if req.echo:
            handle.echo = [t for t in echo_texts(req, prompts, state.tokenizer) for _ in range(n)]
        if req.stream:
            return stream_response(state, completion_stream(state, handle, req.stream_options), handle)
        outs = await collect(request, state, handle)
        return completion_response(state, handle, outs)

    app.openapi = lambda: openapi_schema(app, state)
    return app


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
