#!/usr/bin/env python
"""Where the speculating engine's time goes under load, by kind of round.

Runs bench_serve's in-process load (MT-bench + ShareGPT prompts, greedy, --max-new tokens, C
clients back to back) on two engines that both load the shipped EAGLE head: "on" (EAGLE-2 with
the tree budget, the default) and "on-plain" (the same engine whose budget never speculates,
min_gain = inf), alternating, --reps repetitions. Every round the engine loop reports to the
budget is counted by the kind the budget chose for it (plain, spec, explore; "+prefill" when a
prefill chunk shared the round; "none" when no sequence decoded): rounds, seconds, tokens
emitted, tokens per second; plus the head's catch-up seconds.

    .venv/bin/python bench/bench_round_kinds.py --concurrency 4 --reps 4
    .venv/bin/python bench/bench_round_kinds.py --spec-with-prefill --out bench/results/round_kinds_prefill.json
Writes --out (bench/results/round_kinds.json).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_serve as bs  # noqa: E402



def instrument(llm) -> dict:
    """Count every reported round by the kind the budget chose for it."""
    budget, stats = llm.budget, collections.defaultdict(lambda: [0, 0.0, 0])
    real = budget.observe_round

    def observe_round(tokens, levels, seconds, committed=None, catchup=0.0, prefill=None, **kw):
        pending = budget._pending  # (sequences, prefill tokens, kind, probe) of this round, set by choose()
        key = "none" if pending is None else pending[2] + ("+prefill" if pending[1] else "")
        entry = stats[key]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += committed or 0
        real(tokens, levels, seconds, committed=committed, catchup=catchup, prefill=prefill)
    budget.observe_round = observe_round
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--spec-with-prefill", action="store_true",
                    help="let the 'on' budget speculate in rounds that carry a prefill chunk (off by default)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "round_kinds.json"))
    args = ap.parse_args(argv)
    prompts = bs.load_prompts(args.prompts)
    engines = {name: bs.build_engine(name) for name in ("on", "on-plain")}
    engines["on"].budget.spec_with_prefill = args.spec_with_prefill
    stats = {name: instrument(llm) for name, llm in engines.items()}
    load = argparse.Namespace(concurrency=str(args.concurrency), reps=args.reps, min_requests=args.min_requests,
                              max_new=args.max_new, transports="inproc")
    source = bd.source_digest()
    rows, _ = asyncio.run(bs.sweep(load, engines, prompts))
    kinds = {}
    for name, st in stats.items():
        kinds[name] = {k: {"rounds": v[0], "seconds": v[1], "tokens": v[2], "ms_per_round": 1e3 * v[1] / v[0],
                           "tokens_per_round": v[2] / v[0], "tok_s": v[2] / v[1] if v[1] else None}
                       for k, v in sorted(st.items())}
        print(f"\n{name} (head catch-up {engines[name].runner.catchup_seconds:.2f} s)")
        print("| round kind | rounds | ms per round | tokens per round | tok/s |")
        print("|---|---|---|---|---|")
        for k, v in kinds[name].items():
            print(f"| {k} | {v['rounds']} | {v['ms_per_round']:.1f} | {v['tokens_per_round']:.2f} | {v['tok_s']:.1f} |")
    result = {"config": vars(args), "rows": rows, "round_kinds": kinds,
              "head_catchup_seconds": {n: e.runner.catchup_seconds for n, e in engines.items()},
              "budget_rounds_on": {"chosen": engines["on"].budget.rounds, "speculating": engines["on"].budget.spec_rounds,
                                   "guarded_plain": engines["on"].budget.guarded},
              "source_digest": source, "source_changed": source != bd.source_digest(), "git_head": bd.git_head()}
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
