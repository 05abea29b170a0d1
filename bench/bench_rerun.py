#!/usr/bin/env python
"""Greedy reruns with the prefix cache: does a prompt sent again (its full blocks now cached, so
only its tail is computed, in a forward of a few rows) give the same tokens as the first time?

For each dtype, the default model without speculation decodes --prompts MT-bench first turns
(greedy, --max-new tokens), then decodes them all again on the same engine. Prints and saves,
per dtype, the prompt tokens the rerun found cached and how many reruns matched token for token.
A forward of a few rows takes other kernels (the native few-row linears and paged attention) than
a long prompt's (oneDNN's GEMM, SDPA), so in bfloat16 their roundings differ and greedy decoding
can part at a near-tie; a prompt chunk therefore takes the kernels its whole prompt would.

Then what that costs: the time to first token (prefill + first sample, bf16, no prefix cache)
of random prompts of --sizes tokens with prompt forwards as they run (a chunk takes the kernels
its whole prompt's length picks) against kernels picked by the chunk's own rows (the prompt
length forced to 0), alternating, --repeats times each (medians). Without a cache hit a prompt
is one chunk, so the two should cost the same.

    .venv/bin/python bench/bench_rerun.py [--dtypes bfloat16,float32] [--prompts 12] [--max-new 64]
Writes --out (bench/results/rerun.json).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--sizes", default="4,8,16,32,64,100", help="prompt sizes for the cost (empty: skip it)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "rerun.json"))
    args = ap.parse_args(argv)
    prompts = bd.mtbench_ids(args.prompts + 1)[1:]
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    rows = {}
    for dtype in args.dtypes.split(","):
        llm = LLM(None, spec=SpecConfig("none"), tree_budget=False, dtype=dtype, kv_cache_tokens=16384)
        first = [llm.generate(ids, params)[0].token_ids for ids in prompts]
        hits = llm.allocator.prefix_hit_tokens
        again = [llm.generate(ids, params)[0].token_ids for ids in prompts]
        same = sum(a == b for a, b in zip(first, again))
        parted = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(first, again)]
        rows[dtype] = {"prompts": len(prompts), "rerun_cached_prompt_tokens": llm.allocator.prefix_hit_tokens - hits,
                       "prompt_tokens": sum(len(p) for p in prompts), "reruns_identical": same,
                       "first_differing_token": parted}
        print(f"{dtype}: {same} of {len(prompts)} reruns identical "
              f"({rows[dtype]['rerun_cached_prompt_tokens']} of {rows[dtype]['prompt_tokens']} prompt tokens cached)")
    cost = prompt_cost([int(x) for x in args.sizes.split(",") if x], args.repeats)
    bd.write_result(args.out, {"config": vars(args), "dtypes": rows, "ttft_ms": cost,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "git_head": bd.git_head(), "source_digest": bd.source_digest()})


def prompt_cost(sizes: list[int], repeats: int) -> dict:
    """Median ms to first token per prompt size: {"as_run", "size_chosen", "ratio"}."""
    import dataclasses
    import random
    import statistics
    from engine.model_runner import ModelRunner
    if not sizes:
        return {}
    llm = LLM(None, spec=SpecConfig("none"), tree_budget=False, dtype="bfloat16", kv_cache_tokens=16384,
              enable_prefix_caching=False)
    real = ModelRunner._span
    size_chosen = staticmethod(lambda step, tree: dataclasses.replace(real(step, tree), prompt_len=0))
    rng, one, out = random.Random(0), SamplingParams(max_tokens=1, temperature=0), {}
    try:
        for n in sizes:
            prompt = [rng.randrange(300, 20000) for _ in range(n)]
            t = {"as_run": [], "size_chosen": []}
            for i in range(repeats):
                for mode in (("as_run", "size_chosen") if i % 2 else ("size_chosen", "as_run")):
                    ModelRunner._span = size_chosen if mode == "size_chosen" else staticmethod(real)
                    t0 = time.perf_counter()
                    llm.generate(prompt, one)
                    t[mode].append(1e3 * (time.perf_counter() - t0))
            a, b = statistics.median(t["as_run"]), statistics.median(t["size_chosen"])
            out[n] = {"as_run": a, "size_chosen": b, "ratio": a / b}
            print(f"prompt of {n:4d} tokens: first token {a:.2f} ms as run, {b:.2f} ms with size-chosen kernels "
                  f"({a / b:.2f}x)")
    finally:
        ModelRunner._span = staticmethod(real)
    return out


if __name__ == "__main__":
    main()
