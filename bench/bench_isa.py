#!/usr/bin/env python
"""This CPU's native kernel build against no native kernels, side by side in one process: greedy
decoding of MT-bench first turns, plain and with EAGLE-2 trees, for each of

  off-float32   the native kernels off (oneDNN / torch), float32: what a CPU without a native
                build runs (before the AVX2 build, every AVX2-only CPU: --dtype auto picked float32)
  <isa>-float32 this CPU's build (engine.kernels.isa()), float32
  <isa>-bfloat16 the same build, bfloat16 weights and caches

alternating the systems per prompt (bench_kernels_ab.decode_part). Prints and writes, per tree,
each system's tokens/s, its ratio to off-float32, whether its outputs equal off-float32's, and
each system's speculative speedup (the tree's rate over its own plain rate).

    .venv/bin/python bench/bench_isa.py [--trees none,3x1x2,4x2x2,budget] [--prompts 8] [--max-new 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import bench_kernels_ab as ab  # noqa: E402

from engine import kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default="none,3x1x2,4x2x2,budget", help="'none', 'budget' and/or TOTALxDEPTHxTOPK")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the native build's dtypes")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "isa.json"))
    args = ap.parse_args()
    mod = ab.native_or_exit()
    isa = kernels.isa()[0]
    mods, dtypes = {}, {}
    for dt in args.dtypes.split(","):
        mods[f"{isa}-{dt}"], dtypes[f"{isa}-{dt}"] = mod, dt
    mods["off-float32"], dtypes["off-float32"] = None, "float32"  # last: the ratios' reference
    trees = args.trees.split(",")
    print(f"{isa} build on {bd.cpu_model()}; systems {list(mods)}", flush=True)
    decode = ab.decode_part(mods, trees, bd.mtbench_ids(args.prompts), args.max_new, dtypes=dtypes)
    speedup = {}
    if "none" in decode:
        for tree in trees:
            speedup[tree] = {n: decode[tree]["tok_s"][n] / decode["none"]["tok_s"][n] for n in mods}
            print(f"x own plain, {tree}: " + "  ".join(f"{n} {v:.2f}" for n, v in speedup[tree].items()), flush=True)
    bd.write_result(args.out, {"isa": isa, "cpu": bd.cpu_model(), "git_head": bd.git_head(),
                               "source_digest": bd.source_digest(), "args": vars(args),
                               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "decode": decode,
                               "speedup_over_own_plain": speedup,
                               "order": "alternating systems per prompt, one sequence at a time"})


if __name__ == "__main__":
    main()
