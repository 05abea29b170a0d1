#!/usr/bin/env python
"""One-command check of the CUDA path (docs/gpu.md): correctness, attention backends, KV sizing,
throughput with and without speculation, and the verify-cost curve.

    python bench/gpu_check.py --out $OUT             # a GPU machine; steps limited to ~6 minutes in all
    python bench/gpu_check.py --device cpu --quick   # the same code on tiny shapes, in seconds

Needs torch and this repository only: models are random-weight, built in memory from a
`ModelConfig` (no tokenizer, gguf, safetensors, transformers, fastapi or network). Writes
<out>/gpu_check.json (and <out>/gpu_check.png when matplotlib is installed), rewritten after
every step so a crash or a timeout still leaves the steps done so far. Sections:

  env           torch / CUDA / device / optional packages
  correctness   (a) tiny float32 model: greedy speculative decoding == plain greedy, with an
                oracle drafter (the target's own greedy continuation, acceptance set per run,
                chains and branchy trees) and a random-weight EAGLE-2 / EAGLE-1 head (the real
                tree path) and EAGLE-3 head (the target capturing its low / middle / high
                streams, in the CUDA graphs too); CUDA graphs on and off; graph vs eager
  backends      (b) every attention backend that constructs here (torch, flash, the graphs'
                padded SDPA) vs a float64 reference on random inputs, per dtype, with tolerances
  kv_sizing     the automatic KV cache size from --gpu-memory-utilization (CUDA)
  throughput    (c) decode tokens/s of random-weight models shaped like SmolLM2-135M and
                Llama-3-8B (bf16): plain, and the oracle at acceptance lengths 1..4 over a
                fixed tree, batch 1 and a larger batch, CUDA graphs on and off
  verify_curve  (d) seconds of one verify forward (+ LM head) by tree tokens per sequence
                (1..256), batch 1 and 8, graphs on and off: where verification stops being free
  families      Qwen3, Qwen3-MoE (scaled to fit) and Gemma 3 1B at their real shapes, bf16
                (bench/bench_families.py): plain and oracle-drafted decoding, outputs equal to plain
  fp8           an FP8 model (every decoder linear's weights e4m3 with a scale per output channel, as an
                FP8-dynamic checkpoint loads on a GPU with FP8 matmul; Llama-3-8B shaped, tiny with
                --quick): greedy oracle-drafted decoding == plain greedy, and decode tok/s against the
                same model in --dtype at batch 1 and 16 (engine/fp8.py; skipped below capability 8.9)
  draft_cost    the tree budget's start-up profile (engine.profile.profile_costs) with a random
                EAGLE-2 head at the default tree (SpecConfig("eagle2"): 24 tokens, depth 5, top-k
                4): a drafting round at full depth and at depth 1 by drafting sequences, against
                verify by tokens

Every step runs under its own time limit (a share of --time-budget) and inside try/except: a
failure is recorded in its section ("status": "failed", "error") and the script goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import random
import signal
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from eagle_serve.engine.attention import TorchAttention  # noqa: E402
from eagle_serve.engine.config import EngineConfig  # noqa: E402
from eagle_serve.engine.cuda_graphs import PaddedAttention, bucket_for, expand_batch, pad_spans  # noqa: E402
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch  # noqa: E402
from eagle_serve.engine.kv_cache import KVCache  # noqa: E402
from eagle_serve.engine.layers import RotaryEmbedding  # noqa: E402
from eagle_serve.engine.loader import LoadedModel  # noqa: E402
from eagle_serve.engine.model_config import ModelConfig  # noqa: E402
from eagle_serve.engine.model_runner import ModelRunner  # noqa: E402
from eagle_serve.engine.models.llama import LlamaForCausalLM  # noqa: E402
from eagle_serve.engine.profile import VERIFY_GRID, _time  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.engine.speculative.drafters import Drafter, NoDrafter  # noqa: E402
from eagle_serve.engine.speculative.tree import DraftTree, from_paths, root_only  # noqa: E402
from eagle_serve.engine.step_io import SeqStep  # noqa: E402

SHAPES = {  # (vocab, hidden, intermediate, layers, heads, kv heads, rope theta, tied)
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 100000.0, True),
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 500000.0, False),
    "tiny": (512, 128, 256, 3, 4, 2, 10000.0, False),
}
BLOCK = 16
ATTENTION = [None]  # --attention, for every engine built here
# shares of --time-budget per step (per model for throughput / verify_curve)
SHARES = {"correctness": 0.13, "backends": 0.07, "kv_sizing": 0.07,
          "throughput": {"smollm2-135m": 0.14, "llama3-8b": 0.27, "tiny": 0.2},
          "verify_curve": {"smollm2-135m": 0.09, "llama3-8b": 0.19, "tiny": 0.1},
          "draft_cost": {"smollm2-135m": 0.06, "llama3-8b": 0.1, "tiny": 0.1}, "families": 0.15, "fp8": 0.2}


# ---------------------------------------------------------------- models

def model_config(name: str, max_positions: int = 2048) -> ModelConfig:
    vocab, hidden, inter, layers, heads, kv, theta, tied = SHAPES[name]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, rms_norm_eps=1e-5,
                       rope_theta=theta, max_position_embeddings=max_positions, tie_word_embeddings=tied)


def init_random_(module: torch.nn.Module, seed: int, std: float) -> None:
    """Normal(0, std) weights, norm weights around 1, in place (on the module's device)."""
    for i, (name, p) in enumerate(module.named_parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 1000 + i)
        if "norm" in name:
            p.data.normal_(1.0, 0.1, generator=gen)
        else:
            p.data.normal_(0.0, std, generator=gen)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 std: float = 0.02) -> LlamaForCausalLM:
    """The Llama decoder with random weights, allocated directly in `dtype` on `device`."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    net = net.to(dtype).to_empty(device=device)
    init_random_(net, seed, std)
    net.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                       cfg.rope_scaling).to(device)  # float32 tables, as the loader keeps them
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    return net.eval()


def peak_(net: LlamaForCausalLM, seed: int = 0) -> None:
    """Make a random model's next token a clear winner (in place), for the oracle throughput runs.

    With plain random weights a 128k-vocabulary model's top two logits are often within bf16
    rounding of each other, so a verify batch (other kernels, other rounding) and the plain run
    that made the oracle's reference part ways within a few tokens and the set acceptance
    collapses (first H200 run: Llama-3-8B shape, batch 16, acceptance 1.03-1.09 where 2-4 was
    set). Here the embedding dominates the residual stream (embedding std 1, o_proj and
    down_proj scaled by 1/20) and the LM head is a row permutation of the embedding (untied) or
    the embedding itself (tied): the next token is a fixed function of the current one, by a
    margin of tens of logits. Shapes, dtypes and kernels are unchanged, so the timing is too."""
    with torch.no_grad():
        emb = net.model.embed_tokens.weight
        gen = torch.Generator(device=emb.device).manual_seed(seed)
        emb.normal_(0.0, 1.0, generator=gen)
        for name, p in net.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.05)
        if net.lm_head.weight is not emb:
            perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
            net.lm_head.weight.copy_(emb.index_select(0, perm))


def random_eagle_head(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 1, std: float = 0.05):
    from eagle_serve.engine.speculative.eagle_head import EagleHead
    with torch.device("meta"):
        head = EagleHead(dataclasses.replace(cfg, num_layers=1), bias=True)
    head = head.to(dtype).to_empty(device=device)
    init_random_(head, seed, std)
    return head.eval()


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default low / middle / high layers; every layer below the last where the target
    has fewer than four."""
    from eagle_serve.engine.train.eagle3 import default_aux_layers
    return default_aux_layers(num_layers) if num_layers >= 4 else tuple(range(num_layers - 1))


def random_eagle3_head(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 2, std: float = 0.05,
                       draft_vocab: int | None = None):
    """A random EAGLE-3 head on EAGLE-3's default low / middle / high layers of `cfg`'s target,
    over a draft vocabulary of `draft_vocab` target ids (every other id; None: the whole
    vocabulary)."""
    from eagle_serve.engine.speculative.eagle3_head import Eagle3Head
    aux = eagle3_layers(cfg.num_layers)
    vocab = draft_vocab or cfg.vocab_size
    with torch.device("meta"):
        head = Eagle3Head(dataclasses.replace(cfg, num_layers=1), cfg.hidden_size, aux, vocab,
                          norm_before_residual=False, fc_bias=False, own_embed=False)
    head = head.to(dtype).to_empty(device=device)
    init_random_(head, seed, std)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    if draft_vocab is not None:
        head.d2t = torch.arange(0, 2 * draft_vocab, 2, device=device)[:draft_vocab]
    return head.eval()


def build_runner(name: str, cfg: ModelConfig, dtype: str, device: str, kv_tokens: int | None, max_seqs: int,
                 token_sizes=None, std: float = 0.02, seed: int = 0, peaked: bool = False,
                 aux_layers: tuple[int, ...] = (), prepare=None, **engine) -> ModelRunner:
    """aux_layers: the target returns these layers' streams too (an EAGLE-3 head's), set before
    the CUDA graphs are captured so the captured outputs carry them. prepare: called with the
    model last, before the runner is built (fp8: quantize_fp8_)."""
    net = random_model(cfg, getattr(torch, dtype), torch.device(device), seed, std)
    net.set_aux_layers(aux_layers)
    if peaked:
        peak_(net, seed)
    if prepare is not None:
        prepare(net)
    if ATTENTION[0] is not None:
        engine = {**engine, "attention": ATTENTION[0]}
    loaded = LoadedModel(net, cfg, None, frozenset(), name, "")
    config = EngineConfig(dtype=dtype, device=device, kv_cache_tokens=kv_tokens, block_size=BLOCK,
                          max_num_seqs=max_seqs, spec=SpecConfig("ngram", total_tokens=64, depth=63),
                          cuda_graph_token_sizes=token_sizes, **engine)
    return ModelRunner(config, loaded=loaded)


# ---------------------------------------------------------------- the oracle drafter and a small driver

def oracle_tree(root: int, reference: list[int], accept: int | None, total: int, depth: int, vocab: int,
                rng: random.Random | None = None) -> DraftTree:
    """Root + up to total - 1 nodes. The main path has min(depth, total - 1) tokens: the first
    accept - 1 are `reference` (the target's greedy continuation; accept None: all of them), the
    rest wrong. With `rng`, wrong siblings along the path fill the tree to `total` nodes and
    every node's children come in random order (branchy trees, not only chains)."""
    n_main = min(depth, total - 1)
    if n_main <= 0:
        return root_only(root)
    good = n_main if accept is None else max(0, min(accept - 1, n_main))
    ref = list(reference[:n_main]) + [0] * max(0, n_main - len(reference))
    main = ref[:good] + [(ref[d] + 1) % vocab for d in range(good, n_main)]
    paths = [main]
    if rng is not None:
        for j in range(total - 1 - n_main):
            d = j % n_main  # a sibling of main[d]: never the reference token, never a duplicate
            paths.append(main[:d] + [(ref[d] + 2 + j // n_main) % vocab])
        rng.shuffle(paths)
    return from_paths(root, paths)


class OracleDrafter(Drafter):
    """Proposes each sequence's reference continuation (the target's own greedy output, from a
    plain run) as `oracle_tree`s: acceptance length `accept` per round while the outputs follow
    the reference (after a divergence, e.g. a bf16 near-tie, rounds accept what they can)."""

    def __init__(self, references: dict[int, list[int]], accept: int | None, tree_tokens: int, vocab: int,
                 branchy: bool = False, seed: int = 0):
        self.refs, self.accept, self.tree_tokens, self.vocab = references, accept, tree_tokens, vocab
        self.rng = random.Random(seed) if branchy else None

    def propose(self, steps, max_depths):
        trees = []
        for s, d in zip(steps, max_depths):
            ref = self.refs.get(s.seq_id, [])[len(s.output_token_ids):]
            trees.append(oracle_tree(s.token_ids[-1], ref, self.accept, self.tree_tokens, d, self.vocab, self.rng))
        return trees


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def generate(runner: ModelRunner, prompts: list[list[int]], max_new: int, seq_base: int, slack: int = 80) -> dict:
    """Greedy decoding of every prompt in one batch through `runner.execute` (prefill, then one
    speculative round per step with the runner's drafter). Sequences get contiguous blocks."""
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    per_seq = [-(-(len(p) + max_new + slack) // BLOCK) for p in prompts]
    if sum(per_seq) > runner.num_blocks:
        raise ValueError(f"the KV cache has {runner.num_blocks} blocks, this run needs {sum(per_seq)}")
    tables, start = [], 0
    for n in per_seq:
        tables.append(list(range(start, start + n)))
        start += n
    ids = [seq_base + i for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    first = runner.execute([SeqStep(seq_id=ids[i], token_ids=list(p), num_cached=0, block_table=tables[i],
                                    params=params, seed=0, output_token_ids=[], max_new_tokens=max_new,
                                    prompt_token_ids=list(p), restart=True) for i, p in enumerate(prompts)])
    for i, r in enumerate(first):
        outs[i] += r.token_ids[:max_new]
        cached[i] = len(prompts[i])
    sync(runner.device)
    t0 = time.perf_counter()
    rounds = spec_rounds = accepted = drafted = 0
    while True:
        live = [i for i in range(len(prompts)) if len(outs[i]) < max_new]
        if not live:
            break
        steps = [SeqStep(seq_id=ids[i], token_ids=[outs[i][-1]], num_cached=cached[i], block_table=tables[i],
                         params=params, seed=0, output_token_ids=list(outs[i]), max_new_tokens=max_new - len(outs[i]),
                         prompt_token_ids=list(prompts[i]), restart=False) for i in live]
        for i, r in zip(live, runner.execute(steps)):
            cached[i] += 1 + r.num_accepted
            outs[i] += r.token_ids[:max_new - len(outs[i])]
            if r.num_draft_tokens:
                spec_rounds += 1
                accepted += r.num_accepted
                drafted += r.num_draft_tokens
        rounds += 1
    sync(runner.device)
    seconds = time.perf_counter() - t0
    for i in ids:
        runner.release(i)
    tokens = sum(len(o) - 1 for o in outs)
    return {"outputs": outs, "decode_tokens": tokens, "decode_s": seconds, "rounds": rounds,
            "tok_s": tokens / seconds if seconds > 0 else None,
            "accept_len": (accepted + spec_rounds) / spec_rounds if spec_rounds else None,
            "draft_tokens": drafted, "accepted_tokens": accepted}


class Seq:
    """Unique sequence ids across runs (drafter state is keyed by them)."""

    def __init__(self):
        self.next = 0

    def __call__(self, n: int) -> int:
        base, self.next = self.next, self.next + n
        return base


def use(runner: ModelRunner, drafter: Drafter, spec: SpecConfig) -> None:
    runner.drafter, runner.spec = drafter, spec


def first_divergence(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return {"sequence": i, "index": j}
    return None


# ---------------------------------------------------------------- step (a): correctness

def step_correctness(args, deadline) -> dict:
    dev = args.device
    cfg = model_config("tiny", 1024)
    # std 0.15: well separated logits, so float32 rounding differences between batch shapes do not flip argmaxes
    runner = build_runner("tiny", cfg, "float32", dev, kv_tokens=8192, max_seqs=8, std=0.15, seed=3)
    rng = random.Random(0)
    lens = (3, 7) if args.quick else (5, 17, 33, 64)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]
    max_new = 10 if args.quick else 40
    seq = Seq()
    graphs_modes = [True, False] if runner.graphs.enabled else [False]
    out = {"model": "tiny float32", "graphs_available": runner.graphs.enabled, "backend": runner.backend.name,
           "runs": []}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        runner.graphs.enabled = graphs_modes[0]
        use(runner, NoDrafter(), SpecConfig("none"))
        ref = generate(runner, prompts, max_new, seq(len(prompts)))["outputs"]
        refs_by_base = lambda base: {base + i: ref[i] for i in range(len(prompts))}  # noqa: E731
        tree = 8 if args.quick else 16
        configs = [("plain", None, None)]
        for accept in ((1, 3, None) if args.quick else (1, 2, 4, None)):
            configs.append((f"oracle-chain-accept{accept or 'all'}", "chain", accept))
            configs.append((f"oracle-tree-accept{accept or 'all'}", "tree", accept))
        configs += [("eagle2", "eagle2", None), ("eagle1", "eagle1", None)]
        head = random_eagle_head(cfg, torch.float32, torch.device(dev))
        for graphs in graphs_modes:
            runner.graphs.enabled = graphs
            for name, kind, accept in configs:
                if deadline.expired():
                    out["stopped_early"] = f"time limit before {name} (graphs {graphs})"
                    break
                base = seq(len(prompts))
                if kind is None:
                    use(runner, NoDrafter(), SpecConfig("none"))
                elif kind in ("chain", "tree"):
                    use(runner, OracleDrafter(refs_by_base(base), accept, tree, cfg.vocab_size, kind == "tree", seed=base),
                        SpecConfig("ngram", total_tokens=tree, depth=tree - 1 if kind == "chain" else 6))
                else:
                    from eagle_serve.engine.speculative.eagle_drafter import EagleDrafter
                    spec = SpecConfig(kind, total_tokens=tree, depth=5, top_k=4)
                    use(runner, EagleDrafter(head, runner.model, spec, runner.num_blocks, BLOCK, torch.float32,
                                             runner.device), spec)
                r = generate(runner, prompts, max_new, base)
                expected = None
                if kind in ("chain", "tree") and accept is not None:
                    expected = accept
                div = first_divergence(r["outputs"], ref)
                out["runs"].append({"name": name, "graphs": graphs, "equal_to_plain": div is None,
                                    "first_divergence": div, "accept_len": r["accept_len"],
                                    "expected_accept_len": expected, "rounds": r["rounds"]})
                print(f"  correctness {name:26s} graphs={graphs!s:5s} equal={div is None} "
                      f"accept_len={r['accept_len']}", flush=True)
        out["graph_vs_eager"] = graph_vs_eager(runner, cfg, rng)
        if not deadline.expired():
            out["runs"] += eagle3_runs(args, cfg, prompts, ref, max_new, tree)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    equal = all(r["equal_to_plain"] for r in out["runs"])
    # the oracle's acceptance holds exactly except in the last rounds (trees shrink near max_new)
    acc_ok = all(r["expected_accept_len"] is None or r["accept_len"] is None
                 or abs(r["accept_len"] - r["expected_accept_len"]) < 0.5 for r in out["runs"])
    out["all_equal_to_plain"] = equal
    out["oracle_acceptance_as_set"] = acc_ok
    gve = out["graph_vs_eager"]
    out["status"] = "ok" if equal and acc_ok and gve["ok"] else "failed"
    if out["status"] == "failed":
        out["error"] = "speculative != plain greedy, acceptance off, or graphs != eager (see runs)"
    out["graph_stats"] = dataclasses.asdict(runner.graphs.stats)
    out["graph_capture_failures"] = {str(k): v for k, v in runner.graphs.failed.items()}
    return out


def eagle3_runs(args, cfg: ModelConfig, prompts: list[list[int]], ref: list[list[int]], max_new: int,
                tree: int) -> list[dict]:
    """A random EAGLE-3 head (reduced draft vocabulary) drafting for the correctness step's
    target (same weights, the low / middle / high streams captured in every forward, CUDA
    graphs included): greedy equal to plain, graphs on and off."""
    from eagle_serve.engine.speculative.eagle_drafter import EagleDrafter
    dev = args.device
    runner = build_runner("tiny", cfg, "float32", dev, kv_tokens=8192, max_seqs=8, std=0.15, seed=3,
                          aux_layers=eagle3_layers(cfg.num_layers))
    head = random_eagle3_head(cfg, torch.float32, torch.device(dev), draft_vocab=cfg.vocab_size // 4)
    spec = SpecConfig("eagle3", total_tokens=tree, depth=5, top_k=4)
    use(runner, EagleDrafter(head, runner.model, spec, runner.num_blocks, BLOCK, torch.float32, runner.device), spec)
    seq, runs = Seq(), []
    seq.next = 10_000
    for graphs in ([True, False] if runner.graphs.enabled else [False]):
        runner.graphs.enabled = graphs
        r = generate(runner, prompts, max_new, seq(len(prompts)))
        div = first_divergence(r["outputs"], ref)
        runs.append({"name": "eagle3", "graphs": graphs, "equal_to_plain": div is None, "first_divergence": div,
                     "accept_len": r["accept_len"], "expected_accept_len": None, "rounds": r["rounds"],
                     "aux_layers": list(head.aux_layers)})
        print(f"  correctness {'eagle3':26s} graphs={graphs!s:5s} equal={div is None} accept_len={r['accept_len']}",
              flush=True)
    return runs


def mixed_spans(vocab: int, rng: random.Random, base_block: int = 0) -> list[SeqSpan]:
    """A decode step, a branchy tree and a short prefill chunk, each with its own blocks."""
    tree = from_paths(rng.randrange(vocab), [[1, 2, 3], [4, 5], [6], [1, 7]])
    t = lambda k: list(range(base_block + 8 * k, base_block + 8 * (k + 1)))  # noqa: E731
    return [SeqSpan([rng.randrange(vocab)], 40, t(0)),
            SeqSpan(tree.tokens, 25, t(1), positions=[25 + d for d in tree.depths], tree_mask=tree.ancestor_mask()),
            SeqSpan([rng.randrange(vocab) for _ in range(5)], 0, t(2))]


@torch.inference_mode()
def graph_vs_eager(runner: ModelRunner, cfg: ModelConfig, rng: random.Random) -> dict:
    """The same batch through the graph path (CUDA) or its padded layout run eagerly (CPU) and
    through the eager forward: hidden states of the real tokens must agree."""
    spans = mixed_spans(cfg.vocab_size, rng)
    runner.graphs.enabled = runner.device.type == "cuda" and runner.config.cuda_graphs
    key = runner.graphs.buckets.key(spans)
    before = runner.graphs.stats.replays
    if runner.graphs.enabled:
        got = runner.forward(spans)
        replayed = runner.graphs.stats.replays > before
    else:
        got = runner.graphs.padded_eager(spans, key, scratch_block=runner.num_blocks - 1)  # unused by the spans
        replayed = False
    ref = runner.graphs.eager(spans, runner.backend)
    diff = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    ok = diff <= 1e-4 * max(1.0, scale) and (replayed or not runner.graphs.enabled)
    return {"key": list(key) if key else None, "graph_replayed": replayed, "max_abs_diff": diff,
            "max_abs_hidden": scale, "ok": ok}


# ---------------------------------------------------------------- step (b): attention backends

def discover_backends(scale: float, device: torch.device) -> tuple[dict, dict]:
    """Every attention backend the engine can be told to use (`--attention`), built by
    engine.attention.make_backend as the engine builds it on `device` -> instances; the ones
    that cannot run there -> make_backend's reason."""
    from eagle_serve.engine.attention import make_backend
    from eagle_serve.engine.config import ATTENTIONS
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    found, skipped = {}, {}
    for name in ATTENTIONS:
        if name == "auto":
            continue
        try:
            found[name] = make_backend(scale, device, dtype, name)
        except Exception as e:
            skipped[name] = f"not available here: {type(e).__name__}: {str(e)[:200]}"
    return found, skipped


@torch.inference_mode()
def sdpa_new_shapes(dev: torch.device, count: int = 12) -> dict:
    """ms of one masked GQA SDPA call (the torch backend's call, SmolLM2's heads, bf16, 8 queries)
    on a key length not seen before vs on one just seen, under torch's own kernel choice and
    under the engine's (engine.attention.cuda_sdpa_backends): what an eager round pays when its
    key length is new, as it is every round."""
    from torch.nn.attention import sdpa_kernel
    from eagle_serve.engine.attention import cuda_sdpa_backends
    out = {"cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled()}
    for label, allowed, base in (("torch_default", None, 1000), ("engine", cuda_sdpa_backends(), 3000)):
        first, again = [], []
        for i in range(count):
            L = base + 7 * i
            q = torch.randn(1, 9, 8, 64, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, 3, L, 64, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            mask = torch.ones(1, 1, 8, L, device=dev, dtype=torch.bool).tril(L - 8)
            for bucket in (first, again):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(allowed) if allowed else contextlib.nullcontext():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                torch.cuda.synchronize()
                bucket.append((time.perf_counter() - t0) * 1e3)
        first.sort()
        again.sort()
        out[label] = {"new_shape_ms_median": round(first[len(first) // 2], 3),
                      "seen_shape_ms_median": round(again[len(again) // 2], 3), "calls": count}
        print(f"  sdpa {label:14s} new shape {out[label]['new_shape_ms_median']:8.3f} ms, "
              f"seen {out[label]['seen_shape_ms_median']:8.3f} ms", flush=True)
    return out


def step_backends(args, deadline) -> dict:
    dev = torch.device(args.device)
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    H, HKV, D = 8, 2, 64
    scale = D ** -0.5
    tree = from_paths(0, [[1, 2, 3], [4, 5], [6], [1, 7], [8, 9, 10, 11]])
    blocks = lambda k, n: list(range(k * 32, k * 32 + n))  # noqa: E731
    spans = [SeqSpan(list(range(37)), 0, blocks(0, 4)),  # prefill chunk, nothing cached
             SeqSpan([3], 100, blocks(1, 8)),  # decode
             SeqSpan(tree.tokens, 50, blocks(2, 5), positions=[50 + d for d in tree.depths],
                     tree_mask=tree.ancestor_mask()),  # tree verification
             SeqSpan(list(range(5)), 20, blocks(3, 2)),  # a chain
             SeqSpan(list(range(16)), 64, blocks(4, 6))]  # a prefill chunk after a cached prefix
    T = sum(len(s.token_ids) for s in spans)
    num_blocks = 5 * 32 + 1
    kv_ref = KVCache(1, num_blocks, BLOCK, HKV, D, torch.float64, torch.device("cpu"))
    kv_ref.data.normal_(generator=gen)
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(T, HKV, D, generator=gen, dtype=torch.float64)
    v = torch.randn(T, HKV, D, generator=gen, dtype=torch.float64)
    ref = TorchAttention(scale).forward(q, k, v, 0, build_forward_batch(spans, BLOCK, torch.device("cpu")), kv_ref)
    backends, skipped = discover_backends(scale, dev)
    tolerances = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16", "float16"]
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        base = KVCache(1, num_blocks, BLOCK, HKV, D, dtype, dev)
        base.data.copy_(kv_ref.data.to(dtype))
        args_dev = [t.to(dev, dtype) for t in (q, k, v)]
        for name, backend in [*backends.items(), ("padded (CUDA graphs)", None)]:
            if deadline.expired():
                break
            kv = KVCache(1, num_blocks, BLOCK, HKV, D, dtype, dev)
            kv.data.copy_(base.data)
            try:
                if backend is None:
                    p = pad_spans(spans, 8, 64, 256, BLOCK, num_blocks - 1)
                    batch = expand_batch(*[t.to(dev) for t in p.tensors()], BLOCK)
                    qp = args_dev[0].new_zeros(8 * 64, H, D).index_copy_(0, p.out_rows.to(dev), args_dev[0])
                    kp = args_dev[1].new_zeros(8 * 64, HKV, D).index_copy_(0, p.out_rows.to(dev), args_dev[1])
                    vp = args_dev[2].new_zeros(8 * 64, HKV, D).index_copy_(0, p.out_rows.to(dev), args_dev[2])
                    out = PaddedAttention(scale).forward(qp, kp, vp, 0, batch, kv).index_select(0, p.out_rows.to(dev))
                    slots = p.slot_mapping.to(dev).index_select(0, p.out_rows.to(dev))
                else:
                    batch = build_forward_batch(spans, BLOCK, dev)
                    out = backend.forward(*args_dev, 0, batch, kv)
                    slots = batch.slot_mapping
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                err = (out.double().cpu() - ref).abs().max().item()
                kv_ok = torch.equal(kv.keys(0).index_select(0, slots).cpu(), args_dev[1].cpu()) and \
                    torch.equal(kv.values(0).index_select(0, slots).cpu(), args_dev[2].cpu())
                rows.append({"backend": name, "dtype": dtype_name, "max_abs_err": err, "tolerance": tolerances[dtype_name],
                             "kv_written": kv_ok, "ok": err <= tolerances[dtype_name] and kv_ok})
            except Exception as e:  # e.g. a dtype the backend does not take: listed, not a numeric failure
                rows.append({"backend": name, "dtype": dtype_name, "ok": None,
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"  backend {name:22s} {dtype_name:8s} {rows[-1].get('max_abs_err', rows[-1].get('error'))}",
                  flush=True)
    checked = [r for r in rows if r["ok"] is not None]
    bad = [r for r in checked if not r["ok"]]
    status = "failed" if bad or not checked else "partial" if len(checked) < len(rows) else "ok"
    extra = {}
    if dev.type == "cuda":
        try:
            extra["sdpa_new_shapes"] = sdpa_new_shapes(dev)
        except Exception as e:
            extra["sdpa_new_shapes"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"status": status, **extra, "shapes": {"heads": H, "kv_heads": HKV, "head_dim": D, "tokens": T},
            "reference": "torch backend, float64, CPU", "rows": rows, "skipped": skipped,
            **({"error": "a backend is off the float64 reference (see rows)"} if bad else {}),
            **({"note": "some backend / dtype pairs raised (see rows' error)"} if len(checked) < len(rows) else {})}


# ---------------------------------------------------------------- KV sizing

def step_kv_sizing(args, deadline) -> dict:
    from eagle_serve.engine.gpu_memory import profile_in_use
    if torch.device(args.device).type != "cuda":
        return {"status": "skipped", "reason": "CPU: the KV cache is kv_cache_memory_fraction of RAM (unchanged)"}
    name = "smollm2-135m"
    cfg = model_config(name, 4096)
    runner = build_runner(name, cfg, args.dtype, args.device, kv_tokens=None, max_seqs=64,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    total, in_use = profile_in_use(runner)  # again, now with the cache allocated: for the record
    free, _ = torch.cuda.mem_get_info()
    out = {"status": "ok", "model": name, "gpu_memory_utilization": args.gpu_memory_utilization,
           "num_blocks": runner.num_blocks, "kv_tokens": runner.num_blocks * BLOCK,
           "capped_by_max_num_seqs_x_context": runner.num_blocks * BLOCK >= 64 * cfg.max_model_len - BLOCK,
           "max_model_len": runner.max_model_len, "kv_bytes": runner.kv.data.numel() * runner.kv.data.element_size(),
           "device_total_bytes": total, "in_use_after_cache_bytes": in_use, "free_after_bytes": free}
    del runner
    return out


# ---------------------------------------------------------------- steps (c) and (d), per model

def step_throughput(args, runner: ModelRunner, name: str, seq: Seq, deadline) -> dict:
    vocab = runner.loaded.config.vocab_size
    rng = random.Random(2)
    graphs_modes = [True, False] if graphs_available(runner) else [False]
    rows, refs = [], {}
    out = {"dtype": args.dtype, "prompt_len": args.prompt_len, "max_new": args.max_new,
           "tree_tokens": args.tree_tokens, "backend": runner.backend.name, "rows": rows}
    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        runner.graphs.enabled = graphs_modes[0]
        use(runner, NoDrafter(), SpecConfig("none"))
        ref = generate(runner, prompts, args.max_new, seq(batch))["outputs"]  # also the plain warm-up
        refs[batch] = ref
        for graphs in graphs_modes:
            runner.graphs.enabled = graphs
            if graphs:  # every key these runs can hit, before any timing
                out.setdefault("precapture_s", {})[batch] = precapture(
                    runner, batch, args.prompt_len, args.prompt_len + args.max_new + max(args.tree_tokens),
                    max(args.tree_tokens))
            configs = [("plain", None, None)] + [(f"accept{a}-t{t}", a, t) for t in args.tree_tokens
                                                 for a in args.accepts]
            for label, accept, tree in configs:
                if deadline.expired():
                    out["stopped_early"] = f"time limit at batch {batch}, graphs {graphs}, {label}"
                    out["status"] = "partial"
                    return out
                res = None
                for warm in (True, False):  # a short untimed run first: captures this config's graphs
                    base = seq(batch)
                    if accept is None:
                        use(runner, NoDrafter(), SpecConfig("none"))
                    else:
                        refs_b = {base + i: ref[i] for i in range(batch)}
                        use(runner, OracleDrafter(refs_b, accept, tree, vocab),
                            SpecConfig("ngram", total_tokens=tree, depth=tree - 1))
                    res = generate(runner, prompts, min(args.max_new, (tree or 1) + 3) if warm else args.max_new, base)
                rows.append({"batch": batch, "graphs": graphs, "mode": label, "accept_set": accept,
                             "tree_tokens": tree, "tok_s": res["tok_s"], "accept_len": res["accept_len"],
                             "rounds": res["rounds"], "decode_s": res["decode_s"],
                             "same_as_plain": res["outputs"] == ref})
                print(f"  {name} batch {batch:3d} graphs={graphs!s:5s} {label:14s} {res['tok_s']:9.1f} tok/s "
                      f"accept_len={res['accept_len']}", flush=True)
    for r in rows:  # speedup over plain at the same batch and graphs setting
        plain = next((p for p in rows if p["batch"] == r["batch"] and p["graphs"] == r["graphs"]
                      and p["mode"] == "plain"), None)
        r["speedup_vs_plain"] = r["tok_s"] / plain["tok_s"] if plain and plain["tok_s"] else None
        eager = next((p for p in rows if p["batch"] == r["batch"] and not p["graphs"] and p["mode"] == r["mode"]), None)
        r["speedup_graphs_vs_eager"] = r["tok_s"] / eager["tok_s"] if r["graphs"] and eager and eager["tok_s"] else None
    out["graph_stats"] = dataclasses.asdict(runner.graphs.stats)
    out["status"] = "ok"
    return out


def step_draft_cost(args, runner: ModelRunner, name: str, deadline) -> dict:
    """What the tree budget would measure at start-up on this device: the profile with a random
    EAGLE-2 head (drafting runs eager; the verify forward replays graphs where they fit)."""
    from eagle_serve.engine.profile import profile_costs
    from eagle_serve.engine.speculative.eagle_drafter import EagleDrafter
    cfg = runner.loaded.config
    dtype = getattr(torch, args.dtype)
    spec = SpecConfig("eagle2")
    head = random_eagle_head(cfg, dtype, runner.device)
    use(runner, EagleDrafter(head, runner.model, spec, runner.num_blocks, BLOCK, dtype, runner.device), spec)
    try:
        t0 = time.perf_counter()
        prof = profile_costs(runner, max_tokens=64, max_seqs=max(args.verify_batches + args.batches),
                             context=args.context, repeats=args.repeats)
    finally:
        use(runner, NoDrafter(), SpecConfig("none"))
        del head
    ms = lambda pts: {int(n): round(t * 1e3, 3) for n, t in pts}  # noqa: E731
    out = {"status": "ok", "spec": {"total_tokens": spec.tree_tokens, "depth": spec.max_depth, "top_k": spec.top_k},
           "context": args.context, "verify_ms": ms(prof["verify"]), "draft_full_depth_ms": ms(prof["draft"]),
           "draft_depth1_ms": ms(prof.get("draft_first", [])), "depth": prof.get("depth"),
           "seconds": round(time.perf_counter() - t0, 2)}
    for n in sorted(out["draft_full_depth_ms"]):
        print(f"  {name} draft {n:3d} seqs: depth 1 {out['draft_depth1_ms'].get(n, float('nan')):8.3f} ms, "
              f"depth {out['depth']} {out['draft_full_depth_ms'][n]:8.3f} ms", flush=True)
    return out


def graphs_available(runner: ModelRunner) -> bool:
    return runner.device.type == "cuda" and runner.config.cuda_graphs


def precapture(runner: ModelRunner, batch: int, min_kv: int, max_kv: int, max_tokens: int) -> float:
    """Capture every (batch, tokens <= max_tokens, kv in [min_kv, max_kv]) key now; seconds taken."""
    b = runner.graphs.buckets
    bb, lo, hi = bucket_for(batch, b.batch), bucket_for(min_kv, b.kv), bucket_for(max_kv, b.kv)
    if bb is None or lo is None:
        return 0.0
    keys = [(bb, q, kv) for q in b.tokens if q <= max_tokens for kv in b.kv
            if lo <= kv <= (hi or max(b.kv)) and (b.max_keys is None or bb * kv <= b.max_keys)]
    t0 = time.perf_counter()
    runner.graphs.capture(keys)
    sync(runner.device)
    return round(time.perf_counter() - t0, 3)


@torch.inference_mode()
def step_families(args, deadline) -> dict:
    """Qwen3, Qwen3-MoE and Gemma 3 at their real shapes (bench/bench_families.py's, 2-layer ones
    with --quick), bf16 on the GPU: plain and oracle-drafted decoding at 1 and 8 sequences, tok/s,
    ms a step and outputs equal to plain."""
    sys.path.insert(0, ROOT)
    from bench import bench_families as fam
    ns = argparse.Namespace(quick=args.quick, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32",
                            batches=[1, 8], prompt_len=24 if args.quick else 640, max_new=16 if args.quick else 128,
                            tree_tokens=5)
    out, seq = {"models": {}}, Seq()
    seq.next = 50_000
    for name in fam.MODELS:
        if deadline.expired():
            out["stopped_early"] = f"time limit before {name}"
            break
        out["models"][name] = fam.bench_model(name, ns, seq)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = [r for m in out["models"].values() for r in m["rows"]]
    out["all_equal_to_plain"] = bool(rows) and all(r["same_as_plain"] for r in rows)
    out["status"] = "ok" if out["all_equal_to_plain"] and "stopped_early" not in out else \
        "partial" if out["all_equal_to_plain"] else "failed"
    return out


def step_verify_curve(args, runner: ModelRunner, name: str, deadline) -> dict:
    vocab = runner.loaded.config.vocab_size
    rng = random.Random(3)
    context = args.context
    graphs_modes = [True, False] if graphs_available(runner) else [False]
    rows = []
    out = {"context": context, "repeats": args.repeats, "rows": rows, "backend": runner.backend.name}
    for batch in args.verify_batches:
        for tokens in args.verify_grid:
            if deadline.expired():
                out["stopped_early"] = f"time limit at batch {batch}, {tokens} tokens"
                break
            per = -(-(context + tokens) // BLOCK)
            spans = []
            for b in range(batch):  # a random tree of `tokens` nodes per sequence (parents earlier)
                parents = [-1] + [rng.randrange(i) for i in range(1, tokens)]
                depths = [0] * tokens
                for i in range(1, tokens):
                    depths[i] = depths[parents[i]] + 1
                tree = DraftTree([rng.randrange(vocab) for _ in range(tokens)], parents, depths)
                spans.append(SeqSpan(tree.tokens, context, list(range(b * per, (b + 1) * per)),
                                     positions=[context + d for d in depths], tree_mask=tree.ancestor_mask()))
            row = {"batch": batch, "tokens_per_seq": tokens}
            for graphs in graphs_modes:
                runner.graphs.enabled = graphs
                replays = runner.graphs.stats.replays
                row["graph_ms" if graphs else "eager_ms"] = 1000 * _time(
                    lambda: runner.model.compute_logits(runner.forward(spans)), args.repeats)
                if graphs:
                    row["graph_replayed"] = runner.graphs.stats.replays > replays
            rows.append(row)
            print(f"  {name} verify batch {batch} x {tokens:3d} tokens: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    out["free_until"] = free_until(rows)
    out["graph_stats"] = dataclasses.asdict(runner.graphs.stats)
    out["status"] = "partial" if "stopped_early" in out else "ok"
    return out


def free_until(rows: list[dict]) -> dict:
    """Per batch and mode: the largest tree size whose verify costs at most 1.1x / 1.5x / 2x the
    one-token step (verification is 'free' while the forward stays weight-bandwidth bound)."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        for key in ("graph_ms", "eager_ms"):
            curve = [(r["tokens_per_seq"], r[key]) for r in rows if r["batch"] == batch and key in r]
            if not curve or curve[0][0] != 1:
                continue
            base = curve[0][1]
            out[f"batch{batch}_{key[:-3]}"] = {
                f"{x}x": max((t for t, s in curve if s <= x * base), default=None) for x in (1.1, 1.5, 2.0)}
    return out


# ---------------------------------------------------------------- FP8 weights

def quantize_fp8_(net: LlamaForCausalLM) -> int:
    """Every decoder linear of `net` (q/k/v, o, gate/up, down) to FP8 e4m3 weights with a scale
    per output channel, in place, as an FP8-dynamic checkpoint loads on a GPU with FP8 matmul
    (engine/fp8.py); the LM head stays as it is. Returns how many linears."""
    from eagle_serve.engine import fp8
    from eagle_serve.engine.layers import Linear
    count = 0
    for m in net.model.layers.modules():
        if isinstance(m, Linear) and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0:
            fp8.quantize_(m)
            count += 1
    return count


def fp8_product_check(dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """engine.fp8.scaled (the _scaled_mm call FP8 linears make) against engine.fp8.emulate (the
    same FP8 operands in float64) at row counts that need padding and not, per mode this device
    runs ("rowwise" needs bf16 inputs); an error recorded where _scaled_mm does not run."""
    from eagle_serve.engine import fp8
    rows = []
    modes = ["rowwise", "tensorwise"] if dtype == torch.bfloat16 else ["tensorwise"]
    gen = torch.Generator().manual_seed(5)
    k, n = 256, 384
    w = (torch.randn(n, k, generator=gen) * 2).to(fp8.FP8).to(dev)
    scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(dev)
    bias = torch.randn(n, generator=gen).to(dev, dtype)
    for mode in modes:
        for m in (1, 5, 16, 37):
            x = torch.randn(m, k, generator=gen).to(dev, dtype)
            try:
                got = fp8.scaled(x, w, scale, bias, mode).double()
                emu = fp8.emulate(x, w, scale, bias)
                err = ((got - emu).abs().max() / emu.abs().max()).item()
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
                rows.append({"mode": mode, "rows": m, "k": k, "n": n, "max_rel_err": err, "tolerance": tol,
                             "ok": err <= tol})
            except Exception as e:  # noqa: BLE001: recorded (the model runs then use what probe found)
                rows.append({"mode": mode, "rows": m, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return rows


def step_fp8(args, deadline) -> dict:
    """An FP8 model (quantize_fp8_ of the peaked random model) against the same model in
    args.dtype: greedy oracle-drafted decoding equal to plain greedy (FP8), decode tok/s of
    both, plain, at each batch; and the _scaled_mm product itself against its float64 emulation
    (fp8_product_check). On the CPU (--quick) the model runs the dequantizing reference product;
    the product check runs torch's CPU _scaled_mm where this torch has one."""
    from eagle_serve.engine import fp8
    dev = torch.device(args.device)
    if dev.type == "cuda" and not fp8.fp8_matmul_available(dev):
        cap = torch.cuda.get_device_capability(dev)
        return {"status": "skipped", "reason": f"compute capability {cap[0]}.{cap[1]} < 8.9: FP8 checkpoints "
                                               f"load dequantized here (no FP8 matmul)"}
    name = args.fp8_model
    cfg = model_config(name, 2048)
    dtype = getattr(torch, args.dtype)
    tree, accept = 8, 3
    kv = max(args.batches) * (args.prompt_len + args.max_new + 80 + BLOCK) + 4 * BLOCK
    rng = random.Random(4)
    prompts = {b: [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(b)]
               for b in args.batches}
    seq = Seq()
    seq.next = 70_000
    rows: list[dict] = []
    out = {"model": name, "dtype": args.dtype, "tree_tokens": tree, "accept_set": accept, "rows": rows,
           "prompt_len": args.prompt_len, "max_new": args.max_new}
    counted = {}
    out["product_check"] = fp8_product_check(dev, dtype)

    def timed(runner, batch, ref=None) -> dict:
        """A short untimed run (captures this config's graphs), then the timed one; with `ref`,
        oracle-drafted from these reference outputs."""
        res = None
        for warm in (True, False):
            base = seq(batch)
            if ref is None:
                use(runner, NoDrafter(), SpecConfig("none"))
            else:
                use(runner, OracleDrafter({base + i: ref[i] for i in range(batch)}, accept, tree, cfg.vocab_size),
                    SpecConfig("ngram", total_tokens=tree, depth=tree - 1))
            res = generate(runner, prompts[batch], min(args.max_new, tree + 3) if warm else args.max_new, base)
        return res

    def report_row(row: dict) -> None:
        rows.append(row)
        print(f"  fp8 {name} {row['weights']:8s} batch {row['batch']:3d} {row['mode']:20s} {row['tok_s']:9.1f} tok/s "
              f"{'equal=' + str(row['equal_to_plain']) if 'equal_to_plain' in row else ''}", flush=True)

    refs = {}
    for weights in ("fp8", args.dtype):
        if deadline.expired():
            out["stopped_early"] = f"time limit before the {weights} model"
            break

        def prepare(net):  # FP8 weights, and the product's kind found before any forward (graphs bake it in)
            counted["linears"] = quantize_fp8_(net)
            counted["product"] = fp8.probe(next(net.parameters()).device, dtype)
        runner = build_runner(name, cfg, args.dtype, args.device, kv_tokens=kv, max_seqs=max(args.batches),
                              peaked=True, prepare=prepare if weights == "fp8" else None)
        if weights == "fp8":
            out["linears_fp8"] = counted["linears"]
            out["product"] = counted["product"]  # rowwise / tensorwise _scaled_mm, or reference
            out["fp8_weight_bytes"] = sum(m.fp8_weight.numel() + 4 * m.fp8_scale.numel()
                                          for m in runner.model.modules() if getattr(m, "fp8_weight", None) is not None)
        for batch in args.batches:
            if deadline.expired():
                out["stopped_early"] = f"time limit at the {weights} model, batch {batch}"
                break
            if graphs_available(runner):
                precapture(runner, batch, args.prompt_len, args.prompt_len + args.max_new + tree, tree)
            plain = timed(runner, batch)
            row = {"weights": weights, "batch": batch, "mode": "plain", "tok_s": plain["tok_s"],
                   "decode_s": plain["decode_s"]}
            if weights == "fp8":
                refs[batch] = plain["outputs"]
                spec = timed(runner, batch, ref=plain["outputs"])
                div = first_divergence(spec["outputs"], plain["outputs"])
                report_row(row)
                row = {"weights": weights, "batch": batch, "mode": f"oracle-accept{accept}-t{tree}",
                       "tok_s": spec["tok_s"], "decode_s": spec["decode_s"], "accept_len": spec["accept_len"],
                       "equal_to_plain": div is None, "first_divergence": div}
            elif batch in refs:  # information: where the float model's greedy output leaves the FP8 one's
                row["first_divergence_from_fp8"] = first_divergence(plain["outputs"], refs[batch])
            report_row(row)
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    speed = {}
    for batch in args.batches:
        f = next((r for r in rows if r["weights"] == "fp8" and r["batch"] == batch and r["mode"] == "plain"), None)
        b = next((r for r in rows if r["weights"] == args.dtype and r["batch"] == batch), None)
        if f and b and f["tok_s"] and b["tok_s"]:
            speed[f"batch{batch}"] = {"fp8_tok_s": f["tok_s"], f"{args.dtype}_tok_s": b["tok_s"],
                                      "fp8_speedup": f["tok_s"] / b["tok_s"]}
    out["plain_decode"] = speed
    checked = [r for r in rows if "equal_to_plain" in r]
    out["all_equal_to_plain"] = bool(checked) and all(r["equal_to_plain"] for r in checked)
    products_ok = all(r.get("ok", True) for r in out["product_check"])
    out["status"] = ("failed" if not out["all_equal_to_plain"] or not products_ok else
                     "partial" if "stopped_early" in out else "ok")
    if out["status"] == "ok" and dev.type == "cuda" and out.get("product") == "reference":
        out["status"], out["note"] = "partial", "no _scaled_mm product ran here: the FP8 model dequantized on every call"
    if not products_ok:
        out["error"] = "torch._scaled_mm is off its float64 emulation (see product_check)"
    elif out["status"] == "failed":
        out["error"] = "FP8 oracle-drafted greedy != FP8 plain greedy (see rows)" if checked else "no FP8 run finished"
    return out


# ---------------------------------------------------------------- running steps under limits

class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end


class StepTimeout(BaseException):  # not an Exception: no `except Exception` on the way may swallow it
    pass


@contextlib.contextmanager
def hard_limit(seconds: float):
    """SIGALRM after `seconds` (main thread, POSIX): a step stuck in one call is cut off."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise StepTimeout(f"hard time limit of {seconds:.0f} s reached")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    def __init__(self, out_dir: str):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "gpu_check.json")
        self.data: dict = {}

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def run(self, path: list[str], limit: float, fn, *fn_args) -> dict:
        """fn(deadline, ...) -> dict, recorded at data[path...] with status, seconds, error."""
        node = self.data
        for p in path[:-1]:
            node = node.setdefault(p, {})
        entry = node.setdefault(path[-1], {})
        t0 = time.perf_counter()
        print(f"[{'/'.join(path)}] limit {limit:.0f} s", flush=True)
        try:
            with hard_limit(limit + 10):
                entry.update(fn(*fn_args, deadline=Deadline(limit)) or {})
            entry.setdefault("status", "ok")
        except BaseException as e:  # noqa: BLE001: KeyboardInterrupt too, so the report is written
            entry["status"] = "failed"
            entry["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
            print(f"[{'/'.join(path)}] FAILED: {type(e).__name__}: {e}", flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.write()
        print(f"[{'/'.join(path)}] {entry['status']} in {entry['seconds']} s", flush=True)
        return entry


def environment(args) -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "args": {k: v for k, v in vars(args).items()}}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device_name=p.name, capability=f"{p.major}.{p.minor}", device_memory_bytes=p.total_memory,
                   device_count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    for mod in ("triton", "flash_attn", "matplotlib", "numpy"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "present")
        except Exception as e:
            env[mod] = f"absent ({type(e).__name__})"
    return env


# ---------------------------------------------------------------- chart

def plot(report: Report) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no chart: matplotlib unavailable ({type(e).__name__})"
    thr = report.data.get("throughput", {}).get("models", {})
    cur = report.data.get("verify_curve", {}).get("models", {})
    models = [m for m in dict.fromkeys(list(thr) + list(cur))]
    if not models:
        return "no chart: no throughput or verify data"
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 9), squeeze=False)
    for j, m in enumerate(models):
        ax = axes[0][j]
        rows = thr.get(m, {}).get("rows", [])
        labels = list(dict.fromkeys(f"b{r['batch']} {'graph' if r['graphs'] else 'eager'}" for r in rows))
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            ys = [next((r["tok_s"] or 0 for r in rows if r["mode"] == mode
                        and f"b{r['batch']} {'graph' if r['graphs'] else 'eager'}" == lab), 0) for lab in labels]
            ax.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(labels))], ys, width, label=mode)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{m}: plain vs oracle acceptance", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax = axes[1][j]
        for batch in sorted({r["batch"] for r in cur.get(m, {}).get("rows", [])}):
            for key, style in (("graph_ms", "-o"), ("eager_ms", "--x")):
                pts = [(r["tokens_per_seq"], r[key]) for r in cur[m]["rows"] if r["batch"] == batch and key in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"batch {batch} {key[:-3]}", markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree tokens per sequence")
        ax.set_ylabel("verify forward + LM head (ms)")
        ax.set_title(f"{m}: verify cost", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    env = report.data.get("env", {})
    fig.suptitle(f"gpu_check on {env.get('device_name', 'cpu')}: random weights, {report.data['env']['args']['dtype']}",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(report.dir, "gpu_check.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main

def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens (a smoke run, e.g. on the CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_check_out", help="output folder (default $OUT)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for all steps (default 330; quick 120)")
    ap.add_argument("--models", default=None, help="comma-separated: smollm2-135m, llama3-8b, tiny")
    ap.add_argument("--dtype", default=None, help="throughput / curve dtype (default bfloat16; quick float32)")
    ap.add_argument("--batches", default=None, help="throughput batch sizes (default 1,16)")
    ap.add_argument("--accepts", default=None, help="oracle acceptance lengths (default 1,2,3,4)")
    ap.add_argument("--tree-tokens", default=None, help="oracle tree sizes, root included (default 8,24)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--verify-batches", default=None, help="default 1,8")
    ap.add_argument("--verify-grid", default=None, help="tree tokens per sequence (default engine.profile.VERIFY_GRID)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per sequence in the verify curve")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--attention", default=None, help="the engines' attention backend for eager forwards "
                                                       "(EngineConfig.attention; default: the engine's auto)")
    ap.add_argument("--fp8-model", default=None, help="the fp8 step's shape (default llama3-8b; quick tiny)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = ap.parse_args(argv)
    q = args.quick
    fill = {"time_budget": 120.0 if q else 330.0, "models": "tiny" if q else "smollm2-135m,llama3-8b",
            "dtype": "float32" if q else "bfloat16", "batches": "1,2" if q else "1,16",
            "accepts": "1,2" if q else "1,2,3,4", "tree_tokens": "4" if q else "8,24",
            "prompt_len": 8 if q else 96, "max_new": 8 if q else 128, "verify_batches": "1,2" if q else "1,8",
            "verify_grid": "1,2,4,8" if q else ",".join(map(str, VERIFY_GRID)), "context": 32 if q else 512,
            "repeats": 1 if q else 5, "fp8_model": "tiny" if q else "llama3-8b"}
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = [m for m in args.models.split(",") if m]
    for k in ("batches", "accepts", "tree_tokens", "verify_batches", "verify_grid"):
        setattr(args, k, ints(getattr(args, k)))
    args.skip = set(s for s in args.skip.split(",") if s)
    unknown = [m for m in args.models + [args.fp8_model] if m not in SHAPES]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {list(SHAPES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ATTENTION[0] = args.attention
    if args.device == "cpu":  # a smoke run: skip the native CPU kernels' one-time build
        os.environ.setdefault("EAGLE_SERVE_NATIVE_KERNELS", "0")
    report = Report(args.out)
    t_start = time.perf_counter()
    report.data["env"] = environment(args)
    report.write()
    print(json.dumps({k: v for k, v in report.data["env"].items() if k != "args"}), flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        report.data["error"] = "--device cuda but torch sees no CUDA device"
        report.write()
        print(report.data["error"], flush=True)
        return 2
    budget = args.time_budget

    def share(section, model=None):
        s = SHARES[section]
        return budget * (s[model] if model else s)

    for section, fn in (("correctness", step_correctness), ("backends", step_backends),
                        ("kv_sizing", step_kv_sizing)):
        if section in args.skip:
            report.data[section] = {"status": "skipped", "reason": "--skip"}
            continue
        report.run([section], share(section), fn, args)

    seq = Seq()
    for section in ("throughput", "verify_curve", "draft_cost"):
        report.data.setdefault(section, {"models": {}})
    for name in args.models:
        if {"throughput", "verify_curve", "draft_cost"} <= args.skip:
            break
        cfg = model_config(name, 2048)
        max_seqs = max(args.batches + args.verify_batches)
        need = max(max(args.batches) * (args.prompt_len + args.max_new + 80 + BLOCK),
                   max(args.verify_batches) * (args.context + max(args.verify_grid) + BLOCK))
        holder = {}

        def build(name=name, cfg=cfg, deadline=None):
            t0 = time.perf_counter()
            holder["runner"] = build_runner(name, cfg, args.dtype, args.device, kv_tokens=need + 4 * BLOCK,
                                            max_seqs=max_seqs, peaked=True, token_sizes=tuple(sorted(set(VERIFY_GRID) |
                                                                                         set(args.verify_grid))))
            r = holder["runner"]
            return {"build_s": round(time.perf_counter() - t0, 2), "num_blocks": r.num_blocks,
                    "parameters": sum(p.numel() for p in r.model.parameters()), "backend": r.backend.name,
                    "graphs_enabled": r.graphs.enabled, "shape": dict(zip(
                        ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "rope_theta", "tied"),
                        SHAPES[name]))}
        entry = report.run(["models", name], 120, build)
        for section, fn in (("throughput", step_throughput), ("verify_curve", step_verify_curve),
                            ("draft_cost", step_draft_cost)):
            if section in args.skip:
                report.data[section]["models"][name] = {"status": "skipped", "reason": "--skip"}
            elif "runner" not in holder:
                report.data[section]["models"][name] = {"status": "failed", "error": "model build failed: see models"}
            else:
                extra = (seq,) if section == "throughput" else ()
                report.run([section, "models", name], share(section, name), fn, args, holder["runner"], name, *extra)
        del holder, entry
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "families" in args.skip:
        report.data["families"] = {"status": "skipped", "reason": "--skip"}
    else:
        report.run(["families"], share("families"), step_families, args)
    if "fp8" in args.skip:
        report.data["fp8"] = {"status": "skipped", "reason": "--skip"}
    else:
        report.run(["fp8"], share("fp8"), step_fp8, args)
    for section in ("throughput", "verify_curve", "draft_cost"):
        states = [m.get("status") for m in report.data[section]["models"].values()]
        report.data[section]["status"] = ("ok" if states and all(s == "ok" for s in states) else
                                          "skipped" if states and all(s == "skipped" for s in states) else
                                          "partial" if any(s in ("ok", "partial") for s in states) else "failed")
    report.data["chart"] = plot(report)
    report.data["total_s"] = round(time.perf_counter() - t_start, 1)
    report.write()
    summary = {k: report.data[k].get("status") for k in ("correctness", "backends", "kv_sizing", "throughput",
                                                         "verify_curve", "draft_cost", "families", "fp8")}
    print(json.dumps({"summary": summary, "total_s": report.data["total_s"], "chart": report.data["chart"],
                      "json": report.path}), flush=True)
    return 0 if all(s in ("ok", "skipped") for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
