#!/usr/bin/env python
"""The tree budget at one sequence, request by request: MT-bench first turns one after another
through `LLM.generate` (greedy, 128 new tokens, the shipped head, EAGLE-2 with the budget up to
24 tokens / depth 5), printing after each request how many rounds drafted, the cost model at
the points one sequence uses, the calibration, the measured guard and the probe counters.

    .venv/bin/python bench/trace_budget.py [--prompts 24] [--variants probes,no-probes]

`no-probes` sets `model_probe_every = 0` on the budget, which is the budget before model probes
(the guard then probes every `guard_probe` rounds at every batch size); `old-margins` sets
`guard_z = 0` and `min_gain_one = min_gain`, the budget before the guard's significance margin
and before a single sequence needed no modelled gain. Each variant gets a
fresh engine; the variants run one after the other, so their speeds are not comparable (the
machine drifts), only what the budget did. Writes bench/results/budget_trace.json.
"""
from __future__ import annotations

import argparse
import json
import os
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


def state(b) -> dict:
    c = b.costs
    ms = lambda x: round(1e3 * x, 2)  # noqa: E731
    return {"verify_ms": {t: ms(c.verify(t)) for t in (1, 2, 3, 5)}, "first_level_ms": ms(c.level(1, 1)),
            "further_level_ms": ms(c.level(2, 1)), "calibration": round(b.calibration, 3),
            "prior_depth1": [round(x, 3) for x in b.prior[0][:3]],
            "modelled_tok_s": [round(x, 1) for x in b.last_modelled],
            "guard": {str(k): {kind: [round(v[0], 1), v[1]] for kind, v in m.items()} for k, m in b.measured.items()},
            "rounds": b.rounds, "speculating_rounds": b.spec_rounds, "guarded_plain": b.guarded,
            "model_probes": getattr(b, "model_probes", 0)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--variants", default="probes,no-probes", help="probes, no-probes, old-margins")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "budget_trace.json"))
    args = ap.parse_args(argv)
    prompts = bd.mtbench_ids(args.prompts, 80)
    params = SamplingParams(max_tokens=args.max_new, temperature=0)
    out = {"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "variants": {}}
    for variant in args.variants.split(","):
        llm = LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2", total_tokens=24, depth=5, top_k=4),
                  draft=HEAD, kv_cache_tokens=8192, tree_budget=True)
        if variant == "no-probes":
            llm.budget.model_probe_every = 0
        elif variant == "old-margins":  # the guard's plain comparison, 5% required at one sequence too
            llm.budget.guard_z, llm.budget.min_gain_one = 0.0, llm.budget.min_gain
        elif variant != "probes":
            raise SystemExit(f"unknown variant {variant!r}")
        trace = [{"request": None, **state(llm.budget)}]
        t0 = time.perf_counter()
        tokens = 0
        for i, ids in enumerate(prompts):
            res = llm.generate(ids, params)[0]
            tokens += len(res.token_ids)
            trace.append({"request": i, "drafted_rounds": res.spec.verify_steps, **state(llm.budget)})
            last = trace[-1]
            print(f"{variant:9s} {i:2d}: drafted {res.spec.verify_steps:3d}  first level {last['first_level_ms']:5.2f} ms  "
                  f"guard {last['guard'].get('1')}  speculating {last['speculating_rounds']} / {last['rounds']}  "
                  f"model probes {last['model_probes']}", flush=True)
        out["variants"][variant] = {"tok_s": tokens / (time.perf_counter() - t0), "trace": trace}
        del llm
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
