"""OpenAI request bodies (pydantic) and their translation to engine inputs.

Every field is either implemented or refused with a 400 that names it; unknown fields are
refused too (never accepted and ignored). Nulls and default values are always accepted.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import MAX_LOGPROBS, SamplingParams


class ApiError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


MAX_N = 16


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None, seed_offset: int) -> SamplingParams:
    """The engine's settings for choice number `seed_offset` of this request."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop must be up to 4 non-empty strings", "stop")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    kwargs = dict(max_tokens=max_tokens, temperature=temperature,
                  top_p=1.0 if req.top_p is None else req.top_p,
                  top_k=-1 if req.top_k is None else req.top_k,
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  logit_bias=bias, min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos), stop=tuple(stop),
                  seed=None if req.seed is None else req.seed + seed_offset, logprobs=logprobs)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), param if param in kwargs else None) from None


def check_common(req: _Common) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise ApiError(400, "stream_options.continuous_usage_stats is not supported", "stream_options")
    return n


def chat_inputs(req: ChatRequest) -> tuple[list[dict], int | None, int | None]:
    """(messages for the chat template, max_tokens or None, logprobs top-n or None)."""
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "response_format other than text is not supported yet", "response_format")
    if req.tools:
        raise ApiError(400, "tools are not supported yet", "tools")
    if req.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice is not supported yet", "tool_choice")
    if req.parallel_tool_calls is False:  # only meaningful with tools; true is the default
        raise ApiError(400, "parallel_tool_calls is not supported (no tools yet)", "parallel_tool_calls")
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not supported (system, user, assistant)",
                           f"messages.{i}.role")
        if m.name is not None:  # chat templates here have no place for it: refused, not dropped
            raise ApiError(400, f"messages[{i}].name is not supported", f"messages.{i}.name")
        if isinstance(m.content, list):
            content = "".join(p.text for p in m.content)
        elif m.content is None:
            raise ApiError(400, f"messages[{i}].content is required", f"messages.{i}.content")
        else:
            content = m.content
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    elif req.top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return messages, max_tokens, top


def completion_prompts(req: CompletionRequest, tokenizer) -> list[list[int]]:
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of not in (None, 1) and req.best_of != req.n:
        raise ApiError(400, "best_of other than n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo with logprobs needs prompt logprobs, which are not supported", "echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise ApiError(400, "logprobs must be in [0, 5] for completions", "logprobs")
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    if not items:
        raise ApiError(400, "prompt is empty", "prompt")
    out = []
    for item in items:
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt")
        out.append(ids)
    return out
