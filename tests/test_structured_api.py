"""Structured output over the HTTP API (response_format, vLLM's structured_outputs and guided_*
fields) with the openai SDK against a live server on the embedded default model: the outputs
follow the grammar, and what cannot be served is a 400 naming its field."""
from __future__ import annotations

import json
import re

import httpx2 as httpx
import jsonschema
import pytest
from pydantic import BaseModel

from eagle_serve.server.metrics import parse_metrics
from eagle_serve.server.protocol import ChatRequest
from eagle_serve.server.structured import plan

pytestmark = pytest.mark.real_model

ASK = [{"role": "user", "content": "Describe Paris in JSON: its name, country and population."}]


class City(BaseModel):
    name: str
    country: str
    population: int


def post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def test_parse_with_a_pydantic_model(client, model):
    r = client.chat.completions.parse(model=model, messages=ASK, response_format=City, temperature=0, max_tokens=64)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_streamed_equals_unstreamed(client, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    kw = dict(model=model, messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}], temperature=0,
              max_tokens=40,
              response_format={"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema,
                                                                      "strict": True}})
    text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text


def test_json_object_is_an_object(client, model):
    ask = [{"role": "user", "content": "What is the capital of Italy? Reply in JSON."},
           {"role": "assistant", "content": '{"capital": "Rome"}'},
           {"role": "user", "content": "What is the capital of France? Reply in JSON."}]
    r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=32,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_structured_outputs_regex_choice_and_grammar(client, model):
    kw = dict(model=model, temperature=0, max_tokens=16)
    ask = [{"role": "user", "content": "What year did the French Revolution start?"}]
    year = client.chat.completions.create(messages=ask, extra_body={"structured_outputs": {"regex": "1[0-9]{3}"}}, **kw)
    assert re.fullmatch("1[0-9]{3}", year.choices[0].message.content)
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    pick = client.chat.completions.create(messages=ask, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
                                          **kw)
    assert pick.choices[0].message.content in ("yes", "no")
    older = client.chat.completions.create(messages=ask, extra_body={"guided_choice": ["yes", "no"]}, **kw)
    assert older.choices[0].message.content == pick.choices[0].message.content
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    said = client.chat.completions.create(messages=ask, extra_body={"structured_outputs": {"grammar": ebnf}}, **kw)
    assert re.fullmatch(r"The answer is (yes|no)\.", said.choices[0].message.content)
    # completions too, and a schema sent as text
    comp = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=24,
                                     extra_body={"structured_outputs": {"json": json.dumps(
                                         {"type": "object", "properties": {"capital": {"type": "string"}},
                                          "required": ["capital"]})}})
    assert isinstance(json.loads(comp.choices[0].text)["capital"], str)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": "a thing"}}},
     "response_format.json_schema.description"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_structured_output_is_a_400_naming_the_field(tools_server, model, body, param):
    r = post(tools_server, {"model": model, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_response_format_text_is_plain(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content


def test_compile_timeout_is_a_400(tools_server, model, monkeypatch):
    grammars = tools_server.state.grammars
    monkeypatch.setattr(grammars, "timeout", 1e-9)
    r = post(tools_server, {"model": model, "messages": ASK, "max_tokens": 4,
                            "structured_outputs": {"regex": "[a-z]{1,7}@[a-z]{2,9}\\.(com|org|net)"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_compile_timeout", r.text
    assert r.json()["error"]["param"] == "structured_outputs.regex"


def test_metrics_count_structured_requests_compiles_and_cache_hits(tools_server, model):
    def read():
        m = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
        return (m['eagle_serve_structured_output_requests_total{kind="regex"}'],
                m["eagle_serve_grammar_compile_seconds_count"], m["eagle_serve_grammar_cache_hits_total"])
    body = {"model": model, "messages": ASK, "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{2}:[0-9]{5}"}}
    before = read()
    assert post(tools_server, body).status_code == 200 and post(tools_server, body).status_code == 200
    requests, compiles, hits = (a - b for a, b in zip(read(), before))
    assert (requests, compiles, hits) == (2, 1, 1)


def test_plan_maps_fields_to_one_grammar():
    def spec(**fields):
        return plan(ChatRequest.model_validate({"model": "m", "messages": ASK, **fields})).spec
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    got = spec(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert json.loads(got.json) == schema and list(json.loads(got.json)["properties"]) == ["b", "a"]  # order kept
    assert spec(structured_outputs={"json": schema}).json == got.json
    assert spec(guided_json=json.dumps(schema)).json == json.dumps(schema)
    assert spec(structured_outputs={"choice": ["x", "y"]}).choice == ("x", "y")
    assert spec(structured_outputs={"json_object": True}).json_object
    assert json.loads(spec(response_format={"type": "json_object"}).json) == {"type": "object"}
    assert spec(response_format={"type": "text"}) is None and spec() is None
