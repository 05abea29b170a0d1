"""Tool calls on /v1/chat/completions: tool_choice named and "required" (grammar-forced), "auto"
read by the tool-call parsers, "none"; streamed deltas in OpenAI's shape; the history's tool
calls and results through the shipped chatml_tools template; 400s naming the field."""
from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import pytest

from eagle_serve.engine.tokenizer import _compile
from eagle_serve.server.chat_templates import load_chat_template, renders_tools
from eagle_serve.server.metrics import parse_metrics
from eagle_serve.server.tool_parsers import ToolCallReader, assemble, finish_reason

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
live = pytest.mark.real_model  # the tests on the embedded default model (the parser and template tests need none)


# ---------------------------------------------------------------------------- parsers

FUNCTIONS = {"get_weather": None, "add": ADD}  # add is strict: its arguments are validated


def _streamed(reader: ToolCallReader, text: str, step: int = 1):
    deltas = []
    for i in range(0, len(text), step):
        deltas += reader.feed(text[i:i + step])
    return assemble(deltas + reader.finish())


def _plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_reads_calls_and_keeps_the_text_around_them(step):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = _streamed(ToolCallReader("hermes", FUNCTIONS), text, step)
    assert content == "Let me check.\n\n"
    assert _plain(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in calls)
    assert ToolCallReader("hermes", FUNCTIONS).read(text)[0] == content  # at once: the same


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the request's functions
    '<tool_call>{"name": "add", "arguments": {"a": "one", "b": 2}}</tool_call>',  # strict: does not validate
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_hermes_malformed_block_stays_text(text):
    failures = []
    reader = ToolCallReader("hermes", FUNCTIONS, on_failure=lambda: failures.append(1))
    assert reader.read("Hi " + text) == ("Hi " + text, []) and failures == [1]


def test_hermes_holds_a_partial_marker_and_reads_an_unclosed_block_at_the_end():
    reader = ToolCallReader("hermes", FUNCTIONS)
    assert reader.feed("Sure <tool_") == [{"content": "Sure "}]  # "<tool_" may begin a block: held
    assert reader.feed('call>{"name": "get_weather", "arguments": {"city": "Oslo"}}') == []
    content, calls = assemble(reader.finish())
    assert content is None and _plain(calls) == [("get_weather", {"city": "Oslo"})]
    assert ToolCallReader("hermes", FUNCTIONS).read("a < b and <tool") == ("a < b and <tool", [])
    assert ToolCallReader("hermes", FUNCTIONS).read("  \n") == (None, [])


@pytest.mark.parametrize("step", [1, 1000])
def test_llama3_json_reads_one_or_several_calls(step):
    one = ' {"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert _plain(_streamed(ToolCallReader("llama3_json", FUNCTIONS), one, step)[1]) == [("get_weather", {"city": "Rome"})]
    several = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "X"}}'
    content, calls = _streamed(ToolCallReader("llama3_json", FUNCTIONS), several, step)
    assert content is None and [c[0] for c in _plain(calls)] == ["add", "get_weather"]


@pytest.mark.parametrize("text", ["The weather is fine.", '{"name": "get_weather", "parameters": {"city": "X"} and more',
                                  '{"name": "nope", "parameters": {}}', '{"city": "Paris"}',
                                  '{"name": "add", "parameters": {"a": 1, "b": 2}} {"name": "add", "parameters": {}}'])
def test_llama3_json_anything_else_stays_text(text):
    assert _streamed(ToolCallReader("llama3_json", FUNCTIONS), text, 2) == (text, [])


def test_one_call_without_parallel_tool_calls():
    two = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    content, calls = ToolCallReader("hermes", FUNCTIONS, max_calls=1).read(two)
    assert [c["function"]["name"] for c in calls] == ["add"] and content.startswith("<tool_call>{\"name\": \"get_weather\"")
    several = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {}}'
    assert ToolCallReader("llama3_json", FUNCTIONS, max_calls=1).read(several) == (several, [])


def test_named_and_required_readers():
    named = ToolCallReader("named", FUNCTIONS, "get_weather")
    deltas = named.feed('{"city": ') + named.feed('"Paris"}') + named.finish()
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert assemble(deltas)[1][0]["function"]["arguments"] == '{"city": "Paris"}'
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "P"}}]'
    content, calls = _streamed(ToolCallReader("required", FUNCTIONS), text, 4)
    assert content is None and _plain(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "P"})]
    cut = ToolCallReader("required", FUNCTIONS).read('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name"')
    assert cut[0] == '{"name"' and len(cut[1]) == 1  # cut short (max_tokens): the unread rest is content
    assert finish_reason("stop", 1) == "tool_calls" and finish_reason("length", 1) == "length"
    assert finish_reason("stop", 0) == "stop"


# ---------------------------------------------------------------------------- the template

def test_chatml_tools_template_renders_tools_calls_and_results():
    template = load_chat_template("chatml_tools")
    assert renders_tools(template) and not renders_tools("{{ messages[0]['content'] }}")
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}]
    text = _compile(template).render(messages=messages, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and json.dumps(TOOLS[1]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = _compile(template).render(messages=ASK, tools=None, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"


@live
def test_llm_chat_template_option_and_refusal(tiny_llm, tools_llm):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    from eagle_serve.server.llm import _messages
    text = tools_llm.tokenizer.apply_chat_template(_messages(history), tools=TOOLS)
    assert '"name": "add"' in text and '{"name": "add", "arguments": {"a": 1, "b": 2}}' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    with pytest.raises(ValueError, match="chat_template='chatml_tools'"):
        tiny_llm.chat(ASK, tools=TOOLS)  # its template does not render tools
    with pytest.raises(ValueError, match="shipped template"):
        from eagle_serve.server.chat_templates import load_chat_template
        load_chat_template("no_such_template")


# ---------------------------------------------------------------------------- the live server



def _check_call(call, name: str | None = None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@live
def test_named_tool_call_streamed_equals_unstreamed(client, model):
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, max_tokens=48)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], "get_weather")
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert "".join(p.function.arguments or "" for p in pieces) == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@live
def test_required_tool_call_streamed_equals_unstreamed(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0])
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == calls[0].function.name
    assert "".join(p.function.arguments or "" for p in pieces) == calls[0].function.arguments


@live
def test_history_with_tool_calls_and_results_is_served(client, model):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=16)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@live
def test_auto_answers_without_a_grammar(tools_server, client, model):
    before = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.content or choice.message.tool_calls
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    after = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
    key = 'eagle_serve_structured_output_requests_total{kind="tool_named"}'
    assert after[key] == before[key]  # auto has no grammar


@live
def test_auto_hermes_answer_streams_its_text_then_the_call(tools_server, client, model, monkeypatch):
    """An answer in hermes' format, made certain by a grammar (tool_choice "none" plus a regex,
    read as tool_choice "auto" would read it): the text before the block streams as content, the
    call comes whole once its block closes, streamed and not alike."""
    import eagle_serve.server.app as app_module
    real = app_module.plan

    def as_auto(req, parser=None):
        p = real(req, parser)
        p.reader, p.functions = "hermes", {"get_weather": None}
        return p
    monkeypatch.setattr(app_module, "plan", as_auto)
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=64,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw).choices[0]
    assert r.message.content == "Sure. " and r.finish_reason == "tool_calls"
    assert [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    assert json.loads(r.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Sure. "
    pieces = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""
    assert "".join(p.function.arguments or "" for p in pieces) == r.message.tool_calls[0].function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


@live
def test_tool_call_metrics(tools_server, client, model):
    before = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
    client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    after = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
    for key in ('eagle_serve_tool_calls_parsed_total{parser="named"}',
                'eagle_serve_structured_output_requests_total{kind="tool_named"}'):
        assert after[key] == before[key] + 1, key


def _post(server, body):
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)


@live
@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name", "parameters": ADD}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": ADD}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools.1.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
])
def test_bad_tools_are_400s_naming_the_field(tools_server, model, body, param):
    r = _post(tools_server, {"model": model, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@live
def test_auto_without_a_parser_and_tools_without_a_template_are_400s(tools_server, tools_llm, model, monkeypatch):
    monkeypatch.setattr(tools_server.state, "tool_call_parser", None)
    r = _post(tools_server, {"model": model, "messages": ASK, "max_tokens": 4, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    monkeypatch.setattr(tools_server.state.tokenizer, "chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    r = _post(tools_server, {"model": model, "messages": ASK, "max_tokens": 4, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "--chat-template chatml_tools" in r.json()["error"]["message"]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    r = _post(tools_server, {"model": model, "messages": history, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1"


@live
@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "x"}, "messages.1.tool_call_id"),
    ({"role": "user", "content": None}, "messages.1.content.str"),  # (the first of content's shapes)
    ({"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function",
                                                       "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls"),
    ({"role": "assistant", "content": "x", "tool_call_id": "a"}, "messages.1.tool_call_id"),
])
def test_bad_tool_messages_are_400s(tools_server, model, message, param):
    r = _post(tools_server, {"model": model, "messages": [*ASK, message], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@live
def test_speculation_on_and_off_answer_alike(tools_server, model):
    """The same structured and tool-call requests against a server that speculates with the
    shipped head (EAGLE-2 over grammar-pruned trees, every verified node masked): greedy answers
    equal the plain server's, call for call (ids aside)."""
    from eagle_serve.engine.default_model import default_draft_path
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.app import BackgroundServer, ServerState
    from eagle_serve.server.llm import LLM
    llm = LLM(None, dtype="float32", device="cpu", kv_cache_tokens=4096, chat_template="chatml_tools",
              draft=default_draft_path(), spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=4), tree_budget=False)
    spec_server = BackgroundServer(ServerState(llm, tool_call_parser="hermes"))
    city = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                             "population": {"type": "integer"}},
            "required": ["name", "country", "population"], "additionalProperties": False}
    bodies = [
        {"messages": [{"role": "user", "content": "Describe Paris in JSON: its name, country and population."}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": city}}},
        {"messages": [{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
         "response_format": {"type": "json_object"}},
        {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    ]
    try:
        drafted = 0
        for body in bodies:
            body = {"model": model, "temperature": 0, "max_tokens": 48, **body}
            plain, spec = (_post(srv, body).json() for srv in (tools_server, spec_server))
            p, s = plain["choices"][0], spec["choices"][0]
            assert s["message"]["content"] == p["message"]["content"]
            assert _plain(s["message"].get("tool_calls") or []) == _plain(p["message"].get("tool_calls") or [])
            assert s["finish_reason"] == p["finish_reason"]
            drafted += spec["usage"].get("spec", {}).get("draft_tokens", 0)
        assert drafted > 0  # the speculating server did verify drafts
    finally:
        spec_server.stop()
