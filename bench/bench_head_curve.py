#!/usr/bin/env python
"""Acceptance length of a draft head against the training tokens it had seen.

Every snapshot a `eagle-serve train-draft` run saved (RUN/snapshots/tokens_*) and the final
head (RUN) decode the same MT-bench first turns (chat template, greedy, --max-new tokens) with
EAGLE-2 at EAGLE-2's standard tree (total_tokens 60, depth 6, top_k 10, fixed: no budget);
acceptance length = (accepted + verify steps) / verify steps, pooled over the prompts.

    .venv/bin/python bench/bench_head_curve.py --run /path/to/train-run
    .venv/bin/python bench/bench_head_curve.py --run RUN1,RUN2,RUN3,RUN4   # stages trained with --init
        # the previous one: training tokens count on from the earlier stages' cards
    .venv/bin/python bench/bench_head_curve.py --run RUN1,...,RUN6 --reuse bench/results/head_curve_stages.json
        # a curve extended by new stages: heads an earlier output measured (same head, tokens,
        # tree, prompts, tokens per prompt, dtype) keep its figures, marked "reused"
    .venv/bin/python bench/bench_head_curve.py --run RUN11 --stages 11 --prompts 10 \
        --extend bench/results/head_curve_stages.json --out bench/results/head_curve_stages.json
        # a new stage after ones whose run directories are gone: the earlier output's points
        # are kept as they are, and training tokens count on from its last point
Writes --out (bench/results/head_acceptance_60x6x10.json) and a .png next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402

from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="train-draft output directory, or several (comma-separated, "
                                                 "in training order) for stages that continued each other")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--tree", default="60x6x10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "head_acceptance_60x6x10.json"))
    ap.add_argument("--reuse", default=None, help="an earlier output: its points for the same heads are kept, not re-run")
    ap.add_argument("--extend", default=None,
                    help="an earlier output whose stages --run continues (their run directories may be gone): "
                         "its points are kept as they are, and training tokens count on from its last point")
    ap.add_argument("--stages", default=None, help="the runs' stage numbers, comma-separated (default 1, 2, ...): "
                                                   "a lineage that skipped a stage keeps its numbering")
    args = ap.parse_args(argv)
    runs = args.run.split(",")
    numbers = [int(x) for x in args.stages.split(",")] if args.stages else list(range(1, len(runs) + 1))
    if len(numbers) != len(runs):
        raise SystemExit(f"--stages gives {len(numbers)} numbers for {len(runs)} runs")
    t, d, k = (int(x) for x in args.tree.split("x"))
    prompts = bd.mtbench_ids(args.prompts, max(10, args.prompts))
    heads, offset, card, kept = [], 0, {}, []
    if args.extend:
        with open(args.extend) as f:
            prev = json.load(f)
        same = ("tree", "prompts", "max_new", "dtype")
        if not all(prev["config"].get(k) == getattr(args, k) for k in same):
            raise SystemExit(f"--extend {args.extend}: measured with other settings ({', '.join(same)} must match)")
        kept = [{**p, "reused": p.get("reused") or args.extend} for p in prev["points"]]
        offset = max(p["train_tokens"] for p in kept)
    for stage, run in zip(numbers, runs):
        snaps = os.path.join(run, "snapshots")
        found = sorted((int(n.split("_")[1]), os.path.join(snaps, n)) for n in os.listdir(snaps)) \
            if os.path.isdir(snaps) else []
        with open(os.path.join(run, "card.json")) as f:
            card = json.load(f)
        found = [(n, path) for n, path in found if n < card["train_tokens_seen"]]  # the final head ends the stage
        found.append((card["train_tokens_seen"], run))
        heads.extend((offset + n, path, stage) for n, path in found)
        offset += card["train_tokens_seen"]
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    points, earlier = list(kept), {}
    if args.reuse:
        with open(args.reuse) as f:
            prev = json.load(f)
        same = ("tree", "prompts", "max_new", "dtype")
        if all(prev["config"].get(k) == getattr(args, k) for k in same):
            earlier = {(os.path.abspath(p["head"]), p["train_tokens"]): p for p in prev["points"]}
        else:
            print(f"--reuse {args.reuse}: measured with other settings; every head runs", flush=True)
    for tokens, path, stage in heads:
        old = earlier.get((os.path.abspath(path), tokens))
        if old is not None:
            points.append({**old, "stage": stage, "reused": args.reuse})
            print(f"{tokens:>10d} training tokens: acceptance length {old['acceptance_length']:.3f} (reused)", flush=True)
            continue
        llm = LLM(None, dtype=args.dtype, draft=path, spec=SpecConfig("eagle2", total_tokens=t, depth=d, top_k=k),
                  tree_budget=False, kv_cache_tokens=8192)
        outs = llm.generate(prompts, params)
        steps = sum(o.spec.verify_steps for o in outs)
        acc = sum(o.spec.accepted_tokens for o in outs)
        points.append({"train_tokens": tokens, "stage": stage, "head": path, "acceptance_length": (acc + steps) / steps,
                       "verify_steps": steps, "accepted_tokens": acc})
        print(f"{tokens:>10d} training tokens: acceptance length {(acc + steps) / steps:.3f}", flush=True)
        del llm
    result = {"config": vars(args), "points": points, "card_heldout_top1": card.get("heldout_top1")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = plot(points, args.tree, len(prompts), args.max_new, args.out)
    print("wrote", args.out, *([png] if png else []))


def plot(points: list[dict], tree: str, n_prompts: int, max_new: int, out: str) -> str | None:
    """The curve as a png next to `out` (its path), or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["train_tokens"] / 1e6 for p in points], [p["acceptance_length"] for p in points], color="0.6")
    stages = sorted({p["stage"] for p in points})
    for stage in stages:
        ps = [p for p in points if p["stage"] == stage]
        ax.plot([p["train_tokens"] / 1e6 for p in ps], [p["acceptance_length"] for p in ps], "o",
                label=f"stage {stage}")
    if len(stages) > 1:  # below the rising curve, in two columns past ten stages
        ax.legend(fontsize=7, loc="lower right", ncol=2 if len(stages) > 10 else 1)
    ax.set_xlabel("training tokens seen (millions; epochs included)")
    ax.set_ylabel(f"acceptance length (tree {tree})")
    ax.set_title(f"SmolLM2-135M head, {n_prompts} MT-bench prompts, greedy, {max_new} tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.splitext(out)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
