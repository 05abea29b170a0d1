#!/usr/bin/env python
"""A start-up cost profile taken while other processes use the CPU, and what it does to the tree
budget afterwards.

Three engines of the default model (EAGLE-2, the shipped head, the budget up to 24 tokens /
depth 5) are built: `clean` with the machine to itself; `contended` and `no-retake` while
`--busy` processes (default: one per core) spin on the cores. `no-retake` keeps its contended
profile for good (the engine before idle-time profiles: `LLM.MAX_PROFILES = 1`); `contended`
profiles again when it is next idle. The busy processes then stop and the three serve the same
MT-bench first turns (greedy, `--max-new` tokens), one at a time (1 client) and four at once
(`LLM.generate` of four prompts), alternating the engines' order every repetition. Prints and
writes each profile (CPU share of every attempt, verify curve) and per engine tokens per second,
the ratio to `clean` in the same repetition, and the budget's drafting rounds:

    .venv/bin/python bench/bench_profile_contention.py [--reps 3] [--prompts 8]

Writes bench/results/profile_contention.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402

HEAD = os.path.join(os.path.dirname(HERE), "engine", "heads", "smollm2-135m-instruct")
POINTS = (1, 2, 3, 4, 5, 8, 12, 16)


class Busy:
    """`n` processes spinning on the CPU while the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def build(max_profiles: int | None = None) -> LLM:
    saved = LLM.MAX_PROFILES
    if max_profiles is not None:
        LLM.MAX_PROFILES = max_profiles
    try:
        return LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2", total_tokens=24, depth=5, top_k=4),
                   draft=HEAD, kv_cache_tokens=8192, tree_budget=True)
    finally:
        LLM.MAX_PROFILES = saved


def curve(llm: LLM) -> dict:
    c = llm.budget.costs
    return {"verify_ms": {t: round(1e3 * c.verify(t), 2) for t in POINTS},
            "first_level_ms": round(1e3 * c.level(1, 1), 2), "further_level_ms": round(1e3 * c.level(2, 1), 2)}


def profiles(llm: LLM) -> list[dict]:
    return [{"cpu_share": [round(s, 3) for s in p["cpu_share"] if s is not None], "contended": p["contended"],
             "used": p["used"]} for p in llm.profiles]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns per engine and repetition")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "profile_contention.json"))
    args = ap.parse_args(argv)
    prompts = bd.mtbench_ids(args.prompts, 80)
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    source = bd.source_digest()

    engines = {"clean": build()}
    with Busy(args.busy):
        engines["contended"] = build()
        engines["no-retake"] = build(max_profiles=1)
    out = {"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "busy_processes": args.busy,
           "git_head": bd.git_head(), "source_digest": source}
    out["start"] = {name: {"profiles": profiles(llm), **curve(llm)} for name, llm in engines.items()}
    for name, s in out["start"].items():
        print(f"{name:9s} profile shares {[p['cpu_share'] for p in s['profiles']]}  verify ms {s['verify_ms']}", flush=True)

    warm = SamplingParams(max_tokens=4, temperature=0)
    idle_s = {}
    for name, llm in engines.items():  # the contended engine's idle-time profile runs in its first call
        due = llm.loop.idle_due_in()
        if due is not None and due > 0:  # an engine idle until then (LLM.REPROFILE_AFTER after its build)
            time.sleep(due)
        t0 = time.perf_counter()
        llm.generate(prompts[0], warm)
        idle_s[name] = round(time.perf_counter() - t0, 3)
    out["first_call_s"] = idle_s
    out["after_retake"] = {name: {"profiles": profiles(llm), **curve(llm)} for name, llm in engines.items()}
    print("after the first call:", {n: s["verify_ms"] for n, s in out["after_retake"].items()}, flush=True)

    order = list(engines)
    reps = []
    for rep in range(args.reps):
        row = {}
        for name in (order if rep % 2 == 0 else order[::-1]):
            llm = engines[name]
            b = llm.budget
            r0, s0 = b.rounds, b.spec_rounds
            t0, n1 = time.perf_counter(), 0
            for ids in prompts:
                n1 += len(llm.generate(ids, params)[0].token_ids)
            t1, n4 = time.perf_counter(), 0
            for i in range(0, len(prompts), 4):
                n4 += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + 4], params))
            t2 = time.perf_counter()
            row[name] = {"c1_tok_s": n1 / (t1 - t0), "c4_tok_s": n4 / (t2 - t1),
                         "rounds": b.rounds - r0, "drafting_rounds": b.spec_rounds - s0}
        for name in order:
            for c in ("c1", "c4"):
                row[name][f"{c}_vs_clean"] = row[name][f"{c}_tok_s"] / row["clean"][f"{c}_tok_s"]
        reps.append(row)
        print(f"rep {rep}: " + "  ".join(f"{n} {row[n]['c1_tok_s']:.1f}/{row[n]['c4_tok_s']:.1f} tok/s "
                                          f"({row[n]['c1_vs_clean']:.2f}x/{row[n]['c4_vs_clean']:.2f}x, "
                                          f"drafted {row[n]['drafting_rounds']}/{row[n]['rounds']})" for n in order),
              flush=True)
    out["reps"] = reps
    out["median_vs_clean"] = {n: {c: round(statistics.median(r[n][f"{c}_vs_clean"] for r in reps), 3)
                                  for c in ("c1", "c4")} for n in order}
    out["end"] = {name: curve(llm) for name, llm in engines.items()}
    out["source_changed"] = source != bd.source_digest()
    print("median vs clean:", out["median_vs_clean"])
    bd.write_result(args.out, out)


if __name__ == "__main__":
    main()
