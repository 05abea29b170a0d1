#!/usr/bin/env python
"""Decode speed of the model families beyond Llama: Qwen3 (dense), Qwen3-MoE and Gemma 3, plain
and with an oracle drafter, on random-weight models of their real shapes.

    python bench/bench_families.py                    # bf16, CUDA where available (~4 minutes)
    python bench/bench_families.py --quick            # 2-layer shapes, small vocabularies, seconds

Models (built in memory from a ModelConfig, no checkpoints, tokenizer or network):

  qwen3-0.6b        Qwen3-0.6B's shape (28 layers, hidden 1024, 16 / 8 heads of 128, tied)
  qwen3-30b-a3b-s   Qwen3-30B-A3B's layer shape (hidden 2048, 32 / 4 heads of 128, experts of
                    width 768, 8 routed a token) scaled down to fit ~6 GB in bf16: 6 of its 48
                    layers and 64 of its 128 experts
  gemma3-1b         Gemma 3 1B's shape (26 layers, hidden 1152, 4 / 1 heads of 256, windows of
                    512 keys on five layers of six, tied, vocabulary 262144)

Each runs plain greedy decoding and oracle-drafted decoding (the drafter proposes the target's
own greedy continuation from the plain run as a chain of `--tree-tokens - 1` tokens, so every
round accepts the whole chain while the outputs follow it), at 1 and 8 sequences. Weights are
"peaked" (bench/gpu_check.py peak_): the next token wins by a wide margin, so bf16 rounding
differences between a verify batch and a plain step do not end the oracle's agreement early.
Prompts are `--prompt-len` tokens long; with the default 640 the Gemma 3 windows (512) apply.

Reported per row: decode tokens/s (all sequences), ms a step (one plain step or one
speculative round), the mean acceptance length, and whether the outputs equal the plain run's.
Writes bench/results/model_families.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.gpu_check import BLOCK, OracleDrafter, Seq, generate, init_random_, peak_, use  # noqa: E402
from eagle_serve.engine.config import EngineConfig  # noqa: E402
from eagle_serve.engine.layers import RotaryEmbedding  # noqa: E402
from eagle_serve.engine.loader import LoadedModel, model_class  # noqa: E402
from eagle_serve.engine.model_config import ModelConfig  # noqa: E402
from eagle_serve.engine.model_runner import ModelRunner  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.engine.speculative.drafters import NoDrafter  # noqa: E402

QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_30B_A3B_SCALED = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                            intermediate_size=6144, num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
MODELS = {"qwen3-0.6b": QWEN3_06B, "qwen3-30b-a3b-s": QWEN3_30B_A3B_SCALED, "gemma3-1b": GEMMA3_1B}
# --quick: two layers, small vocabularies, 8 experts, windows of 16 keys
QUICK = {"num_hidden_layers": 2, "vocab_size": 4096, "num_experts": 8, "num_experts_per_tok": 2,
         "sliding_window": 16, "sliding_window_pattern": 2}


def config(name: str, quick: bool, max_positions: int) -> ModelConfig:
    raw = dict(MODELS[name], max_position_embeddings=max_positions)
    if quick:
        raw.update({k: v for k, v in QUICK.items() if k in raw})
    return ModelConfig.from_hf(raw, name)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The family's decoder with random, peaked weights, allocated in `dtype` on `device`; RoPE
    tables float32, as the loader keeps them."""
    with torch.device("meta"):
        net = model_class(cfg)(cfg)
    net = net.to(dtype).to_empty(device=device)
    init_random_(net, seed, 0.02)
    net.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                       cfg.rope_scaling).to(device)
    if cfg.is_gemma3:
        net.model.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                                 cfg.rope_local_theta, {}).to(device)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    peak_(net, seed)
    return net.eval()


def build(name: str, cfg: ModelConfig, args) -> ModelRunner:
    device = torch.device(args.device)
    net = random_model(cfg, getattr(torch, args.dtype), device)
    loaded = LoadedModel(net, cfg, None, frozenset(), name, "")
    per_seq = args.prompt_len + args.max_new + 80
    engine = EngineConfig(dtype=args.dtype, device=args.device, block_size=BLOCK, max_num_seqs=max(args.batches),
                          kv_cache_tokens=max(args.batches) * -(-per_seq // BLOCK) * BLOCK + 64 * BLOCK,
                          spec=SpecConfig("ngram", total_tokens=args.tree_tokens, depth=args.tree_tokens - 1))
    return ModelRunner(engine, loaded=loaded)


def bench_model(name: str, args, seq: Seq) -> dict:
    cfg = config(name, args.quick, args.prompt_len + args.max_new + 256)
    t0 = time.perf_counter()
    runner = build(name, cfg, args)
    params = sum(p.numel() for p in {id(p): p for p in runner.model.parameters()}.values())
    out = {"shape": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("rope_scaling",)},
           "parameters": params, "build_s": round(time.perf_counter() - t0, 2), "backend": runner.backend.name,
           "rows": []}
    rng = random.Random(1)
    for batch in args.batches:
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
        use(runner, NoDrafter(), SpecConfig("none"))
        generate(runner, prompts, 4, seq(batch))  # warm-up
        plain = generate(runner, prompts, args.max_new, seq(batch))
        base = seq(batch)
        refs = {base + i: plain["outputs"][i] for i in range(batch)}
        use(runner, OracleDrafter(refs, None, args.tree_tokens, cfg.vocab_size),
            SpecConfig("ngram", total_tokens=args.tree_tokens, depth=args.tree_tokens - 1))
        oracle = generate(runner, prompts, args.max_new, base)
        for mode, res in (("plain", plain), (f"oracle-chain{args.tree_tokens - 1}", oracle)):
            row = {"batch": batch, "mode": mode, "tok_s": round(res["tok_s"], 2),
                   "ms_per_step": round(1e3 * res["decode_s"] / max(res["rounds"], 1), 2),
                   "accept_len": None if res["accept_len"] is None else round(res["accept_len"], 3),
                   "same_as_plain": res["outputs"] == plain["outputs"]}
            out["rows"].append(row)
            print(f"  {name:16s} batch {batch:2d} {mode:15s} {row['tok_s']:9.1f} tok/s {row['ms_per_step']:9.2f} ms/step "
                  f"accept_len={row['accept_len']} same_as_plain={row['same_as_plain']}", flush=True)
    use(runner, NoDrafter(), SpecConfig("none"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2-layer shapes, small vocabularies, short runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=None, help="default 640 (24 with --quick)")
    ap.add_argument("--max-new", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--tree-tokens", type=int, default=5, help="oracle chain: root + this many - 1 tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "model_families.json"))
    args = ap.parse_args()
    args.prompt_len = args.prompt_len or (24 if args.quick else 640)
    args.max_new = args.max_new or (16 if args.quick else 128)
    from bench.bench_decode import cpu_model
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_model()
              or platform.machine(), "device_type": args.device.split(":")[0], "dtype": args.dtype,
              "threads": torch.get_num_threads(), "command": " ".join(["python"] + sys.argv),
              "torch": torch.__version__, "quick": args.quick, "prompt_len": args.prompt_len, "max_new": args.max_new,
              "tree_tokens": args.tree_tokens, "models": {}}
    seq = Seq()
    t0 = time.perf_counter()
    for name in args.models:
        print(f"{name}:", flush=True)
        result["models"][name] = bench_model(name, args, seq)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'model':16s} {'batch':>5s} {'mode':15s} {'tok/s':>9s} {'ms/step':>9s} {'accept':>7s} same")
    for name, m in result["models"].items():
        for r in m["rows"]:
            print(f"{name:16s} {r['batch']:5d} {r['mode']:15s} {r['tok_s']:9.1f} {r['ms_per_step']:9.2f} "
                  f"{r['accept_len'] if r['accept_len'] is not None else '-':>7} {r['same_as_plain']}")
    print(f"({result['total_s']} s; wrote {os.path.relpath(args.out, ROOT)})")


if __name__ == "__main__":
    main()
