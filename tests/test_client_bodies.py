"""Request bodies as real clients send them, replayed against a live server on a tiny model, and
vLLM's stream_options.continuous_usage_stats.

tests/data/client_bodies/<client>_<case>.json are the bodies the openai SDK (chat and
completions, plain and streamed), LangChain's ChatOpenAI and OpenAI (invoke, stream, tools,
structured output), guidellm (`guidellm run`) and NVIDIA's aiperf (`aiperf profile --streaming`), chat
and completions, POSTed to a server that recorded them; each is stored as sent but for its model
name, which the test sets (and aiperf's synthetic prompts, cut to fit the tiny model's context). The two
vllm_bench_serve_* bodies were recorded from the request functions `vllm bench serve` sends with
(vLLM's openai and openai-chat backends, with --ignore-eos)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest

from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.server.app import BackgroundServer, ServerState
from eagle_serve.server.llm import LLM
from tests.conftest import CHAT_TEMPLATE
from tests.spec_helpers import write_eagle_head

DATA = Path(__file__).parent / "data" / "client_bodies"
BODIES = sorted(p.stem for p in DATA.glob("*.json"))
# bodies refused on purpose: the field the 400 names, and why the server refuses it (none: the
# tools and json_schema bodies are served, with a chat template that renders tools and
# --tool-call-parser hermes, as an operator serving tool calls starts the server)
REFUSED: dict[str, tuple[str, str]] = {}
# a ChatML template that lists the tools by name only: the tiny model's context is 512 tokens, too
# short for the shipped chatml_tools template's instructions in its small vocabulary
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                  "<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    head = write_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), tiny_llama[0])
    # several clients send no token limit: a generation config caps every answer, as an operator's would
    gen = tmp_path_factory.mktemp("generation-config")
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 24}))
    template = tmp_path_factory.mktemp("chat-template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4, draft=head,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), tree_budget=False,
              generation_config=str(gen), chat_template=str(template))
    srv = BackgroundServer(ServerState(llm, served_model_name="tiny", tool_call_parser="hermes"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def stream_chunks(response: httpx.Response) -> list[dict]:
    """A 200 stream's chunks, after checking that it ends with [DONE] and sent no error event."""
    assert response.status_code == 200, response.text
    events = [line[len("data:"):].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and not [c for c in chunks if "error" in c]
    return chunks


def test_every_refused_body_is_recorded():
    assert BODIES and set(REFUSED) <= set(BODIES)
    assert {"langchain_chat_bind_tools", "langchain_chat_structured_output"} <= set(BODIES)


@pytest.mark.parametrize("name", BODIES)
def test_recorded_client_body_is_served_or_refused_by_name(server, name):
    body = {**json.loads((DATA / f"{name}.json").read_text()), "model": "tiny"}
    r = post(server, CHAT if "messages" in body else COMPLETIONS, body)
    if name in REFUSED:
        field = REFUSED[name][0]
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and field in error["message"], r.text
    elif body.get("stream"):
        stream_chunks(r)
    else:
        assert r.status_code == 200 and r.json()["choices"], r.text


def _counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("path,prompt", [(CHAT, {"messages": MSG}), (COMPLETIONS, {"prompt": "the quick brown"})])
def test_continuous_usage_stats_on_every_chunk(server, path, prompt, n):
    body = {"model": "tiny", **prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": n}
    plain = post(server, path, body).json()["usage"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = stream_chunks(post(server, path, {**body, "stream": True, "stream_options": options}))
    assert last["choices"] == [] and _counts(last["usage"]) == _counts(plain)  # include_usage's last chunk
    assert all(c["choices"] and c["usage"]["prompt_tokens"] == plain["prompt_tokens"] for c in chunks)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    # the request's completion tokens so far, over all its choices: they grow to the final count
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and len(set(so_far)) > 1 and so_far[-1] == plain["completion_tokens"] == 8 * n


def test_continuous_usage_stats_needs_include_usage_and_stream(server):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4}
    alone = post(server, CHAT, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    unstreamed = post(server, CHAT, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream_options"
    off = post(server, CHAT, {**body, "stream": True, "stream_options": {"continuous_usage_stats": False}})
    assert all("usage" not in c for c in stream_chunks(off))


def test_repetition_penalty_takes_only_its_neutral_value(server):
    """vLLM's benchmark client sends repetition_penalty 1.0 (no penalty); another value is refused
    by name, as no repetition penalty is implemented."""
    body = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 2}
    assert post(server, COMPLETIONS, {**body, "repetition_penalty": 1}).status_code == 200
    r = post(server, COMPLETIONS, {**body, "repetition_penalty": 1.3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
