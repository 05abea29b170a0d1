#!/usr/bin/env python
"""Speculation's gain against how fast plain decoding ran, prompt by prompt, from a
bench/bench_spec.py result: for every prompt, `none`'s ms per target forward (its verify time
over its forwards: the plain step as this machine ran it then, the prompt's prefill included)
and each other system's tokens/s over `none`'s on the same prompt (the runs alternate, so the
two ran seconds apart). The shared machines' memory bandwidth drifts (plain decoding of the
default model read 94-180 tok/s in one session); a tree's extra rows cost compute that a slow
weight stream hides and a fast one exposes, so a run's median ratio depends on which spells
it caught. Prints the medians below and above --split ms (default: the median plain step), the
pooled ms a forward on each side (none's verify; the system's draft and verify) and writes --out
(json) and a png scatter next to it.

    .venv/bin/python bench/spec_by_speed.py bench/results/eagle_s45_7systems.json [--systems eagle2-t4d2k2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics


def points(result: dict, system: str, min_tokens: int = 0) -> list[dict]:
    """Per prompt where none wrote at least min_tokens: none's ms per forward, the system's and
    none's tok/s, their ratio."""
    by: dict = {}
    for r in result["rows"]:
        by.setdefault(r["qid"], {})[r["system"]] = r
    out = []
    for qid, rs in by.items():
        ref, got = rs.get("none"), rs.get(system)
        if ref is None or got is None or not ref.get("forwards") or ref["new_tokens"] < min_tokens:
            continue
        out.append({"qid": qid, "set": ref.get("set"), "plain_ms_per_forward": 1e3 * ref["verify_s"] / ref["forwards"],
                    "none_tok_s": ref["tok_s"], "tok_s": got["tok_s"], "ratio": got["tok_s"] / ref["tok_s"],
                    "none": {k: ref[k] for k in ("verify_s", "forwards")},
                    "system": {k: got[k] for k in ("draft_s", "verify_s", "forwards", "new_tokens")}})
    return sorted(out, key=lambda p: p["plain_ms_per_forward"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a bench/bench_spec.py json")
    ap.add_argument("--systems", default=None, help="comma-separated (default: every system but none)")
    ap.add_argument("--split", type=float, default=None, help="ms per plain forward between slow and fast")
    ap.add_argument("--min-tokens", type=int, default=100,
                    help="only prompts where none wrote this many tokens (a short answer's ms a forward is mostly "
                         "its prefill)")
    ap.add_argument("--out", default=None, help="default: RESULT with _by_speed.json")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    names = args.systems.split(",") if args.systems else list(dict.fromkeys(
        r["system"] for r in result["rows"] if r["system"] != "none" and "verify_s" in r))
    report = {"source": args.result, "min_tokens": args.min_tokens, "systems": {}}
    for name in names:
        pts = points(result, name, args.min_tokens)
        if not pts:
            continue
        split = args.split if args.split is not None else statistics.median(p["plain_ms_per_forward"] for p in pts)
        slow_pts = [p for p in pts if p["plain_ms_per_forward"] > split]
        fast_pts = [p for p in pts if p["plain_ms_per_forward"] <= split]
        slow, fast = [p["ratio"] for p in slow_pts], [p["ratio"] for p in fast_pts]
        def pooled(ps):  # ms per forward over these prompts: none's verify; the system's draft and verify
            if not ps:
                return None
            fw, nfw = sum(p["system"]["forwards"] for p in ps), sum(p["none"]["forwards"] for p in ps)
            return {"none_verify_ms": 1e3 * sum(p["none"]["verify_s"] for p in ps) / nfw,
                    "draft_ms": 1e3 * sum(p["system"]["draft_s"] for p in ps) / fw,
                    "verify_ms": 1e3 * sum(p["system"]["verify_s"] for p in ps) / fw,
                    "tokens_per_forward": sum(p["system"]["new_tokens"] for p in ps) / fw}

        entry = {"split_ms": split, "median_ratio": statistics.median(p["ratio"] for p in pts),
                 "pooled_slow_plain": pooled(slow_pts), "pooled_fast_plain": pooled(fast_pts),
                 "median_ratio_slow_plain": statistics.median(slow) if slow else None, "prompts_slow_plain": len(slow),
                 "median_ratio_fast_plain": statistics.median(fast) if fast else None, "prompts_fast_plain": len(fast),
                 "points": pts}
        report["systems"][name] = entry
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"{name}: median x none {entry['median_ratio']:.3f}; plain step > {split:.2f} ms "
              f"(slower memory): {fmt(entry['median_ratio_slow_plain'])} over {len(slow)} prompts, "
              f"<= {split:.2f} ms: {fmt(entry['median_ratio_fast_plain'])} over {len(fast)}")
        for side in ("slow", "fast"):
            pp = entry[f"pooled_{side}_plain"]
            if pp:
                print(f"  {side} plain: none verify {pp['none_verify_ms']:.2f} ms a forward; {name} draft "
                      f"{pp['draft_ms']:.2f} + verify {pp['verify_ms']:.2f} ms for {pp['tokens_per_forward']:.3f} tokens")
    out = args.out or os.path.splitext(args.result)[0] + "_by_speed.json"
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for i, (name, e) in enumerate(report["systems"].items()):
            ax.scatter([p["plain_ms_per_forward"] for p in e["points"]], [p["ratio"] for p in e["points"]],
                       s=18, color=f"C{i}", label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("plain decoding, ms per target forward (same prompt, same moment)")
        ax.set_ylabel("tok/s x none")
        ax.set_title(os.path.basename(args.result), fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.splitext(out)[0] + ".png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    print("wrote", out)


if __name__ == "__main__":
    main()
