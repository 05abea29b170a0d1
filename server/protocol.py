"""OpenAI request bodies (pydantic) and their translation to engine inputs.

Every field is either implemented or refused with a 400 that names it; unknown fields are
refused too (never accepted and ignored). Nulls and default values are always accepted.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, TypeAdapter

from eagle_serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from eagle_serve.server.generation_config import GenerationDefaults


class ApiError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              413: "invalid_request_error", 415: "invalid_request_error",
                              503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


MAX_N = 16
MAX_STOP = 4
MAX_TOOLS = 128

# The ranges below are the server's real limits: they are validated here and published in the
# OpenAPI schema (what clients and the fuzz tests read).


def _whole(value):
    """A whole-number float (5.0) is its int: JSON does not tell 5.0 from 5, and some clients'
    encoders write every number as a float. Strings, bools and fractions stay refused."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _int(**limits):
    """An int within limits that takes whole-number floats. The constraints come before the
    validator, so the OpenAPI schema states them as minimum / maximum."""
    return Annotated[int, Field(**limits), BeforeValidator(_whole)]


Int = _int()


TokenId = _int(ge=0)
TokenCount = _int(ge=1)
Penalty = Annotated[float, Field(ge=-2, le=2)]
StopString = Annotated[str, StringConstraints(min_length=1)]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
# canonical: "01" and "1" would be one key; at most 10 digits (a longer key is past any vocabulary,
# and int() refuses strings past 4300 digits)
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")]


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and json_schema names


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it (OpenAI's shape)


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class _Message(_Strict):
    name: None = None  # chat templates here have no place for it: refused (400), not dropped


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # null (or left out): no text, e.g. beside tool calls
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    refusal: None = None  # what an OpenAI answer carries back in a transcript: null only (templates have no place)


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str  # the call this is the result of


# one shape per role (the OpenAPI schema says which fields each role takes)
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
message_adapter = TypeAdapter(ChatMessage)


class FunctionDef(_Strict):
    name: Annotated[str, StringConstraints(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object (none: no arguments)
    strict: bool | None = None  # the arguments always follow the schema where a grammar enforces it


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(_Strict):
    name: Annotated[str, StringConstraints(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the output always follows the schema (a grammar enforces it)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's response_format, one shape per type
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request field: exactly one of these."""
    json_: dict[str, Any] | NonEmpty | None = Field(None, alias="json")  # a JSON Schema, or its text
    json_object: bool | None = None
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False  # a last chunk with the request's usage (and no choices)
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class _Common(_Strict):
    model: str
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: _int(ge=1, le=MAX_N) | None = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: _int(ge=-2**63, le=2**63 - 1) | None = None  # vLLM's bound (the noise is keyed by the seed mod 2^64)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: _int(ge=-1) | None = None
    min_tokens: _int(ge=0) | None = None
    ignore_eos: bool | None = None
    # vLLM's benchmark client (`vllm bench serve`) sends 1.0 on every completions request: the
    # neutral value is taken, any other is refused (no repetition penalty is implemented)
    repetition_penalty: Literal[1.0] | None = None
    # structured output (server/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # and its guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | NonEmpty | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None


# One clear message for fields whose schema is a union (pydantic reports every branch) or
# that accept only their "off" value.
FIELD_HELP = {
    "stop": f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings",
    "prompt": "prompt must be a string, a list of strings, a list of token ids (>= 0), or a list of such lists; "
              "lists may not be empty",
    "logit_bias": "logit_bias maps token ids (decimal strings) to biases in [-100, 100]",
    "tool_choice": "tool_choice must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": NAME}}",
    "guided_json": "guided_json must be a JSON Schema (an object, or its text)",
    "suffix": "suffix is not supported",
    "repetition_penalty": "repetition_penalty other than 1.0 (no penalty) is not supported; "
                          "presence_penalty and frequency_penalty are",
}


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    # tool calls (server/structured.py, server/tool_parsers.py)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: (str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: _int(ge=0, le=5) | None = None
    echo: bool | None = False
    suffix: Annotated[str, Field(max_length=0)] | None = None
    best_of: _int(ge=1, le=MAX_N) | None = None


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None, seed_offset: int,
                    defaults: GenerationDefaults = GenerationDefaults(),
                    structured: StructuredOutputs | None = None) -> SamplingParams:
    """The engine's settings for choice number `seed_offset` of this request; fields the request
    leaves out take the server's generation-config `defaults`, else the neutral ones;
    `structured`: the grammar its output follows (server/structured.py)."""
    bias = {int(key): value for key, value in (req.logit_bias or {}).items()}  # keys: canonical decimals (TokenIdKey)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    def pick(value, default, neutral):
        return value if value is not None else default if default is not None else neutral

    kwargs = dict(max_tokens=defaults.cap(max_tokens), temperature=pick(req.temperature, defaults.temperature, 1.0),
                  top_p=pick(req.top_p, defaults.top_p, 1.0), top_k=pick(req.top_k, defaults.top_k, -1),
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  logit_bias=bias, min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos), stop=tuple(stop),
                  seed=None if req.seed is None else req.seed + seed_offset, logprobs=logprobs)
    try:
        return SamplingParams(**kwargs, structured=structured)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), param if param in kwargs else None) from None


def check_common(req: _Common) -> int:
    n = 1 if req.n is None else req.n
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.stream_options and req.stream_options.continuous_usage_stats and not req.stream_options.include_usage:
        # vLLM sends nothing for it without include_usage; here that would be a field accepted and ignored
        raise ApiError(400, "stream_options.continuous_usage_stats needs stream_options.include_usage=true",
                       "stream_options.continuous_usage_stats")
    return n


def template_message(m: ChatMessage) -> dict:
    """A message as the chat template takes it: text parts joined by newlines (as vLLM joins
    them), developer as system; an assistant's tool calls with their arguments as a dict (the
    JSON text parsed, as vLLM passes them: templates write them with `tojson`; text that is not
    a JSON object stays text), a tool message with its tool_call_id."""
    content = "\n".join(p.text for p in m.content) if isinstance(m.content, list) else m.content
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if isinstance(m, AssistantMessage) and m.tool_calls is not None:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    elif isinstance(m, AssistantMessage) and content is None:
        out["content"] = ""  # an assistant turn without text or calls: an empty one
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def chat_inputs(req: ChatRequest) -> tuple[list[dict], int | None, int | None]:
    """(messages for the chat template, max_tokens or None, logprobs top-n or None)."""
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    messages = [template_message(m) for m in req.messages]
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
    elif req.top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return messages, max_tokens, top


def completion_prompts(req: CompletionRequest, tokenizer) -> list[list[int]]:
    if req.best_of is not None and req.best_of < (req.n or 1):  # as OpenAI and vLLM
        raise ApiError(400, f"best_of must be >= n, got best_of {req.best_of} and n {req.n or 1}", "best_of")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, "best_of other than n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo with logprobs needs prompt logprobs, which are not supported", "echo")
    out = []
    for item in _prompt_items(req):
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt")
        out.append(ids)
    return out


def _prompt_items(req: CompletionRequest) -> list:
    """The request's prompts, each a string or a list of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, int) for x in p):  # (lists are non-empty: the model's min_length)
        return [list(p)]
    return list(p)


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer) -> list[str]:
    """What echo puts before each prompt's completion: a text prompt as it was sent (decoding
    its tokens would drop special tokens such as a chat template's markers), token ids decoded
    with their special tokens (what the model read); "" without a tokenizer."""
    return [item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""
            for item, ids in zip(_prompt_items(req), prompts)]
