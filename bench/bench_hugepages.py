#!/usr/bin/env python
"""Transparent huge pages for the engine's weights, KV cache and head features (engine/hugepages.py)
against 4 KiB pages, side by side in one process: for every tree, an engine built with
EAGLE_SERVE_HUGEPAGES=0 and one with it on, greedy generation on MT-bench first turns alternating
per prompt (the order flipping every prompt), so the machine's drift hits both alike.

    .venv/bin/python bench/bench_hugepages.py [--trees none,4x2x2,budget] [--prompts 10] [--max-new 128] [--batch 1]

Per tree: tokens/s of each build (all prompts' tokens over their seconds), the median of
per-prompt ratios huge / 4k, equal greedy outputs (they must be: only where the numbers live
changes), and how much of each build's memory the kernel really gave as huge pages. Writes --out
(bench/results/hugepages.json) and a png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_decode as bd  # noqa: E402
from bench_kernels_ab import spec_of  # noqa: E402

from engine import hugepages  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from server.llm import LLM  # noqa: E402

VARIANTS = {"4k": "0", "huge": "1"}


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def build(tree: str, variant: str, kv_tokens: int) -> tuple[LLM, int]:
    """An engine for `tree` with huge pages per `variant`, and the huge-page bytes its build added."""
    spec = spec_of(tree)
    before = hugepages.huge_bytes()
    with env("EAGLE_SERVE_HUGEPAGES", VARIANTS[variant]):
        llm = LLM(None, dtype="bfloat16", spec=spec, draft=bd_draft() if spec.uses_head else None,
                  kv_cache_tokens=kv_tokens, tree_budget=tree == "budget")
    return llm, hugepages.huge_bytes() - before


def bd_draft() -> str:
    from bench_serve import default_draft_path
    return default_draft_path()


def run_tree(tree: str, prompts: list[list[int]], max_new: int, batch: int, kv_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_new, temperature=0)
    engines, huge = {}, {}
    for v in VARIANTS:
        engines[v], huge[v] = build(tree, v, kv_tokens)
        engines[v].generate(prompts[:batch], params)  # warm-up
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    toks = {v: 0 for v in VARIANTS}
    secs = {v: 0.0 for v in VARIANTS}
    per_group = {v: [] for v in VARIANTS}
    outs = {v: [] for v in VARIANTS}
    steps = {v: [0, 0] for v in VARIANTS}
    for i, group in enumerate(groups):
        order = list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]
        for v in order:
            t0 = time.perf_counter()
            res = engines[v].generate(group, params)
            dt = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in res)
            toks[v] += n
            secs[v] += dt
            per_group[v].append(n / dt)
            for o in res:
                outs[v].append(list(o.token_ids))
                steps[v][0] += o.spec.verify_steps
                steps[v][1] += o.spec.accepted_tokens
    rates = {v: toks[v] / secs[v] for v in VARIANTS}
    ratios = [h / f for h, f in zip(per_group["huge"], per_group["4k"])]
    same = sum(a == b for a, b in zip(outs["4k"], outs["huge"]))
    row = {"tok_s": rates, "ratio_all": rates["huge"] / rates["4k"], "ratio_median": statistics.median(ratios),
           "ratios": ratios, "same_outputs": f"{same}/{len(prompts)}", "huge_bytes_of_build": huge,
           "acceptance": {v: (1 + a / s if s else None) for v, (s, a) in steps.items()}}
    print(f"{tree:>8} (batch {batch}): 4k {rates['4k']:.1f} tok/s, huge {rates['huge']:.1f} tok/s, "
          f"huge / 4k {row['ratio_all']:.3f} (median per group {row['ratio_median']:.3f}), "
          f"same outputs {same}/{len(prompts)}, huge pages of the builds: "
          + " / ".join(f"{v} {b / 2**20:.0f} MiB" for v, b in huge.items()), flush=True)
    del engines
    return row


def plot(path: str, rows: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(rows)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = range(len(names))
    for k, v in enumerate(VARIANTS):
        ax.bar([i + (k - 0.5) * 0.38 for i in x], [rows[n]["tok_s"][v] for n in names], width=0.38,
               label=f"{v} pages")
    for i, n in enumerate(names):
        ax.annotate(f"{rows[n]['ratio_all']:.2f}x", (i, max(rows[n]["tok_s"].values())), ha="center",
                    va="bottom", fontsize=9)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens/s (greedy, bf16)")
    ax.set_title("Huge pages vs 4 KiB pages, one process, alternating")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="none,4x2x2,budget")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hugepages.json"))
    args = ap.parse_args()
    mode = hugepages.thp_mode()
    print(f"transparent huge pages: {mode}", flush=True)
    if mode not in ("always", "madvise"):
        raise SystemExit(f"this kernel offers no transparent huge pages ({mode}): nothing to compare")
    prompts = bd.mtbench_ids(args.prompts * args.batch)
    rows = {t: run_tree(t, prompts, args.max_new, args.batch, args.kv_cache_tokens) for t in args.trees.split(",")}
    result = {"config": vars(args), "thp_mode": mode, "rows": rows, "cpu": bd.cpu_model(),
              "git_head": bd.git_head(), "source_digest": bd.source_digest()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    print(f"wrote {args.out}" + (f" and {png}" if plot(png, rows) else ""))


if __name__ == "__main__":
    main()
