"""Structured output and tool calls on the request side: which grammar a request's output
follows (OpenAI's response_format, vLLM's structured_outputs and guided_* fields, a forced tool
call), which tools its prompt lists, and how its output is read back (server/tool_parsers.py).

A grammar is compiled before the request is submitted, off the event loop in a small thread
pool of its own and under a time limit; what cannot be served is a 400 naming the request
field it came from.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from eagle_serve.engine.sampling_params import StructuredOutputs
from eagle_serve.server.protocol import ApiError, ChatRequest, Tool, _Common
from eagle_serve.server.tool_parsers import TOOL_CALL_PARSERS

log = logging.getLogger("eagle_serve")

COMPILE_TIMEOUT = 10.0  # seconds a grammar may take to compile (--grammar-compile-timeout)
COMPILE_THREADS = 2
NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function without parameters
ANY_OBJECT = '{"type": "object"}'  # response_format json_object


@dataclass
class Plan:
    """What a request's structured output and tools come to."""

    spec: StructuredOutputs | None = None
    param: str | None = None  # the request field a grammar error names
    kind: str | None = None  # the metrics label (metrics.STRUCTURED_KINDS)
    tools: list[dict] | None = None  # for the chat template: [{"type": "function", "function": {...}}, ...]
    # how the output is read back: None (text), "named" (the output is one call's arguments),
    # "required" (a JSON array of calls), or a tool-call parser's name (auto)
    reader: str | None = None
    function: str | None = None  # the named function
    # function name -> its parameters' schema where the function is strict, else None (the
    # tool-call parsers validate a strict function's arguments)
    functions: dict[str, dict | None] = field(default_factory=dict)
    max_calls: int | None = None  # auto with parallel_tool_calls false: one call (more stay content)


def _schema_text(schema) -> str:
    return json.dumps(schema, ensure_ascii=False)  # (keys in the order sent: properties keep their order)


def _field_spec(req: _Common) -> tuple[StructuredOutputs, str, str] | None:
    """The grammar the request's response_format / structured_outputs / guided_* fields ask for:
    (spec, the field errors name, metrics kind), or None; 400 for several at once."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":  # OpenAI's JSON mode: an object (not any JSON value)
        found.append((StructuredOutputs(json=ANY_OBJECT), "response_format", "json_object"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema.description is not None:  # OpenAI shows it to the model; here nothing would
            raise ApiError(400, "response_format.json_schema.description is not supported: the model is not "
                                "shown it here (put what the output is for in the messages)",
                           "response_format.json_schema.description")
        schema = rf.json_schema.schema_
        if schema is None:
            found.append((StructuredOutputs(json=ANY_OBJECT), "response_format.json_schema", "json_object"))
        else:
            found.append((StructuredOutputs(json=_schema_text(schema)), "response_format.json_schema.schema",
                          "json_schema"))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(so, k) not in (None, False)]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                                f"got {', '.join(k.rstrip('_') for k in given) or 'none'}", "structured_outputs")
        key = given[0]
        found.append(_one(key.rstrip("_"), getattr(so, key), f"structured_outputs.{key.rstrip('_')}"))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{key}")
        if value is not None:
            found.append(_one(key, value, f"guided_{key}"))
    if len(found) > 1:
        raise ApiError(400, f"{found[0][1]} and {found[1][1]} both ask for structured output; give one",
                       found[1][1].split(".")[0])
    return found[0] if found else None


def _one(key: str, value, param: str) -> tuple[StructuredOutputs, str, str]:
    if key == "json":
        text = value if isinstance(value, str) else _schema_text(value)  # (pydantic admits a dict or its text)
        return _spec(param, json=text), param, "json_schema"
    if key == "json_object":
        return StructuredOutputs(json_object=True), param, "json_object"
    if key == "choice":
        return _spec(param, choice=tuple(value)), param, "choice"
    return _spec(param, **{key: value}), param, key


def _spec(param: str, **kwargs) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except ValueError as e:  # an empty regex, grammar or choice
        raise ApiError(400, f"{param}: {e}", param) from None


def plan(req: _Common, tool_call_parser: str | None = None) -> Plan:
    """The request's grammar, its tools for the template and how its output is read back;
    400s for fields that conflict or name what does not exist."""
    spec = _field_spec(req)
    tools = getattr(req, "tools", None) or None
    choice = getattr(req, "tool_choice", None)
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        # (parallel_tool_calls without tools holds whatever its value: no calls are made)
        if spec is None:
            return Plan()
        _no_forced_tokens(req, spec[1])
        return Plan(spec=spec[0], param=spec[1], kind=spec[2])
    assert isinstance(req, ChatRequest)
    names = [t.function.name for t in tools]
    again = next((i for i, n in enumerate(names) if n in names[:i]), None)
    if again is not None:
        raise ApiError(400, f"tools[{again}].function.name: the function name {names[again]!r} is given twice",
                       f"tools.{again}.function.name")
    for i, t in enumerate(tools):
        _check_schema(t, i)
    listed = [_tool_dict(t) for t in tools]
    functions = {t.function.name: (t.function.parameters or NO_ARGUMENTS) if t.function.strict else None
                 for t in tools}
    if choice is None:
        choice = "auto"  # OpenAI's default with tools
    if choice == "none":
        out = Plan(tools=listed)
        if spec is not None:
            _no_forced_tokens(req, spec[1])
            out.spec, out.param, out.kind = spec
        return out
    if spec is not None:
        raise ApiError(400, f"{spec[1]} cannot be combined with tools unless tool_choice is \"none\" (a tool call "
                            "is written in its own format)", spec[1].split(".")[0])
    params = {t.function.name: (t.function.parameters if t.function.parameters is not None else NO_ARGUMENTS)
              for t in tools}
    where = {n: f"tools.{i}.function.parameters" for i, n in enumerate(names)}  # (params: pydantic's dotted form)
    if not isinstance(choice, str):  # a named function
        name = choice.function.name
        if name not in params:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools "
                                f"({', '.join(names)})", "tool_choice")
        _no_forced_tokens(req, "tool_choice")
        return Plan(spec=_tool_spec(params[name], where[name]), param=where[name], kind="tool_named",
                    tools=listed, reader="named", function=name, functions=functions)
    if choice == "required":
        for name in names:  # each schema on its own, so that a refusal names its tool
            _check_tool(params[name], where[name])
        _no_forced_tokens(req, "tool_choice")
        schema = required_schema(params, parallel=req.parallel_tool_calls is not False)
        return Plan(spec=StructuredOutputs(json=_schema_text(schema)), param="tools", kind="tool_required",
                    tools=listed, reader="required", functions=functions)
    if tool_call_parser is None:
        raise ApiError(400, "tool_choice \"auto\" needs a tool-call parser: start the server with "
                            f"--tool-call-parser {{{','.join(TOOL_CALL_PARSERS)}}} (or send tool_choice \"required\", "
                            "a named function, or \"none\")", "tool_choice")
    return Plan(tools=listed, reader=tool_call_parser, functions=functions,
                max_calls=1 if req.parallel_tool_calls is False else None)


def required_schema(params: dict[str, dict], parallel: bool) -> dict:
    """The JSON Schema of tool_choice "required": an array of one call (several with parallel
    tool calls), each {"name": one of the functions, "parameters": its arguments}."""
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in params.items()]
    array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return array


def _tool_dict(t: Tool) -> dict:
    f = {"name": t.function.name}
    if t.function.description is not None:
        f["description"] = t.function.description
    f["parameters"] = t.function.parameters if t.function.parameters is not None else NO_ARGUMENTS
    return {"type": "function", "function": f}


def _check_schema(t: Tool, i: int) -> None:
    """A tool's parameters must be a valid JSON Schema of an object, whatever the tool_choice."""
    schema = t.function.parameters
    if schema is None:
        return
    import jsonschema
    param = f"tools.{i}.function.parameters"
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ApiError(400, f"{param} is not a valid JSON Schema: {e.message}", param) from None
    except RecursionError:
        raise ApiError(400, f"{param} is nested too deeply", param) from None
    except Exception as e:  # noqa: BLE001 - e.g. a $schema or $ref the validator cannot resolve: the request's fault
        raise ApiError(400, f"{param} cannot be checked as a JSON Schema: {type(e).__name__}: {e}", param) from None
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{param} must be the JSON Schema of an object (type \"object\")", param)


def _check_tool(schema: dict, param: str) -> None:
    from eagle_serve.engine.structured import GrammarError, check  # (torch: loaded where grammars are used)
    try:
        check(StructuredOutputs(json=_schema_text(schema)))
    except GrammarError as e:
        raise ApiError(400, _renamed(str(e), e.field, param), param) from None


def _tool_spec(schema: dict, param: str) -> StructuredOutputs:
    _check_tool(schema, param)
    return StructuredOutputs(json=_schema_text(schema))


def _renamed(message: str, field: str, param: str) -> str:
    """An engine message names its spec's field (json_schema, regex, ...): the request's name."""
    return message.replace(field, param, 1) if message.startswith(field) else f"{param}: {message}"


def _no_forced_tokens(req: _Common, param: str) -> None:
    for name in ("min_tokens", "ignore_eos"):
        if getattr(req, name):
            raise ApiError(400, f"{name} cannot be combined with {param} (the grammar decides where the output "
                                "ends)", name)


# ---------------------------------------------------------------------------- compiling

class GrammarCompiler:
    """Compiles a request's grammar before it is submitted: in a thread pool of its own (a
    schema can take seconds; the event loop and the engine go on meanwhile), waited for at most
    `timeout` seconds. A compile that times out runs on in its thread and lands in the cache, so
    the same request sent again may be served."""

    def __init__(self, llm, metrics, timeout: float = COMPILE_TIMEOUT, threads: int = COMPILE_THREADS):
        if not timeout > 0:
            raise ValueError(f"the grammar compile timeout must be > 0 seconds, got {timeout}")
        self.llm, self.metrics, self.timeout, self.threads = llm, metrics, timeout, threads
        self.pool: ThreadPoolExecutor | None = None  # started on the first grammar, again after close()

    def _get(self, spec: StructuredOutputs):
        grammars = self.llm.runner.grammars
        if grammars.cached(spec):
            self.metrics.grammar_cache_hits.inc()
            return grammars.get(spec)
        t0 = time.perf_counter()
        compiled = grammars.get(spec)
        self.metrics.grammar_compile_seconds.observe(time.perf_counter() - t0)
        return compiled

    async def compile(self, p: Plan) -> None:
        """Compile the plan's grammar (a no-op without one); 400 naming its field when it cannot
        be served or takes too long."""
        if p.spec is None:
            return
        from eagle_serve.engine.structured import GrammarError
        loop = asyncio.get_running_loop()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="grammar")
        try:
            await asyncio.wait_for(loop.run_in_executor(self.pool, self._get, p.spec), timeout=self.timeout)
        except GrammarError as e:
            raise ApiError(400, _renamed(str(e), e.field, p.param), p.param) from None
        except asyncio.TimeoutError:
            raise ApiError(400, f"{p.param}: the grammar took longer than {self.timeout:g} s to compile; simplify it",
                           p.param, "grammar_compile_timeout") from None
        except ValueError as e:  # no tokenizer
            raise ApiError(400, str(e), p.param) from None
        except Exception as e:  # noqa: BLE001 - whatever else a spec makes the checks or the compiler raise
            log.warning("grammar for %s failed to compile: %r", p.param, e)
            raise ApiError(400, f"{p.param} cannot be compiled: {type(e).__name__}: {e}", p.param) from None
        self.metrics.structured_requests.labels(p.kind).inc()

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
