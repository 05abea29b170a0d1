"""The offline `LLM` API and the `generate` CLI at their edges (vLLM's shapes where it has them):
sampling-parameter types, prompt forms, chat messages, calls that end early or run at once."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import pytest

from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.server.cli import main

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(stop=""), "stop"), (dict(stop=[""]), "stop"), (dict(stop=[b"x"]), "stop"), (dict(stop=[5]), "stop"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(max_tokens=True), "max_tokens"), (dict(seed=True), "seed"),
    (dict(top_k=True), "top_k"), (dict(logprobs=True), "logprobs"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
])
def test_sampling_params_refuse_wrong_types(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_lone_stop_string_is_one_stop_string(tiny_llm):
    assert SamplingParams(stop="END").stop == ("END",)  # not split into its characters
    ref = tiny_llm.generate([5, 6, 7], GREEDY)[0]
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]


def test_prompt_forms_and_params_keyword(tiny_llm):
    ids = tiny_llm.encode("hello there")
    ref = [o.token_ids for o in tiny_llm.generate([ids], GREEDY)]
    assert [o.token_ids for o in tiny_llm.generate({"prompt_token_ids": ids}, sampling_params=GREEDY)] == ref
    assert [o.token_ids for o in tiny_llm.generate([{"prompt": "hello there"}], [GREEDY])] == ref
    with pytest.raises(ValueError, match="one key"):
        tiny_llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 0 sampling params"):
        tiny_llm.generate([[5], [6]], [])  # not defaults for every prompt
    with pytest.raises(ValueError, match="not both"):
        tiny_llm.generate([5], GREEDY, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="True is not an integer token id"):
        tiny_llm.generate([[5, True]], GREEDY)


def test_chat_takes_text_parts_and_refuses_a_bare_string(tiny_llm):
    plain = tiny_llm.chat([{"role": "user", "content": "hi\nthere"}], GREEDY)
    parts = tiny_llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                         {"type": "text", "text": "there"}]}], GREEDY)
    assert parts[0].token_ids == plain[0].token_ids  # parts reach the template as text
    assert len(tiny_llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY)) == 2
    with pytest.raises(ValueError, match="list of messages"):
        tiny_llm.chat("hello", GREEDY)  # not one conversation per character
    with pytest.raises(ValueError, match="invalid message"):
        tiny_llm.chat([{"role": "robot", "content": "x"}], GREEDY)


def test_an_error_in_the_loop_aborts_the_calls_requests(tiny_llm, monkeypatch):
    """An exception out of the engine loop aborts the call's requests and frees their KV blocks,
    so a later call does not run them again."""
    free = tiny_llm.allocator.num_free_blocks
    ref = [o.token_ids for o in tiny_llm.generate([[5, 6], [7, 8, 9]], GREEDY)]
    real, calls = tiny_llm.loop.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise TypeError("boom")
        return real()
    monkeypatch.setattr(tiny_llm.loop, "step", step)
    with pytest.raises(TypeError, match="boom"):
        tiny_llm.generate([[5, 6], [7, 8, 9]], GREEDY)
    assert not tiny_llm.loop.has_unfinished and tiny_llm.allocator.num_free_blocks == free
    assert [o.token_ids for o in tiny_llm.generate([[5, 6], [7, 8, 9]], GREEDY)] == ref


def test_calls_from_two_threads_each_get_their_own_outputs(tiny_llm, monkeypatch):
    a, b = [5, 6, 7], [9, 10]
    ref = {k: tiny_llm.generate(p, GREEDY)[0].token_ids for k, p in (("a", a), ("b", b))}
    got, errors = {}, []
    real = tiny_llm.loop.executor.execute

    def slow(steps):  # steps long enough for the two calls to overlap
        time.sleep(0.02)
        return real(steps)
    monkeypatch.setattr(tiny_llm.loop.executor, "execute", slow)

    def run(key, prompt):
        try:
            got[key] = tiny_llm.generate(prompt, GREEDY)[0].token_ids
        except Exception as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)
    threads = [threading.Thread(target=run, args=x) for x in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == ref  # one thread's loop may finish the other's request


def test_ctrl_c_during_generate_aborts_it_and_the_next_call_works(tiny_llm, monkeypatch):
    free = tiny_llm.allocator.num_free_blocks
    ref = tiny_llm.generate([8, 9], GREEDY)[0].token_ids
    real, steps = tiny_llm.loop.executor.execute, []

    def slow(batch):
        steps.append(1)
        time.sleep(0.05)
        return real(batch)
    monkeypatch.setattr(tiny_llm.loop.executor, "execute", slow)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # CI may run with SIGINT ignored
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    finally:
        signal.signal(signal.SIGINT, old)
    # the next call queues behind the interrupted one, which aborts at its next step
    assert tiny_llm.generate([8, 9], GREEDY)[0].token_ids == ref
    assert len(steps) < 40  # the interrupted request stopped early (64 tokens: ~64 steps), then 6 for the next
    assert not tiny_llm.loop.has_unfinished and tiny_llm.allocator.num_free_blocks == free


def test_a_draft_head_without_a_method_drafts_with_eagle2_and_is_refused_where_unread(tmp_path):
    assert EngineConfig(draft=str(tmp_path)).spec.method == "eagle2"  # as the CLI infers it
    assert EngineConfig().spec.method == "none" and EngineConfig(spec="ngram").spec.method == "ngram"
    for method in ("ngram", "none"):
        with pytest.raises(ValueError, match="does not apply"):
            EngineConfig(draft=str(tmp_path), spec=SpecConfig(method))
    with pytest.raises(ValueError, match="spec must be"):
        EngineConfig(spec={"method": "ngram"})


def test_cli_refuses_flags_it_would_ignore(capsys, tmp_path, tiny_llama):
    model = ["--model", tiny_llama[0], "--dtype", "float64", "--device", "cpu", "--prompt", "x"]
    for method in ("ngram", "none"):  # --draft would be ignored, even a path that does not exist
        assert main(["generate", *model, "--spec", method, "--draft", "/does/not/exist"]) == 2
        assert f"--draft does not apply to --spec {method}" in capsys.readouterr().err
    assert main(["generate", *model, "--max-num-seqs", "4"]) == 2  # generate runs one sequence
    assert "--max-num-seqs does not apply to generate" in capsys.readouterr().err
    from eagle_serve.server.cli import build_parser  # nor does generate's --help offer it
    gen = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    assert "--max-num-seqs" not in gen.format_help() and "--max-prefill-chunk" in gen.format_help()
    assert main(["generate", *model, "--spec", "eagle1", "--draft", "none", "--static-tree", str(tmp_path)]) == 2
    assert "Is a directory" in capsys.readouterr().err  # named, not a traceback


def test_max_tokens_none_generates_up_to_the_context(tiny_llm):
    ctx = tiny_llm.max_model_len
    prompt = [5 + i % 50 for i in range(ctx - 7)]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"  # None: up to the context
    with pytest.raises(ValueError, match="leaves none to generate"):
        tiny_llm.generate([[5] * ctx], SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="min_tokens is 8 but the context leaves 7"):
        tiny_llm.generate([prompt], SamplingParams(max_tokens=None, min_tokens=8))
    assert tiny_llm.allocator.num_free_blocks == tiny_llm.runner.num_blocks
