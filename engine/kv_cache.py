"""The paged KV tensors. The scheduler decides slots; the engine writes and reads them."""
from __future__ import annotations

import torch

from eagle_serve.engine import hugepages


class KVCache:
    """Per layer, keys and values of every slot: [num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
        try:
            # on the CPU in huge pages where the kernel has them (engine.hugepages): a decode
            # step reads every sequence's keys and values of every layer
            self.data = hugepages.zeros(shape, dtype, device)
        except (RuntimeError, MemoryError) as e:  # e.g. --kv-cache-tokens far past the memory
            raise ValueError(f"cannot allocate the KV cache ({_gib(shape, dtype):.1f} GiB for {num_blocks * block_size} "
                             f"slots): ask for fewer (serve / generate: --kv-cache-tokens) ({str(e).splitlines()[0][:120]})") from None

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write new keys/values [T, Hkv, D] at `slots`; returns the layer's (keys, values)."""
        k_cache, v_cache = self.data[layer, 0], self.data[layer, 1]
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        return k_cache, v_cache


def _gib(shape, dtype) -> float:
    n = 1
    for x in shape:
        n *= int(x)
    return n * torch.empty(0, dtype=dtype).element_size() / 2 ** 30
