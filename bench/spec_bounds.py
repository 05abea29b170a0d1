#!/usr/bin/env python
"""What a bench_spec run says about the ceiling of each fixed tree: from its per-round cost
profile (ms of draft / verify / accept / other per target forward) and tokens per forward,
the speedup over `none` as measured, with the draft free, with the draft and the
accept/other overhead both at `none`'s, and the tokens per forward each tree would need for a
target speedup at its measured cost. No model runs: it reads the json.

    .venv/bin/python bench/spec_bounds.py bench/results/speculative_single_stream.json --target 1.5
Writes --out (default: the input's name with _bounds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402


def bounds(summary: dict, target: float, pooled_tpf: dict) -> dict:
    """Per method of one prompt set's summary: modelled speedups (ratios of tokens per ms,
    so they use mean round costs, not the medians of per-prompt ratios bench_spec reports).
    Tokens per forward are pooled over all rounds as the round costs are (`pooled_tpf` by
    method, from the file's rows); the mean of per-prompt values that
    this used before weighs a short prompt's rounds like a long one's (3x1x2's free-draft
    ceiling on MT-bench in eagle_s25.json: 1.39 by it, 1.42 pooled)."""
    none = summary["none"]["ms_per_round"]
    plain = sum(none.values())  # ms a plain token costs
    out = {}
    for name, row in summary.items():
        if name == "none" or not row.get("verify_steps"):
            continue
        ms = row["ms_per_round"]
        tpf = pooled_tpf.get(name)
        if tpf is None:
            raise SystemExit(f"{name}: no pooled tokens per forward (a bench_spec json with its rows)")
        round_ms = sum(ms.values())
        free_draft = round_ms - ms["draft"]
        verify_only = ms["verify"] + none["accept"] + none["other"] + none["draft"]
        out[name] = {
            "tok_per_forward": tpf,
            "round_ms": round_ms,
            "round_x_plain": round_ms / plain,
            "speedup_modelled": tpf * plain / round_ms,
            "speedup_measured_median": row["speedup_vs_none"],
            "speedup_free_draft": tpf * plain / free_draft,
            "speedup_verify_only": tpf * plain / verify_only,
            f"tok_per_forward_for_{target}x": target * round_ms / plain,
            f"tok_per_forward_for_{target}x_free_draft": target * free_draft / plain,
        }
    return out


def pooled_tok_per_forward(data: dict, set_name: str) -> dict:
    """{method: new tokens / target forwards over its rows in the set ("all": every set), from
    the rows a bench_spec json keeps (also those written before it summarised them pooled)}."""
    sums: dict[str, list[int]] = {}
    for r in data.get("rows", []):
        if "forwards" in r and (set_name == "all" or r.get("set") == set_name):
            acc = sums.setdefault(r["system"], [0, 0])
            acc[0] += r["new_tokens"]
            acc[1] += r["forwards"]
    return {name: t / f for name, (t, f) in sums.items() if f}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench_spec json (its summary and ms_per_round)")
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.result) as f:
        data = json.load(f)
    result = {"config": vars(args), "source_git_head": data.get("env", {}).get("git_head"), "sets": {}}
    for set_name, summary in data["summary"].items():
        if "none" not in summary:
            continue
        table = result["sets"][set_name] = bounds(summary, args.target, pooled_tok_per_forward(data, set_name))
        print(f"\n{set_name}: plain token {sum(summary['none']['ms_per_round'].values()):.2f} ms")
        print(f"| method | tok/forward | round x plain | modelled | measured (median) | draft free | verify only "
              f"| tok/forward for {args.target}x | same, draft free |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, b in table.items():
            print(f"| {name} | {b['tok_per_forward']:.2f} | {b['round_x_plain']:.2f} | {b['speedup_modelled']:.2f} "
                  f"| {b['speedup_measured_median']:.2f} | {b['speedup_free_draft']:.2f} | {b['speedup_verify_only']:.2f} "
                  f"| {b[f'tok_per_forward_for_{args.target}x']:.2f} "
                  f"| {b[f'tok_per_forward_for_{args.target}x_free_draft']:.2f} |")
    out = args.out or os.path.splitext(args.result)[0] + "_bounds.json"
    bd.write_result(out, result)


if __name__ == "__main__":
    main()
