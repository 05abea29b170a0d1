"""The `flash` attention backend: flash-attn 2 kernels over the paged KV cache (CUDA).

Every sequence's keys are split by what its mask allows (the mask is read once per batch):

- causal sequences (prefill chunks, plain decode steps, chain-shaped trees) go through one
  `flash_attn_varlen_func(causal=True)` call for all of them: flash-attn aligns the causal mask
  to the bottom right, so new token i of a sequence with c committed keys sees keys [0, c + i],
  which is exactly the engine's mask, and no log-sum-exp is needed;
- the others (speculative trees; the EAGLE drafter's frontier, whose scratch keys are masked)
  are split in two. The prefix every query of the sequence sees (its first P keys, P <= num_cached)
  goes through `flash_attn_with_kvcache(causal=False, return_softmax_lse=True)`; the rest (the
  tree block: the new tokens and any masked cached keys) is computed in torch under the batch's
  mask with its own log-sum-exp (`attention_lse`), and `merge_lse` combines the two exactly.

KV layout. flash-attn's paged path takes k_cache as [num_pages, page_size, Hkv, D] with an int32
block table and requires page_size % 256 == 0. When the engine's block size is a multiple of 256
(`--block-size 256`) the cache tensor [slots, Hkv, D] is viewed as pages of one engine block each
and read in place through the block tables (recovered from the batch's gather indices). With
smaller blocks each sequence's keys are gathered first, as the torch backend does, and the same
two kernels run on the gathered copy (non-paged `k_cache` [B, L, Hkv, D]; packed keys for
varlen). Both layouts therefore work; the paged one skips a copy of every key per layer. The
fallback exists because the EAGLE drafter builds its own backend with `make_backend(...)` and
the engine's default block size is 16.

Log-sum-exp conventions (natural log of sum exp(scale * q.k)): `flash_attn_with_kvcache` returns
float32 [B, H, Sq] (transposed here to [B, Sq, H]); `flash_attn_varlen_func` would return
[H, total_q], but the causal path needs none. A query that sees no key (a sequence whose prefix
is empty) gets output 0 and LSE +inf from flash-attn (its early-exit path), so the glue replaces
those LSEs with -inf before merging; `merge_lse` then returns the tree part alone.

Planning (which sequences are causal, prefix lengths, index tensors) happens once per batch and
is reused by every layer; it costs one device-to-host copy of 4 ints per sequence.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from eagle_serve.engine.attention_base import AttentionBackend

PAGE_MULTIPLE = 256  # flash-attn 2: "Paged KV cache block size must be divisible by 256"
MAX_HEAD_DIM = 256


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact tests); everything else accumulates in float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention and its log-sum-exp.

    q: [..., M, D]; k, v: [..., N, D]; mask: bool [..., M, N] (True = attend), broadcastable, or
    None for all keys. Returns (out [..., M, D], lse [..., M]) in float32 (float64 for float64
    inputs), lse = log sum_j exp(scale * q.k_j) over the allowed keys. A row that sees no key
    gets out 0 and lse -inf (no NaN).
    """
    acc = _acc_dtype(q.dtype, k.dtype, v.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = lse.masked_fill(lse == float("-inf"), 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))  # rows with no key: exp(-inf) = 0
    return torch.matmul(probs, v.to(acc)), lse


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
              lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the parts over each.

    o1, o2: [..., D] normalised outputs; lse1, lse2: [...] their log-sum-exps (natural log;
    finite, or -inf for a part that saw no key). With m = max(lse1, lse2):
    out = (e^(lse1-m) o1 + e^(lse2-m) o2) / (e^(lse1-m) + e^(lse2-m)), lse = m + log(sum).
    Exact up to rounding; computed in float32 (float64 if any input is float64).
    """
    acc = _acc_dtype(o1.dtype, o2.dtype, lse1.dtype, lse2.dtype)
    lse1, lse2 = lse1.to(acc), lse2.to(acc)
    m = torch.maximum(lse1, lse2)
    m = m.masked_fill(m == float("-inf"), 0.0)  # both parts empty: weights 0, output 0
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (w1.unsqueeze(-1) * o1.to(acc) + w2.unsqueeze(-1) * o2.to(acc)) / denom.unsqueeze(-1)
    return out, m + torch.log(total)


def block_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_lse` in the backend's layouts, grouped-query aware without copying keys.

    q: [B, M, H, D]; k, v: [B, N, Hkv, D]; mask: bool [B, M, N]. Query head h uses kv head
    h // (H // Hkv), as flash-attn and SDPA's enable_gqa do. Returns out [B, M, H, D], lse [B, M, H].
    """
    B, M, H, D = q.shape
    hkv = k.shape[2]
    g = H // hkv
    q5 = q.view(B, M, hkv, g, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, M, D]
    k5 = k.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, N, D]
    v5 = v.permute(0, 2, 1, 3).unsqueeze(2)
    out, lse = attention_lse(q5, k5, v5, mask[:, None, None], scale)  # [B, Hkv, G, M, D], [B, Hkv, G, M]
    return out.permute(0, 3, 1, 2, 4).reshape(B, M, H, D), lse.permute(0, 3, 1, 2).reshape(B, M, H)


@dataclass
class _CausalGroup:
    rows: torch.Tensor | None  # [Tc] rows of q; None: every row
    cu_seqlens_q: torch.Tensor  # [Bc + 1] int32
    cu_seqlens_k: torch.Tensor  # [Bc + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor | None  # [Bc, max_blocks] int32 (paged)
    slots: torch.Tensor | None  # [sum kv_len] int64 packed key slots (gathered)


@dataclass
class _TreeGroup:
    rows: torch.Tensor | None  # [Tt] rows of q; None: every row
    dest: torch.Tensor  # [Tt] rows of the padded [Bt * Qt] query grid
    num_seqs: int  # Bt
    max_query_len: int  # Qt
    prefix_lens: torch.Tensor  # [Bt] int32: keys [0, P) every query sees (flash-attn)
    no_prefix: torch.Tensor  # [Bt] bool: P == 0
    max_prefix: int
    block_table: torch.Tensor | None  # [Bt, max_blocks] int32 (paged)
    prefix_slots: torch.Tensor | None  # [Bt * max_prefix] int64 (gathered)
    block_width: int  # W: keys [P, kv_len) computed in torch, padded to W
    block_slots: torch.Tensor  # [Bt * W] int64
    block_mask: torch.Tensor  # [Bt, Qt, W] bool


@dataclass
class _Plan:
    block_size: int
    paged: bool
    causal: _CausalGroup | None
    trees: _TreeGroup | None


class FlashAttention(AttentionBackend):
    """flash-attn 2 over the paged cache; tree masks by an exact log-sum-exp merge (module doc)."""

    name = "flash"

    def __init__(self, scale: float, module=None):
        if module is None:
            import flash_attn as module
        self.scale = scale
        self.fa = module
        self._plan_ref: weakref.ref | None = None
        self._plan: _Plan | None = None

    def forward(self, q, k, v, layer, batch, kv):
        k_cache, v_cache = kv.store(layer, batch.slot_mapping, k, v)
        T, H, D = q.shape
        if D > MAX_HEAD_DIM or D % 8:
            raise ValueError(f"the flash backend needs head_dim <= {MAX_HEAD_DIM} and a multiple of 8, got {D}")
        plan = self.plan(batch, kv.block_size)
        if plan.paged:
            pages = (-1, plan.block_size) + tuple(k_cache.shape[1:])
            k_src, v_src = k_cache.view(pages), v_cache.view(pages)
        else:
            k_src, v_src = k_cache, v_cache
        c, t = plan.causal, plan.trees
        if t is None:
            return self._causal(q, k_src, v_src, c, plan.paged).reshape(T, H * D)
        if c is None:
            return self._trees(q, k_cache, v_cache, k_src, v_src, t, plan.paged).reshape(T, H * D)
        out = q.new_empty(T, H, D)
        out.index_copy_(0, c.rows, self._causal(q.index_select(0, c.rows), k_src, v_src, c, plan.paged))
        out.index_copy_(0, t.rows, self._trees(q.index_select(0, t.rows), k_cache, v_cache, k_src, v_src, t,
                                               plan.paged))
        return out.view(T, H * D)

    def _causal(self, q, k_src, v_src, c: _CausalGroup, paged: bool) -> torch.Tensor:
        if paged:
            keys, values = k_src, v_src
        else:
            keys, values = k_src.index_select(0, c.slots), v_src.index_select(0, c.slots)
        return self.fa.flash_attn_varlen_func(q, keys, values, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q,
                                              c.max_seqlen_k, softmax_scale=self.scale, causal=True,
                                              block_table=c.block_table)

    def _trees(self, q, k_cache, v_cache, k_src, v_src, t: _TreeGroup, paged: bool) -> torch.Tensor:
        _, H, D = q.shape
        B, Q, W = t.num_seqs, t.max_query_len, t.block_width
        hkv = k_cache.shape[1]
        grid = q.new_zeros(B * Q, H, D).index_copy_(0, t.dest, q).view(B, Q, H, D)
        bk = k_cache.index_select(0, t.block_slots).view(B, W, hkv, D)
        bv = v_cache.index_select(0, t.block_slots).view(B, W, hkv, D)
        out, lse = block_attention_lse(grid, bk, bv, t.block_mask, self.scale)  # [B, Q, H, D], [B, Q, H]
        if t.max_prefix > 0:
            if paged:
                pk, pv = k_src, v_src
            else:
                pk = k_cache.index_select(0, t.prefix_slots).view(B, t.max_prefix, hkv, D)
                pv = v_cache.index_select(0, t.prefix_slots).view(B, t.max_prefix, hkv, D)
            o1, lse1 = self.fa.flash_attn_with_kvcache(grid, pk, pv, cache_seqlens=t.prefix_lens,
                                                       block_table=t.block_table, softmax_scale=self.scale,
                                                       causal=False, return_softmax_lse=True)
            # [B, H, Q] -> [B, Q, H]; flash-attn reports +inf for rows that saw no key: make them empty
            lse1 = lse1.transpose(1, 2).masked_fill(t.no_prefix[:, None, None], float("-inf"))
            out, lse = merge_lse(o1, lse1, out, lse)
        return out.reshape(B * Q, H, D).index_select(0, t.dest).to(q.dtype)

    def plan(self, batch, block_size: int) -> _Plan:
        """The batch's split into causal and tree sequences, with every index tensor the layers
        need; built on the first layer and reused by the others (one host sync per batch)."""
        if self._plan is not None and self._plan_ref() is batch and self._plan.block_size == block_size:
            return self._plan
        plan = _make_plan(batch, block_size)
        self._plan_ref, self._plan = weakref.ref(batch), plan
        return plan


def _make_plan(batch, block_size: int) -> _Plan:
    B, Q, L = batch.num_seqs, batch.max_query_len, batch.max_kv_len
    dev = batch.kv_lens.device
    n = torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, batch.q_seq, torch.ones_like(batch.q_seq))
    kv_lens = batch.kv_lens.to(torch.long)
    cached = kv_lens - n
    if batch.attn_mask is None:  # one sequence, one token: every key
        prefix, causal = cached, torch.ones(B, dtype=torch.bool, device=dev)
        mask = None
    else:
        mask = batch.attn_mask.view(B, Q, L)
        i = torch.arange(Q, device=dev)[None, :, None]
        j = torch.arange(L, device=dev)[None, None, :]
        pad_row = i >= n[:, None, None]  # [B, Q, 1] rows past the sequence's queries
        seen_by_all = (mask | pad_row).all(dim=1)  # [B, L]
        prefix = torch.minimum(seen_by_all.to(torch.long).cumprod(dim=1).sum(dim=1), cached)
        c = cached[:, None, None]
        causal_mask = (j < c) | ((j - c <= i) & (j < kv_lens[:, None, None]))
        causal = ((mask == causal_mask) | pad_row).flatten(1).all(dim=1)
    n_l, kv_l, p_l, causal_l = torch.stack([n, kv_lens, prefix, causal.to(torch.long)]).tolist()  # the sync

    paged = block_size % PAGE_MULTIPLE == 0
    gather = batch.kv_gather.view(B, L)
    tables = (gather[:, ::block_size] // block_size).to(torch.int32) if paged else None  # [B, ceil(L / bs)]
    starts = [0]
    for x in n_l:
        starts.append(starts[-1] + x)
    causal_idx = [b for b in range(B) if causal_l[b]]
    tree_idx = [b for b in range(B) if not causal_l[b]]

    def rows_of(idx):
        return torch.tensor([r for b in idx for r in range(starts[b], starts[b + 1])], dtype=torch.long, device=dev)

    def cumulative(values):
        out = [0]
        for x in values:
            out.append(out[-1] + x)
        return torch.tensor(out, dtype=torch.int32, device=dev)

    causal_group = None
    if causal_idx:
        sel = torch.tensor(causal_idx, dtype=torch.long, device=dev)
        slots = None
        if not paged:
            pos = torch.arange(L, device=dev)
            slots = gather.index_select(0, sel)[pos[None, :] < kv_lens.index_select(0, sel)[:, None]]
        causal_group = _CausalGroup(
            rows=None if not tree_idx else rows_of(causal_idx),
            cu_seqlens_q=cumulative(n_l[b] for b in causal_idx), cu_seqlens_k=cumulative(kv_l[b] for b in causal_idx),
            max_seqlen_q=max(n_l[b] for b in causal_idx), max_seqlen_k=max(kv_l[b] for b in causal_idx),
            block_table=tables.index_select(0, sel).contiguous() if paged else None, slots=slots)

    tree_group = None
    if tree_idx:
        assert mask is not None
        sel = torch.tensor(tree_idx, dtype=torch.long, device=dev)
        bt, qt = len(tree_idx), max(n_l[b] for b in tree_idx)
        width = max(kv_l[b] - p_l[b] for b in tree_idx)
        max_prefix = max(p_l[b] for b in tree_idx)
        dest = torch.tensor([r * qt + i for r, b in enumerate(tree_idx) for i in range(n_l[b])], dtype=torch.long,
                            device=dev)
        p_sel = prefix.index_select(0, sel)
        pos = p_sel[:, None] + torch.arange(width, device=dev)[None, :]  # [Bt, W] key positions of the block
        in_seq = pos < kv_lens.index_select(0, sel)[:, None]
        pos = pos.clamp(max=L - 1)
        block_slots = gather.index_select(0, sel).gather(1, pos)
        block_mask = mask.index_select(0, sel)[:, :qt].gather(2, pos[:, None, :].expand(bt, qt, width))
        prefix_slots = None
        if not paged and max_prefix > 0:
            prefix_slots = gather.index_select(0, sel)[:, :max_prefix].reshape(-1)
        tree_group = _TreeGroup(
            rows=None if not causal_idx else rows_of(tree_idx), dest=dest, num_seqs=bt, max_query_len=qt,
            prefix_lens=p_sel.to(torch.int32), no_prefix=p_sel == 0, max_prefix=max_prefix,
            block_table=tables.index_select(0, sel).contiguous() if paged else None, prefix_slots=prefix_slots,
            block_width=width, block_slots=block_slots.reshape(-1), block_mask=block_mask & in_seq[:, None, :])
    return _Plan(block_size, paged, causal_group, tree_group)
