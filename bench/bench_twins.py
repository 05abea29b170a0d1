#!/usr/bin/env python
"""Two identical engines in one process: does the order they were built in change their speed?

bench_serve.py compares two engines (speculation on / off) that live in one process. This
script builds two engines of the same kind (default: --spec none) in one process, "first" and
"second", and runs bench_serve's in-process load on them alternately (--reps repetitions at
--concurrency clients). Any ratio away from 1 is the process's doing, not the code's: it bounds
what a one-process on/off comparison can resolve, and says which way the build order leans.

    .venv/bin/python bench/bench_twins.py --concurrency 4 --reps 6
Writes --out (bench/results/twins.json).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_serve as bs  # noqa: E402



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", default="off", help="off (--spec none), on (shipped head, tree budget) or on-plain")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "twins.json"))
    args = ap.parse_args(argv)
    prompts = bs.load_prompts(32)
    engines = {"first": bs.build_engine(args.kind)}
    engines["second"] = bs.build_engine(args.kind)
    load = argparse.Namespace(concurrency=str(args.concurrency), reps=args.reps, min_requests=args.min_requests,
                              max_new=args.max_new, transports="inproc")
    rows, _ = asyncio.run(bs.sweep(load, engines, prompts))
    ratios = bs.rep_ratios(rows, "first", "second")
    print("first / second per repetition:", ", ".join(f"{r:.3f}" for r in ratios))
    print(f"median {statistics.median(ratios):.3f}")
    bd.write_result(args.out, {"config": vars(args), "rows": rows, "first_over_second": ratios,
                               "median": statistics.median(ratios), "git_head": bd.git_head(),
                               "source_digest": bd.source_digest()})


if __name__ == "__main__":
    main()
