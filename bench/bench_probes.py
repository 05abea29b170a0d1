#!/usr/bin/env python
"""Small probes of where time goes on this CPU, each timed in isolation (medians of repeated
calls; warm caches unless a probe says otherwise):

  dot        packed bf16 products on ONE thread over a 576 x 576 weight (0.66 MB, in L2) at 1-16
             rows: GFLOP/s of the kernel's arithmetic, with the AMX tiles off and (where the CPU
             has them) on
  attention  the native paged attention alone, the default model's heads (9 query, 3 KV, 64
             dims), T rows of a causal tree over L keys: ns per key, row and KV head, and x 30
             layers
  head       the shipped head's seven products at one row (fc_aux, fc, the layer's four, its
             8192-token LM head: 20 MB), back to back with the weights cached, and right after
             streaming 400 MB (what the draft's first level finds after the target's forward)
  argmax     greedy picks over [rows, 49152] float32 logits: argmax against max(-1).indices
  stack      the default model's forward (native stack + nothing else) by tokens and context, on
             the engine thread as the engine runs it
  greedy     plain greedy decoding of 32 MT-bench prompts at once, sampler.choose by argmax
             against max(-1).indices, alternating, same engine: tokens/s and equal outputs
  roofline   a plain step's native stack (one token after an MT-bench prompt) against its 120
             layer products called alone and a 230 MB product, alternating: ms and GB/s (how
             near the step is to the memory stream)
  tree       a real round's whole 4x2x2 draft tree (the shipped head, DecodeStack.draft_tree,
             captured mid-generation) replayed hot, right after a 230 MB product streamed
             non-temporally, and right after the same stream temporal

    .venv/bin/python bench/bench_probes.py [--probes dot,attention,head,argmax,stack,greedy,roofline,tree]
Writes --out (bench/results/probes.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import torch  # noqa: E402

from engine import kernels  # noqa: E402


def timed(fn, reps: int, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def probe_dot(mod) -> dict:
    threads, default = torch.get_num_threads(), mod.amx()
    torch.set_num_threads(1)
    try:
        w = mod.pack_bf16((torch.randn(576, 576) * 0.02).to(torch.bfloat16))
        out = {}
        for amx in ([False, True] if default else [False]):
            mod.set_amx(amx)
            for m in (1, 2, 4, 8, 16):
                x = torch.randn(m, 576).to(torch.bfloat16)
                s = timed(lambda: mod.skinny_linear(x, w, None, False), 2000, 50)
                out[f"{'amx' if amx else 'avx512'}_rows{m}_gflops"] = round(2 * m * 576 * 576 / s / 1e9, 1)
        return out
    finally:
        mod.set_amx(default)
        torch.set_num_threads(threads)


def probe_attention(mod) -> dict:
    H, Hkv, D, S = 9, 3, 64, 4096
    kc, vc = (torch.randn(S, Hkv, D).to(torch.bfloat16) for _ in range(2))
    out = {}
    for L in (256, 1024):
        for T in (1, 2, 4, 8):
            q = torch.randn(T, H, D).to(torch.bfloat16)
            mask = torch.ones(1, T, L, dtype=torch.bool)
            for t in range(T):
                mask[0, t, L - T + t + 1:] = False
            args = (q, kc, vc, torch.arange(L).view(1, L), torch.tensor([L]), torch.zeros(T, dtype=torch.long),
                    torch.arange(T), mask, D ** -0.5)
            s = timed(lambda: mod.paged_attention(*args), 200, 10)
            out[f"L{L}_T{T}"] = {"ns_per_key_row_kvhead": round(s * 1e9 / (T * Hkv * L), 2),
                                 "ms_x30_layers": round(s * 30e3, 2)}
    return out


def probe_head(mod) -> dict:
    """The draft head's seven products (the default model's shapes) at one row with bf16 packed
    weights, hot and right after a 400 MB stream; and, where the kernels have pack_int8, the
    same with int8 weights (EngineConfig.draft_quantization: int8, and w8a8 where the kernels
    take int8 inputs) and bf16 alike at 1 / 2 / 4 / 6 / 16 rows."""
    shapes = [(576, 1728), (576, 1152), (960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]
    raw = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for n, k in shapes]
    big = torch.ones(400 * 1024 * 1024 // 2, dtype=torch.bfloat16)

    def measure(ws, rows):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}

        def one():
            for (_, k), w in zip(shapes, ws):
                mod.skinny_linear(xs[k], w, None, False)
        hot = timed(one, 200, 20)
        cold = []
        for _ in range(21):
            big.sum()
            t0 = time.perf_counter()
            one()
            cold.append(time.perf_counter() - t0)
        return round(hot * 1e3, 3), round(statistics.median(cold) * 1e3, 3)
    bf16 = [mod.pack_bf16(w) for w in raw]
    hot, cold = measure(bf16, 1)
    out = {"weights_mb": round(sum(n * k * 2 for n, k in shapes) / 1e6, 1), "hot_ms": hot, "after_400mb_ms": cold}
    if hasattr(mod, "pack_int8"):
        kinds = [("bf16", bf16), ("int8", [mod.pack_int8(w) for w in raw])]
        if getattr(mod, "int8_inputs_available", lambda: False)():
            kinds.append(("w8a8", [mod.pack_int8(w, True) for w in raw]))
        for rows in (1, 2, 4, 6, 16):
            for name, ws in kinds:
                h, c = measure(ws, rows)
                out[f"rows{rows}_{name}"] = {"hot_ms": h, "after_400mb_ms": c}
    return out


def probe_argmax() -> dict:
    """Greedy picks over 49152-token float32 rows: torch's argmax and max(-1).indices, and the
    native kernels' argmax_rows (engine.sampler.greedy_picks) where the module has it."""
    from engine import kernels
    native = getattr(kernels.native(), "argmax_rows", None)
    out = {}
    for m in (1, 4, 32):
        x = torch.randn(m, 49152)
        out[f"rows{m}_us"] = {"argmax": round(timed(lambda: x.argmax(-1), 200) * 1e6, 1),
                              "max_indices": round(timed(lambda: x.max(-1).indices, 200) * 1e6, 1)}
        if native is not None:
            out[f"rows{m}_us"]["argmax_rows"] = round(timed(lambda: native(x), 200) * 1e6, 1)
    return out


def probe_stack() -> dict:
    from engine.forward_batch import SeqSpan, build_forward_batch
    from server.llm import LLM
    llm = LLM(None, dtype="bfloat16", kv_cache_tokens=8192)
    r = llm.runner
    bs = r.config.block_size

    def run(T: int, ctx: int) -> float:
        span = SeqSpan([100 + i for i in range(T)], ctx, list(range((ctx + T) // bs + 2)),
                       positions=[ctx + i for i in range(T)], tree_mask=torch.tril(torch.ones(T, T, dtype=torch.bool)))
        batch = build_forward_batch([span], bs, r.device)
        with torch.inference_mode():
            return timed(lambda: r.model(batch, r.kv, r.backend), 30, 3)
    return {f"ctx{ctx}_T{T}_ms": round(run(T, ctx) * 1e3, 2) for ctx in (256, 1024) for T in (1, 4, 8)}


def probe_greedy() -> dict:
    import engine.sampler as sm
    from engine.sampling_params import SamplingParams
    from server.llm import LLM
    new = sm.choose

    def old(logits, rows, skip=frozenset()):  # choose() as it was, by argmax
        chosen = logits.argmax(-1)
        for i, row in enumerate(rows):
            if not (row.params.greedy or i in skip):
                chosen[i] = sm.draw(logits[i], row.params, sm.gumbel_noise(row.seed, row.output_position, logits.shape[1]))
        return chosen
    llm = LLM(None, dtype="bfloat16", kv_cache_tokens=65536)
    prompts, params = bd.mtbench_ids(32), SamplingParams(max_tokens=128, temperature=0)
    llm.generate(prompts, params)
    rates, outs = {"argmax": [], "max_indices": []}, {}
    try:
        for rep in range(4):
            for name in (("argmax", "max_indices") if rep % 2 == 0 else ("max_indices", "argmax")):
                sm.choose = old if name == "argmax" else new
                t0 = time.perf_counter()
                o = llm.generate(prompts, params)
                rates[name].append(sum(len(x.token_ids) for x in o) / (time.perf_counter() - t0))
                outs[name] = [x.token_ids for x in o]
    finally:
        sm.choose = new
    return {"tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
            "ratio": round(sum(rates["max_indices"]) / sum(rates["argmax"]), 3),
            "same_outputs": outs["argmax"] == outs["max_indices"]}


def _big_stream(mod):
    """A packed bf16 [200000, 576] weight (230 MB, past any cache) and a one-row input."""
    return mod.pack_bf16((torch.randn(200000, 576) * 0.02).to(torch.bfloat16)), torch.randn(1, 576).to(torch.bfloat16)


def _median_ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


def _calls_during(obj, name: str, run) -> list[tuple]:
    """The (args, kwargs) of every call of obj.<name> while run() runs (the method restored after)."""
    calls, fn = [], getattr(obj, name)
    setattr(obj, name, lambda *a, **kw: (calls.append((a, kw)), fn(*a, **kw))[1])
    try:
        run()
    finally:
        setattr(obj, name, fn)
    return calls


def probe_roofline(mod) -> dict:
    from engine.layers import Linear
    from engine.sampling_params import SamplingParams
    from server.llm import LLM
    llm = LLM(None, dtype="bfloat16", kv_cache_tokens=4096)
    model = llm.runner.model
    forward = model._native_forward
    calls = _calls_during(model, "_native_forward",
                          lambda: llm.generate([bd.mtbench_ids(1)[0]], SamplingParams(max_tokens=4, temperature=0)))
    batch, kv = [a for a, _ in calls if a[0].input_ids.shape[0] == 1][-1]  # the last one-token step
    linears = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
    weights = [m.native_weight for m in linears]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    big, x = _big_stream(mod)
    inputs = [torch.randn(1, m.weight.shape[1]).to(torch.bfloat16) for m in linears]
    t = {"stack": [], "products": [], "stream_gbs": []}
    with torch.inference_mode():
        for _ in range(60):
            mod.skinny_linear(x, big, None, True)  # every part below starts after the same stream
            t0 = time.perf_counter()
            forward(batch, kv)
            t["stack"].append(time.perf_counter() - t0)
            mod.skinny_linear(x, big, None, True)
            t0 = time.perf_counter()
            for w, xi in zip(weights, inputs):
                mod.skinny_linear(xi, w, None, False)
            t["products"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mod.skinny_linear(x, big, None, True)
            t["stream_gbs"].append(big.numel() * big.element_size() / (time.perf_counter() - t0) / 1e9)
    gbs = statistics.median(t["stream_gbs"])
    return {"context": int(batch.positions[0]), "layer_bytes_mb": round(nbytes / 1e6, 1),
            "stack_ms": _median_ms(t["stack"]), "products_ms": _median_ms(t["products"]),
            "stream_gb_s": round(gbs, 1), "layer_bytes_at_stream_ms": round(1e3 * nbytes / gbs / 1e9, 3)}


def probe_tree(mod) -> dict:
    from engine.default_model import default_draft_path
    from engine.sampling_params import SamplingParams
    from engine.spec.config import SpecConfig
    from server.llm import LLM
    llm = LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2", total_tokens=4, depth=2, top_k=2),
              draft=default_draft_path(), kv_cache_tokens=4096, tree_budget=False)
    head = llm.runner.drafter.head
    tree = head.tree
    calls = _calls_during(head, "tree",
                          lambda: llm.generate([bd.mtbench_ids(1)[0]], SamplingParams(max_tokens=64, temperature=0)))
    a, kw = calls[len(calls) // 2]  # mid-generation: a full-depth round
    big, x = _big_stream(mod)
    nta = mod.nta_streams()
    out = {"pending_pairs": [len(p) for p in a[0]], "depths": list(a[3])}
    try:
        with torch.inference_mode():
            for name, stream in (("hot_ms", None), ("after_nta_stream_ms", True), ("after_temporal_stream_ms", False)):
                ts = []
                for _ in range(200):
                    if stream is not None:
                        mod.set_nta_streams(stream)
                        mod.skinny_linear(x, big, None, True)
                    t0 = time.perf_counter()
                    tree(*a, **kw)
                    ts.append(time.perf_counter() - t0)
                out[name] = _median_ms(ts)
    finally:
        mod.set_nta_streams(nta)
    return out


def main() -> None:
    """Every probe runs on the engine's thread: torch ops on a second thread leave that thread's
    OpenMP team behind (bench_kernels_ab), and the engines built here decode on it."""
    from scheduler.worker import on_engine_thread
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", default="dot,attention,head,argmax,stack,greedy",
                    help="comma-separated; also roofline, tree")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "probes.json"))
    args = ap.parse_args()
    mod = kernels.native()
    if mod is None:
        sys.exit("the native kernels are unavailable on this machine")
    probes = {"dot": lambda: probe_dot(mod), "attention": lambda: probe_attention(mod),
              "head": lambda: probe_head(mod), "argmax": probe_argmax, "stack": probe_stack, "greedy": probe_greedy,
              "roofline": lambda: probe_roofline(mod), "tree": lambda: probe_tree(mod)}
    result = {"command": " ".join(["python"] + sys.argv), "git_head": bd.git_head(), "source_digest": bd.source_digest(),
              "cpu": bd.cpu_model(), "amx": mod.amx(), "nta_streams": mod.nta_streams(), "threads": torch.get_num_threads()}
    for name in args.probes.split(","):
        if name not in probes:
            sys.exit(f"--probes: {name!r} is not one of {', '.join(probes)}")
        result[name] = on_engine_thread(probes[name])
        print(name, result[name], flush=True)
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
