"""The engine executor: owns model, KV tensors and backend; runs one packed forward per step."""
from __future__ import annotations

import os

import torch

from engine.attention import TorchAttention
from engine.config import EngineConfig
from engine.forward_batch import SeqSpan, build_forward_batch
from engine.kv_cache import KVCache
from engine.loader import LoadedModel, load_model
from engine.sampler import SampleRow, sample
from engine.step_io import SeqResult, SeqStep


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    # Measured (bench/bench_decode.py): with native bf16 dot products, bf16 halves the bytes
    # read per token and decodes ~2x faster than float32; without them bf16 is emulated.
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded: LoadedModel = load_model(config.model, self.dtype, self.device, config.skip_tokenizer)
        self.model = self.loaded.model
        self.num_prepacked = self.model.prepack() if self.device.type == "cpu" else 0
        cfg = self.loaded.config
        self.num_blocks = self._num_blocks()
        self.kv = KVCache(cfg.num_layers, self.num_blocks, config.block_size, cfg.num_kv_heads,
                          cfg.head_dim, self.dtype, self.device)
        self.max_model_len = self._max_model_len()
        self.backend = TorchAttention(scale=cfg.head_dim ** -0.5)

    def _num_blocks(self) -> int:
        c, m = self.config, self.loaded.config
        tokens = c.kv_cache_tokens
        if tokens is None:
            per_token = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
            budget = int(_memory_bytes(self.device) * c.kv_cache_memory_fraction) // per_token
            tokens = min(budget, c.max_num_seqs * m.max_model_len)
        return max(1, tokens // c.block_size)

    def _max_model_len(self) -> int:
        model_len = self.loaded.config.max_model_len
        cache_len = self.num_blocks * self.config.block_size
        if self.config.max_model_len is not None:
            if self.config.max_model_len > model_len:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                                 f"context {model_len}")
            if self.config.max_model_len > cache_len:
                raise ValueError(f"max_model_len {self.config.max_model_len} does not fit in the KV "
                                 f"cache ({cache_len} tokens); raise kv_cache_tokens")
            return self.config.max_model_len
        return min(model_len, cache_len)

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep]) -> list[SeqResult]:
        spans = [SeqSpan(s.token_ids, s.num_cached, s.block_table) for s in steps]
        batch = build_forward_batch(spans, self.config.block_size, self.device)
        hidden = self.model(batch, self.kv, self.backend)
        ends = torch.tensor([len(s.token_ids) for s in steps]).cumsum(0) - 1
        sampled = [i for i, s in enumerate(steps) if s.sample]
        logits = self.model.compute_logits(hidden[ends[sampled].to(self.device)])
        rows = [SampleRow(steps[i].params, steps[i].seed, steps[i].output_position,
                          steps[i].output_token_ids) for i in sampled]
        tokens, logprobs = sample(logits, rows, self.loaded.eos_token_ids)
        return [SeqResult(steps[i].seq_id, t, lp) for i, t, lp in zip(sampled, tokens, logprobs)]
