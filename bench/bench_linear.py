#!/usr/bin/env python
"""Linear layers at decode sizes on the CPU: F.linear vs oneDNN prepacked vs the native skinny
kernel (row layout, and bf16's packed layout), over the default model's weight shapes (30 layers of qkv / o / gate_up / down plus the
LM head: the bytes one decode step reads), for 1..24 input rows.

    .venv/bin/python bench/bench_linear.py [--dtypes bfloat16,float32] [--rows 1,2,4,8,16,24]
    .venv/bin/python bench/bench_linear.py --dtypes bfloat16 --rows 1,4 --layers 2 --no-head   # cache-resident

Prints ms per pass and effective GB/s; writes bench/results/linear.json. This is what sets
SKINNY_MAX_ROWS (engine/layers.py) and why the CPU path prepacks weights.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eagle_serve.engine import kernels  # noqa: E402
from eagle_serve.engine.layers import _onednn_ok  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
HEAD = (49152, 576)


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def weights(dtype: torch.dtype, layers: int = 30, head: bool = True) -> list[torch.Tensor]:
    return [(torch.randn(o, i) * 0.02).to(dtype) for _ in range(layers) for o, i in SHAPES] + \
           ([(torch.randn(*HEAD) * 0.02).to(dtype)] if head else [])


def paths(ws: list[torch.Tensor]) -> dict:
    out = {"F.linear": lambda x, i: F.linear(x, ws[i])}
    if _onednn_ok(ws[0].dtype):  # (no bf16 prepacking on AVX2-only CPUs)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
        out["onednn-prepacked"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
    mod = kernels.native()
    if mod is not None:
        out["native-skinny"] = lambda x, i: mod.skinny_linear(x, ws[i], None)
        if ws[0].dtype == torch.bfloat16:  # the packed layout the engine uses for bf16 (engine/layers.py)
            vnni = [mod.pack_bf16(w) for w in ws]
            out["native-packed"] = lambda x, i: mod.skinny_linear(x, vnni[i], None)
    return out


def measure(dtype: torch.dtype, rows: list[int], reps: int, layers: int = 30, head: bool = True) -> list[dict]:
    ws = weights(dtype, layers, head)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {w.shape[1] for w in ws}}
        flops = 2 * m * nbytes / ws[0].element_size()  # a multiply-add per weight and row
        for name, fn in paths(ws).items():
            s = timed(lambda: [fn(xs[w.shape[1]], i) for i, w in enumerate(ws)], reps)
            results.append({"dtype": str(dtype).removeprefix("torch."), "rows": m, "path": name,
                            "ms": round(s * 1e3, 3), "GB_per_s": round(nbytes / s / 1e9, 1),
                            "GFLOP_per_s": round(flops / s / 1e9, 1)})
            print(f"{results[-1]['dtype']:9} rows {m:3}  {name:17} {s * 1e3:8.3f} ms  {nbytes / s / 1e9:6.1f} GB/s"
                  f"  {flops / s / 1e9:6.1f} GFLOP/s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,4,8,16,24")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=30,
                    help="layers of weights (2 with --no-head: 13.5 MB in bf16, which stays in a 32 MB L3: what the "
                         "products cost in arithmetic once the weights arrive fast)")
    ap.add_argument("--no-head", action="store_true", help="leave the 49152-token LM head out")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "linear.json"))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = [r for d in args.dtypes.split(",")
               for r in measure(getattr(torch, d), rows, args.reps, args.layers, not args.no_head)]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    sys.path.insert(0, HERE)
    import bench_decode as bd
    mod = kernels.native()
    provenance = {"command": " ".join(["python"] + sys.argv), "git_head": bd.git_head(),
                  "source_digest": bd.source_digest(), "cpu": bd.cpu_model(),
                  "amx": mod.amx() if mod is not None and hasattr(mod, "amx") else None,
                  "nta_streams": mod.nta_streams() if mod is not None and hasattr(mod, "nta_streams") else None}
    with open(args.out, "w") as f:
        json.dump({**provenance, "threads": torch.get_num_threads(), "torch": torch.__version__, "results": results},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
