"""Attention backends: one interface, chosen at start-up.

Contract: `forward(q, k, v, layer, batch, kv)` first writes this forward's new keys and values
into the cache at `batch.slot_mapping`, then returns attention of every query over its
sequence's keys as allowed by the batch's mask, packed back to [T, num_heads * head_dim].
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache


class AttentionBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""


class TorchAttention(AttentionBackend):
    """Reference backend: gather through the block table, one masked SDPA for the batch."""

    name = "torch"

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, q, k, v, layer, batch, kv):
        k_cache, v_cache = kv.keys(layer), kv.values(layer)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        B, Q, L = batch.num_seqs, batch.max_query_len, batch.max_kv_len
        T, H, D = q.shape
        keys = k_cache.index_select(0, batch.kv_gather).view(B, L, -1, D).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, batch.kv_gather).view(B, L, -1, D).transpose(1, 2)
        if batch.q_index is None:  # one sequence: no padding
            queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        else:
            queries = q.new_zeros(B * Q, H, D).index_copy_(0, batch.q_index, q)
            queries = queries.view(B, Q, H, D).transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.attn_mask,
                                             scale=self.scale, enable_gqa=True)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(B * Q, H * D)
        return out if batch.q_index is None else out.index_select(0, batch.q_index)


class NativeCPUAttention(TorchAttention):
    """CPU backend: the native paged kernel (engine/kernels/cpu_attention.cpp) for batches of
    few queries per sequence (decode, tree verification), reading keys through the block
    table without a gathered copy; prefill-sized batches use the torch path."""

    name = "native"
    MAX_QUERIES = 64

    def __init__(self, scale: float, kernels):
        super().__init__(scale)
        self.kernels = kernels

    def forward(self, q, k, v, layer, batch, kv):
        if batch.max_query_len > self.MAX_QUERIES and batch.num_seqs == 1:
            return super().forward(q, k, v, layer, batch, kv)
        k_cache, v_cache = kv.keys(layer), kv.values(layer)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        gather = batch.kv_gather.view(batch.num_seqs, batch.max_kv_len)
        if batch.max_query_len <= self.MAX_QUERIES:
            return self.kernels.paged_attention(q.contiguous(), k_cache, v_cache, gather, batch.kv_lens,
                                                batch.q_seq, batch.q_row, batch.mask_3d(), self.scale)
        return self._mixed(q, k_cache, v_cache, gather, batch)

    def _mixed(self, q, k_cache, v_cache, gather, batch):
        """Prefill chunks batched with decodes: a padded grid would be [B, Q, L] for the
        longest chunk's Q. Long sequences attend alone (SDPA, no padding); the short ones go
        through the native kernel together."""
        T, H, D = q.shape
        out = q.new_empty(T, H * D)
        counts = torch.bincount(batch.q_seq, minlength=batch.num_seqs).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        kv_lens = batch.kv_lens.tolist()
        mask = batch.mask_3d()
        small = [b for b, c in enumerate(counts) if c <= self.MAX_QUERIES]
        for b, c in enumerate(counts):
            if c <= self.MAX_QUERIES:
                continue
            slots = gather[b, :kv_lens[b]]
            keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            queries = q[starts[b]:starts[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, c, D]
            m = mask[b, :c, :kv_lens[b]].unsqueeze(0).unsqueeze(0) if mask.numel() else None
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=m, scale=self.scale, enable_gqa=True)
            out[starts[b]:starts[b + 1]] = o[0].transpose(0, 1).reshape(c, H * D)
        if small:
            rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in small]).to(q.device)
            idx = torch.tensor(small, device=q.device)
            q_seq = torch.repeat_interleave(torch.arange(len(small), device=q.device),
                                            torch.tensor([counts[b] for b in small], device=q.device))
            qmax = max(counts[b] for b in small)
            sub_mask = mask[idx, :qmax].contiguous() if mask.numel() else mask
            out[rows] = self.kernels.paged_attention(q[rows].contiguous(), k_cache, v_cache, gather[idx].contiguous(),
                                                     batch.kv_lens[idx].contiguous(), q_seq, batch.q_row[rows].contiguous(),
                                                     sub_mask, self.scale)
        return out


def make_backend(scale: float, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The native CPU backend where its kernels build, else the torch reference."""
    from engine import kernels
    from engine.layers import FAST_DTYPES
    mod = kernels.native() if device.type == "cpu" and dtype in FAST_DTYPES else None
    return NativeCPUAttention(scale, mod) if mod is not None else TorchAttention(scale)
