#!/usr/bin/env python
"""The facts the tree budget rests on, measured on the default model with the shipped head,
in-process, single stream, greedy, MT-bench first turns (128 new tokens):

- calibration: accepted / predicted draft tokens (predicted = sum of the verified nodes'
  confidences) for fixed trees;
- whether a sequence's last round predicts its next: correlation between one round's top
  confidence (and its accepted count) and the next round's accepted count, 2-token tree;
- the measured wall time of one round (plan, engine step, outputs, as the budget observes it)
  by tree size x draft depth, alternating the configurations per prompt, with tokens per round.

    .venv/bin/python bench/bench_budget_stats.py   # -> bench/results/budget_stats.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
from engine.default_model import default_draft_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402


def prompts(tokenizer, n: int) -> list[list[int]]:
    questions, _ = bd.load_questions(bd.mtbench_wheel(None), 80)
    return [tokenizer.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[:n]]


def recorded(llm: LLM) -> list:
    results = []
    real = llm.runner.execute

    def execute(steps):
        out = real(steps)
        results.extend(out)
        return out
    llm.runner.execute = execute
    return results


def calibration(shape, n_prompts: int, params) -> dict:
    llm = LLM(None, draft=default_draft_path(), spec=SpecConfig("eagle2", *shape), tree_budget=False)
    results = recorded(llm)
    llm.generate(prompts(llm.tokenizer, n_prompts), params)
    rs = [r for r in results if r.num_draft_tokens]
    predicted = sum(sum(r.draft_confidence[:r.num_draft_tokens]) for r in rs)
    accepted = sum(r.num_accepted for r in rs)
    out = {"tree": list(shape), "rounds": len(rs), "predicted": predicted, "accepted": accepted,
           "accepted_over_predicted": accepted / predicted,
           "mean_top_confidence": statistics.mean(r.draft_confidence[0] for r in rs),
           "depth1_accept_rate": sum(r.num_accepted >= 1 for r in rs) / len(rs)}
    if shape == (2, 1, 1):
        by_seq = {}
        for r in rs:
            by_seq.setdefault(r.seq_id, []).append(r)
        pairs = [(a, b) for seq in by_seq.values() for a, b in zip(seq, seq[1:])]
        nxt = [b.num_accepted for _, b in pairs]
        out["corr_last_top_confidence_vs_next_accepted"] = statistics.correlation(
            [a.draft_confidence[0] for a, _ in pairs], nxt)
        out["corr_last_accepted_vs_next_accepted"] = statistics.correlation([a.num_accepted for a, _ in pairs], nxt)
        out["pairs"] = len(pairs)
    return out


class FixedTree:
    """A budget stand-in that verifies a fixed tree at a fixed depth and records round times."""

    def __init__(self):
        self.tokens, self.depth, self.times = 1, None, {}
        self.last_depths = []

    def choose(self, confidences, caps, prefill_tokens=0, depths=None, **kw):
        self.last_depths = [self.depth if self.tokens > 1 else None] * len(confidences)
        return [self.tokens] * len(confidences)

    def observe(self, *args):
        pass

    def observe_round(self, tokens, levels, seconds, committed=None, catchup=0.0, prefill=None, **kw):
        if tokens == 1 or levels:  # decode rounds only (not the prompt's prefill)
            self.times.setdefault(f"{self.tokens}x{self.depth}", []).append(seconds)


def round_costs(n_prompts: int, reps: int, params) -> dict:
    llm = LLM(None, draft=default_draft_path(), spec=SpecConfig("eagle2"))
    fixed = FixedTree()
    llm.loop.scheduler.budget = fixed
    configs = [(1, None), (2, 1), (3, 1), (5, 1), (3, 2), (6, 5)]
    stats = {}
    for rep in range(reps):
        for p in prompts(llm.tokenizer, n_prompts):
            for t, d in configs if rep % 2 == 0 else configs[::-1]:
                fixed.tokens, fixed.depth = t, d
                o = llm.generate([p], params)[0]
                s = stats.setdefault(f"{t}x{d}", [0, 0])
                s[0] += o.spec.accepted_tokens
                s[1] += o.spec.verify_steps
    plain = statistics.median(fixed.times["1xNone"])
    out = {}
    for key, times in fixed.times.items():
        med = statistics.median(times)
        acc, rounds = stats[key]
        per_round = 1 + (acc / rounds if key != "1xNone" and rounds else 0.0)
        out[key] = {"median_round_ms": med * 1e3, "x_plain_round": med / plain, "tokens_per_round": per_round,
                    "speed_vs_plain_rounds": per_round / (med / plain), "rounds": len(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=40, help="for the calibration and correlation")
    ap.add_argument("--cost-prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "budget_stats.json"))
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_new, temperature=0, ignore_eos=True)
    result = {"config": vars(args),
              "calibration": [calibration(s, args.prompts, params) for s in ((2, 1, 1), (24, 5, 4))],
              "round_costs": round_costs(args.cost_prompts, args.reps,
                                         SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))}
    print(json.dumps(result, indent=1))
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
