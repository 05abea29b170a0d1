"""scripts/self_prompts.py: training conversations the target writes itself (prompts sampled from an
opened user turn, answered greedily), in the layout train-draft reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.train.data import load_conversations, render
from scripts.self_prompts import answer, user_prefix, write_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_user_prefix_is_where_a_user_turn_starts(tiny_llm):
    tok = tiny_llm.tokenizer
    prefix = user_prefix(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}], False)
    assert text.startswith(prefix + "hello there") and prefix.endswith("user\n")


def test_prompts_are_distinct_finished_and_start_with_an_opener(tiny_llm):
    openers = ("the", "a quick")
    got = write_prompts(tiny_llm, 4, openers=openers, max_tokens=48, min_chars=1, max_chars=400, ascii_share=0.0,
                        batch=16, log=lambda *_: None)
    assert 1 <= len(got) <= 4 and len(set(got)) == len(got)
    assert all(p.startswith(openers) for p in got)
    # the same seed gives the same prompts; a filter nothing passes ends after max_tries, empty
    again = write_prompts(tiny_llm, 4, openers=openers, max_tokens=48, min_chars=1, max_chars=400, ascii_share=0.0,
                          batch=16, log=lambda *_: None)
    assert again == got
    assert write_prompts(tiny_llm, 2, openers=openers, max_tokens=8, min_chars=10_000, batch=8, max_tries=24,
                         log=lambda *_: None) == []


def test_answers_are_the_targets_greedy_ids_and_train_draft_reads_them(tiny_llm, tmp_path):
    prompts = ["the quick brown fox", "a lazy dog"]
    rows = answer(tiny_llm, prompts, max_tokens=12, log=lambda *_: None)
    tok = tiny_llm.tokenizer
    for p, r in zip(prompts, rows):
        ref = tiny_llm.generate(tok.encode_chat([{"role": "user", "content": p}]),
                                SamplingParams(max_tokens=12, temperature=0.0))[0]
        ids = list(ref.token_ids)
        if ids[-1] in tiny_llm.runner.loaded.eos_token_ids:
            ids.pop()
        assert r["messages"][0] == {"role": "user", "content": p}
        assert r["messages"][1]["token_ids"] == ids and r["messages"][1]["content"] == ref.text
    path = tmp_path / "self.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs = load_conversations(str(path), 10)
    ex = render(tok, convs[0], 1024)
    # the assistant tokens are the generated ids followed by the template's end of turn
    start = ex.mask.index(1)
    assert ex.ids[start:start + len(rows[0]["messages"][1]["token_ids"])] == rows[0]["messages"][1]["token_ids"]


def test_cli_rejects_a_bad_count(tmp_path):
    r = subprocess.run([sys.executable, "scripts/self_prompts.py", "--count", "0", "--out", str(tmp_path / "x.jsonl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--count must be >= 1" in r.stderr


def test_cli_checks_its_arguments_before_loading_the_model(tmp_path):
    """Bad arguments are refused before the model loads, not after every prompt and answer is
    generated (an --out in a missing directory), and impossible filters are not an empty file."""
    for args, said in ((["--out", str(tmp_path / "no" / "x.jsonl")], "no such directory"),
                       (["--answer-max-tokens", "0"], "--answer-max-tokens must be >= 1"),
                       (["--temperature", "-1"], "--temperature must be"),
                       (["--dtype", "float99"], "invalid choice"),
                       (["--min-chars", "50", "--max-chars", "10"], "--min-chars is above --max-chars"),
                       (["--ascii-share", "5"], "--ascii-share must be in [0, 1]")):
        out = [] if "--out" in args else ["--out", str(tmp_path / "x.jsonl")]
        r = subprocess.run([sys.executable, "scripts/self_prompts.py", "--count", "1", *args, *out],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and said in r.stderr, (args, r.stderr[-500:])


def test_sharegpt_instructions_refuses_counts_it_cannot_honour(tmp_path):
    for args, said in ((["--count", "0"], "--count must be >= 1"), (["--count", "-3"], "--count must be >= 1"),
                       (["--after", "-1", "--count", "3"], "--after must be >= 0")):  # refused, not one row written
        r = subprocess.run([sys.executable, "scripts/sharegpt_instructions.py", *args, "--out", str(tmp_path / "x.jsonl")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and said in r.stderr and not (tmp_path / "x.jsonl").exists()
