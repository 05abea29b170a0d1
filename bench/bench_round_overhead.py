#!/usr/bin/env python
"""What a plain decode round costs on each engine, phase by phase.

Runs bench_serve's in-process load (MT-bench + ShareGPT prompts, greedy, C clients back to back)
on "off" (no head), "on-plain" (the head loaded and kept in step, nothing drafted) and "on"
(EAGLE-2 with the tree budget), or bench_instances' variants (e.g. on-nofeat: the head keeps no
features), alternating, --reps repetitions. Every round of the engine loop
is timed by phase: plan (admission, block reservations, the tree budget's choice), the engine
step (drafter work before the forward, the target forward with sampling, acceptance and the
drafter's bookkeeping after it; the worker-thread hop is what is left), and complete (commit,
detokenise, the budget's learning). Rounds are grouped by kind: "plain-N" (N sequences each
decoding one token, no prefill, no tree), "tree-N", "+prefill". The plain-N rows compare like
with like across the engines; their difference is what the head costs a round it does not draft.

    .venv/bin/python bench/bench_round_overhead.py --concurrency 4 --reps 3
Writes --out (bench/results/round_overhead.json).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_instances as bi  # noqa: E402
import bench_serve as bs  # noqa: E402

PHASES = ("plan", "draft", "verify", "accept", "hop", "complete", "round")


def instrument(llm, by_previous: bool = False) -> dict:
    """Time every round of `llm`'s engine loop by phase; returns {kind: {phase: [seconds...]}}.
    by_previous: a round right after a drafting round is its own kind ("...<after-tree"), to see
    whether a drafting round's output work (its extra tokens, streamed to the clients on the
    event loop while the next round runs) lands on the round after it."""
    loop, runner = llm.loop, llm.runner
    stats: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    cur: dict = {}
    prev = {"tree": False}
    plan, execute, complete = loop.plan, loop.execute, loop.complete

    def timed_plan():
        t0 = time.perf_counter()
        seqs, steps = plan()
        cur.clear()
        cur.update(t0=t0, plan=time.perf_counter() - t0, steps=steps)
        return seqs, steps

    def timed_execute(seqs, steps):
        tm = runner.timings
        before = (tm.draft, tm.verify, tm.accept)
        cur["catchup0"] = getattr(runner, "catchup_seconds", 0.0)
        t0 = time.perf_counter()
        out = execute(seqs, steps)
        cur["exec"] = time.perf_counter() - t0
        cur["draft"], cur["verify"], cur["accept"] = (a - b for a, b in zip((tm.draft, tm.verify, tm.accept), before))
        cur["results"] = out
        return out

    def timed_complete(seqs, results):
        t0 = time.perf_counter()
        out = complete(seqs, results)
        t1 = time.perf_counter()
        if "exec" in cur:
            steps = cur["steps"]
            prefill = any(len(s.token_ids) > 1 for s in steps)
            tree = any(getattr(r, "num_draft_tokens", 0) for r in cur["results"])
            kind = ("tree" if tree else "plain") + f"-{len(steps)}" + ("+prefill" if prefill else "")
            if by_previous and prev["tree"]:
                kind += "<after-tree"
            prev["tree"] = tree
            row = stats[kind]
            row["plan"].append(cur["plan"])
            for p in ("draft", "verify", "accept"):
                row[p].append(cur[p])
            row["hop"].append(cur["exec"] - cur["draft"] - cur["verify"] - cur["accept"])
            row["complete"].append(t1 - t0)
            row["round"].append(t1 - cur["t0"])
            ok = [r for r in cur["results"] if not isinstance(r, BaseException)]
            row["emitted"].append(sum(len(getattr(r, "token_ids", ())) for r in ok))
            row["drafted"].append(sum(getattr(r, "num_draft_tokens", 0) for r in ok))
            row["catchup"].append(getattr(runner, "catchup_seconds", 0.0) - cur["catchup0"])
        cur.clear()
        return out

    loop.plan, loop.execute, loop.complete = timed_plan, timed_execute, timed_complete
    return stats


def summarise(stats: dict) -> dict:
    out = {}
    for kind, row in sorted(stats.items()):
        n = len(row["round"])
        total = sum(row["round"])
        out[kind] = {"rounds": n, **{f"{p}_ms_mean": 1e3 * statistics.fmean(row[p]) for p in PHASES},
                     "round_ms_median": 1e3 * statistics.median(row["round"]),
                     # tokens the rounds emitted, draft tokens they verified, and the catch-ups inside them
                     "emitted_per_round": sum(row["emitted"]) / n, "drafted_per_round": sum(row["drafted"]) / n,
                     "catchup_ms_mean": 1e3 * statistics.fmean(row["catchup"]),
                     "tok_s": sum(row["emitted"]) / total if total > 0 else None,
                     "tok_s_without_catchup": (sum(row["emitted"]) / (total - sum(row["catchup"]))
                                               if total - sum(row["catchup"]) > 0 else None),
                     "seconds": total}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--engines", default="off,on-plain,on")
    ap.add_argument("--warmup-concurrency", type=int, default=2,
                    help="one untimed pass at this concurrency on every engine first (0: none)")
    ap.add_argument("--by-previous", action="store_true",
                    help="rounds right after a drafting round as kinds of their own (<after-tree)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "round_overhead.json"))
    args = ap.parse_args(argv)
    prompts = bs.load_prompts(args.prompts)
    engines = {name: bi.build(name) for name in args.engines.split(",")}
    source = bd.source_digest()
    if args.warmup_concurrency:
        warm = argparse.Namespace(concurrency=str(args.warmup_concurrency), reps=1, min_requests=4,
                                  max_new=32, transports="inproc")
        asyncio.run(bs.sweep(warm, engines, prompts))
    stats = {name: instrument(llm, args.by_previous) for name, llm in engines.items()}
    load = argparse.Namespace(concurrency=args.concurrency, reps=args.reps, min_requests=args.min_requests,
                              max_new=args.max_new, transports="inproc")
    rows, _ = asyncio.run(bs.sweep(load, engines, prompts))
    kinds = {name: summarise(st) for name, st in stats.items()}
    for name, ks in kinds.items():
        print(f"\n{name} (head catch-up {engines[name].runner.catchup_seconds:.2f} s)")
        print("| round kind | rounds | " + " | ".join(f"{p} ms" for p in PHASES)
              + " | median round ms | catch-up ms | drafted | emitted | tok/s | s in all |")
        print("|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|")
        for k, v in ks.items():
            print(f"| {k} | {v['rounds']} | " + " | ".join(f"{v[p + '_ms_mean']:.2f}" for p in PHASES)
                  + f" | {v['round_ms_median']:.2f} | {v['catchup_ms_mean']:.2f} | {v['drafted_per_round']:.2f}"
                  f" | {v['emitted_per_round']:.2f} | {v['tok_s'] or 0:.1f} | {v['seconds']:.2f} |")
    by_c = collections.defaultdict(dict)
    for r in rows:
        by_c[r["concurrency"]].setdefault(r["engine"], []).append(r["tok_s"])
    for c, per in sorted(by_c.items()):
        print(f"c={c}: " + ", ".join(f"{e} {statistics.median(v):.1f} tok/s" for e, v in per.items()))
    result = {"config": vars(args), "rows": rows, "round_phases": kinds,
              "head_catchup_seconds": {n: e.runner.catchup_seconds for n, e in engines.items()},
              "head_catchup_pairs": {n: e.runner.catchup_pairs for n, e in engines.items()},
              # sequence-rounds the budget left plain for their backlog, and its per-pair cost (s)
              "budget_retired": {n: getattr(e.budget, "retired", None) for n, e in engines.items()},
              "budget_catchup_rate": {n: getattr(e.budget, "catchup_rate", None) for n, e in engines.items()},
              "source_digest": source, "source_changed": source != bd.source_digest(), "git_head": bd.git_head()}
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
