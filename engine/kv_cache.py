"""The paged KV tensors. The scheduler decides slots; the engine writes and reads them."""
from __future__ import annotations

import torch


class KVCache:
    """Per layer, keys and values of every slot: [num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
