#!/usr/bin/env python
"""The tree budget at one sequence against fixed trees and plain decoding, prompt by prompt.

Serving's default (EAGLE-2 with the load-aware tree budget) decodes MT-bench first turns one
at a time through `LLM.generate` (greedy, --max-new tokens), alternating per prompt with
engines that verify a fixed tree (--fixed, TOTALxDEPTHxTOPK, no budget) and one without a
head. Prints tok/s per engine over all prompts (ratios to "none" in the same run), the
budget's choices (tokens to verify, depth drafted) by count, and its cost model, prior and
calibration at the end. Per choice, also what the budget predicted a round of it would emit and
cost against what such rounds gave (`predicted`; decode rounds without a prompt chunk).

    .venv/bin/python bench/bench_budget_c1.py [--prompts 12] [--fixed 3x1x2]
Writes --out (bench/results/budget_c1.json).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402

from engine.default_model import default_draft_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from server.llm import LLM  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=None, help="EAGLE head (default: the shipped head)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--fixed", default="3x1x2", help="comma list of fixed trees TOTALxDEPTHxTOPK")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "budget_c1.json"))
    args = ap.parse_args(argv)
    source = bd.source_digest()
    draft = args.draft or default_draft_path()
    common = dict(dtype="bfloat16", kv_cache_tokens=16384)
    engines = {"budget": LLM(None, spec=SpecConfig("eagle2"), draft=draft, **common)}
    for shape in filter(None, args.fixed.split(",")):
        t, d, k = (int(x) for x in shape.split("x"))
        engines[shape] = LLM(None, spec=SpecConfig("eagle2", total_tokens=t, depth=d, top_k=k), draft=draft,
                             tree_budget=False, **common)
    engines["none"] = LLM(None, spec=SpecConfig("none"), tree_budget=False, **common)
    budget = engines["budget"].budget
    choices = collections.Counter()
    # per choice: [rounds, predicted tokens, tokens, predicted seconds, seconds]
    predicted = collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0])
    _trace(budget, choices, predicted)
    prompts = bd.mtbench_ids(args.prompts + 1)
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    for llm in engines.values():  # warm-up: the first prompt
        llm.generate(prompts[0], params)
    choices.clear()
    predicted.clear()
    start = (budget.rounds, budget.spec_rounds, budget.explored, budget.explored_depth)  # the warm-up's left out
    seconds, tokens = collections.Counter(), collections.Counter()
    for i, ids in enumerate(prompts[1:]):
        order = list(engines)
        order = order[i % len(order):] + order[:i % len(order)]  # each engine first in turn
        for name in order:
            t0 = time.perf_counter()
            tokens[name] += len(engines[name].generate(ids, params)[0].token_ids)
            seconds[name] += time.perf_counter() - t0
    rates = {name: tokens[name] / seconds[name] for name in engines}
    for name, r in rates.items():
        print(f"{name:>8}: {r:7.1f} tok/s  x none {r / rates['none']:.3f}")
    print("budget choices (tokens@depth):", dict(choices.most_common()))
    pred = {}
    for key, (r, pt, t, ps, sec) in sorted(predicted.items(), key=lambda kv: -kv[1][0]):
        pred[key] = {"rounds": r, "tokens_predicted": pt / r, "tokens": t / r, "ms_predicted": 1e3 * ps / r,
                     "ms": 1e3 * sec / r}
        if r >= 10:
            print(f"  {key:>5}: {r:4d} rounds, tokens a round predicted {pt / r:.3f} got {t / r:.3f}, "
                  f"ms predicted {1e3 * ps / r:.2f} got {1e3 * sec / r:.2f}")
    result = {"config": vars(args), "draft": draft, "tok_s": rates,
              "x_none": {n: r / rates["none"] for n, r in rates.items()},
              "tokens": dict(tokens), "budget_choices": dict(choices.most_common()), "predicted": pred,
              "budget_cost_model_end": budget.costs.to_json(), "budget_cost_profile": engines["budget"].cost_profile,
              "budget_prior": [list(p[:8]) for p in budget.prior], "budget_calibration": budget.calibration,
              "budget_rounds": dict(zip(("chosen", "speculating", "explored_plain", "explored_depth"),
                                        (now - then for now, then in zip((budget.rounds, budget.spec_rounds, budget.explored,
                                                                          budget.explored_depth), start)))),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_head": bd.git_head(), "source_digest": source,
              "source_changed": source != bd.source_digest()}
    bd.write_result(args.out, result)


def _trace(budget, choices, predicted) -> None:
    """Count the budget's one-sequence decode choices and, per choice, what it predicted the
    round would emit and cost (1 + calibration x the prior's confidences; verify + draft) next
    to what the round gave (tokens committed; the seconds its cost model learns from)."""
    choose, observe_round, pending = budget.choose, budget.observe_round, {}

    def counted(confidences, caps, prefill_tokens=0, **kw):
        sizes = choose(confidences, caps, prefill_tokens, **kw)
        pending.clear()
        if len(sizes) == 1 and not prefill_tokens:
            t, d = sizes[0], budget.last_depths[0] or 0
            key = f"{t}@{d}"
            choices[key] += 1
            if t > 1:
                tok = 1 + budget.calibration * sum(budget.prior[d - 1][:t - 1])
                sec = budget.costs.verify(t) + budget.costs.draft(1, d)
            else:
                tok, sec = 1.0, budget.costs.verify(1)
            pending["x"] = (key, tok, sec)
        return sizes

    def observed(tokens, levels, seconds, committed=None, catchup=0.0, **kw):
        x = pending.pop("x", None)
        if x is not None and committed is not None:
            p = predicted[x[0]]
            p[0] += 1
            p[1] += x[1]
            p[2] += committed
            p[3] += x[2]
            p[4] += seconds - catchup
        return observe_round(tokens, levels, seconds, committed=committed, catchup=catchup, **kw)
    budget.choose, budget.observe_round = counted, observed


if __name__ == "__main__":
    main()
