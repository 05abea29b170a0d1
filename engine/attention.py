"""Attention backends: one interface (`AttentionBackend`, engine/attention_base.py), chosen at
start-up.

Backends: `torch` (reference, any device), `native` (CPU kernels), `flash` (flash-attn 2 on
CUDA, engine/flash_attention.py). `make_backend` picks one from `EngineConfig.attention`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from eagle_serve.engine import kernels
from eagle_serve.engine.attention_base import AttentionBackend
from eagle_serve.engine.config import ATTENTIONS
from eagle_serve.engine.flash_attention import FlashAttention
from eagle_serve.engine.layers import FAST_DTYPES

log = logging.getLogger(__name__)


def cuda_sdpa_backends():
    """The SDPA kernels the torch backend allows on CUDA: flash, memory-efficient and math, not
    cuDNN. cuDNN's attention builds an execution plan per input shape, and the eager forward's
    key length grows every round, so every round would pay for a new plan (bench/gpu_check.py)."""
    from torch.nn.attention import SDPBackend
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttention(AttentionBackend):
    """Reference backend: gather through the block table, one masked SDPA for the batch.
    `sdpa_backends`: the SDPA kernels allowed (None: torch's own choice); make_backend passes
    `cuda_sdpa_backends()` on CUDA."""

    name = "torch"

    def __init__(self, scale: float, sdpa_backends=None):
        self.scale = scale
        self.sdpa_backends = sdpa_backends

    def sdpa(self, *args, **kwargs) -> torch.Tensor:
        if self.sdpa_backends is None:
            return F.scaled_dot_product_attention(*args, **kwargs)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(self.sdpa_backends):
            return F.scaled_dot_product_attention(*args, **kwargs)

    @staticmethod
    def store_and_gather(k, v, layer, batch, kv):
        """Write the new K/V, then every sequence's keys and values as [B, Hkv, L, D]."""
        k_cache, v_cache = kv.store(layer, batch.slot_mapping, k, v)
        B, L, D = batch.num_seqs, batch.max_kv_len, k.shape[-1]
        keys = k_cache.index_select(0, batch.kv_gather).view(B, L, -1, D).transpose(1, 2)
        values = v_cache.index_select(0, batch.kv_gather).view(B, L, -1, D).transpose(1, 2)
        return keys, values

    def forward(self, q, k, v, layer, batch, kv):
        keys, values = self.store_and_gather(k, v, layer, batch, kv)
        B, Q = batch.num_seqs, batch.max_query_len
        T, H, D = q.shape
        if batch.q_index is None:  # one sequence: no padding
            queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        else:
            queries = q.new_zeros(B * Q, H, D).index_copy_(0, batch.q_index, q)
            queries = queries.view(B, Q, H, D).transpose(1, 2)  # [B, H, Q, D]
        out = self.sdpa(queries, keys, values, attn_mask=batch.attn_mask,
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
        # a prompt chunk goes as its whole prompt would (ForwardBatch.prompt_lens): the tail a
        # prefix-cache hit leaves rounds as it did within the whole prompt
        long_prompt = max(batch.prompt_lens, default=0) > self.MAX_QUERIES
        if (batch.max_query_len > self.MAX_QUERIES or long_prompt) and batch.num_seqs == 1:
            return super().forward(q, k, v, layer, batch, kv)
        k_cache, v_cache = kv.store(layer, batch.slot_mapping, k, v)
        gather = batch.kv_gather.view(batch.num_seqs, batch.max_kv_len)
        if batch.max_query_len <= self.MAX_QUERIES and not long_prompt:
            return self.kernels.paged_attention(q.contiguous(), k_cache, v_cache, gather, batch.kv_lens,
                                                batch.q_seq, batch.q_row, batch.mask_3d(), self.scale)
        return self._mixed(q, k_cache, v_cache, gather, batch)

    def _mixed(self, q, k_cache, v_cache, gather, batch):
        """Prefill chunks batched with decodes: a padded grid would be [B, Q, L] for the
        longest chunk's Q. Long chunks and chunks of long prompts attend alone (SDPA, no
        padding); the others go through the native kernel together."""
        T, H, D = q.shape
        out = q.new_empty(T, H * D)
        counts = torch.bincount(batch.q_seq, minlength=batch.num_seqs).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        kv_lens = batch.kv_lens.tolist()
        mask = batch.mask_3d()
        alone = [max(c, p) > self.MAX_QUERIES for c, p in zip(counts, batch.prompt_lens or [0] * len(counts))]
        small = [b for b in range(len(counts)) if not alone[b]]
        for b, c in enumerate(counts):
            if not alone[b]:
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


FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_INSTALL = "--attention flash needs the flash-attn package (pip install -e '.[cuda]')"


def make_backend(scale: float, device: torch.device, dtype: torch.dtype, attention: str = "auto") -> AttentionBackend:
    """The attention backend for `attention` (one of ATTENTIONS) on `device` / `dtype`.

    auto: on CUDA, `flash` when flash-attn imports and the dtype is float16/bfloat16, else the
    torch backend, whose masked SDPA runs on any device (not FlexAttention: tree masks change
    shape every round, which would cost a block mask per batch or a compile per shape); on the CPU, `native` where its kernels build (AVX-512 with bf16, dtype float32
    or bfloat16), else torch.
    Explicit choices that cannot run raise ValueError with the reason: `flash` without
    flash-attn, on the CPU (unless a test installed a stand-in module marked `__standin__`), or
    in a dtype flash-attn lacks; `native` off the CPU or where the kernels do not build.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if attention == "torch":
        return TorchAttention(scale, cuda_sdpa_backends() if device.type == "cuda" else None)
    if attention == "flash":
        return _flash_backend(scale, device, dtype)
    if attention == "native":
        if device.type != "cpu":
            raise ValueError(f"--attention native is the CPU kernel backend; the device is {device.type} "
                             f"(use flash or torch)")
        mod = _native_kernels(dtype)
        if mod is None:
            raise ValueError("--attention native: the native CPU kernels are unavailable (they need AVX-512 with "
                             "bf16, a C++ compiler and dtype float32 or bfloat16); use torch")
        return NativeCPUAttention(scale, mod)
    if device.type == "cuda":
        try:
            return _flash_backend(scale, device, dtype)
        except ValueError as e:
            log.info("attention auto: torch backend on %s (%s)", device, e)
            return TorchAttention(scale, cuda_sdpa_backends())
    mod = _native_kernels(dtype) if device.type == "cpu" else None
    return NativeCPUAttention(scale, mod) if mod is not None else TorchAttention(scale)


def _native_kernels(dtype: torch.dtype):
    return kernels.native() if dtype in FAST_DTYPES else None


def _flash_backend(scale: float, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    try:
        import flash_attn
    except ImportError as e:
        detail = "" if isinstance(e, ModuleNotFoundError) and e.name == "flash_attn" else f" ({e})"
        raise ValueError(FLASH_INSTALL + detail) from e
    standin = getattr(flash_attn, "__standin__", False)
    if device.type != "cuda" and not standin:
        raise ValueError(f"--attention flash runs on CUDA devices; the device is {device.type} (use native or torch)")
    if dtype not in FLASH_DTYPES and not (standin and getattr(flash_attn, "allow_full_precision", False)):
        raise ValueError(f"--attention flash computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')} "
                         f"(use --dtype bfloat16, or --attention torch)")
    return FlashAttention(scale, flash_attn)
