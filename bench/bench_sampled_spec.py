#!/usr/bin/env python
"""Seeded sampling with EAGLE-2 trees: the target's draws made where the acceptance walk reads
them (engine.sampler.Picks) against every tree node drawn up front (what the engine did before:
a top-p sort of the whole vocabulary and a noise vector per node), side by side in one process;
and plain sampled decoding with top-p found by a growing top-k against a sort of the whole
vocabulary (the 'none/sort' arm).

Both arms run the same engine (the default model, the shipped head, a fixed tree, no tree
budget); the 'eager' arm wraps Picks so that it draws all rows when built, the work of the
engine before lazy draws (both arms with today's truncate: the tree rows measure the lazy draws
alone). Prompts are MT-bench first turns through the chat template; the arms alternate per
prompt and repetition. Outputs must be the same ids in both arms (the draws are keyed by seed
and position), which the script checks. Plain sampled decoding (no speculation) runs alongside
as the reference.

    .venv/bin/python bench/bench_sampled_spec.py [--trees 3x1x2,8x4x3] [--prompts 4] [--max-new 64]
Writes --out (bench/results/sampled_spec.json). First, and alone with --micro-only: one
vocabulary-sized row's top-p truncation, growing top-k against the whole sort (truncate_micro).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
from bench_spec import spec_from_shape  # noqa: E402

import engine.model_runner as mr  # noqa: E402
import torch  # noqa: E402
import engine.sampler as sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402

HEAD = os.path.join(bd.ROOT, "engine", "heads", "smollm2-135m-instruct")


def sort_truncate(logits, top_k, top_p):
    """top-k / top-p as the engine did before the growing top-k: a sort of the whole vocabulary."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return logits


class EagerPicks(sampler.Picks):
    """Picks that draws every row when built (the engine's work before Picks)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        for i in range(len(self)):
            self[i]


def truncate_micro(reps: int = 30) -> list[dict]:
    """ms per top-p truncation of one 49152-token float64 row (the default model's vocabulary),
    the growing top-k against the whole sort, alternating, at three spreads of the logits
    (bf16-rounded, as the model's are) and three top_p: the nucleus from a token to most of the
    vocabulary. Also one whole draw (truncation + noise) at the peaked spread."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for spread in (0.5, 3.0, 10.0):
        row = (torch.randn(49152, generator=gen) * spread).to(torch.bfloat16).double() / 0.7
        for top_p in (0.5, 0.9, 0.99):
            t = {"growing": [], "sort": []}
            for _ in range(reps):
                for name, fn in (("growing", sampler.truncate), ("sort", sort_truncate)):
                    t0 = time.perf_counter()
                    kept = fn(row, -1, top_p)
                    t[name].append((time.perf_counter() - t0) * 1e3)
            out.append({"spread": spread, "top_p": top_p, "kept": int((~torch.isinf(kept)).sum()),
                        "growing_ms": statistics.median(t["growing"]), "sort_ms": statistics.median(t["sort"])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="3x1x2,8x4x3,60x6x10", help="TOTALxDEPTHxTOPK, comma-separated")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sampled_spec.json"))
    ap.add_argument("--micro-only", action="store_true", help="only the truncation timings (no model)")
    args = ap.parse_args(argv)
    micro = truncate_micro()
    print(f"{'spread':>6} {'top_p':>5} {'kept':>6} {'growing ms':>10} {'sort ms':>8}")
    for m in micro:
        print(f"{m['spread']:>6} {m['top_p']:>5} {m['kept']:>6} {m['growing_ms']:>10.2f} {m['sort_ms']:>8.2f}")
    if args.micro_only:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "truncate_micro": micro}, f, indent=1)
        print(f"-> {args.out}")
        return 0
    prompts = bd.mtbench_ids(args.prompts)
    params = [SamplingParams(max_tokens=args.max_new, temperature=args.temperature, top_p=args.top_p, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    engines = {"none": LLM(None, spec=SpecConfig("none"), kv_cache_tokens=4096)}
    for t in args.trees.split(","):
        engines[t] = LLM(None, draft=HEAD, spec=spec_from_shape("eagle2", t), tree_budget=False, kv_cache_tokens=4096)
    real = sampler.Picks
    # none/sort: plain sampled decoding with the whole-vocabulary sort for top-p (the old truncate)
    arms = [("none", "sort"), ("none", "lazy")] + [(t, m) for t in args.trees.split(",") for m in ("eager", "lazy")]
    real_truncate = sampler.truncate
    for name, llm in engines.items():  # warm-up: kernels, allocator, first-call costs
        llm.generate(prompts[0][:32], SamplingParams(max_tokens=8, temperature=0.7, seed=0))
    times = {a: [] for a in arms}
    ids = {a: {} for a in arms}
    try:
        for rep in range(args.reps):
            for i, (p, sp) in enumerate(zip(prompts, params)):
                order = arms if (rep + i) % 2 == 0 else arms[::-1]
                for a in order:
                    tree, mode = a
                    mr.Picks = EagerPicks if mode == "eager" else real
                    sampler.truncate = sort_truncate if mode == "sort" else real_truncate
                    t0 = time.perf_counter()
                    out = engines[tree].generate(p, sp)[0]
                    times[a].append(len(out.token_ids) / (time.perf_counter() - t0))
                    ids[a][i] = out.token_ids
                print(f"rep {rep} prompt {i}: " + ", ".join(f"{t}/{m} {times[(t, m)][-1]:.1f}" for t, m in arms),
                      flush=True)
    finally:
        mr.Picks, sampler.truncate = real, real_truncate
    rows = []
    for tree in args.trees.split(","):
        same = all(ids[(tree, "eager")][i] == ids[(tree, "lazy")][i] for i in ids[(tree, "lazy")])
        ratio = statistics.median(b / a for a, b in zip(times[(tree, "eager")], times[(tree, "lazy")]))
        rows.append({"tree": tree, "eager_tok_s": statistics.median(times[(tree, "eager")]),
                     "lazy_tok_s": statistics.median(times[(tree, "lazy")]), "lazy_over_eager": ratio,
                     "same_ids": same,
                     "lazy_over_none": statistics.median(b / a for a, b in zip(times[("none", "lazy")],
                                                                                 times[(tree, "lazy")]))})
    result = {"args": vars(args), "truncate_micro": micro, "none_tok_s": statistics.median(times[("none", "lazy")]),
              "none_sort_tok_s": statistics.median(times[("none", "sort")]),
              "none_over_none_sort": statistics.median(b / a for a, b in zip(times[("none", "sort")],
                                                                              times[("none", "lazy")])),
              "none_same_ids": ids[("none", "sort")] == ids[("none", "lazy")], "trees": rows,
              "samples": {f"{t}/{m}": v for (t, m), v in times.items()}}
    print(f"{'tree':<10} {'eager tok/s':>12} {'lazy tok/s':>11} {'lazy/eager':>11} {'lazy/none':>10} same ids")
    for r in rows:
        print(f"{r['tree']:<10} {r['eager_tok_s']:>12.1f} {r['lazy_tok_s']:>11.1f} {r['lazy_over_eager']:>10.2f}x "
              f"{r['lazy_over_none']:>9.2f}x {r['same_ids']}")
    print(f"none (plain sampled): {result['none_tok_s']:.1f} tok/s; with the whole-vocabulary sort for top-p "
          f"{result['none_sort_tok_s']:.1f} ({result['none_over_none_sort']:.2f}x; same ids: {result['none_same_ids']})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"-> {args.out}")
    # (none/sort vs none/lazy may part at bf16 logits tied at the nucleus's edge: reported, not required)
    return 0 if all(r["same_ids"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
