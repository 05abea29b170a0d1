"""The CPU fast paths of `Linear` (native skinny kernel, oneDNN prepack) equal F.linear."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from eagle_serve.engine import kernels
from eagle_serve.engine.layers import SKINNY_MAX_ROWS, Linear, onednn_rows

native = kernels.native()


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# up to 4 rows: one weight row at a time; more: 2 x 4 register tiles, with ragged edges in m, n, k
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (2, 64, 8), (3, 100, 13), (4, 1536, 37), (1, 7, 1),
                                     (5, 576, 961), (8, 100, 13), (13, 1536, 37), (16, 40, 2), (31, 576, 7)])
def test_native_skinny_linear_matches_reference(dtype, tol, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    for bias in (None, b):
        got = native.skinny_linear(x, w, bias).double()
        want = ref if bias is not None else ref - b.double()
        assert got.shape == (m, n) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 33])
def test_prepacked_linear_matches_f_linear(dtype, rows):
    lin = Linear(96, 200, bias=True)
    gen = torch.Generator().manual_seed(rows)
    lin.weight.data = (torch.randn(200, 96, generator=gen) / 10).to(dtype)
    lin.bias.data = torch.randn(200, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert lin.prepack()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol)



def test_onednn_rows_buckets_row_counts():
    assert [onednn_rows(m) for m in (17, 32, 33, 256, 257, 1024, 1025)] == [32, 32, 48, 256, 320, 1024, 1280]
    assert all(onednn_rows(m) >= m and onednn_rows(m) - m < 256 for m in range(1, 3000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_products_padded_to_a_bucket_give_each_rows_own_result(dtype):
    """Linear pads oneDNN's rows up to onednn_rows (so a new row count reuses a built kernel):
    every row must come out as the unpadded product computes it, bit for bit, and as the same
    row in a product of more rows."""
    lin = Linear(576, 1536, bias=False)
    gen = torch.Generator().manual_seed(0)
    lin.weight.data = (torch.randn(1536, 576, generator=gen) / 20).to(dtype)
    lin.prepack()
    if lin._packed is None:
        pytest.skip("no oneDNN prepacked path for this dtype here")
    lin.bucket_rows = True
    lin.native_max_rows = 0  # every row count through oneDNN (the native kernels take up to 64 rows on some CPUs)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    whole = torch.ops.mkldnn._linear_pointwise(x, lin._packed, None, "none", [], "")
    for m in (17, 37, 100, 255, 257, 300):
        got = lin(x[:m])
        assert got.shape == (m, 1536) and got.is_contiguous()
        unpadded = torch.ops.mkldnn._linear_pointwise(x[:m].contiguous(), lin._packed, None, "none", [], "")
        assert torch.equal(got, unpadded)
        assert torch.equal(got, whole[:m])

H, Hkv, D, BS = 6, 2, 32, 4  # attention test shapes: GQA, blocks of 4


def _twin_caches(n_blocks: int, dtype, gen):
    """Two equal random KV caches (one per backend) and a shuffled block order."""
    from eagle_serve.engine.kv_cache import KVCache
    kv_a = KVCache(1, n_blocks, BS, Hkv, D, dtype, torch.device("cpu"))
    kv_a.data.copy_(torch.randn(kv_a.data.shape, generator=gen).to(dtype))
    kv_b = KVCache(1, n_blocks, BS, Hkv, D, dtype, torch.device("cpu"))
    kv_b.data.copy_(kv_a.data)
    return kv_a, kv_b, torch.randperm(n_blocks, generator=gen).tolist()


def _qkv(T: int, dtype, gen):
    return (torch.randn(T, H, D, generator=gen).to(dtype), torch.randn(T, Hkv, D, generator=gen).to(dtype),
            torch.randn(T, Hkv, D, generator=gen).to(dtype))


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_paged_attention_matches_torch_backend(dtype, tol):
    """Packed batch: a decode, a tree and a short chunk, GQA, shuffled blocks, vs the torch path."""
    from eagle_serve.engine.attention import NativeCPUAttention, TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.speculative.tree import from_paths
    gen = torch.Generator().manual_seed(0)
    kv_a, kv_b, blocks = _twin_caches(64, dtype, gen)
    tree = from_paths(1, [[2, 3], [2, 4], [5]])
    spans = [SeqSpan([7], 13, blocks[:4]), SeqSpan(tree.tokens, 9, blocks[4:8], tree_mask=tree.ancestor_mask()),
             SeqSpan([1, 2, 3], 5, blocks[8:10])]
    batch = build_forward_batch(spans, BS, torch.device("cpu"))
    q, k, v = _qkv(batch.input_ids.shape[0], dtype, gen)
    want = TorchAttention(D ** -0.5).forward(q, k, v, 0, batch, kv_a).float()
    got = NativeCPUAttention(D ** -0.5, native).forward(q, k, v, 0, batch, kv_b).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(kv_b.data, kv_a.data)  # the same KV written
    single = build_forward_batch([SeqSpan([7], 13, blocks[:4])], BS, torch.device("cpu"))  # no mask at all
    want = TorchAttention(D ** -0.5).forward(q[:1], k[:1], v[:1], 0, single, kv_a).float()
    got = NativeCPUAttention(D ** -0.5, native).forward(q[:1], k[:1], v[:1], 0, single, kv_b).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_paged_attention_long_contexts_match_torch_backend(dtype, tol):
    """Rows whose keys span different numbers of chunks (128 keys each) in one batch: a tree over
    290 committed keys, a decode over 130, one over 40, and a decode row of 257 (the kernel's
    work items are per row, KV head and chunk, ordered by sequence, then merged)."""
    from eagle_serve.engine.attention import NativeCPUAttention, TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.speculative.tree import from_paths
    gen = torch.Generator().manual_seed(3)
    kv_a, kv_b, blocks = _twin_caches(240, dtype, gen)
    tree = from_paths(1, [[2, 3], [2, 4], [5]])
    spans = [SeqSpan([7], 130, blocks[:34]), SeqSpan(tree.tokens, 290, blocks[34:110], tree_mask=tree.ancestor_mask()),
             SeqSpan([9], 40, blocks[110:121]), SeqSpan([4], 256, blocks[121:186])]
    batch = build_forward_batch(spans, BS, torch.device("cpu"))
    q, k, v = _qkv(batch.input_ids.shape[0], dtype, gen)
    want = TorchAttention(D ** -0.5).forward(q, k, v, 0, batch, kv_a).float()
    got = NativeCPUAttention(D ** -0.5, native).forward(q, k, v, 0, batch, kv_b).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 37, 300])  # 300: several key chunks (CHUNK 128), merged
# head dims with compiled register layouts (32, 64, 128) and the run-time one (48); 1-8 query
# heads per KV head (groups of up to 4, or 2 at 128)
@pytest.mark.parametrize("H, Hkv, D", [(4, 2, 32), (9, 3, 64), (16, 2, 64), (6, 2, 128), (2, 1, 48)])
def test_native_paged_attention_depends_only_on_the_visible_keys(dtype, n, H, Hkv, D):
    """Bit-identical output for a query that sees the same keys contiguously (a plain step) or
    scattered among masked ones (a tree node: committed keys, then its ancestors among other
    nodes), as verified trees need; the kernel works through keys in blocks, which must be cut
    from the visible keys. Also checks it against a float64 softmax."""
    gen = torch.Generator().manual_seed(n)
    S = max(96, n + 60)
    kc = torch.randn(S, Hkv, D, generator=gen).to(dtype)
    vc = torch.randn(S, Hkv, D, generator=gen).to(dtype)
    q = (torch.randn(1, H, D, generator=gen) * 2).to(dtype)
    seen = torch.randperm(S, generator=gen)[:n + 3].tolist()  # the query's keys, in order
    junk = [x for x in range(S) if x not in seen][:40]
    # scattered: the committed n keys, then each of 3 ancestors behind a run of masked keys
    slots = seen[:n] + junk[:13] + seen[n:n + 1] + junk[13:30] + seen[n + 1:n + 2] + junk[30:31] + seen[n + 2:]
    mask = torch.tensor([[[x in seen for x in slots]]])
    one = lambda s, m: native.paged_attention(  # noqa: E731
        q, kc, vc, torch.tensor([s]), torch.tensor([len(s)]), torch.tensor([0]), torch.tensor([0]), m, D ** -0.5)
    scattered = one(slots, mask)
    contiguous = one(seen, torch.empty(0, dtype=torch.bool))
    assert torch.equal(scattered, contiguous)
    k64, v64 = kc[seen].double(), vc[seen].double()  # [n + 3, Hkv, D]
    g = H // Hkv
    want = torch.stack([torch.softmax(k64[:, h // g] @ q[0, h].double() * D ** -0.5, 0) @ v64[:, h // g]
                        for h in range(H)]).reshape(1, H * D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(contiguous.double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 300])  # committed keys: within, at and across key chunks (128)
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (16, 2, 64), (6, 2, 128), (2, 1, 48)])
def test_native_paged_attention_rows_sharing_keys_compute_what_each_row_alone_does(dtype, n, H, Hkv, D):
    """A row's output must be bit-identical to that row alone over its visible keys, whatever
    other rows and sequences share the batch (a tree's other nodes over the same committed keys,
    a plain step, a causal prompt chunk), in whatever order the rows come: what greedy
    speculation's equality with plain decoding rests on, and what a kernel that reads rows
    sharing keys together (a work item per sequence, not per row) must keep."""
    gen = torch.Generator().manual_seed(1000 + n)
    S = n + 120
    kc = torch.randn(S, Hkv, D, generator=gen).to(dtype)
    vc = torch.randn(S, Hkv, D, generator=gen).to(dtype)
    perm = torch.randperm(S, generator=gen).tolist()
    # sequence 0: n committed keys, then a tree of 5 nodes (0 root; 1, 2 its children; 3 under 1; 4 under 3)
    committed, nodes = perm[:n], perm[n:n + 5]
    parents = [None, 0, 0, 1, 3]
    seq0 = committed + nodes
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j is not None:
            tree[i, j] = True
            j = parents[j]
    # sequence 1: a plain step over 70 other keys; sequence 2: a causal prompt chunk of 3 rows after 90 keys
    seq1 = perm[n + 5:n + 75]
    seq2 = perm[n + 5:n + 5 + 93]  # shares slots with sequence 1: only its own rows' lists matter
    L = max(len(seq0), len(seq1), len(seq2))
    gather = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, 5, L, dtype=torch.bool)
    for b, sl in enumerate((seq0, seq1, seq2)):
        gather[b, :len(sl)] = torch.tensor(sl)
    mask[0, :, :n] = True
    mask[0, :, n:n + 5] = tree
    mask[1, 0, :70] = True
    for r in range(3):
        mask[2, r, :91 + r] = True
    # rows interleaved across sequences: (seq, row)
    rows = [(0, 0), (2, 0), (0, 1), (1, 0), (0, 2), (2, 1), (0, 3), (2, 2), (0, 4)]
    q = (torch.randn(len(rows), H, D, generator=gen) * 2).to(dtype)
    lens = torch.tensor([len(seq0), len(seq1), len(seq2)])
    batched = native.paged_attention(q, kc, vc, gather, lens, torch.tensor([b for b, _ in rows]),
                                     torch.tensor([r for _, r in rows]), mask, D ** -0.5)
    for i, (b, r) in enumerate(rows):
        visible = [gather[b, j].item() for j in range(L) if mask[b, r, j]]
        alone = native.paged_attention(q[i:i + 1], kc, vc, torch.tensor([visible]), torch.tensor([len(visible)]),
                                       torch.tensor([0]), torch.tensor([0]), torch.empty(0, dtype=torch.bool),
                                       D ** -0.5)
        assert torch.equal(batched[i], alone[0]), (b, r)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixed_prefill_and_decode_batch_matches_torch_backend(dtype, tol):
    """Continuous batching: a 100-token prefill chunk (past the native kernel's query limit)
    packed with a decode, a tree and a fresh prompt: long ones alone, short ones native."""
    from eagle_serve.engine.attention import NativeCPUAttention, TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.speculative.tree import from_paths
    gen = torch.Generator().manual_seed(1)
    kv_a, kv_b, blocks = _twin_caches(128, dtype, gen)
    tree = from_paths(1, [[2, 3], [2, 4], [5]])
    spans = [SeqSpan([7], 13, blocks[:4]), SeqSpan(list(range(100)), 8, blocks[4:32]),
             SeqSpan(tree.tokens, 9, blocks[32:36], tree_mask=tree.ancestor_mask()),
             SeqSpan(list(range(70)), 0, blocks[36:54]), SeqSpan([1, 2, 3], 5, blocks[54:56])]
    batch = build_forward_batch(spans, BS, torch.device("cpu"))
    q, k, v = _qkv(batch.input_ids.shape[0], dtype, gen)
    want = TorchAttention(D ** -0.5).forward(q, k, v, 0, batch, kv_a).float()
    got = NativeCPUAttention(D ** -0.5, native).forward(q, k, v, 0, batch, kv_b).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(kv_b.data, kv_a.data)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_add_rms_norm(dtype, tol):
    from eagle_serve.engine.layers import RMSNorm
    norm = RMSNorm(40, 1e-5)
    norm.weight.data = torch.randn(40).to(dtype)
    x, delta = torch.randn(3, 40).to(dtype), torch.randn(3, 40).to(dtype)
    want_res = (x.float() + delta.float())
    want = F.rms_norm(want_res, (40,), norm.weight.float(), 1e-5)
    got, res = norm.add_forward(delta, x.clone())
    torch.testing.assert_close(res.float(), want_res, rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("aux", [(), (0,)])
def test_native_decode_stack_matches_python_forward(tiny_llama, dtype, tol, aux):
    """The one-call native stack gives the Python path's hidden states and KV (decode batch of
    two sequences, a single-sequence step, a 6-row step; shuffled blocks); with aux layers set
    (a fused-feature draft head's), also the same residual stream after them."""
    from eagle_serve.engine.attention import make_backend
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import load_model
    loaded = load_model(tiny_llama[0], dtype, torch.device("cpu"), skip_tokenizer=True)
    model, cfg = loaded.model, loaded.config
    model.prepack()
    assert model._stack is not None
    model.set_aux_layers(aux)
    backend = make_backend(cfg.head_dim ** -0.5, torch.device("cpu"), dtype)
    caches = [KVCache(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
              for _ in range(2)]
    blocks = [[9, 3, 17, 5, 22, 25], [1, 30, 12, 7]]
    prompts = [[5, 8, 13, 21, 34, 55, 89, 144, 233, 10, 11, 12, 13, 14, 15, 16, 17], [7, 6, 5, 4, 3, 2, 1, 9]]
    outs = []
    for kv, use_stack in zip(caches, (True, False)):
        stack = model._stack
        model._stack = stack if use_stack else None
        with torch.inference_mode():
            prefill = build_forward_batch([SeqSpan(p, 0, b) for p, b in zip(prompts, blocks)], 4, torch.device("cpu"))
            # 25 rows: the Python path, except in bf16 where oneDNN has no bf16 (the stack then takes
            # up to STACK_ALL_ROWS rows)
            model(prefill, kv, backend)
            step = build_forward_batch([SeqSpan([40], len(prompts[0]), blocks[0]), SeqSpan([41], len(prompts[1]), blocks[1])],
                                       4, torch.device("cpu"))
            two = model(step, kv, backend)
            one = model(build_forward_batch([SeqSpan([42], len(prompts[0]) + 1, blocks[0])], 4, torch.device("cpu")),
                        kv, backend)
            # 6 rows: the stack's tiled kernel path (more than 4 rows per linear)
            six = model(build_forward_batch([SeqSpan([43, 44, 45], len(prompts[0]) + 2, blocks[0]),
                                             SeqSpan([46, 47, 48], len(prompts[1]) + 1, blocks[1])],
                                            4, torch.device("cpu")), kv, backend)
        model._stack = stack
        outs.append((two.float(), one.float(), six.float(), kv.data.float()))
        assert two.shape[-1] == cfg.hidden_size * (1 + len(aux))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_native_decode_stack_refuses_a_slot_outside_the_cache(tiny_llama):
    """The stack writes K and V straight into the cache's memory: a slot past its end (or
    negative) is refused before any layer runs, and the cache is left as it was."""
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import load_model
    from eagle_serve.engine.models.llama import native_stack_forward
    loaded = load_model(tiny_llama[0], torch.float32, torch.device("cpu"), skip_tokenizer=True)
    model, cfg = loaded.model, loaded.config
    model.prepack()
    kv = KVCache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    batch = build_forward_batch([SeqSpan([5, 6], 0, [1])], 4, torch.device("cpu"))
    h = model.model.embed_tokens(batch.input_ids)
    before = kv.data.clone()
    for bad in (kv.data.shape[2], -1):
        batch.slot_mapping = torch.tensor([4, bad])
        with pytest.raises(RuntimeError, match="slot out of range"):
            native_stack_forward(model._stack, h, batch, kv, model.model.rotary)
        assert torch.equal(kv.data, before)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 5])
def test_native_aux_norm_matches_the_torch_expression(dtype, tol, rows):
    """A fused head's aux features: each chunk RMS-normalised, one native call on the CPU."""
    from eagle_serve.engine.speculative.eagle_head import aux_norm
    torch.manual_seed(0)
    n, h, eps = 3, 96, 1e-5
    x = (torch.randn(rows, n * h) * torch.tensor([0.5, 4.0, 30.0]).repeat_interleave(h)).to(dtype)
    ref = x.double().view(rows, n, h)
    ref = (ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + eps)).view(rows, n * h)
    got = aux_norm(x, n, eps)  # the native path
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(native.rms_norm_chunks(x, n, eps), got, rtol=0, atol=0)
    x.requires_grad_(True)  # with autograd: the torch expression (within an ulp of the kernel in bf16)
    torch.testing.assert_close(aux_norm(x, n, eps).detach().double(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_native_stack_silu_lanes_tail_and_large_gates(tmp_path, dtype, tol):
    """The stack's vectorised SiLU x up: an intermediate size that leaves a scalar tail (40 = 2 x
    16 + 8) and gate pre-activations of +-100 (exp's clamps) give the Python path's states."""
    from conftest import write_tiny_model
    from eagle_serve.engine.attention import make_backend
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import load_model
    write_tiny_model(str(tmp_path), layers=1, intermediate=40, tokenizer=False)
    loaded = load_model(str(tmp_path), dtype, torch.device("cpu"), skip_tokenizer=True)
    model, cfg = loaded.model, loaded.config
    with torch.no_grad():  # gate rows scaled up: |g| reaches ~100 on these inputs
        model.model.layers[0].mlp.gate_up_proj.weight[:40] *= 60
    model.prepack()
    assert model._stack is not None
    backend = make_backend(cfg.head_dim ** -0.5, torch.device("cpu"), dtype)
    outs = []
    for use_stack in (True, False):
        kv = KVCache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
        stack = model._stack
        model._stack = stack if use_stack else None
        with torch.inference_mode():
            model(build_forward_batch([SeqSpan([5, 8, 13, 21, 34, 55], 0, [3, 1])], 4, torch.device("cpu")), kv, backend)
            outs.append(model(build_forward_batch([SeqSpan([40, 41, 42], 6, [3, 1, 6])], 4, torch.device("cpu")),
                              kv, backend).float())
        model._stack = stack
    scale = outs[1].abs().max()
    torch.testing.assert_close(outs[0] / scale, outs[1] / scale, rtol=tol, atol=tol)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_skinny_float_out_keeps_the_accumulator():
    """The LM head's logits come out in float32 straight from the accumulator: no bf16 rounding
    (which at |logit| ~ 25 has steps of 0.125 and turns near-ties into exact ties)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 576, generator=gen).bfloat16()
    w = (torch.randn(300, 576, generator=gen) / 5).bfloat16()
    ref = x.double() @ w.double().T  # bf16 products are exact in float32; only the sum rounds
    got = native.skinny_linear(x, w, None, True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    rounded = native.skinny_linear(x, w, None, False).double()
    assert (rounded - ref).abs().max() > 10 * (got.double() - ref).abs().max()


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (3, 64, 32), (8, 1536, 64), (9, 100, 96), (17, 576, 32)])
def test_packed_bf16_linear_matches_reference_and_is_row_independent(m, k, n):
    """pack_bf16 + skinny_linear: the float64 product within bf16 tolerance, and each row's
    result bit-identical whether it comes alone or with other rows (what keeps verified trees
    equal to plain decoding)."""
    gen = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = native.pack_bf16(w)
    assert packed.shape == (n // 32, k // 2, 64)
    for bias in (None, b):
        got = native.skinny_linear(x, packed, bias, True)
        want = F.linear(x.double(), w.double(), None if bias is None else b.double())
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
        alone = torch.cat([native.skinny_linear(x[i:i + 1].contiguous(), packed, bias, True) for i in range(m)])
        assert torch.equal(got, alone)
    with pytest.raises(RuntimeError, match="N % 32"):
        native.pack_bf16(w[: n - 1].contiguous() if n > 32 else torch.zeros(31, k, dtype=torch.bfloat16))


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("int8", [False, True, "w8a8"])
def test_native_head_stack_matches_python_forward(tiny_llama, tmp_path, dtype, tol, int8):
    """The EAGLE head's layer as a one-layer native stack (no input norm, no final norm) gives
    the Python path's features and draft KV: pairs consumed by two sequences, then a frontier
    over masked scratch keys, as drafting feeds it; with int8 weights (every call here has at
    most INT8_MAX_ROWS rows) both paths read them."""
    from eagle_serve.engine.attention import make_backend
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import load_model
    from eagle_serve.engine.speculative.eagle_drafter import _rotary
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    from tests.spec_helpers import write_eagle_head
    target = load_model(tiny_llama[0], dtype, torch.device("cpu"), skip_tokenizer=True).model
    target.prepack()
    head = load_eagle_head(write_eagle_head(str(tmp_path / "head"), tiny_llama[0], std=0.2), target, dtype)
    needs_vnni(int8 == "w8a8")
    head.prepack(int8=bool(int8), int8_inputs=int8 == "w8a8")
    assert head._stack is not None and head._stack_max_rows >= 4
    assert all((m.int8_weight is not None) == bool(int8) for m in head.modules() if isinstance(m, Linear))
    cfg = head.config
    backend = make_backend(cfg.head_dim ** -0.5, torch.device("cpu"), dtype)
    rotary = _rotary(cfg)
    gen = torch.Generator().manual_seed(3)
    blocks = [[9, 3, 17, 5], [1, 30, 12, 7]]
    # 2 + 2 committed pairs, then 2 + 2 frontier nodes (depth 2: one scratch key each, masked)
    consume = [SeqSpan([5, 8], 0, blocks[0]), SeqSpan([7, 6], 0, blocks[1])]
    frontier = [SeqSpan([11, 12], 3, blocks[b], positions=[2, 2], num_masked_cached=1,
                        tree_mask=torch.tensor([[True, True, False], [False, False, True]])) for b in range(2)]
    scratch = [SeqSpan([13], 2, blocks[b]) for b in range(2)]
    feats = [torch.randn(4, cfg.hidden_size, generator=gen).to(dtype) for _ in range(2)] + \
            [torch.randn(2, cfg.hidden_size, generator=gen).to(dtype)]
    def run(use_stack, last):
        stack = head._stack
        head._stack = stack if use_stack else None
        kv = KVCache(1, 32, 4, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
        got = []
        with torch.inference_mode():
            for spans, f in ((consume, feats[0]), (scratch, feats[2]), (last, feats[1])):
                batch = build_forward_batch(spans, 4, torch.device("cpu"))
                got.append(head(target.model.embed_tokens(batch.input_ids), f, batch, kv, backend, rotary).float())
        head._stack = stack
        return got + [kv.data.float()]

    outs = [run(True, frontier), run(False, frontier)]
    # bf16: RoPE tables are float32 natively, bf16 in Python; roundings spread, and where int8
    # products round their inputs to 8 bits too (VNNI) such a difference can move an input a step
    close = tol * (2 if int8 == "w8a8" and dtype == torch.bfloat16 else 1)
    for a, b in zip(*outs):
        assert ((a - b).norm() / b.norm()).item() < close, ((a - b).norm() / b.norm()).item()
    # the stack applies the frontier's mask over the scratch key: unmasked, the rows come out otherwise
    unmasked = [SeqSpan(sp.token_ids, sp.num_cached, sp.block_table, positions=sp.positions, num_masked_cached=1,
                        tree_mask=torch.ones(2, 3, dtype=torch.bool)) for sp in frontier]
    seen_all = run(True, unmasked)[2]
    assert ((seen_all - outs[0][2]).norm() / outs[0][2].norm()).item() > 10 * tol


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_a_cached_prompt_reruns_bit_identical_in_bf16(tiny_llama, spec):
    # A rerun computes only the tail a prefix-cache hit leaves, in a forward of a few rows; the
    # few-row native kernels and oneDNN's GEMM and SDPA round differently in bf16, so a prompt
    # chunk takes the kernels its whole prompt's length picks, and a prompt's last token is not
    # drafted on, even as a one-token tail.
    import random
    from eagle_serve.engine.sampling_params import SamplingParams
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.llm import LLM
    llm = LLM(tiny_llama[0], dtype="bfloat16", device="cpu", kv_cache_tokens=4096, block_size=16,
              spec=SpecConfig(spec), tree_budget=False)
    rng = random.Random(0)
    for n in (100, 20, 17, 33):  # tails of 4 rows after 96 cached tokens and after 16; of 1 after 16 and 32
        # (a pattern that repeats: the n-gram drafter finds something to propose on the last token)
        prompt = ([rng.randrange(3, 300) for _ in range(6)] * 20)[:n]
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
        first = llm.generate(prompt, params)[0]
        hits = llm.allocator.prefix_hit_tokens
        again = llm.generate(prompt, params)[0]
        assert llm.allocator.prefix_hit_tokens - hits == n // 16 * 16
        assert again.token_ids == first.token_ids
        assert [(x.logprob, x.top) for x in again.logprobs] == [(x.logprob, x.top) for x in first.logprobs]


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_nta_streams_switch_default_by_vendor_and_same_numbers():
    """Non-temporal streams are a prefetch hint only: on or off, a large linear (over 16 MB, the
    streamed size) gives the same bits. The default is on for AMD CPUs only (it nearly halved
    plain decoding on an Intel Xeon)."""
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    before = native.nta_streams()
    amx_before = native.amx() if hasattr(native, "amx") else False
    try:
        if amx_before:  # the streams belong to the AVX-512 loop; AMX tiles would take this weight
            native.set_amx(False)
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(8192 * 2 + 32, 576, generator=gen) * 0.02).to(torch.bfloat16)  # 19 MB
        wp = native.pack_bf16(w)
        x = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
        outs = []
        for on in (True, False):
            native.set_nta_streams(on)
            assert native.nta_streams() is on
            outs.append(native.skinny_linear(x, wp, None, True))
        assert torch.equal(outs[0], outs[1])
        ref = x.float() @ w.float().T
        assert (outs[0] - ref).abs().max() < 1e-2
    finally:
        native.set_nta_streams(before)
        if amx_before:
            native.set_amx(True)
    assert before is amd or "EAGLE_SERVE_NTA_STREAMS" in os.environ


def test_nta_streams_env_is_checked(monkeypatch):
    calls = []

    class Mod:
        def set_nta_streams(self, on):
            calls.append(on)

    for value, want in (("1", [True]), ("0", [False]), ("", []), (" On ", [True]), ("false", [False])):
        calls.clear()
        monkeypatch.setenv("EAGLE_SERVE_NTA_STREAMS", value)
        kernels.configure(Mod())
        assert calls == want
    monkeypatch.setenv("EAGLE_SERVE_NTA_STREAMS", "2")
    with pytest.raises(ValueError, match="expected 1/0, true/false"):
        kernels.configure(Mod())


amx = native is not None and hasattr(native, "amx") and native.amx()


@pytest.mark.skipif(not amx, reason="no AMX on this CPU (or OS)")
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (64, 32), (96, 2880), (64, 48)])
def test_amx_products_match_reference_and_each_row_stands_alone(n, k):
    """The AMX path (k = 48: not a multiple of 32, the AVX-512 loop at every row count): within
    bf16 products' error of float64, within float32 rounding of the AVX-512 path, and every
    row's result the same whatever rows come with it (every prefix of 1..40 rows: several
    16-row blocks, ragged)."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    wp = native.pack_bf16(w)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    try:
        native.set_amx(False)
        avx = native.skinny_linear(x, wp, b, True)
        native.set_amx(True)
        full = native.skinny_linear(x, wp, b, True)
        ref = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(full.double(), ref, rtol=0, atol=1e-4)
        torch.testing.assert_close(full, avx, rtol=0, atol=1e-4)
        for m in range(1, 41):
            assert torch.equal(native.skinny_linear(x[:m].contiguous(), wp, b, True), full[:m])
        for i in (0, 7, 39):
            assert torch.equal(native.skinny_linear(x[i:i + 1].contiguous(), wp, b, True), full[i:i + 1])
        half = native.skinny_linear(x, wp, b, False)  # rounded once to bf16, from the same sums
        assert torch.equal(half, full.to(torch.bfloat16))
    finally:
        native.set_amx(True)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_amx_switch_refused_without_amx():
    if amx:
        try:
            native.set_amx(False)
            assert not native.amx()
        finally:
            native.set_amx(True)
        assert native.amx()
    else:
        with pytest.raises(RuntimeError, match="no AMX"):
            native.set_amx(True)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_packed_rows_limit_follows_amx_and_the_input_width():
    """32 rows natively only where AMX tiles take the weight (inputs a multiple of 32), 64 on AMD
    CPUs with the AVX-512 build (no AMX there), else 16; a decode stack takes what its linears
    all take."""
    from eagle_serve.engine.layers import AMX_PACKED_MAX_ROWS, PACKED_MAX_ROWS, WIDE_PACKED_MAX_ROWS, packed_max_rows
    other = WIDE_PACKED_MAX_ROWS if not amx and kernels.wide_packed() else PACKED_MAX_ROWS
    assert packed_max_rows(576) == (AMX_PACKED_MAX_ROWS if amx else other)
    assert packed_max_rows(48) == other
    for k, want in ((64, AMX_PACKED_MAX_ROWS if amx else other), (48, other)):
        lin = Linear(k, 64)
        lin.weight.data = torch.randn(64, k).to(torch.bfloat16)
        lin.prepack()
        assert lin.native_max_rows == want


@pytest.mark.skipif(native is None or not kernels.wide_packed() or amx, reason="a CPU with the wide packed limit only")
def test_prompt_tokens_keep_the_16_row_limit_where_decode_batches_take_64():
    """Within rows_as(..., prompt=True) a packed linear takes its prompt limit (16 rows), so a
    prompt of 17-64 tokens, and the cached prefix it may share, rounds as on every CPU."""
    from eagle_serve.engine.layers import PACKED_MAX_ROWS, WIDE_PACKED_MAX_ROWS, rows_as
    lin = Linear(576, 64)
    lin.weight.data = torch.randn(64, 576).to(torch.bfloat16)
    lin.prepack()
    assert (lin.native_max_rows, lin.prompt_max_rows) == (WIDE_PACKED_MAX_ROWS, PACKED_MAX_ROWS)
    assert lin.native_for(32) is lin.native_weight
    with rows_as(32, prompt=True):
        assert lin.native_for(32) is None
    with rows_as(PACKED_MAX_ROWS, prompt=True):
        assert lin.native_for(PACKED_MAX_ROWS) is lin.native_weight
    with rows_as(32):  # a decode batch's rows_as: the wide limit
        assert lin.native_for(32) is lin.native_weight


@pytest.mark.parametrize("vendor, build, amx_on, want", [
    ("AuthenticAMD", "avx512", False, 64), ("GenuineIntel", "avx512", False, 16), ("AuthenticAMD", "avx2", False, 16),
    ("GenuineIntel", "avx512", True, 32)])
def test_packed_rows_limit_by_vendor_build_and_amx(monkeypatch, vendor, build, amx_on, want):
    """The wide limit is the AVX-512 build's on AMD CPUs only (measured there); AMX keeps 32."""
    from types import SimpleNamespace

    from eagle_serve.engine.layers import packed_max_rows
    monkeypatch.setattr(kernels, "native", lambda: SimpleNamespace(amx=lambda: amx_on))
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels, "isa", lambda: (build, set(), []))
    assert packed_max_rows(576) == want


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("n, k", [(960, 576), (64, 2880), (32, 100)])
def test_packed_loop_rows_stand_alone_at_every_count(n, k):
    """The packed bf16 loop without AMX tiles (AVX-512's 8 rows a block, or AVX2's 3 rows a block
    going through the tile span by span; k = 2880: ragged spans, k = 100: one short span): every
    row's result the same whatever rows come with it, for every prefix of 1..40 rows, and the
    bf16 output the float32 sums rounded once to nearest even, as torch rounds them."""
    gen = torch.Generator().manual_seed(n * 3 + k)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    wp = native.pack_bf16(w)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    try:
        if amx:
            native.set_amx(False)
        full = native.skinny_linear(x, wp, b, True)
        torch.testing.assert_close(full.double(), F.linear(x.double(), w.double(), b.double()), rtol=0, atol=1e-4)
        for m in range(1, 41):
            assert torch.equal(native.skinny_linear(x[:m].contiguous(), wp, b, True), full[:m])
        for i in (0, 2, 3, 39):
            assert torch.equal(native.skinny_linear(x[i:i + 1].contiguous(), wp, b, True), full[i:i + 1])
        assert torch.equal(native.skinny_linear(x, wp, b, False), full.to(torch.bfloat16))
    finally:
        if amx:
            native.set_amx(True)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("onednn", [True, False])
def test_bf16_linear_without_onednn_bf16_takes_every_row_natively(monkeypatch, onednn):
    """Where oneDNN cannot prepack bf16 (AVX2-only CPUs; forced here) a bf16 Linear with packed
    weights sends every row count to the native kernel (F.linear in bf16 is several times slower
    there), so each row of a prompt comes out as it would alone; weights that cannot be packed
    (200 outputs) and a Linear without native kernels keep their paths, and all of them run."""
    import eagle_serve.engine.layers as layers
    if onednn and not layers._onednn_ok(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 on this CPU")
    monkeypatch.setattr(layers, "_onednn_ok", lambda dtype: onednn or dtype != torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    for n, use_native, all_rows in ((64, True, not onednn), (200, True, False), (64, False, False)):
        lin = Linear(96, n, bias=True)
        lin.weight.data = (torch.randn(n, 96, generator=gen) / 10).to(torch.bfloat16)
        lin.bias.data = torch.randn(n, generator=gen).to(torch.bfloat16)
        assert lin.prepack(use_native) == (use_native or onednn)
        assert lin.native_all_rows == all_rows
        out = lin(x)
        torch.testing.assert_close(out.float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()),
                                   rtol=3e-2, atol=3e-2)
        if all_rows:
            assert torch.equal(out, torch.cat([lin(x[i:i + 1]) for i in range(40)]))


def test_native_build_follows_the_cpu_flags(monkeypatch):
    """The AVX-512 build where the CPU has AVX-512 with bf16 and VNNI dot products, else the AVX2
    build where it has AVX2 and FMA (AVX-512 without bf16 included), else none;
    EAGLE_SERVE_NATIVE_ISA picks a build the CPU has, and a name that is none is refused."""
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    monkeypatch.delenv("EAGLE_SERVE_NATIVE_ISA", raising=False)
    for flags, want in ((avx512 | {"avx2", "fma"}, "avx512"), ({"avx2", "fma", "avx512f", "avx512bw"}, "avx2"),
                        ({"avx2", "fma"}, "avx2"), ({"avx2"}, None), (set(), None)):
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: flags)
        got = kernels.isa()
        assert (got and got[0]) == want
        if want == "avx512":
            assert "-mavx512bf16" in got[2] and "-mavx512vnni" in got[2]
        if want == "avx2":
            assert "-mfma" in got[2] and not any("avx512" in f for f in got[2])
    monkeypatch.setattr(kernels, "cpu_flags", lambda: avx512 | {"avx2", "fma"})
    monkeypatch.setenv("EAGLE_SERVE_NATIVE_ISA", "avx2")
    assert kernels.isa()[0] == "avx2"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("EAGLE_SERVE_NATIVE_ISA", "avx512")
    assert kernels.isa() is None
    monkeypatch.setenv("EAGLE_SERVE_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="EAGLE_SERVE_NATIVE_ISA='avx9': expected one of avx512, avx2"):
        kernels.isa()


def int8_inputs(x: torch.Tensor, rounded: bool) -> torch.Tensor:
    """The inputs an int8 product multiplies, in float64: x itself, or where the weights were
    packed for int8 inputs (VNNI) each row rounded to the nearest step of its own max |x| / 127."""
    if not rounded:
        return x.double()
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # float32, as the kernel
    q = (xf * inv).clamp(-127, 127).round()
    return q.double() * (amax / 127).double()


def needs_vnni(rounded: bool):
    if rounded and not native.int8_inputs_available():
        pytest.skip("int8 inputs need the AVX-512 build (VNNI)")


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 33, 576])
@pytest.mark.parametrize("rounded", [False, True])
def test_int8_linear_matches_its_dequantized_weights(dtype, k, rounded):
    """pack_int8 rounds each weight to the nearest step of its row's scale (max |w| / 127; an
    all-zero row stays zero) and the int8 product is the float32 product with those weights (and,
    packed for int8 inputs, with each input row rounded the same way: int8_inputs), for any row
    count, bias and output dtype."""
    needs_vnni(rounded)
    gen = torch.Generator().manual_seed(5)
    n = 128
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    w[3] = 0
    wq = native.pack_int8(w, rounded)
    shape = (n // 64, (k + 3) // 4 + 3, 256) if rounded else (n // 64, k + 4, 64)
    assert wq.dtype == torch.int8 and tuple(wq.shape) == shape
    wd = native.unpack_int8(wq)
    assert wd.shape == (n, k)
    step = w.float().abs().amax(1, keepdim=True) / 127
    assert ((wd - w.float()).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(wd[3], torch.zeros(k))
    for m in range(1, 10):
        x = torch.randn(m, k, generator=gen).to(dtype)
        x[m // 2] = 0  # an all-zero input row: its scale is 0, its output the bias
        b = torch.randn(n, generator=gen).to(dtype)
        ref = int8_inputs(x, rounded) @ wd.double().T + b.double()
        got = native.skinny_linear(x, wq, b, True)
        assert got.dtype == torch.float32
        assert (got.double() - ref).abs().max().item() < 1e-5 * (1 + ref.abs().max().item())
        out = native.skinny_linear(x, wq, None, False)
        assert out.dtype == dtype
        assert torch.allclose(out.double(), ref - b.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="N % 64"):
        native.pack_int8(w[:96].contiguous())
    with pytest.raises(RuntimeError, match="does not match"):
        native.skinny_linear(torch.randn(2, k + 1).to(dtype), wq, None, False)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("rounded", [False, True])
def test_linear_int8_weights_take_few_rows_and_leave_more_to_the_packed_path(rounded):
    from eagle_serve.engine.layers import INT8_MAX_ROWS
    needs_vnni(rounded)
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(128, 576, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(128, generator=gen).to(torch.bfloat16)
    lin, ref = Linear(576, 128, bias=True), Linear(576, 128, bias=True)
    for m in (lin, ref):
        m.weight.data, m.bias.data = w.clone(), b.clone()
        m.prepack()
    assert lin.quantize_int8(INT8_MAX_ROWS, rounded)
    wd = native.unpack_int8(lin.int8_weight)
    for rows in range(1, INT8_MAX_ROWS + 3):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        got = lin(x, float_out=True)
        if rows <= INT8_MAX_ROWS:
            want = int8_inputs(x, rounded) @ wd.double().T + b.double()
            assert (got.double() - want).abs().max().item() < 1e-4
            assert not torch.equal(got, ref(x, float_out=True))  # the int8 weights, not the bf16 ones
        else:
            assert torch.equal(got, ref(x, float_out=True))
    lin.prepack()  # prepacking again drops them
    assert lin.int8_weight is None
    odd = Linear(576, 96)
    odd.weight.data = torch.randn(96, 576).to(torch.bfloat16)
    odd.prepack()
    assert not odd.quantize_int8(INT8_MAX_ROWS) and odd.int8_weight is None
    bad = Linear(576, 128)
    bad.weight.data = w.clone()
    bad.weight.data[5, 7] = float("nan")  # no int8 scale for it: the weights stay as they are
    bad.prepack()
    assert not bad.quantize_int8(INT8_MAX_ROWS) and bad.int8_weight is None
    with pytest.raises(RuntimeError, match="finite"):
        native.pack_int8(bad.weight.data)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("v", [1, 5, 16, 17, 320, 49152])
def test_native_argmax_rows_is_max_indices(v):
    """Greedy picks (sampler.greedy_picks) through argmax_rows give torch's max(-1).indices:
    the first of equal maxima, a row's first NaN, index 0 of an all -inf row, at every width
    (vector body and scalar tail)."""
    from eagle_serve.engine.sampler import greedy_picks
    gen = torch.Generator().manual_seed(v)
    for rows in (1, 3, 7):
        cases = [torch.randn(rows, v, generator=gen), torch.randint(0, 3, (rows, v), generator=gen).float(),
                 torch.full((rows, v), float("-inf")), torch.zeros(rows, v)]
        nan = torch.randn(rows, v, generator=gen)
        nan[0, v // 2] = float("nan")
        nan[-1, v - 1] = float("nan")
        cases.append(nan)
        for x in cases:
            assert torch.equal(native.argmax_rows(x), x.max(-1).indices)
            assert torch.equal(greedy_picks(x), x.max(-1).indices)
    x64 = torch.randn(2, v, generator=gen, dtype=torch.float64)  # float64: torch's own reduction
    assert torch.equal(greedy_picks(x64), x64.max(-1).indices)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("v", [1, 5, 16, 17, 320, 8192])
def test_native_topk_log_softmax_is_log_softmax_topk(v):
    """A draft level's ranking (topk_log_softmax) gives log_softmax(x).topk(k): the same
    indices (through d2t where given), values within float32 rounding; equal values by lower
    index (a vector block holding one already held, the scalar tail alike); rows with a NaN or an
    infinity as ATen ranks them; 1, 3 and 40 rows (the rows split over threads past 16)."""
    gen = torch.Generator().manual_seed(v)
    none = torch.empty(0, dtype=torch.long)
    for rows in (1, 3, 40):
        for k in sorted({1, min(2, v), min(10, v), v if v <= 17 else 1}):
            x = torch.randn(rows, v, generator=gen) * 4
            got_v, got_i = native.topk_log_softmax(x, k, none)
            ref = x.log_softmax(-1).topk(k)
            assert torch.equal(got_i, ref.indices)
            torch.testing.assert_close(got_v, ref.values, rtol=0, atol=1e-5)
            d2t = torch.randperm(v, generator=gen) * 7
            assert torch.equal(native.topk_log_softmax(x, k, d2t)[1], d2t[ref.indices])
    x = torch.zeros(2, v)
    x[:, v // 3] = x[:, v - 1] = 3.0  # ties: the lower index first
    want = [v // 3, v - 1] if v > 1 else [0]
    got_i = native.topk_log_softmax(x, len(want), none)[1]
    assert got_i[0].tolist() == want and got_i[1].tolist() == want
    if v >= 5:
        bad = torch.randn(3, v, generator=gen)
        bad[0, 2] = float("nan")
        bad[1, 4] = float("inf")
        bad[2, 1] = float("-inf")
        got_v, got_i = native.topk_log_softmax(bad, 3, none)
        ref = bad.log_softmax(-1).topk(3)
        assert torch.equal(got_i, ref.indices)
        torch.testing.assert_close(got_v, ref.values, rtol=0, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="k must be"):
        native.topk_log_softmax(torch.zeros(1, v), v + 1, none)
    with pytest.raises(RuntimeError, match="float32"):
        native.topk_log_softmax(torch.zeros(1, v, dtype=torch.float64), 1, none)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
def test_fused_draft_level_equals_the_python_path(tiny_llama, tmp_path, dtype, int8):
    """EagleHead.level (one native call: embeddings, fc, the stack, the draft LM head's top-k)
    gives exactly the numbers of forward() + draft_topk(), the draft KV included; it declines
    (None) where the Python path must run."""
    from eagle_serve.engine.attention import make_backend
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import load_model
    from eagle_serve.engine.speculative.eagle_drafter import _rotary
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    from tests.spec_helpers import write_eagle_head
    target = load_model(tiny_llama[0], dtype, torch.device("cpu"), skip_tokenizer=True).model
    target.prepack()
    head = load_eagle_head(write_eagle_head(str(tmp_path / "head"), tiny_llama[0], std=0.2), target, dtype)
    head.set_draft_vocab(torch.arange(0, 256, 2), target)  # 128 draft tokens
    head.prepack(int8=int8)
    cfg = head.config
    backend = make_backend(cfg.head_dim ** -0.5, torch.device("cpu"), dtype)
    rotary, embed = _rotary(cfg), target.model.embed_tokens
    gen = torch.Generator().manual_seed(4)
    blocks = [[9, 3, 17, 5], [1, 30, 12, 7]]
    rounds = [([SeqSpan([5, 8, 2], 0, blocks[0]), SeqSpan([7], 0, blocks[1])], torch.tensor([2, 3])),
              ([SeqSpan([11, 12], 4, blocks[0], positions=[3, 3], num_masked_cached=1,
                        tree_mask=torch.tensor([[True, True, False], [False, False, True]]))], None)]
    feats = [torch.randn(4, cfg.hidden_size, generator=gen).to(dtype), torch.randn(2, cfg.hidden_size, generator=gen).to(dtype)]
    kvs = [KVCache(1, 32, 4, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu")) for _ in range(2)]
    with torch.inference_mode():
        for (spans, top), f in zip(rounds, feats):
            batch = build_forward_batch(spans, 4, torch.device("cpu"))
            hidden = head(embed(batch.input_ids), f, batch, kvs[0], backend, rotary)
            rows = hidden if top is None else hidden[top]
            values, ids = head.draft_topk(rows, target, 3)
            fused = head.level(batch, embed, f, kvs[1], backend, rotary, 3, top)
            assert fused is not None
            for a, b in zip((hidden, rows, values, ids), fused):
                assert torch.equal(a, b)
        assert torch.equal(kvs[0].data, kvs[1].data)
        batch = build_forward_batch(rounds[1][0], 4, torch.device("cpu"))
        lm = head.lm_head
        head.lm_head = None  # the full-vocabulary draft ranks through the target's LM head: Python path
        assert head.level(batch, embed, feats[1], kvs[1], backend, rotary, 3) is None
        head.lm_head = lm
        rows = head._stack_max_rows
        head._stack_max_rows = 1  # more rows than the stack takes
        assert head.level(batch, embed, feats[1], kvs[1], backend, rotary, 3) is None
        head._stack_max_rows = rows
