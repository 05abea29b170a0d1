"""The OpenAI-compatible server, driven by the official `openai` SDK against a live uvicorn on
127.0.0.1 (tiny float64 model; one test on the real default model)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import socket
import time

import httpx2 as httpx
import openai
import pytest

from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.step_io import TokenLogprobs
from eagle_serve.engine.tokenizer import Tokenizer
from eagle_serve.server.app import BackgroundServer, ServerState
from eagle_serve.server.llm import LLM
from eagle_serve.server.metrics import parse_metrics
from eagle_serve.server.responses import TextOffsets, completion_logprobs
from tests.spec_helpers import write_eagle_head


class LiveServer:
    def __init__(self, llm, **state_kwargs):
        self.state = ServerState(llm, **state_kwargs)
        self.background = BackgroundServer(self.state)
        self.url = self.background.url

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def stop(self):
        self.background.stop()


@pytest.fixture(scope="module")
def head_dir(tiny_llama, tmp_path_factory):
    return write_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), tiny_llama[0])


@pytest.fixture(scope="module")
def server(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), tree_budget=False)
    srv = LiveServer(llm, served_model_name="tiny", max_body_bytes=64 << 10)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


MSG = [{"role": "user", "content": "the quick brown fox"}]


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_chat_and_completion_plain_and_streaming_agree(client):
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=MSG, **kw)
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 12 and chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert chat.usage.model_extra["spec"]["method"] == "eagle2"
    chunks = list(client.chat.completions.create(messages=MSG, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    comp = client.completions.create(prompt="the quick brown", **kw)
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 12
    parts = list(client.completions.create(prompt="the quick brown", stream=True, **kw))
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text
    echo = client.completions.create(prompt="the quick brown", echo=True, **kw)
    assert echo.choices[0].text == "the quick brown" + comp.choices[0].text
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kw)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    # echo gives the prompt as sent, special tokens included (decoding would drop them), and
    # token ids as the model read them, per prompt and for each of its n choices
    marked = "<|im_start|>user\nthe quick<|im_end|>\n"
    for prompt, opening in ((["the", marked], ["the", "the", marked, marked]),
                            ([[1, 5, 6]], ["<|im_start|>"] * 2)):
        special = client.completions.create(prompt=prompt, echo=True, n=2, **kw)
        texts = [c.text for c in sorted(special.choices, key=lambda c: c.index)]
        assert all(t.startswith(o) for t, o in zip(texts, opening)) and len(texts) == len(opening), texts
    streamed = "".join(p.choices[0].text for p in client.completions.create(prompt=marked, echo=True, stream=True, **kw))
    assert streamed.startswith(marked)


def test_stream_include_usage(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))  # (unseeded: may draw EOS)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_n_choices_prefill_once_and_seeds(server, client):
    before = server.state.llm.allocator.prefix_hit_tokens
    long_msg = [{"role": "user", "content": "speculative decoding verifies a draft tree " * 3}]
    r = client.chat.completions.create(model="tiny", messages=long_msg, n=2, max_tokens=6, temperature=0.9, seed=3)
    hit = server.state.llm.allocator.prefix_hit_tokens - before
    n_prompt = r.usage.prompt_tokens
    full = (n_prompt - 1) // 4 * 4
    assert full <= hit < 2 * full  # the second choice reused every full block the first computed
    again = client.chat.completions.create(model="tiny", messages=long_msg, n=2, max_tokens=6, temperature=0.9, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # choice i uses seed + i: choice 1 of seed 3 == choice 0 of seed 4
    one = client.chat.completions.create(model="tiny", messages=long_msg, max_tokens=6, temperature=0.9, seed=4)
    assert one.choices[0].message.content == r.choices[1].message.content


def test_stop_strings_spanning_tokens_never_leak(client):
    full = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:9]  # almost surely spans a token boundary
    assert len(stop) == 4
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(p.choices[0].text for p in client.completions.create(
        model="tiny", prompt="the quick brown", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def test_logprobs_both_shapes(client):
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == chat.choices[0].message.content
    comp = client.completions.create(model="tiny", prompt="the quick", max_tokens=4, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    # keys are distinct (a partial character is keyed by its bytes, not merged into one
    # "\ufffd"), and the sampled token is always among them, even where it is not in the top n
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs), lp.top_logprobs
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    for n, temperature in ((0, 0), (1, 1.5)):
        lp = client.completions.create(model="tiny", prompt="the quick", max_tokens=8, temperature=temperature, seed=4,
                                       logprobs=n, extra_body={"ignore_eos": True}).choices[0].logprobs
        assert all(1 <= len(t) <= n + 1 for t in lp.top_logprobs), lp.top_logprobs
        assert all(key in t and t[key] == pytest.approx(v)
                   for t, key, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)), lp
    # streamed with a stop string (whose possible start is held back from the text sent), the
    # offsets are the same: they followed the text sent, and lagged it
    kw = dict(model="tiny", prompt="the quick", max_tokens=12, temperature=0, logprobs=0, stop=["zzzzzz"],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs.text_offset
    streamed = [o for c in client.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole and whole == sorted(whole)


def test_text_offset_counts_a_character_split_over_tokens_once():
    class Tok:  # 🔥 split over two tokens, then "a"; 4 a special token (not in the text)
        pieces = {1: b"\xf0\x9f", 2: b"\x94\xa5", 3: b"a", 4: b"<|im_start|>"}
        special_ids = frozenset({4})
        text_bytes = Tokenizer.text_bytes  # the real rule, over these pieces

        def token_bytes(self, t):
            return self.pieces[t]

    state = type("S", (), {"tokenizer": Tok()})()
    lps = [TokenLogprobs(-0.1, [])] * 3
    assert completion_logprobs(state, [1, 2, 3], lps, TextOffsets())["text_offset"] == [0, 0, 1]  # text "🔥a"
    offsets = TextOffsets(5)  # after a 5-character echo, over two chunks (a stream's)
    assert completion_logprobs(state, [3, 1], lps[:2], offsets)["text_offset"] == [5, 6]
    assert completion_logprobs(state, [2, 3], lps[:2], offsets)["text_offset"] == [6, 7]
    # the text leaves special tokens out (skip_special_tokens): "a<|im_start|>a" is "aa"
    assert completion_logprobs(state, [3, 4, 3], lps, TextOffsets())["text_offset"] == [0, 1, 1]


def test_logprobs_with_speculation_equal_without(tiny_llama, server):
    plain = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    srv = LiveServer(plain, served_model_name="tiny")
    try:
        kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=10, temperature=0, logprobs=5,
                  extra_body={"ignore_eos": True})
        a = server.client().completions.create(**kw).choices[0].logprobs
        b = srv.client().completions.create(**kw).choices[0].logprobs
    finally:
        srv.stop()
    assert a.tokens == b.tokens
    assert all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a.token_logprobs, b.token_logprobs))
    for ta, tb in zip(a.top_logprobs, b.top_logprobs):
        assert ta.keys() == tb.keys() and all(math.isclose(ta[k], tb[k], abs_tol=1e-6) for k in ta)


def test_multibyte_characters_stream_intact(tiny_llama):
    """The engine's sampled tokens are replaced by a script whose characters span tokens: the
    SSE stream (detokenizer, output processor, chunks) must deliver every character whole."""
    import dataclasses
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    tok = llm.tokenizer
    text = "héllo 你好 wörld ✓ 世界"
    script = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in script)  # some character really spans tokens
    real = llm.runner.execute

    def scripted(steps):
        return [dataclasses.replace(r, token_ids=[script[s.output_position]])
                for r, s in zip(real(steps), [s for s in steps if s.sample])]
    llm.runner.execute = scripted
    srv = LiveServer(llm, served_model_name="tiny")
    try:
        parts = [p.choices[0].text for p in srv.client().completions.create(
            model="tiny", prompt="x", max_tokens=len(script), stream=True, extra_body={"ignore_eos": True})]
    finally:
        srv.stop()
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    assert len([p for p in parts if p]) > 3


def _error(fn):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    body = e.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return e.value.response.status_code, body["error"]


def test_errors_have_openai_shape_and_status(server, client):
    s, e = _error(lambda: client.chat.completions.create(model="nope", messages=MSG))
    assert s == 404 and e["code"] == "model_not_found"
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=MSG, temperature=5))
    assert s == 400 and e["param"] == "temperature"
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=MSG, extra_body={"bogus": 1}))
    assert s == 400 and e["param"] == "bogus"
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=MSG, tools=[{"type": "function",
                                                         "function": {"name": "f", "parameters": {}}}]))
    assert s == 400 and e["param"] == "tools"
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=MSG,
                                                         response_format={"type": "json_schema"}))
    assert s == 400 and e["param"] == "response_format.json_schema"
    s, e = _error(lambda: client.completions.create(model="tiny", prompt="x" * 3000, max_tokens=5))
    assert s == 400 and e["code"] == "context_length_exceeded"
    # a later prompt too long: no prompt of the request is added, so none is counted as aborted
    before = server.metrics()
    s, e = _error(lambda: client.completions.create(model="tiny", prompt=["the quick", "x" * 3000], max_tokens=5, n=2))
    assert s == 400 and e["code"] == "context_length_exceeded"
    after = server.metrics()
    assert {k: v for k, v in after.items() if k.startswith("eagle_serve_requests_total")} == \
        {k: v for k, v in before.items() if k.startswith("eagle_serve_requests_total")}
    s, e = _error(lambda: client.completions.create(model="tiny", prompt=[[5, 400000]], max_tokens=5))
    assert s == 400
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x"}]))
    assert s == 400
    s, e = _error(lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x",
                                                                                  "name": "bob"}]))
    assert s == 400 and e["param"] == "messages.0.name"
    s, e = _error(lambda: client.completions.create(model="tiny", prompt="hi", n=0))
    assert s == 400 and e["param"] == "n"
    s, e = _error(lambda: client.completions.create(model="tiny", prompt="hi", n=2, best_of=1))  # as OpenAI / vLLM
    assert s == 400 and e["param"] == "best_of" and "best_of must be >= n" in e["message"]
    for seed in (2**63, -2**63 - 1):  # vLLM's int64 bound (seeds 2^64 apart drew the same noise)
        s, e = _error(lambda: client.completions.create(model="tiny", prompt="hi", seed=seed, max_tokens=1))
        assert s == 400 and e["param"] == "seed", (seed, e)
    big = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"a" * (70 << 10) + b'"}',
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and set(big.json()["error"]) == {"message", "type", "param", "code"}
    bad = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    # types are not coerced ("8" for 8, true for 1), and a token id key is written one way only
    for field, value in (("max_tokens", "8"), ("max_tokens", True), ("seed", "1"), ("ignore_eos", "yes"),
                         ("logit_bias", {"0001": 1, "1": -1})):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, (field, r.text)
    # but a whole-number float is its int (JSON does not tell 2.0 from 2; vLLM accepts it), a fraction is not
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 3.0,
                                                             "n": 2.0, "seed": 7.0, "temperature": 1, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    again = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 3,
                                                                 "n": 2, "seed": 7, "temperature": 1, "ignore_eos": True})
    assert [c["message"] for c in r.json()["choices"]] == [c["message"] for c in again.json()["choices"]]
    # an unknown route or method: the same shape, not FastAPI's {"detail": ...}
    for r, status in ((httpx.get(server.url + "/v1/nope"), 404), (httpx.get(server.url + "/v1/chat/completions"), 405)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # nulls and defaults are accepted
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2,
                                                              "temperature": None, "stop": None, "logit_bias": None,
                                                              "n": 1, "stream": False, "tools": None, "user": "u1"})
    assert ok.status_code == 200
    assert server.state.llm.loop.has_unfinished is False


def test_api_key_and_busy_queue(tiny_llama):
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4, max_num_seqs=1)
    srv = LiveServer(llm, served_model_name="tiny", api_key="s3cret", max_waiting=1)
    try:
        s, e = _error(lambda: srv.client(api_key="wrong").models.list())
        assert s == 401
        missing = httpx.get(srv.url + "/v1/models")
        assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(srv.url + "/health").status_code == 200  # open without a key
        assert httpx.get(srv.url + "/metrics").status_code == 200
        good = srv.client(api_key="s3cret")
        assert good.models.list().data[0].id == "tiny"
        # one running, one waiting: the next is refused with 503 + Retry-After
        with good.completions.with_streaming_response.create(model="tiny", prompt="a", max_tokens=300, stream=True,
                                                             extra_body={"ignore_eos": True}) as first:
            it = first.iter_lines()
            next(it)
            with good.completions.with_streaming_response.create(model="tiny", prompt="b", max_tokens=300, stream=True,
                                                                  extra_body={"ignore_eos": True}) as second:
                with pytest.raises(openai.APIStatusError) as e:
                    good.completions.create(model="tiny", prompt="c", max_tokens=3)
                assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
                del second
    finally:
        srv.stop()


def test_metrics_are_consistent_with_responses(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), tree_budget=False)
    srv = LiveServer(llm, served_model_name="tiny")
    try:
        m0 = srv.metrics()
        assert m0['eagle_serve_requests_total{finish_reason="error"}'] == 0  # series exist from start-up
        assert 'eagle_serve_decode_steps_total{mode="spec"}' in m0
        assert 'eagle_serve_spec_accepted_tokens_per_depth_total{depth="1"}' in m0
        c = srv.client()
        total = 0
        for i in range(3):  # (a prefix in common: a prompt's last token after a cache hit is not a decode step)
            r = c.completions.create(model="tiny", prompt=f"the quick brown {i}", max_tokens=10 + i, temperature=0,
                                     extra_body={"ignore_eos": True})
            total += r.usage.completion_tokens
        m = srv.metrics()
        assert m["eagle_serve_generation_tokens_total"] == total
        assert m['eagle_serve_requests_total{finish_reason="length"}'] == 3
        assert 0 <= m["eagle_serve_spec_accepted_tokens_total"] <= m["eagle_serve_spec_draft_tokens_total"]
        assert m["eagle_serve_spec_draft_tokens_total"] > 0
        per_depth = sum(v for k, v in m.items() if k.startswith("eagle_serve_spec_accepted_tokens_per_depth_total"))
        assert per_depth == m["eagle_serve_spec_accepted_tokens_total"]
        # tokens emitted in verify rounds = verify steps + accepted drafts
        assert m["eagle_serve_spec_acceptance_length_sum"] == (m["eagle_serve_spec_verify_steps_total"]
                                                              + m["eagle_serve_spec_accepted_tokens_total"])
        assert m["eagle_serve_spec_verify_steps_total"] == m["eagle_serve_spec_acceptance_length_count"]
        assert m["eagle_serve_time_to_first_token_seconds_count"] == 3
        assert m["eagle_serve_requests_running"] == 0 and m["eagle_serve_kv_cache_usage_ratio"] <= 1
        assert 'eagle_serve_spec_tree_tokens_bucket{le="64.0"}' in m
        # one batch-size observation per decoding step, of each mode; one sequence at a time here
        for mode in ("spec", "plain"):
            steps = m[f'eagle_serve_decode_steps_total{{mode="{mode}"}}']
            assert m[f'eagle_serve_decode_batch_size_count{{mode="{mode}"}}'] == steps
            assert m[f'eagle_serve_decode_batch_size_sum{{mode="{mode}"}}'] == steps
            assert m[f'eagle_serve_decode_batch_size_bucket{{le="1.0",mode="{mode}"}}'] == steps
        assert m['eagle_serve_decode_steps_total{mode="spec"}'] > 0
        # the steps that sample a prompt's first token are not plain decode steps nor size-1
        # trees: decode steps give every token but each request's first
        plain = m['eagle_serve_decode_steps_total{mode="plain"}']
        assert m["eagle_serve_spec_acceptance_length_sum"] + plain == total - 3
        assert m["eagle_serve_spec_tree_tokens_count"] == m["eagle_serve_spec_verify_steps_total"] + plain
        # a stream's tokens are counted as they are committed, not at its end
        kw = dict(model="tiny", prompt="the quick", max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
        llm.runner.fault_hook = lambda steps: time.sleep(0.01)
        try:
            stream = c.completions.create(stream=True, **kw)
            for _, _ in zip(range(8), stream):
                pass
            during = srv.metrics()["eagle_serve_generation_tokens_total"] - total
            rest = list(stream)
        finally:
            llm.runner.fault_hook = None
        assert rest and 0 < during < 120
        assert srv.metrics()["eagle_serve_generation_tokens_total"] == total + 120
        # n choices of one prompt: its tokens count once, as usage counts them
        before = srv.metrics()["eagle_serve_prompt_tokens_total"]
        r = c.completions.create(n=3, **{**kw, "max_tokens": 2, "prompt": " ".join(["the quick brown fox"] * 4)})
        m = srv.metrics()
        assert m["eagle_serve_prompt_tokens_total"] - before == r.usage.prompt_tokens
        # the engine's own counts: preemptions, prefix-cache lookups and hits (the 3 choices shared a prefix)
        assert m["eagle_serve_num_preemptions_total"] == llm.loop.scheduler.num_preemptions
        assert 0 < m["eagle_serve_prefix_cache_hits_total"] <= m["eagle_serve_prefix_cache_queries_total"]
    finally:
        srv.stop()


def test_disconnect_aborts_and_frees_blocks_and_health_turns_503(tiny_llama):
    asgi_errors = _Records()
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    free0 = llm.allocator.num_free_blocks
    srv = LiveServer(llm, served_model_name="tiny")
    # uvicorn's loggers do not propagate, and its config replaced their handlers when it started
    logging.getLogger("uvicorn.error").addHandler(asgi_errors)

    def settled(aborts: int) -> None:
        """Everything aborted so far is gone: blocks back, `aborts` counted, nothing ran to its end."""
        deadline = time.time() + 20
        while (llm.loop.has_unfinished or llm.allocator.num_free_blocks != free0) and time.time() < deadline:
            time.sleep(0.05)
        assert not llm.loop.has_unfinished and llm.allocator.num_free_blocks == free0
        m = srv.metrics()
        assert m['eagle_serve_requests_total{finish_reason="abort"}'] == aborts
        assert m.get('eagle_serve_requests_total{finish_reason="length"}', 0) == 0

    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the quick",
                          "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data:") for line in got)
        settled(1)
        # a client that disconnects from a non-streaming request aborts it too (each round slowed
        # to 5 ms: 400 tokens would take 2 s, the abort comes within one 0.5 s poll). Through
        # @app.middleware("http") the disconnect would never show and the request run to its end.
        llm.runner.fault_hook = lambda steps: time.sleep(0.005)
        try:
            httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 400,
                                                          "ignore_eos": True}, timeout=0.3)
        except httpx.TimeoutException:
            pass
        settled(2)
        # and quietly: a CancelledError out of the endpoint would log a traceback at every disconnect
        assert not [r for r in asgi_errors.records if "Exception in ASGI application" in r.getMessage()]
        # a chat stream of n = 2 choices whose client is gone before reading anything: both are
        # aborted (its opening chunks, a role delta per choice, come before the cleanup that aborts)
        host, port = srv.url.split("//")[1].split(":")
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 400,
                           "ignore_eos": True, "stream": True, "n": 2, "temperature": 1}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 5
        while not llm.loop.has_unfinished and time.time() < deadline:
            time.sleep(0.01)
        settled(4)
        llm.runner.fault_hook = None
        # the scheduler loop stops: /health says so
        assert httpx.get(srv.url + "/health").status_code == 200
        fut = asyncio.run_coroutine_threadsafe(srv.state.engine.stop(), srv.state.engine._task.get_loop())
        fut.result(timeout=10)
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()
        logging.getLogger("uvicorn.error").removeHandler(asgi_errors)


def test_a_crashed_engine_loop_ends_and_counts_its_requests(tiny_llama):
    # a bug in the loop itself (here: its output step raising) fails every request with 503; the
    # requests leave the running / waiting gauges and are counted as finished
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4, max_num_seqs=1)
    srv = LiveServer(llm, served_model_name="tiny")
    try:
        real = llm.loop.complete
        llm.loop.complete = lambda *a, **k: (_ for _ in ()).throw(KeyError("boom"))
        llm.runner.fault_hook = lambda steps: time.sleep(0.5)  # all three are in before the first step ends

        def ask(_):
            return httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 8},
                              timeout=30).status_code
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            codes = list(pool.map(ask, range(3)))
        assert codes == [503, 503, 503]
        m = srv.metrics()
        assert m['eagle_serve_requests_total{finish_reason="error"}'] == 3
        assert m["eagle_serve_requests_running"] == 0 and m["eagle_serve_requests_waiting"] == 0
        assert m["eagle_serve_kv_cache_usage_ratio"] == 0
        assert httpx.get(srv.url + "/health").status_code == 503
        llm.loop.complete, llm.runner.fault_hook = real, None
    finally:
        srv.stop()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.real_model
def test_real_default_model_chat(tmp_path):
    llm = LLM(None, dtype="float32", device="cpu", kv_cache_tokens=4096)
    srv = LiveServer(llm)
    try:
        c = srv.client()
        name = c.models.list().data[0].id
        r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
            temperature=0, stream=True) if ch.choices)
        assert streamed == r.choices[0].message.content
    finally:
        srv.stop()


def test_serve_flags_from_environment(monkeypatch):
    from eagle_serve.server.cli import build_parser
    monkeypatch.setenv("EAGLE_SERVE_PORT", "9123")
    monkeypatch.setenv("EAGLE_SERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("EAGLE_SERVE_FIXED_TREE", "true")
    monkeypatch.setenv("EAGLE_SERVE_MAX_NUM_SEQS", "7")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.host, args.fixed_tree, args.max_num_seqs) == (9123, "0.0.0.0", True, 7)
    assert build_parser().parse_args(["serve", "--port", "1"]).port == 1  # the command line wins


def test_serve_draft_resolution(tmp_path):
    from eagle_serve.engine.default_model import default_draft_path
    from eagle_serve.server.cli import build_parser, resolve_draft
    p = build_parser()
    assert resolve_draft(p.parse_args(["serve"])) == default_draft_path()  # the shipped head, if any
    assert resolve_draft(p.parse_args(["serve", "--draft", "none"])) is None
    assert resolve_draft(p.parse_args(["serve", "--model", str(tmp_path)])) is None
    assert resolve_draft(p.parse_args(["serve", "--spec", "ngram"])) is None
    with pytest.raises(ValueError):
        resolve_draft(p.parse_args(["serve", "--model", str(tmp_path), "--draft", "default"]))


def test_request_latency_histograms_reach_past_a_minute():
    """The latency histograms' buckets reach past a minute: a top bucket at 80 s (the inter-token
    scale) would read a longer request as 80 s in every quantile above it."""
    from prometheus_client import generate_latest
    from eagle_serve.server.metrics import Metrics
    m = Metrics(lambda: 0, lambda: 0, lambda: 0.0, max_depth=1)
    m.latency.observe(300.0)
    m.ttft.observe(150.0)
    text = generate_latest(m.registry).decode()
    assert 'eagle_serve_request_latency_seconds_bucket{le="240.0"} 0.0' in text
    assert 'eagle_serve_request_latency_seconds_bucket{le="480.0"} 1.0' in text
    assert 'eagle_serve_time_to_first_token_seconds_bucket{le="240.0"} 1.0' in text


def test_inter_token_latency_is_the_engines_not_the_readers():
    """A stream whose reader falls behind pulls queued outputs in a burst: timed when read, the
    gaps would be ~0 for the burst and one long one; they are the engine's, as its outputs say."""
    import dataclasses
    import time as time_mod
    from eagle_serve.server.metrics import LatencyTracker, Metrics
    from eagle_serve.scheduler.output_processor import RequestOutput
    from eagle_serve.scheduler.sequence import SpecStats
    m = Metrics(lambda: 0, lambda: 0, lambda: 0.0, max_depth=1)
    tracker = LatencyTracker(m)
    base = RequestOutput(seq_id=7, prompt_token_ids=[1], token_ids=[], text="", text_delta="", finished=False,
                         finish_reason=None, stop_reason=None, logprobs=None, arrival_time=0.0, first_token_time=0.5,
                         finish_time=None, spec=SpecStats(0, 0, 0, []))
    made = [dataclasses.replace(base, token_ids=list(range(k + 1)), output_time=0.5 + 0.03 * k) for k in range(5)]
    time_mod.sleep(0.2)  # the reader comes late and reads them all at once
    for out in made:
        tracker.see(out)
    assert m.itl._sum.get() == pytest.approx(4 * 0.03)
    assert m.ttft._sum.get() == pytest.approx(0.5)
