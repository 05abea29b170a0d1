#!/usr/bin/env python
"""The native stack's row limit side by side: an engine built with this CPU's limit (64 rows on
AMD CPUs with the AVX-512 build, engine/layers.py WIDE_PACKED_MAX_ROWS) against one built with
the 16-row limit, batched greedy generation of MT-bench first turns (bf16, 128 new tokens), the
two alternating within every repetition.

    .venv/bin/python bench/bench_wide_rows.py [--spec none|eagle2] [--batches 16,24,32] [--reps 2] [--serial]
Writes --out (bench/results/wide_rows.json): tok/s of each engine by batch, their ratio, and
how many outputs the two engines give alike (bf16 rounds the native kernels and oneDNN apart,
so past 16 rows greedy outputs may part at near-ties).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)

import engine.layers as layers  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402

HEAD = os.path.join(os.path.dirname(HERE), "engine", "heads", "smollm2-135m-instruct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="none", choices=["none", "eagle2"], help="eagle2: the shipped head, tree budget")
    ap.add_argument("--batches", default="16,24,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--serial", action="store_true",
                    help="each batch's prompts one generate call at a time (a prefix cache filled by earlier prompts)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "wide_rows.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(spec=SpecConfig("none"), draft=None) if args.spec == "none" else dict(draft=HEAD)
    systems = {"wide": LLM(None, dtype="bfloat16", kv_cache_tokens=65536, **kw)}
    limit = layers.packed_max_rows
    layers.packed_max_rows = lambda k, wide=True: min(limit(k, wide), layers.PACKED_MAX_ROWS)
    try:
        systems["narrow"] = LLM(None, dtype="bfloat16", kv_cache_tokens=65536, **kw)
    finally:
        layers.packed_max_rows = limit
    rows = {name: llm.runner.model._stack_max_rows for name, llm in systems.items()}
    print("stack rows", rows, flush=True)
    params = SamplingParams(max_tokens=128, temperature=0)
    prompts = bd.mtbench_ids(max(batches))
    for llm in systems.values():
        llm.generate(prompts[:2], params)  # untimed: first calls
    source = bd.source_digest()
    result = {}
    for b in batches:
        tok, sec, same = collections.Counter(), collections.Counter(), 0
        for r in range(args.reps):
            outs = {}
            for name in (["wide", "narrow"] if r % 2 == 0 else ["narrow", "wide"]):
                t0 = time.perf_counter()
                if args.serial:
                    got = [systems[name].generate([p], params)[0] for p in prompts[:b]]
                else:
                    got = systems[name].generate(prompts[:b], params)
                sec[name] += time.perf_counter() - t0
                tok[name] += sum(len(o.token_ids) for o in got)
                outs[name] = [o.token_ids for o in got]
            same += sum(a == c for a, c in zip(outs["wide"], outs["narrow"]))
        rate = {name: tok[name] / sec[name] for name in systems}
        result[b] = {"tok_s": rate, "wide_over_narrow": rate["wide"] / rate["narrow"], "same_outputs": same,
                     "outputs": b * args.reps}
        print(f"batch {b}: wide {rate['wide']:.1f} narrow {rate['narrow']:.1f} tok/s  "
              f"wide/narrow {result[b]['wide_over_narrow']:.3f}  same {same}/{b * args.reps}", flush=True)
    bd.write_result(args.out, {"config": vars(args), "stack_rows": rows, "batches": result, "source_digest": source,
                               "source_changed": source != bd.source_digest(), "git_head": bd.git_head()})


if __name__ == "__main__":
    main()
