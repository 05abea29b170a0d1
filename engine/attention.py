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
