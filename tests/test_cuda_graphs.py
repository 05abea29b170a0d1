"""CUDA graph buckets and padding, the eager fallback, the flags, and the CUDA KV sizing
arithmetic: everything that can be checked without a GPU (bench/gpu_check.py does the rest)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle_serve.engine.attention import TorchAttention
from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.cuda_graphs import (Buckets, GraphRunner, bucket_for, default_buckets, expand_batch, graphs_enabled,
                                kv_sizes_for, pad_spans, powers_up_to, scratch_blocks)
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.gpu_memory import (cuda_kv_cache_tokens, graph_reserve_bytes, kv_bytes_per_token, kv_cache_blocks,
                               kv_cache_bytes)
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.tree import from_paths

GIB = 1 << 30
CPU = torch.device("cpu")


# ---------------------------------------------------------------- buckets

def test_bucket_for_edges():
    sizes = (1, 2, 4, 8, 16, 24)
    assert bucket_for(1, sizes) == 1  # batch 1 is its own bucket
    assert bucket_for(3, sizes) == 4
    assert bucket_for(16, sizes) == 16  # exact sizes map to themselves
    assert bucket_for(17, sizes) == 24
    assert bucket_for(24, sizes) == 24
    assert bucket_for(25, sizes) is None  # beyond the largest: eager
    assert bucket_for(5, (8, 2)) == 8  # order of the sizes does not matter


def test_size_helpers():
    assert powers_up_to(1) == (1,)
    assert powers_up_to(24) == (1, 2, 4, 8, 16, 24)
    assert powers_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert kv_sizes_for(1000, 16) == (256, 512, 1008)
    assert kv_sizes_for(100, 16) == (112,)
    assert kv_sizes_for(256, 16) == (256,)
    assert kv_sizes_for(300, 256) == (256, 512)
    assert all(s % 16 == 0 for s in kv_sizes_for(4096 + 24, 16))
    b = default_buckets(64, 24, 4096 + 24, 16)
    assert b.batch == (1, 2, 4, 8, 16, 32, 64) and b.tokens == (1, 2, 4, 8, 16, 24)
    assert b.kv == (256, 512, 1024, 2048, 4096, 4128)
    assert default_buckets(64, 24, 512, 16, batch_sizes=(8, 1), token_sizes=(4,)).batch == (1, 8)
    with pytest.raises(ValueError):
        Buckets((), (1,), (16,))


def _span(n, cached, blocks=64, **kw):
    return SeqSpan([1] * n, cached, list(range(blocks)), **kw)


def test_batch_to_key():
    b = Buckets((1, 2, 4), (1, 4, 8), (256, 512), max_keys=None)
    assert b.key([_span(1, 10)]) == (1, 1, 256)
    assert b.key([_span(1, 10)] * 3) == (4, 1, 256)
    assert b.key([_span(3, 300), _span(1, 5)]) == (2, 4, 512)  # the largest tree and context decide
    assert b.key([_span(1, 255)]) == (1, 1, 256)  # 256 keys
    assert b.key([_span(1, 256)]) == (1, 1, 512)  # 257 keys
    assert b.key([_span(1, 600)]) is None  # beyond the largest kv bucket
    assert b.key([_span(9, 0)]) is None  # a prefill chunk beyond the largest tokens bucket
    assert b.key([_span(1, 0)] * 5) is None  # beyond the largest batch bucket
    assert b.key([]) is None
    assert b.key([_span(2, 4, num_masked_cached=1, tree_mask=torch.ones(2, 3, dtype=torch.bool))]) is None
    capped = Buckets((1, 2, 4), (1,), (256, 512), max_keys=512)
    assert capped.key([_span(1, 300)]) == (1, 1, 512)
    assert capped.key([_span(1, 300)] * 2) is None  # 2 x 512 gathered keys > 512
    assert capped.key([_span(1, 100)] * 2) == (2, 1, 256)
    assert capped.largest == (2, 1, 512)


# ---------------------------------------------------------------- flags

def test_graphs_only_on_cuda_and_when_enabled():
    cuda = torch.device("cuda")
    assert graphs_enabled(cuda, True) and not graphs_enabled(cuda, False) and not graphs_enabled(CPU, True)
    assert scratch_blocks(cuda, True) == 1 and scratch_blocks(cuda, False) == 0 and scratch_blocks(CPU, True) == 0
    assert EngineConfig().cuda_graphs is True and EngineConfig().gpu_memory_utilization == 0.9
    cfg = _model_config()

    def runner(device, on):  # GraphRunner.for_runner reads only these; nothing touches CUDA
        return SimpleNamespace(config=EngineConfig(cuda_graphs=on, max_num_seqs=8), device=device,
                               spec=SpecConfig("ngram"), max_model_len=512, num_blocks=10,
                               model=SimpleNamespace(config=cfg), kv=SimpleNamespace(num_blocks=11))
    assert GraphRunner.for_runner(runner(cuda, True)).enabled
    assert not GraphRunner.for_runner(runner(cuda, False)).enabled  # --no-cuda-graphs
    assert not GraphRunner.for_runner(runner(CPU, True)).enabled
    g = GraphRunner.for_runner(runner(cuda, True))
    assert g.buckets.batch == (1, 2, 4, 8) and g.buckets.tokens == (1, 2, 4) and g.scratch_block == 10


@pytest.mark.parametrize("bad", [dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5),
                                 dict(cuda_graph_batch_sizes=()), dict(cuda_graph_token_sizes=(0, 4))])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_cli_flags():
    from eagle_serve.server.cli import build_parser, engine_kwargs
    kw = engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert kw["cuda_graphs"] is True and kw["gpu_memory_utilization"] == 0.9
    args = build_parser().parse_args(["serve", "--no-cuda-graphs", "--gpu-memory-utilization", "0.5"])
    kw = engine_kwargs(args)
    assert kw["cuda_graphs"] is False and kw["gpu_memory_utilization"] == 0.5
    EngineConfig(**kw)


# ---------------------------------------------------------------- padding

def test_pad_spans_layout():
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    spans = [SeqSpan([5], 6, [2, 3]),  # decode: position 6 is slot 3 * 4 + 2
             SeqSpan([7, 8, 9], 2, [4, 5], positions=[2, 3, 3], tree_mask=tree)]
    p = pad_spans(spans, 4, 4, 8, block_size=4, scratch_block=9)
    scratch = 9 * 4
    assert p.input_ids.view(4, 4).tolist() == [[5, 0, 0, 0], [7, 8, 9, 0], [0] * 4, [0] * 4]
    assert p.positions.view(4, 4).tolist() == [[6, 0, 0, 0], [2, 3, 3, 0], [0] * 4, [0] * 4]
    assert p.slot_mapping.view(4, 4).tolist() == [[14, scratch, scratch, scratch], [18, 19, 20, scratch],
                                                  [scratch] * 4, [scratch] * 4]
    assert p.block_tables.dtype == torch.int32
    assert p.block_tables.tolist() == [[2, 3], [4, 5], [9, 9], [9, 9]]  # padded sequences: the scratch block
    assert p.num_cached.tolist() == [6, 2, 0, 0] and p.num_new.tolist() == [1, 3, 0, 0]
    assert p.tree_mask[0].tolist() == [[True, False, False, False]] + [[False] * 4] * 3
    assert torch.equal(p.tree_mask[1, :3, :3], tree) and not p.tree_mask[1, 3].any() and not p.tree_mask[1, :, 3].any()
    assert not p.tree_mask[2:].any()
    assert p.out_rows.tolist() == [0, 4, 5, 6]
    chunk = pad_spans([SeqSpan([1, 2, 3], 0, [0])], 1, 4, 4, 4, 9)  # a prefill chunk: causal
    assert chunk.tree_mask[0, :3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    for bad in ([spans[0]] * 5, [SeqSpan([1] * 5, 0, [0, 1])], [SeqSpan([1], 8, [0, 1, 2])], [SeqSpan([1], 6, [0])]):
        with pytest.raises(ValueError):  # too many sequences / tokens / keys, a short block table
            pad_spans(bad, 4, 4, 8, 4, 9)


def test_expand_batch_sees_what_the_eager_batch_sees():
    tree = from_paths(11, [[12, 13], [14]])
    spans = [SeqSpan([5], 6, [2, 3]),
             SeqSpan(tree.tokens, 3, [4, 5], positions=[3 + d for d in tree.depths], tree_mask=tree.ancestor_mask()),
             SeqSpan([1, 2, 3], 0, [6])]
    B, Q, L = 4, 8, 8
    p = pad_spans(spans, B, Q, L, 4, 9)
    padded = expand_batch(*p.tensors(), 4)
    eager = build_forward_batch(spans, 4, CPU)
    mask = padded.attn_mask[:, 0]
    emask = eager.attn_mask[:, 0]
    gather = padded.kv_gather.view(B, L)
    egather = eager.kv_gather.view(len(spans), eager.max_kv_len)
    for b, s in enumerate(spans):
        n, kv_len = len(s.token_ids), s.num_cached + len(s.token_ids)
        assert torch.equal(mask[b, :n, :kv_len], emask[b, :n, :kv_len])
        assert not mask[b, :n, kv_len:].any()  # nothing past the sequence's keys
        assert mask[b, n:].sum().item() == Q - n and mask[b, n:, 0].all()  # padded rows: key 0 only
        assert torch.equal(gather[b, :kv_len], egather[b, :kv_len])
    assert mask[3].sum().item() == Q and mask[3, :, 0].all()  # a padded sequence
    assert gather[3].tolist() == [36, 37, 38, 39] * 2  # ... reads the scratch block
    assert padded.kv_lens.tolist() == [7, 7, 3, 0]


# ---------------------------------------------------------------- numerics (tiny float64 model, CPU)

@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from eagle_serve.engine.loader import load_model
    return load_model(tiny_llama[0], torch.float64, CPU, skip_tokenizer=True)


def _prefilled_cache(loaded, num_blocks, bs, contexts):
    cfg = loaded.config
    kv = KVCache(cfg.num_layers, num_blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, torch.float64, CPU)
    backend = TorchAttention(cfg.head_dim ** -0.5)
    with torch.inference_mode():
        loaded.model(build_forward_batch([SeqSpan(ids, 0, table) for ids, table in contexts], bs, CPU), kv, backend)
    return kv, backend


def _two_equal_caches(tiny):
    """Block size, block count, three block tables, and two caches with the same two prefilled
    contexts (one for the eager reference, one for the runner under test)."""
    bs, num_blocks = 4, 48
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    contexts = [(list(range(3, 13)), tables[0]), (list(range(50, 55)), tables[1])]
    kv_a, backend = _prefilled_cache(tiny, num_blocks, bs, contexts)
    kv_b = KVCache.__new__(KVCache)
    kv_b.__dict__.update(kv_a.__dict__, data=kv_a.data.clone())
    return bs, num_blocks, tables, kv_a, kv_b, backend


def _mixed_spans(tables):
    tree = from_paths(40, [[41, 42, 43], [44, 45], [46]])
    return [SeqSpan([17], 10, tables[0]),  # decode after a 10-token context
            SeqSpan(tree.tokens, 5, tables[1], positions=[5 + d for d in tree.depths],
                    tree_mask=tree.ancestor_mask()),  # tree verification
            SeqSpan([30, 31, 32], 0, tables[2])]  # a fresh prefill chunk


@pytest.mark.parametrize("key", [(4, 8, 32), (8, 8, 64), (3, 7, 24)])
def test_padded_forward_equals_eager(tiny, key):
    bs, num_blocks, tables, kv_a, kv_b, backend = _two_equal_caches(tiny)
    spans = _mixed_spans(tables)
    with torch.inference_mode():
        ref = tiny.model(build_forward_batch(spans, bs, CPU), kv_a, backend)
        runner = GraphRunner(tiny.model, kv_b, bs, num_blocks, CPU, Buckets((1, 2, 4), (1, 8), (32,)), enabled=False)
        got = runner.padded_eager(spans, key)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    real = slice(0, num_blocks * bs)  # same KV everywhere but the scratch block
    assert torch.allclose(kv_a.data[:, :, real], kv_b.data[:, :, real], atol=1e-10, rtol=0)
    assert kv_b.data[:, :, num_blocks * bs:].abs().sum() > 0  # the padding wrote there


def test_runner_falls_back_to_eager_on_cpu(tiny):
    bs, num_blocks = 4, 48
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    kv, backend = _prefilled_cache(tiny, num_blocks, bs, [(list(range(3, 13)), tables[0]),
                                                          (list(range(50, 55)), tables[1])])
    spans = _mixed_spans(tables)
    runner = GraphRunner(tiny.model, kv, bs, num_blocks, CPU, default_buckets(8, 8, 64, bs), enabled=True)
    assert not runner.enabled  # the CPU never captures
    with torch.inference_mode():
        got = runner.forward(spans, backend)
        ref = tiny.model(build_forward_batch(spans, bs, CPU), kv, backend)
    assert torch.equal(got, ref)
    assert (runner.stats.eager, runner.stats.replays, runner.stats.captures) == (1, 0, 0) and not runner.graphs


def test_graph_path_plumbing_with_a_stand_in_capture(tiny, monkeypatch):
    """GraphRunner.forward's CUDA path on the CPU: padding, copies into the shared static
    buffers, replay, the real rows picked out; the capture is replaced by replaying the captured
    function eagerly (what record_graph would record)."""
    import eagle_serve.engine.cuda_graphs as cg
    monkeypatch.setattr(cg, "record_graph", lambda run, device, pool: SimpleNamespace(replay=run))
    monkeypatch.setattr(cg.GraphRunner, "_pool_handle", lambda self: None)
    bs, num_blocks, tables, kv_a, kv_b, backend = _two_equal_caches(tiny)
    runner = GraphRunner(tiny.model, kv_b, bs, num_blocks, CPU, Buckets((1, 2, 4), (1, 2, 4, 8), (16, 32)), enabled=False)
    runner.enabled = True  # as on CUDA
    batches = [_mixed_spans(tables), [SeqSpan([21], 11, tables[0])], _mixed_spans(tables),
               [SeqSpan([22], 12, tables[0]), SeqSpan([23], 12, tables[1])],
               [SeqSpan(list(range(60, 69)), 3, tables[2])]]  # 9 new tokens: past the tokens buckets, eager
    with torch.inference_mode():
        for spans in batches:
            got = runner.forward(spans, backend)
            ref = tiny.model(build_forward_batch(spans, bs, CPU), kv_a, backend)
            assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    assert sorted(runner.graphs) == [(1, 1, 16), (2, 1, 16), (4, 8, 16)]
    s = runner.stats
    assert (s.captures, s.replays, s.eager, s.failed) == (3, 4, 1, 0)
    real = slice(0, num_blocks * bs)
    assert torch.allclose(kv_a.data[:, :, real], kv_b.data[:, :, real], atol=1e-10, rtol=0)


def test_a_failed_capture_runs_eager(tiny, monkeypatch):
    import eagle_serve.engine.cuda_graphs as cg

    def broken(run, device, pool):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(cg, "record_graph", broken)
    monkeypatch.setattr(cg.GraphRunner, "_pool_handle", lambda self: None)
    kv, backend = _prefilled_cache(tiny, 48, 4, [(list(range(3, 13)), list(range(8)))])
    runner = GraphRunner(tiny.model, kv, 4, 48, CPU, Buckets((1,), (1,), (16,)), enabled=False)
    runner.enabled = True
    spans = [SeqSpan([21], 10, list(range(8)))]
    with torch.inference_mode():
        runner.forward(spans, backend)
        runner.forward(spans, backend)
    assert (runner.stats.failed, runner.stats.eager, runner.stats.replays) == (1, 2, 0)  # tried once only
    assert "capture failed" in runner.failed[(1, 1, 16)]


def test_engine_on_cpu_is_unchanged(tiny_llm):
    from eagle_serve.engine.sampling_params import SamplingParams
    r = tiny_llm.runner
    assert not r.graphs.enabled and r.kv.num_blocks == r.num_blocks  # no scratch block on the CPU
    before = r.graphs.stats.eager
    out = tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and r.graphs.stats.eager > before and r.graphs.stats.replays == 0


# ---------------------------------------------------------------- KV sizing on CUDA (made-up numbers)

def test_kv_cache_bytes_arithmetic():
    assert kv_cache_bytes(80 * GIB, 20 * GIB, 0.9) == int(80 * GIB * 0.9) - 20 * GIB
    assert kv_cache_bytes(80 * GIB, 20 * GIB, 0.9, reserve=2 * GIB) == int(80 * GIB * 0.9) - 22 * GIB
    assert kv_cache_bytes(80 * GIB, 20 * GIB, 1.0) == 60 * GIB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*--gpu-memory-utilization"):
        kv_cache_bytes(16 * GIB, 15 * GIB, 0.9)  # 14.4 GiB allowed, 15 GiB already in use
    with pytest.raises(ValueError, match="CUDA graphs reserve"):
        kv_cache_bytes(16 * GIB, 10 * GIB, 0.9, reserve=5 * GIB)
    with pytest.raises(ValueError):
        kv_cache_bytes(16 * GIB, 1, 0.0)


def test_kv_blocks_and_bytes_per_token():
    llama8b = kv_bytes_per_token(32, 8, 128, 2)
    assert llama8b == 128 * 1024  # 128 KiB per token in bf16
    assert kv_bytes_per_token(32, 8, 128, 2, draft_layers=1) == llama8b * 33 // 32
    # the head's feature cache: its width in values a token ([f ; 3 aux] = 4 x 4096 here)
    assert kv_bytes_per_token(32, 8, 128, 2, draft_layers=1, draft_feature_width=4 * 4096) == \
        llama8b * 33 // 32 + 4 * 4096 * 2
    assert kv_cache_blocks(1000, 10, 16) == 6
    assert kv_cache_blocks(160, 10, 16) == 1
    with pytest.raises(ValueError, match="does not hold one block"):
        kv_cache_blocks(159, 10, 16)
    small = graph_reserve_bytes(8, 8, 1024, 32, 8, 128, 4096, 14336, 2)
    assert 0 < small < graph_reserve_bytes(8, 8, 4096, 32, 8, 128, 4096, 14336, 2)


def _model_config(**kw):
    base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False)
    return ModelConfig(**{**base, **kw})


def test_cuda_kv_tokens_from_profile(monkeypatch):
    import eagle_serve.engine.gpu_memory as gm
    monkeypatch.setattr(gm, "profile_in_use", lambda runner: (80 * GIB, 20 * GIB))
    cfg = _model_config()

    def runner(**kw):
        return SimpleNamespace(config=EngineConfig(**kw), loaded=SimpleNamespace(config=cfg),
                               device=torch.device("cuda"), dtype=torch.bfloat16)
    per_token = 128 * 1024
    tokens = cuda_kv_cache_tokens(runner(cuda_graphs=False, block_size=16))
    assert tokens == (int(80 * GIB * 0.9) - 20 * GIB) // (per_token * 16) * 16
    with_graphs = cuda_kv_cache_tokens(runner(block_size=16))
    assert tokens - 16 * 1024 < with_graphs < tokens  # the graph pool's reserve comes off (under 2 GiB here)
    assert cuda_kv_cache_tokens(runner(cuda_graphs=False, gpu_memory_utilization=0.5)) < tokens
    with pytest.raises(ValueError, match="no GPU memory left"):
        cuda_kv_cache_tokens(runner(cuda_graphs=False, gpu_memory_utilization=0.25))  # 20 GiB allowed, 20 in use


def test_kv_budget_counts_the_heads_feature_cache(tmp_path, monkeypatch):
    """Sized by memory, the KV cache leaves room for the EAGLE head's KV and feature cache: a
    fused head's wider features cost blocks, on the GPU and the CPU alike."""
    import json

    import eagle_serve.engine.gpu_memory as gm
    from eagle_serve.engine.speculative.config import SpecConfig
    monkeypatch.setattr(gm, "profile_in_use", lambda runner: (80 * GIB, 20 * GIB))
    cfg = _model_config()
    heads = {}
    for name, aux in (("plain", None), ("fused", [2, 15, 27])):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 4096} | ({"aux_layers": aux} if aux else {})))
        heads[name] = str(d)

    def tokens(draft):
        spec = SpecConfig("eagle2" if draft else "none")
        return cuda_kv_cache_tokens(SimpleNamespace(
            config=EngineConfig(cuda_graphs=False, block_size=16, spec=spec, draft=draft),
            loaded=SimpleNamespace(config=cfg), device=torch.device("cuda"), dtype=torch.bfloat16))
    budget = int(80 * GIB * 0.9) - 20 * GIB
    assert tokens(None) == budget // (128 * 1024 * 16) * 16
    for name, width in (("plain", 4096), ("fused", 4 * 4096)):
        assert tokens(heads[name]) == budget // ((128 * 1024 * 33 // 32 + width * 2) * 16) * 16
    assert gm.draft_feature_width(EngineConfig(spec=SpecConfig("eagle2"), draft=heads["fused"]), 576) == 4 * 576
    assert gm.draft_feature_width(EngineConfig(spec=SpecConfig("eagle2"), draft=None), 576) == 0
