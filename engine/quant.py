"""Block-quantized weights kept quantized in memory: GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K.

A GGUF tensor of one of these types is read as a `QuantTensor` (its raw blocks, one byte row
per weight row) and packed into one uint8 tensor the native kernels take
(engine/kernels/cpu_gguf.cpp): a 128-byte header of int64s [MAGIC, N, K, segments, (ggml
type, rows, byte offset) x up to 4], then each segment's rows. Segments stack along the output
dimension, so a fused q/k/v whose parts have different types is still one weight. The kernel
decodes a weight row's blocks to float32 and accumulates in float32: the results are those of the
dequantized weights, up to accumulation order.

`quantize_q8_0` quantizes a float weight into Q8_0 blocks (int8, one fp16 scale per 32
weights): the `--quantization int8` load option of Hugging Face checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from eagle_serve.engine import kernels

MAGIC = 0x31544E5146474745
HEADER_BYTES = 128
MAX_SEGMENTS = 4
ALIGN = 64
# ggml type id -> (name, weights a block, bytes a block): the types the native kernels multiply
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
BLOCK_TYPES = {Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20), Q8_0: ("Q8_0", 32, 34),
               Q4_K: ("Q4_K", 256, 144), Q6_K: ("Q6_K", 256, 210)}


@dataclass
class QuantTensor:
    """A GGUF weight in its block layout: `blocks` uint8 [rows, row bytes], `shape` (rows, K)."""
    ggml_type: int
    blocks: torch.Tensor
    shape: tuple[int, int]

    @staticmethod
    def from_raw(ggml_type: int, raw: np.ndarray, shape: tuple[int, int]) -> "QuantTensor":
        """raw: the tensor's bytes as the gguf package reads them ([rows, row bytes] or flat)."""
        _, per, nbytes = BLOCK_TYPES[ggml_type]
        rows, K = shape
        if K % per:
            raise ValueError(f"{K} columns are not a multiple of the {per}-weight block")
        row_bytes = K // per * nbytes
        data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, row_bytes)
        return QuantTensor(ggml_type, torch.from_numpy(data.copy()), (rows, K))

    def take_rows(self, order: torch.Tensor) -> "QuantTensor":
        """The same weight with its rows reordered (llama.cpp's Q/K row permutation undone)."""
        return QuantTensor(self.ggml_type, self.blocks[order].contiguous(), self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, K] (the gguf package's reference dequantization)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize
        out = dequantize(self.blocks.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(self.shape).copy())


def pack(parts: list[QuantTensor]) -> torch.Tensor:
    """One uint8 tensor for the kernels from parts stacked along the output dimension (all of
    the same K); parts of the same type next to each other share a segment."""
    if not parts:
        raise ValueError("nothing to pack")
    K = parts[0].shape[1]
    if any(p.shape[1] != K for p in parts):
        raise ValueError("packed parts must have the same number of columns")
    segs: list[list[QuantTensor]] = []
    for p in parts:
        if segs and segs[-1][0].ggml_type == p.ggml_type:
            segs[-1].append(p)
        else:
            segs.append([p])
    if len(segs) > MAX_SEGMENTS:
        raise ValueError(f"a packed weight holds at most {MAX_SEGMENTS} runs of one type")
    header = np.zeros(HEADER_BYTES // 8, dtype=np.int64)
    N = sum(p.shape[0] for p in parts)
    header[:4] = (MAGIC, N, K, len(segs))
    chunks, offset = [], HEADER_BYTES
    for i, seg in enumerate(segs):
        blocks = torch.cat([p.blocks for p in seg]) if len(seg) > 1 else seg[0].blocks
        header[4 + 3 * i: 7 + 3 * i] = (seg[0].ggml_type, blocks.shape[0], offset)
        flat = blocks.reshape(-1)
        pad = -flat.numel() % ALIGN
        chunks.append(flat)
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        offset += flat.numel() + pad
    head = torch.from_numpy(header.view(np.uint8).copy())
    return torch.cat([head, *chunks])


def packed_shape(w: torch.Tensor) -> tuple[int, int]:
    header = w[:HEADER_BYTES].numpy().view(np.int64)
    return int(header[1]), int(header[2])


def packed_types(w: torch.Tensor) -> list[str]:
    header = w[:HEADER_BYTES].numpy().view(np.int64)
    return [BLOCK_TYPES[int(header[4 + 3 * i])][0] for i in range(int(header[3]))]


def unpack(w: torch.Tensor) -> list[QuantTensor]:
    """The segments of a packed weight."""
    header = w[:HEADER_BYTES].numpy().view(np.int64)
    K = int(header[2])
    out = []
    for i in range(int(header[3])):
        t, rows, off = (int(v) for v in header[4 + 3 * i: 7 + 3 * i])
        _, per, nbytes = BLOCK_TYPES[t]
        row_bytes = K // per * nbytes
        out.append(QuantTensor(t, w[off: off + rows * row_bytes].view(rows, row_bytes), (rows, K)))
    return out


def dequantize(w: torch.Tensor) -> torch.Tensor:
    """A packed weight as float32 [N, K]: the native kernel's, else the gguf package's."""
    mod = kernels.native()
    if mod is not None:
        return mod.gguf_dequantize(w)
    return torch.cat([q.dequantize() for q in unpack(w)])


def rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight, float32 [len(ids), K]."""
    mod = kernels.native()
    if mod is not None:
        return mod.gguf_rows(w, ids.reshape(-1).long())
    return dequantize(w)[ids.reshape(-1).long()]


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, float_out: bool) -> torch.Tensor:
    """x @ W.T (+ bias) for a packed weight and any number of rows: the kernel's tiles, or
    (no native kernels) the dequantized weight in float32."""
    mod = kernels.native()
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype not in (torch.float32, torch.bfloat16):  # float64 models: the exact product
        y = torch.nn.functional.linear(x2, dequantize(w).to(x.dtype), bias)
    elif mod is not None:
        y = mod.gguf_mm(x2.contiguous(), w, bias, float_out)
    else:
        y = torch.nn.functional.linear(x2.float(), dequantize(w), None if bias is None else bias.float())
        y = y if float_out else y.to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quantize_q8_0(w: torch.Tensor) -> QuantTensor:
    """Q8_0 blocks of a float weight [N, K] (K a multiple of 32): per 32 weights a scale
    d = max |w| / 127 rounded to fp16 and q = round(w / d), as llama.cpp's quantize_row_q8_0."""
    N, K = w.shape
    if K % 32:
        raise ValueError(f"Q8_0 needs in_features divisible by 32, got {K}")
    b = w.detach().to(torch.float32).reshape(N, K // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp_(-127, 127).to(torch.int8)
    d16 = d.to(torch.float16)
    blocks = torch.cat([d16.view(torch.uint8).reshape(N, K // 32, 2), q.view(torch.uint8)], dim=-1)
    return QuantTensor(Q8_0, blocks.reshape(N, -1).contiguous(), (N, K))


def placeholder(shape: tuple[int, int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A weight that costs no memory and keeps its module's shape and dtype: one NaN seen
    through a stride-0 view, so any use of it where the quantized (GGUF or FP8) weight belongs
    is loud."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(*shape)


class QuantizedEmbedding(nn.Module):
    """An embedding lookup over a packed GGUF weight: the looked-up rows are dequantized."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.gguf_weight = packed
        self.num_embeddings, self.embedding_dim = packed_shape(packed)
        self.weight = nn.Parameter(placeholder((self.num_embeddings, self.embedding_dim), dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = rows(self.gguf_weight, ids).to(self.weight.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "gguf_weight", None) is not None


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A Linear's or embedding's weight as a dense tensor (dequantized where it is quantized)."""
    if is_quantized(module):
        return dequantize(module.gguf_weight).to(module.weight.dtype)
    return module.weight.data


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the packed quantized weights a model holds (a tied weight counted once)."""
    seen, total = set(), 0
    for m in model.modules():
        w = getattr(m, "gguf_weight", None)
        if w is not None and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            total += w.numel()
    return total
