"""Building blocks shared by model families: linear with CPU weight prepacking, RMSNorm, RoPE."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eagle_serve.engine import fp8, hugepages, kernels, quant


FAST_DTYPES = (torch.float32, torch.bfloat16)
# Up to how many input rows the native kernels take a linear (and the fused decode stack a whole
# forward), by weight layout; more rows go to oneDNN, which wins once the weights are no longer the
# bottleneck. Packed bf16 reads the weights once for all rows; AMX tiles and AMD's AVX-512 build keep
# that lead further. Picked by bench/bench_linear.py.
PACKED_MAX_ROWS = 16
AMX_PACKED_MAX_ROWS = 32
WIDE_PACKED_MAX_ROWS = 64  # the native attention's most queries; prompt batches keep 16 (Linear.prompt_max_rows)
ROW_LAYOUT_MAX_ROWS = 4  # float32, or shapes that cannot be packed
SKINNY_MAX_ROWS = PACKED_MAX_ROWS  # the most rows the native paths take on every CPU they run on
# Up to how many rows a draft head's int8 weights take an input: the int8 loop does one FMA a weight
# and row, so past a few rows it is compute-bound where packed bf16 is not (bench/bench_spec.py
# --draft-quantization measures the draft both ways).
INT8_MAX_ROWS = 4
# The same for int8 weights packed for int8 inputs (VNNI, draft_quantization w8a8): four inputs an
# instruction keep them ahead of bf16 up to a draft level of several sequences (bench/bench_spec.py
# --draft-quantization w8a8 --compare-quantization int8).
W8A8_MAX_ROWS = 16
# Up to how many rows GGUF block weights go to the native kernel (a weight row's blocks decoded in
# registers, multiplied into up to 8 input rows at a time); more rows dequantize tiles for float32 BLAS
# (quant.matmul): the two take about as long at 24-32 rows (Q8_0, Q4_0, Q4_K; 2048 x 8192).
GGUF_MAX_ROWS = 24


def packed_max_rows(in_features: int, wide: bool = True) -> int:
    """Up to how many rows packed bf16 weights of this many inputs go to the native kernel on
    this CPU: 32 where its AMX path takes them (in_features % 32 == 0), 64 with the AVX-512 build
    on AMD CPUs (kernels.wide_packed; wide=False: not, the limit prompt tokens keep), else 16.
    Decided at prepack: the module's set_amx is for benchmarks, before any model is built."""
    mod = kernels.native()
    amx = mod is not None and getattr(mod, "amx", lambda: False)()
    if amx and in_features % 32 == 0:
        return AMX_PACKED_MAX_ROWS
    if wide and mod is not None and not amx and kernels.wide_packed():
        return WIDE_PACKED_MAX_ROWS
    return PACKED_MAX_ROWS


_rows_as = 0  # within `rows_as`: linears pick their kernel as if their input had at least this many rows
_prompt = False  # within `rows_as(..., prompt=True)`: by their prompt limit (Linear.prompt_max_rows)


class rows_as:
    """Within it, every Linear picks its kernel (native or oneDNN) as if its input had at least
    `rows` rows: a forward of prompt tokens, whose rounding must be the one its whole prompt
    gets (ForwardBatch.prompt_lens). prompt: the batch holds prompt tokens, which take the
    limits every CPU gives them (Linear.prompt_max_rows): a cached prefix is shared by prompts of
    every length, so its KV must not depend on which of them computed it."""

    def __init__(self, rows: int, prompt: bool = False):
        self.rows, self.prompt = rows, prompt

    def __enter__(self):
        global _rows_as, _prompt
        self.prev = _rows_as, _prompt
        _rows_as, _prompt = max(self.rows, _rows_as), self.prompt or _prompt

    def __exit__(self, *exc):
        global _rows_as, _prompt
        _rows_as, _prompt = self.prev


class Linear(nn.Module):
    """y = x W^T (+ b). On the CPU in float32/bfloat16, `prepack()` sets up two faster paths
    than F.linear (MKL reads weights at ~10 GB/s for one-row inputs on these AMD machines):
    the native skinny kernel (engine/kernels) for up to native_max_rows rows, and oneDNN's
    prepacked blocked layout for more rows (bench/bench_linear.py measures all three)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        self._skinny = None
        self.native_weight: torch.Tensor | None = None  # what the native kernel reads (maybe packed)
        self.native_max_rows = 0  # inputs up to this many rows go to the native kernel
        self.prompt_max_rows = 0  # the same for prompt tokens (within rows_as(..., prompt=True))
        self.native_all_rows = False  # every input does: no oneDNN path for packed bf16 here
        self.int8_weight: torch.Tensor | None = None  # quantize_int8's weights (draft heads)
        self.int8_max_rows = 0  # inputs up to this many rows go to them
        self.bucket_rows = False  # oneDNN products round their rows up to onednn_rows' buckets
        self.gguf_weight: torch.Tensor | None = None  # GGUF blocks kept quantized (set_gguf)
        # FP8 checkpoints on GPUs with FP8 matmul (engine/fp8.py): float8_e4m3fn [N, K] and float32 [N];
        # `weight` is then a NaN placeholder of its shape that takes no memory
        self.fp8_weight: torch.Tensor | None = None
        self.fp8_scale: torch.Tensor | None = None

    def set_gguf(self, packed: torch.Tensor, dtype: torch.dtype) -> None:
        """Hold quantized GGUF blocks (engine/quant.py's packed weight) instead of a dense weight:
        `weight` keeps the shape and dtype and holds no memory (quant.placeholder)."""
        if quant.packed_shape(packed) != tuple(self.weight.shape):
            raise ValueError(f"packed weight of shape {quant.packed_shape(packed)} for a linear of {tuple(self.weight.shape)}")
        self.gguf_weight = packed
        self.weight = nn.Parameter(quant.placeholder(tuple(self.weight.shape), dtype), requires_grad=False)

    def prepack(self, native: bool = True) -> bool:
        w = self.weight
        self.int8_weight, self.int8_max_rows = None, 0
        if self.gguf_weight is not None:  # products of up to GGUF_MAX_ROWS rows by the block kernel
            self._skinny = kernels.skinny_linear() if native and w.dtype in FAST_DTYPES else None
            self.native_weight = self.gguf_weight if self._skinny is not None else None
            self.native_max_rows = self.prompt_max_rows = GGUF_MAX_ROWS if self._skinny is not None else 0
            self._packed, self.native_all_rows = None, False
            return self._skinny is not None
        if w.device.type != "cpu" or w.dtype not in FAST_DTYPES:
            return False
        self._skinny = kernels.skinny_linear() if native else None
        self.native_weight = w.data
        self.native_max_rows = self.prompt_max_rows = ROW_LAYOUT_MAX_ROWS if self._skinny is not None else 0
        packed = (self._skinny is not None and w.dtype == torch.bfloat16 and w.shape[0] % 32 == 0
                  and w.shape[1] % 2 == 0 and w.shape[1] > 0)
        if packed:
            self.native_weight = kernels.native().pack_bf16(w.data)
            self.native_max_rows = packed_max_rows(w.shape[1])
            self.prompt_max_rows = packed_max_rows(w.shape[1], wide=False)
        if _onednn_ok(w.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
        # without oneDNN's bf16 GEMM (AVX2-only CPUs) torch's bf16 F.linear is emulated and slower than
        # the packed kernel at any row count, so that kernel takes them all (bench/bench_linear.py)
        self.native_all_rows = packed and self._packed is None
        return self._skinny is not None or self._packed is not None

    def quantize_int8(self, max_rows: int, int8_inputs: bool = False) -> bool:
        """Int8 weights with a float32 scale per output (the native kernel's pack_int8) for inputs
        of up to `max_rows` rows, after prepack(); more rows keep the prepacked paths. For draft
        heads only: their numbers are proposals the target verifies, so rounding the weights to
        int8 cannot change the output, only how often drafts are accepted. int8_inputs: each
        input row is rounded to 8 bits too and the products run as VNNI dot products (the
        module's int8_inputs_available()). Needs the native kernels and out_features % 64 == 0;
        returns whether it applied."""
        mod = kernels.native()
        if (self._skinny is None or mod is None or not hasattr(mod, "pack_int8") or self.gguf_weight is not None
                or self.weight.shape[0] % 64 or self.weight.shape[1] == 0
                or not bool(torch.isfinite(self.weight).all())):  # a NaN / inf has no int8 scale
            return False
        self.int8_weight = mod.pack_int8(self.weight.data, int8_inputs)
        self.int8_max_rows = max_rows
        return True

    def native_for(self, rows: int) -> torch.Tensor | None:
        """The weight forward() hands the native kernel for an input of this many rows (int8 or
        prepacked), or None where forward() would take another path."""
        if self.int8_weight is not None and rows <= self.int8_max_rows:
            return self.int8_weight
        limit = self.prompt_max_rows if _prompt else self.native_max_rows
        if self._skinny is not None and (self.native_all_rows or max(rows, _rows_as) <= limit):
            return self.native_weight
        return None

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """float_out: return float32 (where the native kernel runs, straight from its float32
        accumulator, not rounded through the weight dtype)."""
        if self.fp8_weight is not None:
            return fp8.linear(self, x, float_out)
        w = self.native_for(x.shape[0])
        if w is not None:
            return self._skinny(x.contiguous(), w, self.bias, float_out)
        if self.gguf_weight is not None:
            return quant.matmul(x, self.gguf_weight, self.bias, float_out)
        if self._packed is not None:
            rows = x.shape[0]
            pad = onednn_rows(rows) - rows if self.bucket_rows and x.dim() == 2 else 0
            if pad:
                x = F.pad(x, (0, 0, 0, pad))
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            return y[:rows] if pad else y
        return F.linear(x, self.weight, self.bias)


def weights_to_arena(linears: list["Linear"], also: tuple = ()) -> int:
    """Move the prepacked native weights (and int8 weights, and GGUF blocks) of `linears` into one
    huge-page arena (engine.hugepages): a decode step streams them all, about 66,000 pages a step
    in 4 KiB pages. Call after prepack / quantize_int8 and before a native stack takes the tensors.
    Weights that are the module's own `weight` (the row layout) stay where they are. `also`:
    other modules holding GGUF blocks (a quantized embedding), which follow a block tensor they
    share with a linear (a tied LM head). Returns the bytes moved."""
    if not hugepages.enabled():
        return 0
    slots, blocks = [], {}
    for m in linears:
        if m.gguf_weight is not None:  # one copy however many modules hold it
            blocks.setdefault(m.gguf_weight.data_ptr(), m.gguf_weight)
            continue
        if m.native_weight is not None and m.native_weight.data_ptr() != m.weight.data_ptr():
            slots.append((m, "native_weight"))
        if m.int8_weight is not None:
            slots.append((m, "int8_weight"))
    moved = hugepages.arena([getattr(m, a) for m, a in slots] + list(blocks.values()))
    for (m, a), t in zip(slots, moved):
        setattr(m, a, t)
    new_blocks = dict(zip(blocks, moved[len(slots):]))
    for m in [*linears, *also]:
        w = getattr(m, "gguf_weight", None)
        if w is not None and w.data_ptr() in new_blocks:
            t = new_blocks[w.data_ptr()]
            if getattr(m, "native_weight", None) is w:
                m.native_weight = t
            m.gguf_weight = t
    return sum(t.numel() * t.element_size() for t in moved)


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN product of `rows` rows runs at where its Linear has bucket_rows
    (a draft head's: EagleHead.prepack): rounded up to a multiple of 16 (of 64 past 256 rows,
    of 256 past 1024). oneDNN builds a kernel for every new shape, and a head meets a new row
    count with nearly every catch-up (a new prompt's pairs, a backlog); a new shape costs more
    than the padded rows. The target keeps exact
    row counts: its forward builds a shape once for all its layers and would pad every one of
    them. A row's result does not
    depend on the rows beside it (tests/test_kernels.py checks it on the machine that runs the
    tests), so the padding changes no output."""
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


def _onednn_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear takes this dtype here: bf16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses the weight otherwise (an AVX2-only CPU; F.linear then)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); fused in one native call on the CPU."""
        mod = kernels.native() if residual.device.type == "cpu" and residual.dtype in FAST_DTYPES else None
        if mod is not None:
            return mod.add_rms_norm(residual, delta.contiguous(), self.weight, self.eps), residual
        residual = residual + delta
        return self.forward(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with linear or llama3 scaling. Computed in float32
    like Hugging Face's reference, whose numbers the checkpoints were trained with."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its factor
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with cos/sin tables looked up once per forward."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(head_dim, theta, scaling))  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)  # [T, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
