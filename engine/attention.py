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
        if batch.max_query_len > self.MAX_QUERIES:
            return super().forward(q, k, v, layer, batch, kv)
        k_cache, v_cache = kv.keys(layer), kv.values(layer)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        return self.kernels.paged_attention(q.contiguous(), k_cache, v_cache,
                                            batch.kv_gather.view(batch.num_seqs, batch.max_kv_len),
                                            batch.kv_lens, batch.q_seq, batch.q_row, batch.mask_3d(), self.scale)


def make_backend(scale: float, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The native CPU backend where its kernels build, else the torch reference."""
    from engine import kernels
    from engine.layers import FAST_DTYPES
    mod = kernels.native() if device.type == "cpu" and dtype in FAST_DTYPES else None
    return NativeCPUAttention(scale, mod) if mod is not None else TorchAttention(scale)
