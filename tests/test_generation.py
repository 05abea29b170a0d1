"""End-to-end generation on a tiny model: stops, EOS rules, preemption, detokenization, CLI."""
from __future__ import annotations

import json
import random

import pytest

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.tokenizer import IncrementalDetokenizer
from eagle_serve.server.cli import main
from eagle_serve.server.llm import LLM

GREEDY = dict(temperature=0, ignore_eos=True)


def test_stop_string_truncates_and_reports(tiny_llm):
    prompt = "the quick brown fox"
    full = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0]
    assert len(full.text) > 12
    stop = full.text[6:10]
    first = full.text.find(stop)
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0]
    assert out.text == full.text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True,
                                                    **GREEDY))[0]
    assert kept.text == full.text[:first + len(stop)]
    # no stop string ends the output before min_tokens tokens (vLLM's rule): the match at token
    # k is passed over, the output goes on past it
    k = len(out.token_ids)
    late = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], min_tokens=k + 1, **GREEDY))[0]
    assert len(late.token_ids) >= k + 1 and late.token_ids == full.token_ids[:len(late.token_ids)]
    assert late.text.startswith(full.text[:first + len(stop)])
    if late.finish_reason == "stop":  # a later match, after the first min_tokens tokens
        assert full.text.find(stop, first + 1) == len(late.text)
    # and a longer stop string beside it changes nothing: its hold-back window must not bring
    # the passed-over match back into the search once min_tokens is reached
    both = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop, "Z" * 16], min_tokens=k + 1,
                                                    **GREEDY))[0]
    assert (both.text, both.token_ids, both.finish_reason) == (late.text, late.token_ids, late.finish_reason)


def test_stop_token_ids_eos_min_tokens_and_ignore_eos(tiny_llm):
    prompt = [5, 6, 7, 8]
    full = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[full[3]], **GREEDY))[0]
    assert out.token_ids == full[:full.index(full[3]) + 1] and out.stop_reason == full[3]
    eos = SamplingParams(max_tokens=12, temperature=0, logit_bias={2: 100.0})
    assert tiny_llm.generate(prompt, eos)[0].token_ids == [2]
    at_least = SamplingParams(max_tokens=12, temperature=0, logit_bias={2: 100.0}, min_tokens=5)
    out = tiny_llm.generate(prompt, at_least)[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == 2 and out.finish_reason == "stop"
    ignore = SamplingParams(max_tokens=12, temperature=0, logit_bias={2: 100.0}, ignore_eos=True)
    out = tiny_llm.generate(prompt, ignore)[0]
    assert out.token_ids == [2] * 12 and out.finish_reason == "length"


def test_kv_pressure_preempts_and_recomputes_identically(tiny_llama):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (14, 20, 9, 17, 11, 22)]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0, 0.8, 0, 1.1, 0, 0.6))]
    roomy = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4)
    tight = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=64, block_size=4)
    ref = [o.token_ids for o in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert [o.token_ids for o in got] == ref
    assert tight.loop.scheduler.num_preemptions > 0  # the pressure was real
    assert tight.allocator.num_free_blocks == tight.allocator.num_blocks  # nothing leaked


def test_incremental_detokenizer_never_splits_characters(tiny_llm):
    tok = tiny_llm.tokenizer
    text = "héllo wörld ✓ 你好 世界 ünïcode"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas)  # some character really spans tokens


def test_chat_template_is_applied(tiny_llm):
    ids = tiny_llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert tiny_llm.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_generate_json(tiny_llama, capsys):
    code = main(["generate", "--model", tiny_llama[0], "--dtype", "float64", "--device", "cpu",
                 "--kv-cache-tokens", "1024", "--prompt", "the quick", "--max-tokens", "5", "--ignore-eos", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "elapsed_s",
                        "tokens_per_s", "finish_reason", "spec"}
    assert out["num_generated_tokens"] == len(out["token_ids"]) == 5 and out["finish_reason"] == "length"


def test_cli_generate_with_ngram_spec_reports_stats(tiny_llama, capsys):
    args = ["generate", "--model", tiny_llama[0], "--dtype", "float64", "--device", "cpu", "--kv-cache-tokens", "1024",
            "--prompt", "the quick brown fox the quick brown fox the quick", "--max-tokens", "24", "--ignore-eos", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--spec", "ngram", "--total-tokens", "5", "--fixed-tree"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["spec"]
    assert s["method"] == "ngram" and s["verify_steps"] >= 1 and s["draft_tokens"] >= s["accepted_tokens"]
    assert s["acceptance_length"] == round((s["accepted_tokens"] + s["verify_steps"]) / s["verify_steps"], 4)
    assert sum(s["accepted_per_depth"]) == s["accepted_tokens"]
    assert main(args + ["--spec", "eagle2"]) == 2
    assert "needs a draft head" in capsys.readouterr().err


def test_float16_and_float32_on_cpu_generate(tiny_llama):
    outs = {}
    for dtype in ("float16", "float32"):
        llm = LLM(tiny_llama[0], dtype=dtype, device="cpu", kv_cache_tokens=256, block_size=4)
        outs[dtype] = llm.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert len(outs[dtype].token_ids) == 8
    # float16 has 10 mantissa bits: allow a late divergence, not an early one
    assert outs["float16"].token_ids[:2] == outs["float32"].token_ids[:2]
