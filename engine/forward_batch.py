"""`ForwardBatch`: every tensor one packed forward needs, built once and passed as an argument.

Tokens of all sequences are packed along one axis T. Each sequence's keys are its committed KV
(storage positions [0, num_cached)) followed by its new tokens' KV; each new token sees all of
the committed keys and, among the new ones, either a causal prefix or a tree mask (itself and its
ancestors). The torch backend gathers every sequence's keys into a padded [B, L] grid through
the block table and runs one masked attention for the whole batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from eagle_serve.engine import kernels


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
    prompt_len: int = 0  # prompt tokens (a prefill chunk): the whole prompt's length (see ForwardBatch.prompt_lens)


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
    # per sequence, the whole prompt's length where its span holds prompt tokens (else 0): a
    # prompt chunk takes the kernels its whole prompt would (the attention and the forward's
    # linears pick by row count as if the chunk were that long). A prompt's KV must not depend
    # on how much of it a prefix-cache hit left to compute: the few-row native kernels round
    # bf16 differently from oneDNN's GEMM and SDPA, and a greedy rerun of a cached prompt must
    # match its first run. CPU only: CUDA graphs pick buckets by
    # the rows (engine/cuda_graphs.py), so there a cached prompt's tail may still round apart
    prompt_lens: tuple[int, ...] = ()

    @property
    def rows_as(self) -> int:
        """The row count kernels are picked by: the rows, or the longest prompt in the batch."""
        return max(self.input_ids.shape[0], max(self.prompt_lens, default=0))

    def mask_3d(self) -> torch.Tensor:
        """The mask as the native kernels take it: [B, Q, L], or empty for 'every key'."""
        if self.attn_mask is None:
            return _NO_MASK
        return self.attn_mask.view(self.num_seqs, self.max_query_len, self.max_kv_len)


_NO_MASK = torch.empty(0, dtype=torch.bool)


def build_forward_batch(spans: list[SeqSpan], block_size: int, device: torch.device) -> ForwardBatch:
    # Index arithmetic in numpy, one tensor per field at the end: at decode sizes the per-op cost
    # of torch calls, not the arithmetic, dominates the build.
    n_new = np.fromiter((len(s.token_ids) for s in spans), np.int64, len(spans))
    n_cached = np.fromiter((s.num_cached for s in spans), np.int64, len(spans))
    kv_lens = n_cached + n_new
    for s, end in zip(spans, kv_lens.tolist()):
        if end > len(s.block_table) * block_size:  # the padded grid would map those slots to block 0
            raise ValueError(f"a span writes storage positions up to {end - 1}, past its block table "
                             f"({len(s.block_table)} blocks of {block_size})")
    build = _native_build() if device.type == "cpu" else None
    if build is not None:
        ids, positions, slots, gather, mask, q_index, lens, q_seq, q_row = build(
            [s.token_ids for s in spans], n_cached.tolist(), [s.block_table for s in spans],
            [s.positions or [] for s in spans], [s.tree_mask for s in spans], [s.num_masked_cached for s in spans],
            block_size)
        return ForwardBatch(input_ids=ids, positions=positions, slot_mapping=slots, kv_gather=gather,
                            attn_mask=mask, q_index=q_index, num_seqs=len(spans), max_query_len=int(n_new.max()),
                            max_kv_len=int(kv_lens.max()), kv_lens=lens, q_seq=q_seq, q_row=q_row,
                            prompt_lens=tuple(s.prompt_len for s in spans))
    B, Q, L = len(spans), int(n_new.max()), int(kv_lens.max())
    ids = [t for s in spans for t in s.token_ids]
    positions = [p for s in spans for p in (s.positions or range(s.num_cached, s.num_cached + len(s.token_ids)))]

    # Slot of storage position p: block_table[p // block_size] * block_size + p % block_size.
    max_blocks = -(-L // block_size)
    tables = np.zeros((B, max_blocks), np.int64)
    for b, s in enumerate(spans):
        row = s.block_table[:max_blocks]
        tables[b, :len(row)] = row
    pos = np.arange(L)
    grid = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    kv_gather = np.where(pos[None, :] < kv_lens[:, None], grid, 0).reshape(-1)
    slot_mapping = np.concatenate([grid[b, n_cached[b]:kv_lens[b]] for b in range(B)])

    mask = _attention_mask(spans, n_cached, n_new, Q, L)
    q_index = None
    if B > 1:
        q_index = np.concatenate([np.arange(n) + b * Q for b, n in enumerate(n_new)])
    q_seq = np.repeat(np.arange(B), n_new)
    q_row = np.arange(int(n_new.sum())) - np.repeat(np.cumsum(n_new) - n_new, n_new)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=t(slot_mapping), kv_gather=t(kv_gather),
        attn_mask=None if mask is None else t(mask),
        q_index=None if q_index is None else t(q_index),
        num_seqs=B, max_query_len=Q, max_kv_len=L, kv_lens=t(kv_lens), q_seq=t(q_seq), q_row=t(q_row),
        prompt_lens=tuple(s.prompt_len for s in spans))


def _native_build():
    """The native kernels' build_batch (the same tensors as the numpy path below, in one call),
    or None without them. EAGLE_SERVE_NATIVE_BATCH=0 keeps the numpy path (tests compare both)."""
    if os.environ.get("EAGLE_SERVE_NATIVE_BATCH", "1") == "0":
        return None
    return getattr(kernels.native(), "build_batch", None)


def _attention_mask(spans, n_cached, n_new, Q, L) -> np.ndarray | None:
    """[B, 1, Q, L]: query i of sequence b sees key j (committed, causal or tree ancestor)."""
    if len(spans) == 1 and Q == 1 and spans[0].tree_mask is None:
        return None  # one token sees every key
    c = n_cached[:, None, None]
    n = n_new[:, None, None]
    i = np.arange(Q)[None, :, None]
    j = np.arange(L)[None, None, :]
    mask = (j < c) | ((j >= c) & (j - c <= i) & (j < c + n))
    for b, s in enumerate(spans):
        if s.tree_mask is not None:
            nb, cb = int(n_new[b]), int(n_cached[b])
            mask[b, :nb, cb - s.num_masked_cached:cb + nb] = s.tree_mask.cpu().numpy()
    mask &= i < n  # padded query rows see nothing ...
    mask[:, :, 0] |= (i >= n)[:, :, 0]  # ... but key 0, so softmax stays finite
    return mask[:, None]


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: a view where the row indices are consecutive (one sequence's rows, a prefill's,
    a sequence's pending pairs in the head's feature cache), else a gather. (The gather, a tensor
    from the list and an index, cost more than the row copy at decode sizes; the LM head and the
    head take either.)"""
    if not rows:
        return t[:0]
    first, n = rows[0], len(rows)
    if rows[-1] - first == n - 1 and rows == list(range(first, first + n)):
        return t[first:first + n]
    return t[torch.tensor(rows, dtype=torch.long, device=t.device)]
