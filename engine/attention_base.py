"""The attention backend contract, shared by every backend module (engine/attention.py,
engine/flash_attention.py).

`forward(q, k, v, layer, batch, kv)` first writes this forward's new keys and values into the
cache at `batch.slot_mapping`, then returns attention of every query over its sequence's keys as
allowed by the batch's mask, packed back to [T, num_heads * head_dim].
"""
from __future__ import annotations

import abc

import torch

from eagle_serve.engine.forward_batch import ForwardBatch
from eagle_serve.engine.kv_cache import KVCache


class AttentionBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""
