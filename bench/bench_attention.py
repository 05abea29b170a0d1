#!/usr/bin/env python
"""The native paged attention kernel against an earlier version of itself, side by side in one
process: the default model's attention shape (9 query heads over 3 KV heads, head_dim 64, bf16),
30 layers' worth of calls, for 1..16 query rows of one sequence (a decode step, or a tree of
that many nodes under its ancestor mask) and 1..32 sequences of one row each (batched decoding),
at a few context lengths.

    .venv/bin/python bench/bench_attention.py --base REV [--rows 1,2,4,8,16] [--seqs 1,8,32]
        [--contexts 128,512,1024] [--reps 15]

`--base` (required) is a git revision whose
engine/kernels/cpu_attention.cpp is compiled as a second extension next to the working tree's;
the two run alternately, call by call. Prints
ms per 30 layers and the ratio; writes bench/results/attention.json and attention.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from eagle_serve.engine import kernels  # noqa: E402

H, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16
BINDING = """
#include <torch/extension.h>
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_attention", &paged_attention); }
"""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the kernel to compare against")
    ap.add_argument("--rows", default="1,2,4,8,16", help="query rows of one sequence (tree nodes)")
    ap.add_argument("--seqs", default="1,8,32", help="sequences of one row each (batched decode)")
    ap.add_argument("--contexts", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attention.json"))
    return ap.parse_args(argv)


def base_module(rev: str):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:engine/kernels/cpu_attention.cpp"],
                         check=True, capture_output=True, text=True).stdout
    d = tempfile.mkdtemp(prefix="attn-base-")
    paths = [os.path.join(d, "attention.cpp"), os.path.join(d, "binding.cpp")]
    for path, text in zip(paths, (src, BINDING)):
        with open(path, "w") as f:
            f.write(text)
    header = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:engine/kernels/simd.h"], capture_output=True, text=True)
    if header.returncode == 0:  # the shared AVX-512 helpers, where the revision has them
        with open(os.path.join(d, "simd.h"), "w") as f:
            f.write(header.stdout)
    from torch.utils.cpp_extension import load
    return load("eagle_serve_attention_base", paths, extra_cflags=kernels.isa()[2], verbose=False,
                build_directory=d)


def case(seqs: int, rows: int, ctx: int, gen):
    """Inputs of one call: `seqs` sequences of ctx committed keys, `rows` new rows each (a chain
    under the tree mask when rows > 1, as verification sees it)."""
    blocks = -(-(ctx + rows) // BS)
    slots_total = seqs * blocks * BS
    kc = torch.randn(slots_total, HKV, D, generator=gen).bfloat16()
    vc = torch.randn(slots_total, HKV, D, generator=gen).bfloat16()
    perm = torch.randperm(seqs * blocks, generator=gen)
    L = ctx + rows
    gather = torch.stack([torch.cat([torch.arange(BS) + int(perm[s * blocks + b]) * BS for b in range(blocks)])[:L]
                          for s in range(seqs)])
    q = torch.randn(seqs * rows, H, D, generator=gen).bfloat16()
    lens = torch.full((seqs,), L, dtype=torch.long)
    q_seq = torch.arange(seqs).repeat_interleave(rows)
    q_row = torch.arange(rows).repeat(seqs)
    if rows > 1:
        mask = torch.ones(seqs, rows, L, dtype=torch.bool)
        mask[:, :, ctx:] = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    else:
        mask = torch.empty(0, dtype=torch.bool)
    return (q, kc, vc, gather, lens, q_seq, q_row, mask, D ** -0.5)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    new = kernels.native()
    if new is None:
        raise SystemExit("the native kernels are unavailable on this machine (AVX-512 bf16 and a compiler needed)")
    old = base_module(args.base)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, r) for r in map(int, args.rows.split(","))] + \
             [(s, 1) for s in map(int, args.seqs.split(",")) if s > 1]
    results = []
    for ctx in map(int, args.contexts.split(",")):
        for seqs, rows in shapes:
            inp = case(seqs, rows, ctx, gen)
            a, b = old.paged_attention(*inp), new.paged_attention(*inp)
            err = (a.float() - b.float()).abs().max().item()
            times = {"base": [], "new": []}
            for _ in range(args.reps):
                for name, mod in (("base", old), ("new", new)):
                    t0 = time.perf_counter()
                    for _ in range(LAYERS):
                        mod.paged_attention(*inp)
                    times[name].append(time.perf_counter() - t0)
            row = {"context": ctx, "seqs": seqs, "rows": rows,
                   "base_ms": 1e3 * statistics.median(times["base"]), "new_ms": 1e3 * statistics.median(times["new"]),
                   "max_abs_diff": err}
            row["speedup"] = row["base_ms"] / row["new_ms"]
            results.append(row)
            print(f"ctx {ctx:5d}  {seqs:3d} seq x {rows:2d} rows: base {row['base_ms']:7.2f} ms  "
                  f"new {row['new_ms']:7.2f} ms  x{row['speedup']:.2f}  (max |diff| {err:.2g})", flush=True)
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", args.base], capture_output=True, text=True).stdout.strip()
    out = {"base": args.base, "base_commit": rev, "shape": {"heads": H, "kv_heads": HKV, "head_dim": D, "layers": LAYERS},
           "threads": torch.get_num_threads(), "reps": args.reps, "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    plot(out, args.out.rsplit(".", 1)[0] + ".png")


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no chart written")
        return
    rs = out["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, (key, label) in zip(axes, (("rows", "query rows of one sequence (tree nodes)"),
                                       ("seqs", "sequences, one row each"))):
        for ctx in sorted({r["context"] for r in rs}):
            pts = sorted((r[key], r) for r in rs if r["context"] == ctx and (r["seqs"] == 1 if key == "rows" else r["rows"] == 1))
            xs = [x for x, _ in pts]
            ax.plot(xs, [r["base_ms"] for _, r in pts], "o--", label=f"base, ctx {ctx}")
            ax.plot(xs, [r["new_ms"] for _, r in pts], "o-", label=f"new, ctx {ctx}")
        ax.set_xlabel(label)
        ax.set_ylabel("ms per 30 layers")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.suptitle(f"native paged attention, base {out['base_commit'][:7]} vs working tree "
                 f"(9 heads / 3 KV heads, d=64, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
