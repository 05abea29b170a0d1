#!/usr/bin/env python
"""Does a prefix-cache hit change a greedy output on the real model? The same MT-bench first
turns decoded twice by one engine (plain greedy decoding, the default dtype), with prefix caching
on and off: how many outputs are the same in both passes. With caching on, the second pass
computes only each prompt's last partial block, a prefill of another shape; in bfloat16 oneDNN's
products round differently by shape, so a near-tie can go the other way (the float64 tests hold
cached and uncached outputs equal: tests/test_scheduler.py).

    .venv/bin/python bench/bench_prefix_repeat.py --prompts 40 --max-new 96
Writes --out (bench/results/prefix_repeat.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)

from engine.sampling_params import SamplingParams  # noqa: E402
from server.llm import LLM  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefix_repeat.json"))
    args = ap.parse_args(argv)
    prompts = bd.mtbench_ids(args.prompts, max(80, args.prompts))
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    result = {"config": vars(args), "runs": {}}
    for caching in (True, False):
        llm = LLM(None, dtype=args.dtype, spec="none", kv_cache_tokens=16384, enable_prefix_caching=caching)
        first = [list(o.token_ids) for o in llm.generate(prompts, params)]
        second = [list(o.token_ids) for o in llm.generate(prompts, params)]
        same = sum(a == b for a, b in zip(first, second))
        diverge = [bd.first_divergence(a, b) for a, b in zip(first, second) if a != b]
        key = "prefix_caching" if caching else "no_prefix_caching"
        result["runs"][key] = {"same_outputs": same, "prompts": len(prompts), "first_divergence_at": diverge}
        print(f"{key}: {same}/{len(prompts)} outputs the same in both passes"
              + (f" (others diverge at tokens {diverge})" if diverge else ""), flush=True)
        del llm
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
