"""The flash backend on the CPU, through a flash-attn stand-in: LSE merge, backend vs torch,
generation, backend selection."""
from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from eagle_serve.engine.attention import NativeCPUAttention, TorchAttention, make_backend
from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.flash_attention import FlashAttention, attention_lse, block_attention_lse, merge_lse
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.sampling_params import SamplingParams
from tests import flash_attn_standin as standin

CPU = torch.device("cpu")
SLOTS = 8192  # cache slots in the backend tests


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


TREES = {"single": [-1], "chain": [-1, 0, 1, 2, 3, 4], "wide": [-1, 0, 0, 0, 0, 0, 0],
         "random": random_parents(random.Random(5), 11)}


# ---- merge_lse -----------------------------------------------------------------------------

def reference_attention(q, k, v, mask, scale):
    """float64 softmax by hand: q [M, H, D], k, v [N, Hkv, D], mask [M, N] -> out [M, H, D], lse [M, H]."""
    M, H, D = q.shape
    g = H // k.shape[1]
    out = torch.empty(M, H, D, dtype=torch.float64)
    lse = torch.empty(M, H, dtype=torch.float64)
    for h in range(H):
        s = (q[:, h].double() @ k[:, h // g].double().T) * scale
        s = torch.where(mask, s, torch.tensor(float("-inf"), dtype=torch.float64))
        m = s.max(dim=-1, keepdim=True).values
        e = torch.exp(s - m)
        total = e.sum(dim=-1, keepdim=True)
        out[:, h] = (e / total) @ v[:, h // g].double()
        lse[:, h] = (m + torch.log(total)).squeeze(-1)
    return out, lse


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("prefix", [0, 1, 9])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_lse_merge_equals_full_attention(tree, prefix, group):
    parents = TREES[tree]
    n, hkv = len(parents), 2
    H, D = hkv * group, 8
    gen = torch.Generator().manual_seed(prefix * 31 + group * 7 + n)
    q = torch.randn(1, n, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, prefix + n, hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, prefix + n, hkv, D, generator=gen, dtype=torch.float64)
    tmask = ancestor_mask(parents)
    full = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tmask], dim=1)
    scale = D ** -0.5
    ref_out, ref_lse = reference_attention(q[0], k[0], v[0], full, scale)

    o1, l1 = block_attention_lse(q, k[:, :prefix], v[:, :prefix], torch.ones(1, n, prefix, dtype=torch.bool), scale)
    o2, l2 = block_attention_lse(q, k[:, prefix:], v[:, prefix:], tmask[None], scale)
    if prefix == 0:
        assert torch.all(l1 == float("-inf")) and torch.all(o1 == 0)
    out, lse = merge_lse(o1, l1, o2, l2)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0], ref_lse, rtol=1e-12, atol=1e-12)
    swapped, lse_s = merge_lse(o2, l2, o1, l1)  # the order of the parts does not matter
    torch.testing.assert_close(swapped, out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse_s, lse, rtol=1e-13, atol=1e-13)


def test_merge_lse_random_splits_and_empty_parts():
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        M, N, D = (int(x) for x in torch.randint(1, 12, (3,), generator=gen))
        q = torch.randn(M, D, generator=gen, dtype=torch.float64) * 3
        k = torch.randn(N, D, generator=gen, dtype=torch.float64)
        v = torch.randn(N, D, generator=gen, dtype=torch.float64)
        mask = torch.rand(M, N, generator=gen) < 0.6
        mask[:, 0] = True
        cut = int(torch.randint(0, N + 1, (1,), generator=gen))
        whole = attention_lse(q, k, v, mask, 0.3)
        out, lse = merge_lse(*attention_lse(q, k[:cut], v[:cut], mask[:, :cut], 0.3),
                             *attention_lse(q, k[cut:], v[cut:], mask[:, cut:], 0.3))
        torch.testing.assert_close(out, whole[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, whole[1], rtol=1e-12, atol=1e-12)
    o = torch.randn(3, 4, dtype=torch.float64)
    empty = torch.full((3,), float("-inf"), dtype=torch.float64)
    out, lse = merge_lse(o, empty, torch.zeros(3, 4, dtype=torch.float64), empty)  # both parts empty
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out, lse = merge_lse(o, torch.zeros(3, dtype=torch.float64), o * 0, empty)  # one part empty
    torch.testing.assert_close(out, o)
    # float32 LSE (flash-attn's) with bfloat16 outputs merges in float32
    out, lse = merge_lse(o.bfloat16(), torch.zeros(3), o.bfloat16(), torch.zeros(3))
    assert out.dtype == torch.float32 and torch.allclose(lse, torch.full((3,), 0.6931472))


# ---- the stand-in keeps flash-attn's conventions ---------------------------------------------

def test_standin_causal_alignment_empty_rows_and_layouts(monkeypatch):
    fa = standin.install(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 5, 1, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 5, 1, 8, generator=gen, dtype=torch.float64)
    out, lse = fa.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    assert lse.shape == (1, 2, 2) and lse.dtype == torch.float64  # [B, H, Sq]
    docs_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # flash-attn's docstring
    ref, ref_lse = reference_attention(q[0], k[0], v[0], docs_mask, 8 ** -0.5)
    torch.testing.assert_close(out[0], ref)
    torch.testing.assert_close(lse[0].T, ref_lse)
    # seqlen_q 5 > seqlen_k 2: the first three rows see nothing -> output 0, LSE +inf
    q5 = torch.randn(1, 5, 2, 8, generator=gen, dtype=torch.float64)
    out, lse = fa.flash_attn_with_kvcache(q5, k[:, :2], v[:, :2], causal=True, return_softmax_lse=True)
    assert torch.all(out[0, :3] == 0) and torch.all(lse[0, :, :3] == float("inf"))
    # an empty cache row (cache_seqlens 0) behaves the same
    out, lse = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.zeros(1, dtype=torch.int32),
                                          return_softmax_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    # varlen: LSE [H, total_q], same numbers as the kvcache call
    kv_out, kv_lse = fa.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    vo, vlse, s_dmask = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 2, 5, causal=True,
                                                  return_attn_probs=True)
    assert vlse.shape == (2, 2) and s_dmask.numel() == 0
    torch.testing.assert_close(vo, kv_out[0])
    torch.testing.assert_close(vlse, kv_lse[0])


def test_standin_refuses_what_flash_attn_refuses(monkeypatch):
    fa = standin.install(monkeypatch, full_precision=False)
    q = torch.randn(1, 1, 2, 8, dtype=torch.bfloat16)
    pages = torch.randn(4, 256, 1, 8, dtype=torch.bfloat16)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    lens = torch.tensor([300], dtype=torch.int32)
    fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table)
    with pytest.raises(RuntimeError, match="int32"):
        fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table.long())
    with pytest.raises(RuntimeError, match="int32"):
        fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens.long(), block_table=table)
    small = torch.randn(64, 16, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        fa.flash_attn_with_kvcache(q, small, small, cache_seqlens=lens, block_table=table)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fa.flash_attn_with_kvcache(q.double(), pages.double(), pages.double(), cache_seqlens=lens, block_table=table)
    with pytest.raises(RuntimeError, match="out of range"):
        fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens + 300, block_table=table)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        fa.flash_attn_varlen_func(q[0].expand(3, 2, 8), pages, pages, torch.tensor([0, 3], dtype=torch.int32),
                                  torch.tensor([0, 10], dtype=torch.int32), 2, 10, block_table=table)


# ---- the backend against the torch reference -------------------------------------------------

def drafter_mask(rng: random.Random, m: int, n: int) -> torch.Tensor:
    """[n, m + n]: each frontier node sees some scratch keys and itself (as the EAGLE drafter's)."""
    mask = torch.zeros(n, m + n, dtype=torch.bool)
    for i in range(n):
        for j in range(m):
            mask[i, j] = rng.random() < 0.5
        mask[i, m + i] = True
    return mask


def make_spans(kind: str, block_size: int, rng: random.Random) -> list[SeqSpan]:
    """Spans of every shape the engine builds: prefill chunks (from 0 and continuing, long and
    short), decode steps, target trees (chain, wide, random; empty and one-token prefixes) and
    drafter spans with masked scratch keys."""
    pool = list(range(SLOTS // block_size))
    rng.shuffle(pool)

    def table(length):
        nb = -(-length // block_size)
        return [pool.pop() for _ in range(nb)]

    def tree(cached, parents):
        return SeqSpan([rng.randrange(100) for _ in parents], cached, table(cached + len(parents)),
                       tree_mask=ancestor_mask(parents))

    def chunk(cached, n):
        return SeqSpan([rng.randrange(100) for _ in range(n)], cached, table(cached + n))

    causal = [chunk(0, 70), chunk(300, 20), chunk(rng.randrange(1, 600), 1), chunk(0, 1), chunk(257, 1)]
    trees = [tree(40, TREES["random"]), tree(0, TREES["wide"]), tree(1, TREES["random"]), tree(290, TREES["wide"]),
             tree(5, TREES["single"])]
    m, n = 3, 4
    drafter = [SeqSpan([1, 2, 3, 4], 50 + m, table(50 + m + n), positions=[51] * n,
                       tree_mask=drafter_mask(rng, m, n), num_masked_cached=m),
               SeqSpan([5, 6], 2, table(4), positions=[1, 1], tree_mask=drafter_mask(rng, 2, 2), num_masked_cached=2)]
    chain = [tree(12, TREES["chain"])]  # a chain's ancestor mask is causal: the varlen path takes it
    spans = {"mixed": causal + trees + drafter + chain, "causal": causal + chain, "trees": trees + drafter,
             "one_decode": [chunk(33, 1)], "one_tree": [tree(300, TREES["random"])],
             "one_prefill": [chunk(0, 9)]}[kind]
    rng.shuffle(spans)
    return spans


def run_both(spans, block_size, dtype, layers=2, H=4, hkv=2, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = build_forward_batch(spans, block_size, CPU)
    T = batch.input_ids.shape[0]
    ref_kv = KVCache(layers, SLOTS // block_size, block_size, hkv, D, dtype, CPU)
    ref_kv.data.copy_(torch.randn(ref_kv.data.shape, generator=gen, dtype=torch.float64).to(dtype))
    got_kv = KVCache(layers, SLOTS // block_size, block_size, hkv, D, dtype, CPU)
    got_kv.data.copy_(ref_kv.data)
    ref_be, flash = TorchAttention(D ** -0.5), FlashAttention(D ** -0.5, standin)
    outs = []
    for layer in range(layers):
        q, k, v = (torch.randn(T, h, D, generator=gen, dtype=torch.float64).to(dtype) for h in (H, hkv, hkv))
        outs.append((ref_be.forward(q, k, v, layer, batch, ref_kv), flash.forward(q, k, v, layer, batch, got_kv)))
        if layer == 0:
            plan = flash._plan
        assert flash._plan is plan  # planned once per batch
    assert torch.equal(ref_kv.data, got_kv.data)  # the same K/V writes
    return outs, plan


@pytest.mark.parametrize("block_size", [256, 16])
@pytest.mark.parametrize("kind", ["mixed", "causal", "trees", "one_decode", "one_tree", "one_prefill"])
def test_flash_backend_matches_torch_float64(monkeypatch, block_size, kind):
    standin.install(monkeypatch)
    spans = make_spans(kind, block_size, random.Random(block_size + len(kind)))
    outs, plan = run_both(spans, block_size, torch.float64, H=4 if kind != "mixed" else 8)
    for ref, got in outs:
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert plan.paged == (block_size == 256)
    has_trees = kind in ("mixed", "trees", "one_tree")
    assert (plan.trees is not None) == has_trees
    assert (plan.causal is not None) == (kind != "one_tree")  # "trees" has a one-node tree: causal
    assert (standin.calls["flash_attn_with_kvcache"] > 0) == has_trees
    assert (standin.calls["flash_attn_varlen_func"] > 0) == (plan.causal is not None)
    if kind == "mixed":  # empty and one-token prefixes were in the tree group
        lens = plan.trees.prefix_lens.tolist()
        assert 0 in lens and 1 in lens and plan.trees.max_prefix > 256


def test_flash_backend_bfloat16_real_dtype_rules(monkeypatch):
    """bfloat16 with the stand-in's full-precision extension off: the dtypes and argument types the
    real kernels demand; results match the float64 reference within bfloat16 rounding."""
    standin.install(monkeypatch, full_precision=False)
    spans = make_spans("mixed", 256, random.Random(3))
    outs, _ = run_both(spans, 256, torch.bfloat16, layers=1)
    for ref, got in outs:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.float(), rtol=0.03, atol=0.03)


# ---- whole generation through the stand-in ---------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[random.Random(i).randrange(3, 300) for _ in range(n)] for i, n in enumerate((7, 40, 270))]


@pytest.fixture(scope="module")
def torch_reference(tiny_llama):
    from eagle_serve.server.llm import LLM
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=256,
              attention="torch", max_prefill_chunk=64)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("block_size", [256, 16])
def test_generation_through_flash_equals_torch(tiny_llama, torch_reference, monkeypatch, block_size):
    from eagle_serve.server.llm import LLM
    standin.install(monkeypatch)
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=block_size,
              attention="flash", max_prefill_chunk=64)
    assert llm.runner.backend.name == "flash"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == torch_reference
    assert standin.calls["flash_attn_varlen_func"] > 0


def test_eagle_trees_through_flash_equal_plain_torch(tiny_llama, torch_reference, monkeypatch, tmp_path):
    """EAGLE-2 trees verified by the flash backend (LSE-merge path), the draft head's own
    frontier (masked scratch keys) through it too: greedy output equals plain decoding."""
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.llm import LLM
    from tests.spec_helpers import write_eagle_head
    fa = standin.install(monkeypatch)
    head = write_eagle_head(str(tmp_path / "head"), tiny_llama[0])
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=256,
              attention="flash", max_prefill_chunk=64, draft=head, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2))
    drafter = llm.runner.drafter
    drafter.backend = FlashAttention(drafter.head.config.head_dim ** -0.5, fa)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == torch_reference
    assert standin.calls["flash_attn_with_kvcache"] > 0
    assert sum(o.spec.draft_tokens for o in outs) > 0


# ---- backend selection -----------------------------------------------------------------------

def no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError


def test_selection_without_flash_attn(monkeypatch):
    from eagle_serve.engine import kernels
    no_flash(monkeypatch)
    cuda = torch.device("cuda")
    assert isinstance(make_backend(0.1, cuda, torch.bfloat16), TorchAttention)  # auto falls back
    assert isinstance(make_backend(0.1, cuda, torch.bfloat16, "torch"), TorchAttention)
    with pytest.raises(ValueError, match=r"needs the flash-attn package \(pip install -e '\.\[cuda\]'\)"):
        make_backend(0.1, cuda, torch.bfloat16, "flash")
    with pytest.raises(ValueError, match="flash-attn package"):
        make_backend(0.1, CPU, torch.float32, "flash")
    with pytest.raises(ValueError, match="native is the CPU kernel backend"):
        make_backend(0.1, cuda, torch.bfloat16, "native")
    with pytest.raises(ValueError, match="attention must be one of"):
        make_backend(0.1, CPU, torch.float32, "sdpa")
    monkeypatch.setattr(kernels, "native", lambda: None)  # no kernels: auto -> torch, native -> clear error
    assert isinstance(make_backend(0.1, CPU, torch.float32), TorchAttention)
    with pytest.raises(ValueError, match="native CPU kernels are unavailable"):
        make_backend(0.1, CPU, torch.float32, "native")
    sentinel = object()
    monkeypatch.setattr(kernels, "native", lambda: sentinel)
    assert isinstance(make_backend(0.1, CPU, torch.float32), NativeCPUAttention)
    assert type(make_backend(0.1, CPU, torch.float64)) is TorchAttention  # no float64 kernels


def test_torch_backend_on_cuda_never_uses_cudnn_attention(monkeypatch):
    """cuDNN's SDPA builds a plan per shape, and the eager key length changes every round, so
    every round would pay for a new plan (bench/gpu_check.py measures it)."""
    from torch.nn.attention import SDPBackend
    from eagle_serve.engine.attention import cuda_sdpa_backends
    no_flash(monkeypatch)
    cuda = torch.device("cuda")
    for choice in ("auto", "torch"):
        backend = make_backend(0.1, cuda, torch.bfloat16, choice)
        assert backend.sdpa_backends == cuda_sdpa_backends()
        assert SDPBackend.CUDNN_ATTENTION not in backend.sdpa_backends
        assert SDPBackend.EFFICIENT_ATTENTION in backend.sdpa_backends  # takes masks and GQA
    assert make_backend(0.1, CPU, torch.float64, "torch").sdpa_backends is None
    # the restricted call computes what the unrestricted one does (the CPU runs it through math / flash)
    spans = [SeqSpan([3], 30, list(range(4))), SeqSpan([1, 2, 5], 7, list(range(4, 8)))]
    batch = build_forward_batch(spans, 16, CPU)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    outs = []
    for allowed in (None, cuda_sdpa_backends()):
        kv = KVCache(1, 9, 16, 2, 8, torch.float64, CPU)
        kv.data.normal_(generator=torch.Generator().manual_seed(1))
        outs.append(TorchAttention(8 ** -0.5, allowed).forward(q, k, v, 0, batch, kv))
    assert torch.equal(outs[0], outs[1])


def test_selection_with_flash_attn(monkeypatch):
    cuda = torch.device("cuda")
    real_looking = types.ModuleType("flash_attn")  # installed, but not a CPU stand-in
    monkeypatch.setitem(sys.modules, "flash_attn", real_looking)
    assert isinstance(make_backend(0.1, cuda, torch.bfloat16), FlashAttention)  # auto on CUDA
    assert isinstance(make_backend(0.1, cuda, torch.float16, "flash"), FlashAttention)
    assert type(make_backend(0.1, cuda, torch.float32)) is TorchAttention  # flash-attn has no float32
    with pytest.raises(ValueError, match="float16 or bfloat16, not float32"):
        make_backend(0.1, cuda, torch.float32, "flash")
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        make_backend(0.1, CPU, torch.bfloat16, "flash")
    assert type(make_backend(0.1, CPU, torch.float64)) is TorchAttention  # auto never picks flash on the CPU
    standin.install(monkeypatch, full_precision=False)
    assert isinstance(make_backend(0.1, CPU, torch.bfloat16, "flash"), FlashAttention)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        make_backend(0.1, CPU, torch.float64, "flash")


def test_config_and_cli_carry_the_choice():
    from eagle_serve.server.cli import build_parser, engine_kwargs
    assert EngineConfig(attention="flash").attention == "flash"
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="sdpa")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--attention", "torch"])
    assert engine_kwargs(args)["attention"] == "torch"
    assert build_parser().parse_args(["serve"]).attention == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--attention", "xformers"])
