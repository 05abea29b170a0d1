#!/usr/bin/env python
"""The small per-round pieces around the big forwards, timed in isolation (medians of many
calls, warm caches: these are the pieces' own costs, not what they cost inside a round):

  batch    engine.forward_batch.build_forward_batch, the working tree's against a revision's
           (its source loaded from git), on decode-sized batches: a 4-token tree at one
           sequence, a draft level, 8 plain sequences
  auxnorm  a fused head's aux-feature norm (3 x 576 per token): the native rms_norm_chunks
           against the torch expression it replaces on the CPU
  wide     the default model's native decode stack + LM head over 16 one-token sequences,
           with and without the shipped head's aux layers in its output

    .venv/bin/python bench/bench_small_ops.py [--rev 814819f]
Writes --out (bench/results/small_ops.json).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import torch  # noqa: E402

from engine import forward_batch as fb_now  # noqa: E402
from engine.forward_batch import SeqSpan  # noqa: E402


def median_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def module_at(rev: str, path: str, name: str):
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:{path}"])
    tmp = tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False)
    tmp.write(src)
    tmp.close()
    spec = importlib.util.spec_from_file_location(name, tmp.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    os.unlink(tmp.name)
    return mod


def batch_part(rev: str, n: int) -> dict:
    old = module_at(rev, "engine/forward_batch.py", "forward_batch_at_rev")
    rng = random.Random(0)
    table = lambda k: rng.sample(range(4000), k)  # noqa: E731
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    cases = {
        "tree of 4, one sequence, 300 keys": [SeqSpan([1, 2, 3, 4], 300, table(20), positions=[300, 301, 301, 302],
                                                      tree_mask=tree)],
        "draft level of 2, 302 keys": [SeqSpan([7, 8], 302, table(20), positions=[300, 300], num_masked_cached=2,
                                               tree_mask=torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool))],
        "8 plain sequences, ~300 keys": [SeqSpan([5], 300 + 7 * b, table(22)) for b in range(8)],
    }
    out = {}
    cpu = torch.device("cpu")
    for name, spans in cases.items():
        a = median_us(lambda: old.build_forward_batch(spans, 16, cpu), n)
        b = median_us(lambda: fb_now.build_forward_batch(spans, 16, cpu), n)
        out[name] = {f"rev-{rev}_us": round(a, 1), "worktree_us": round(b, 1)}
        print(f"batch  {name}: rev {a:.0f} us, worktree {b:.0f} us", flush=True)
    return out


def auxnorm_part(n: int) -> dict:
    from engine import kernels
    from engine.spec.eagle_head import aux_norm
    mod = kernels.native()
    if mod is None:
        return {"skipped": "no native kernels"}
    out = {}
    for rows in (1, 3):
        x = torch.randn(rows, 3 * 576).to(torch.bfloat16)
        with torch.inference_mode():
            saved, kernels.native = kernels.native, lambda: None  # aux_norm's torch expression
            try:
                a = median_us(lambda: aux_norm(x, 3, 1e-5), n)
            finally:
                kernels.native = saved
            b = median_us(lambda: aux_norm(x, 3, 1e-5), n)
        out[f"{rows} rows"] = {"torch_expression_us": round(a, 1), "native_us": round(b, 1)}
        print(f"auxnorm {rows} rows: torch {a:.0f} us, native {b:.0f} us", flush=True)
    return out


def wide_part(reps: int) -> dict:
    from engine.default_model import default_draft_path
    from engine.forward_batch import build_forward_batch
    from engine.models.llama import native_stack_forward
    from engine.spec.config import SpecConfig
    from scheduler.worker import on_engine_thread
    from server.llm import LLM
    llm = LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2", total_tokens=3, depth=1, top_k=2),
              draft=default_draft_path(), kv_cache_tokens=65536, tree_budget=False)
    r, m = llm.runner, llm.runner.model
    if m._stack is None or not m.aux_layers:
        return {"skipped": "no native stack or no fused head"}

    def go():
        spans = [SeqSpan([100 + b], 300, list(range(5 + 20 * b, 25 + 20 * b))) for b in range(16)]
        times = {"with aux": [], "without": []}
        with torch.inference_mode():
            batch = build_forward_batch(spans, r.config.block_size, torch.device("cpu"))
            emb = m.model.embed_tokens(batch.input_ids)
            for _ in range(reps):
                for mode in times:
                    m._stack.set_aux(list(m.aux_layers) if mode == "with aux" else [])
                    t0 = time.perf_counter()
                    m.compute_logits(native_stack_forward(m._stack, emb, batch, r.kv, m.model.rotary))
                    times[mode].append(time.perf_counter() - t0)
            m._stack.set_aux(list(m.aux_layers))
        return {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
    out = on_engine_thread(go)
    print(f"wide   16 sequences, stack + LM head ms: {out}", flush=True)
    return {"16 sequences, stack + LM head, ms": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="814819f", help="the revision whose build_forward_batch is compared")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--reps", type=int, default=30, help="alternated stack forwards per mode")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "small_ops.json"))
    args = ap.parse_args()
    result = {"args": vars(args), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "git_head": bd.git_head(),
              "source_digest": bd.source_digest(), "batch": batch_part(args.rev, args.calls),
              "auxnorm": auxnorm_part(args.calls), "wide": wide_part(args.reps)}
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
