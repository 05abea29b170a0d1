#!/usr/bin/env python
"""What a verify step costs by token count, native stack vs per-op oneDNN, on the default model
(bf16, 2 threads, no draft head): engine/profile.py's verify profile (the tree budget's own
start-up measurement: a packed target forward plus the LM head over every row) run twice per
repetition, alternating:

  native  as the engine runs: the fused native stack with packed bf16 weights up to
          PACKED_MAX_ROWS tokens (STACK_ALL_ROWS where oneDNN has no bf16), oneDNN beyond
  onednn  the stack and the native linears' row limits switched off: the per-op Python path
          with oneDNN (where oneDNN has no bf16, AVX2-only CPUs: with the packed native
          linears, which take every row count there)

    .venv/bin/python bench/bench_verify_cost.py [--reps 2] [--max-tokens 32]
Writes --out (bench/results/verify_cost.json): median ms by tokens for each mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from engine.layers import Linear  # noqa: E402
from engine.profile import profile_costs  # noqa: E402
from server.llm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_cost.json"))
    args = ap.parse_args()
    llm = LLM(None, dtype="bfloat16", draft=None, kv_cache_tokens=16384)
    runner, model = llm.runner, llm.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    native = (model._stack_max_rows, [m.native_max_rows for m in linears])

    def set_mode(mode: str) -> None:
        on = mode == "native"
        model._stack_max_rows = native[0] if on else 0
        for m, rows in zip(linears, native[1]):
            m.native_max_rows = rows if on else 0

    runs: dict[str, list[dict[int, float]]] = {"native": [], "onednn": []}
    for rep in range(args.reps):
        for mode in (["native", "onednn"] if rep % 2 == 0 else ["onednn", "native"]):
            set_mode(mode)
            costs = profile_costs(runner, args.max_tokens, 1, repeats=5)["verify"]
            runs[mode].append({t: s * 1e3 for t, s in costs})
    set_mode("native")
    result = {"stack_max_rows": native[0], "ms": {mode: {t: round(statistics.median(r[t] for r in rs), 2)
                                                         for t in rs[0]} for mode, rs in runs.items()},
              "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("tokens  " + "  ".join(f"{t:>6}" for t in result["ms"]["native"]))
    for mode, row in result["ms"].items():
        print(f"{mode:7} " + "  ".join(f"{v:6.1f}" for v in row.values()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
