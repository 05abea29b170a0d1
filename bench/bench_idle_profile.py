#!/usr/bin/env python
"""How long a request arriving during the idle-time cost profile waits: the profile's points,
each timed as the serving loop runs it (one `LLM.run_idle` call: take the free KV blocks, measure
one point, give them back), on the default model with the shipped head and the server's
defaults. The longest point is the most an arriving request waits; the sum is what the whole
profile took in one go before it was split (and still costs, spread over idle turns).

    .venv/bin/python bench/bench_idle_profile.py --reps 2
Writes --out (bench/results/idle_profile.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_serve as bs  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="idle profiles to time, one after another")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "idle_profile.json"))
    args = ap.parse_args(argv)
    llm = bs.build_engine("on")
    source = bd.source_digest()
    reps = []
    for rep in range(args.reps):
        llm._reprofile_at = 0.0  # due now, as after a contended profile
        points = []
        while True:
            run_before = llm._idle_run
            t0 = time.perf_counter()
            llm.loop.run_idle()
            seconds = time.perf_counter() - t0
            run = run_before or llm._idle_run
            kind = "verify" if len(points) < len(run.verify) else "draft"
            x = run.verify[len(points)][0] if kind == "verify" else run.draft[len(points) - len(run.verify)][0]
            points.append({"kind": kind, "x": x, "seconds": seconds})
            if llm._idle_run is None:
                break
        secs = [p["seconds"] for p in points]
        rep_row = {"rep": rep, "points": points, "max_s": max(secs), "median_s": statistics.median(secs),
                   "total_s": sum(secs), "cpu_share": llm.profiles[-1]["cpu_share"]}
        reps.append(rep_row)
        worst = max(points, key=lambda p: p["seconds"])
        print(f"rep {rep}: {len(points)} points, total {rep_row['total_s']:.2f} s, longest {worst['kind']}({worst['x']}) "
              f"{1e3 * worst['seconds']:.0f} ms, median {1e3 * rep_row['median_s']:.0f} ms, CPU share {rep_row['cpu_share']}")
    bd.write_result(args.out, {"config": vars(args), "reps": reps, "source_digest": source,
                               "source_changed": source != bd.source_digest(), "git_head": bd.git_head()})


if __name__ == "__main__":
    main()
