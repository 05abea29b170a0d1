"""Engine settings, parsed once at the edge (CLI / LLM) and validated here."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.config import SpecConfig

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # auto: bfloat16 where the CPU has native bf16 (measured fastest), else float32
    device: str = "auto"
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: kv_cache_memory_fraction of the device memory
    kv_cache_memory_fraction: float = 0.1
    max_model_len: int | None = None  # None: the model's own, capped to what the cache holds
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int = 512  # prompt tokens one sequence feeds per step (chunked prefill)
    enable_prefix_caching: bool = True
    tree_budget: bool = True  # size each round's trees by the load-aware budget (speculation only)
    skip_tokenizer: bool = False
    draft: str | None = None  # EAGLE head directory
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size ({self.block_size})")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
