"""`ForwardBatch`: every tensor one packed forward needs, built once and passed as an argument.

Tokens of all sequences are packed along one axis T. Each sequence's keys are its committed KV
(storage positions [0, num_cached)) followed by its new tokens' KV; each new token sees all of
the committed keys and, among the new ones, either a causal prefix or a tree mask (itself and its
ancestors). The torch backend gathers every sequence's keys into a padded [B, L] grid through
the block table and runs one masked attention for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a forward (engine-internal, built by the model runner)."""

    token_ids: list[int]
    num_cached: int
    block_table: list[int]
    positions: list[int] | None = None  # RoPE positions; default num_cached + i
    # [n, m + n] bool over the last m cached keys and the n new ones (m = num_masked_cached):
    # new token i sees key j. Keys before those are seen by all; None: causal.
    tree_mask: torch.Tensor | None = None
    num_masked_cached: int = 0


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 RoPE positions
    slot_mapping: torch.Tensor  # [T] int64 cache slot each new token's KV is written to
    kv_gather: torch.Tensor  # [B * L] int64 slots of every sequence's keys, padded
    attn_mask: torch.Tensor | None  # [B, 1, Q, L] bool (True = attend); None: attend to all keys
    q_index: torch.Tensor | None  # [T] rows of the padded [B * Q] query grid; None when B == 1
    num_seqs: int
    max_query_len: int  # Q
    max_kv_len: int  # L
    kv_lens: torch.Tensor  # [B] int64 keys of each sequence
    q_seq: torch.Tensor  # [T] int64 sequence of each query
    q_row: torch.Tensor  # [T] int64 row of each query within its sequence (mask row)
    cos: torch.Tensor | None = None  # [T, head_dim], set by the model from `positions`
    sin: torch.Tensor | None = None

    def mask_3d(self) -> torch.Tensor:
        """The mask as the native kernels take it: [B, Q, L], or empty for 'every key'."""
        if self.attn_mask is None:
            return _NO_MASK
        return self.attn_mask.view(self.num_seqs, self.max_query_len, self.max_kv_len)


_NO_MASK = torch.empty(0, dtype=torch.bool)


def build_forward_batch(spans: list[SeqSpan], block_size: int, device: torch.device) -> ForwardBatch:
    n_new = [len(s.token_ids) for s in spans]
    n_cached = [s.num_cached for s in spans]
    kv_lens = [c + n for c, n in zip(n_cached, n_new)]
    B, Q, L = len(spans), max(n_new), max(kv_lens)
    ids = [t for s in spans for t in s.token_ids]
    positions = [p for s in spans for p in (s.positions or range(s.num_cached, s.num_cached + len(s.token_ids)))]

    # Slot of storage position p: block_table[p // block_size] * block_size + p % block_size.
    max_blocks = -(-L // block_size)
    tables = torch.tensor([s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                           for s in spans], dtype=torch.long)  # [B, max_blocks]
    pos = torch.arange(L)
    grid = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    valid_key = pos[None, :] < torch.tensor(kv_lens)[:, None]
    kv_gather = torch.where(valid_key, grid, 0).reshape(-1)
    new_rows = [grid[b, n_cached[b]:kv_lens[b]] for b in range(B)]
    slot_mapping = torch.cat(new_rows)

    mask = _attention_mask(spans, n_cached, n_new, Q, L)
    q_index = None
    if B > 1:
        q_index = torch.cat([torch.arange(n) + b * Q for b, n in enumerate(n_new)])
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=slot_mapping.to(device), kv_gather=kv_gather.to(device),
        attn_mask=None if mask is None else mask.to(device),
        q_index=None if q_index is None else q_index.to(device),
        num_seqs=B, max_query_len=Q, max_kv_len=L, kv_lens=torch.tensor(kv_lens, device=device),
        q_seq=torch.tensor([b for b, n in enumerate(n_new) for _ in range(n)], device=device),
        q_row=torch.tensor([i for n in n_new for i in range(n)], device=device))


def _attention_mask(spans, n_cached, n_new, Q, L) -> torch.Tensor | None:
    """[B, 1, Q, L]: query i of sequence b sees key j (committed, causal or tree ancestor)."""
    if len(spans) == 1 and Q == 1 and spans[0].tree_mask is None:
        return None  # one token sees every key
    c = torch.tensor(n_cached)[:, None, None]
    n = torch.tensor(n_new)[:, None, None]
    i = torch.arange(Q)[None, :, None]
    j = torch.arange(L)[None, None, :]
    mask = (j < c) | ((j >= c) & (j - c <= i) & (j < c + n))
    for b, s in enumerate(spans):
        if s.tree_mask is not None:
            nb, cb = n_new[b], n_cached[b]
            mask[b, :nb, cb - s.num_masked_cached:cb + nb] = s.tree_mask
    mask &= i < n  # padded query rows see nothing ...
    mask[:, :, 0] |= (i < n).logical_not()[:, :, 0]  # ... but key 0, so softmax stays finite
    return mask[:, None]
