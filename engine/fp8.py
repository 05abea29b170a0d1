"""FP8 (e4m3) checkpoints: their quantization_config checked, their weights read, and the FP8
linear product.

Two layouts load (docs/usage.md, "FP8 checkpoints"):

  compressed-tensors  quant_method "compressed-tensors", format "float-quantized" (llm-compressor's
                      FP8 / FP8-dynamic / FP8-block schemes): `<name>.weight` float8_e4m3fn and
                      `<name>.weight_scale`, [N, 1] per output channel ("channel"), [] or [1]
                      per tensor ("tensor"), or [ceil(N / bn), ceil(K / bk)] per block ("block",
                      block_structure [bn, bk]).
  fp8                 quant_method "fp8" (AutoFP8, transformers' FP8): `<name>.weight` float8_e4m3fn
                      and `<name>.weight_scale` (per tensor, or per channel); with
                      "weight_block_size" [bn, bk] the per-block `<name>.weight_scale_inv`.

A weight is the stored e4m3 value times its scale (`weight_scale_inv` too: it is the factor that
dequantizes, whatever the name). Activations are quantized dynamically or not at all: a static
activation scheme (a stored `input_scale`) is refused, not approximated.

`Fp8Weights` wraps the checkpoint's (name, tensor) stream. On the CPU, and on GPUs without FP8
matmul (compute capability < 8.9), every quantized weight comes out dequantized to float32
(then cast to the model's dtype by the loader). On a CUDA GPU with FP8 matmul the weights of the
decoder's linears stay FP8: `keep_on` (before loading) picks them, the stream yields in their
place, under the module's (fused) name, an uninitialised tensor of its shape whose pages are never
touched, and `attach` (after loading) sets each such
Linear's `fp8_weight` [N, K] float8_e4m3fn and `fp8_scale` [N] float32 and replaces its `weight`
by a NaN tensor of the same shape that takes no memory (a stride-0 view). `linear` is then the
module's forward: torch._scaled_mm with a per-row activation scale computed on the fly.
Block-scaled weights, the LM head and MoE experts (the grouped GPU path stacks their float
weights) are dequantized on every device.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_serve.engine import quant
from eagle_serve.engine.model_files import ModelLoadError

log = logging.getLogger(__name__)

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
ZERO_POINT_SUFFIXES = ("weight_zero_point", "input_zero_point")


@dataclass(frozen=True)
class Fp8Scheme:
    """What a quantization_config allows: the weight scale layouts ("tensor", "channel",
    "block"), the block shape, the scale tensors' suffix."""
    method: str
    strategies: frozenset[str]
    block: tuple[int, int] | None
    scale_suffix: str
    activations: str  # "dynamic" (per token on the GPU path) or "none" (weight-only)

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return (f"{self.method} FP8 e4m3, {'/'.join(sorted(self.strategies))}{block} weight scales, "
                f"{self.activations} activations")


def scheme(quant, where: str) -> Fp8Scheme:
    """The FP8 scheme of a config.json quantization_config, or a ModelLoadError naming what is
    not supported (another method, bit width, int types, static activation scales, ...)."""
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{where}: quantization_config is not an object")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    if method == "fp8":
        return _plain_fp8(quant, where)
    raise ModelLoadError(f"{where}: quantized checkpoints (quant_method {method!r}) are not supported; FP8 ones "
                         f"(quant_method 'compressed-tensors' float-quantized, or 'fp8') are. Use an unquantized "
                         f"checkpoint, an FP8 one or a GGUF file")


def _refuse(where: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: quantization_config: {what}; only FP8 e4m3 weights (8-bit float, per tensor, "
                          f"per channel or per block) with dynamic or no activation quantization load")


def _block(value, where: str, field: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(where, f"{field} {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


def _compressed_tensors(quant: dict, where: str) -> Fp8Scheme:
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "compressed-tensors without config_groups")
    if quant.get("kv_cache_scheme") is not None:
        raise _refuse(where, "a kv_cache_scheme (FP8 KV cache scales) is set; the KV cache is not quantized here")
    sparsity = quant.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise _refuse(where, f"sparsity format {sparsity.get('format')!r}")
    strategies, block, dynamic = set(), None, set()
    for gname, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(where, f"config group {gname!r} is not an object")
        gfmt = group.get("format") or fmt
        if gfmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(where, f"compressed-tensors format {gfmt!r} (group {gname!r})")
        if group.get("output_activations") is not None:
            raise _refuse(where, f"group {gname!r} quantizes output activations")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _refuse(where, f"group {gname!r} has no weight quantization")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise _refuse(where, f"group {gname!r} weights are {w.get('num_bits')}-bit {w.get('type')}")
        if w.get("symmetric") is False:
            raise _refuse(where, f"group {gname!r} weights are asymmetric (zero points)")
        if w.get("dynamic"):
            raise _refuse(where, f"group {gname!r} weights are dynamic (no stored scales)")
        strategy = w.get("strategy")
        if strategy == "block":
            b = _block(w.get("block_structure"), where, f"group {gname!r} block_structure")
            if block is not None and b != block:
                raise _refuse(where, f"two block shapes {block} and {b}")
            block = b
        elif strategy not in ("tensor", "channel"):
            raise _refuse(where, f"group {gname!r} weight strategy {strategy!r}")
        strategies.add(strategy)
        act = group.get("input_activations")
        if act is None:
            dynamic.add("none")
        elif not isinstance(act, dict) or act.get("num_bits") != 8 or act.get("type") != "float":
            raise _refuse(where, f"group {gname!r} input activations {act!r}")
        elif act.get("dynamic") is not True:
            raise _refuse(where, f"group {gname!r} has static input activation scales (input_scale), which are "
                                 f"not implemented")
        else:
            dynamic.add("dynamic")
    return Fp8Scheme("compressed-tensors", frozenset(strategies), block, "weight_scale", "/".join(sorted(dynamic)))


def _plain_fp8(quant: dict, where: str) -> Fp8Scheme:
    act = quant.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise _refuse(where, f"activation_scheme {act!r} (static input_scale tensors are not implemented)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, f"fmt {fmt!r}")
    if quant.get("weight_block_size") is not None:
        block = _block(quant["weight_block_size"], where, "weight_block_size")
        return Fp8Scheme("fp8", frozenset({"block"}), block, "weight_scale_inv", "dynamic")
    return Fp8Scheme("fp8", frozenset({"tensor", "channel"}), None, "weight_scale", "dynamic")


# ---------------------------------------------------------------- reading the weights

def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 weight of FP8 `w` [N, K]: each e4m3 value times its scale (a scalar, [N] / [N, 1],
    or per block [ceil(N / bn), ceil(K / bk)])."""
    s = scale.float()
    if block is not None and s.dim() == 2 and s.numel() > 1:
        n, k = w.shape
        s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    else:
        s = s.reshape(())
    return w.float() * s


class Fp8Weights:
    """The checkpoint's (name, tensor) stream with FP8 weights paired with their scales: each
    comes out dequantized (float32), or kept for `attach` (see keep_on). Zero points must be
    zero and are consumed; an `input_scale`, a scale without its FP8 weight, an FP8 weight
    without its scale or a scale of the wrong shape is a ModelLoadError."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]], fp8: Fp8Scheme, where: str):
        self.tensors, self.scheme, self.where = tensors, fp8, where
        self.keep = None  # prefix -> whether its weight stays FP8 (keep_on); None: dequantize all
        self.device: torch.device | None = None
        self.target = lambda prefix: prefix  # HF prefix -> the module it loads into (keep_on: fused names)
        self.parts = lambda target: 1  # how many checkpoint tensors a module's weight is made of (keep_on)
        self.dtype = torch.float32  # the model's dtype (keep_on)
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # HF prefix -> (fp8 [N, K], scale [N])
        self.kinds: dict[str, bool] = {}  # module kept FP8 or not, for fused modules' parts (keep_on)
        self.complete: set[str] = set()  # modules whose kept parts are all there
        self.counts = {"dequantized": 0, "kept": 0}

    def __iter__(self):
        weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale (shards may split them)
        scales: dict[str, torch.Tensor] = {}
        plain: set[str] = set()
        suffix = self.scheme.scale_suffix
        for name, t in self.tensors:
            prefix, _, last = name.rpartition(".")
            if last == "input_scale":
                raise ModelLoadError(f"{self.where}: {name!r} is a static activation scale; static activation "
                                     f"quantization is not implemented (only dynamic or none)")
            if last in ZERO_POINT_SUFFIXES:
                if bool(t.ne(0).any()):
                    raise ModelLoadError(f"{self.where}: {name!r} has nonzero zero points (asymmetric); only "
                                         f"symmetric FP8 loads")
                continue
            if last in SCALE_SUFFIXES:
                if last != suffix:
                    raise ModelLoadError(f"{self.where}: {name!r}: this scheme ({self.scheme.describe()}) stores "
                                         f"scales as {suffix!r}")
                if prefix in plain:
                    raise ModelLoadError(f"{self.where}: {name!r} scales a weight that is not float8_e4m3fn")
                scales[prefix] = t
            elif last == "weight" and t.dtype == FP8:
                weights[prefix] = t
            elif last == "weight" and t.dtype.is_floating_point and t.element_size() == 1:
                raise ModelLoadError(f"{self.where}: {name!r} is {t.dtype}; only float8_e4m3fn weights load")
            else:
                if last == "weight":
                    if prefix in scales:
                        raise ModelLoadError(f"{self.where}: {prefix}.{suffix} scales a weight that is {t.dtype}, "
                                             f"not float8_e4m3fn")
                    plain.add(prefix)
                    self._mark(prefix, False)
                yield name, t
                continue
            if prefix in weights and prefix in scales:
                out = self._take(prefix, weights.pop(prefix), scales.pop(prefix))
                if out is not None:
                    yield out
        if weights:
            raise ModelLoadError(f"{self.where}: FP8 weights without their {suffix}: "
                                 f"{sorted(p + '.weight' for p in weights)[:4]}")
        if scales:
            raise ModelLoadError(f"{self.where}: {suffix} tensors without an FP8 weight: "
                                 f"{sorted(p + '.' + suffix for p in scales)[:4]}")
        waiting = sorted({self.target(p) for p in self.kept} - self.complete)
        if waiting:
            raise ModelLoadError(f"{self.where}: parts of fused FP8 weights missing: {waiting[:4]}")
        if not self.counts["dequantized"] + self.counts["kept"]:
            raise ModelLoadError(f"{self.where}: the quantization_config declares FP8 ({self.scheme.describe()}) "
                                 f"but no weight is float8_e4m3fn")

    def _take(self, prefix: str, w: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """What the loader gets for an FP8 weight: (its name, the dequantized weight); or, kept,
        nothing until every part of its module is there, then (the module's fused weight name,
        an uninitialised tensor of its shape and dtype: untouched pages, no memory in use)."""
        name = prefix + ".weight"
        if w.dim() != 2:
            raise ModelLoadError(f"{self.where}: FP8 weight {name!r} has shape {tuple(w.shape)}, not 2-D")
        n, k = w.shape
        strategy = _strategy(scale, n, k, self.scheme)
        if strategy is None:
            shapes = {"tensor": "[] or [1]", "channel": f"[{n}, 1]",
                      "block": (f"[{-(-n // self.scheme.block[0])}, {-(-k // self.scheme.block[1])}]"
                                if self.scheme.block else "")}
            want = " or ".join(shapes[s] for s in sorted(self.scheme.strategies))
            raise ModelLoadError(f"{self.where}: {prefix}.{self.scheme.scale_suffix} has shape {tuple(scale.shape)}; "
                                 f"weight {tuple(w.shape)} under {self.scheme.describe()} needs {want}")
        if not scale.dtype.is_floating_point or not bool(torch.isfinite(scale.float()).all()):
            raise ModelLoadError(f"{self.where}: {prefix}.{self.scheme.scale_suffix} is not finite floats")
        keep = strategy != "block" and self.keep is not None and self.keep(prefix)
        self._mark(prefix, keep)
        if keep:
            per_row = scale.float().reshape(-1).expand(n).contiguous()
            self.kept[prefix] = (w.to(self.device), per_row.to(self.device))
            self.counts["kept"] += 1
            target = self.target(prefix)
            parts = [self.kept[p][0] for p in self.kept if self.target(p) == target]
            if len(parts) < self.parts(target):
                return None
            self.complete.add(target)  # (attach replaces the placeholder)
            return target + ".weight", torch.empty(sum(t.shape[0] for t in parts), k, dtype=self.dtype)
        self.counts["dequantized"] += 1
        return name, dequantize(w, scale, self.scheme.block if strategy == "block" else None)

    def _mark(self, prefix: str, kept: bool) -> None:
        """A fused linear (q/k/v, gate/up) keeps FP8 weights as a whole or not at all."""
        if self.keep is None or not self.keep(prefix):
            return
        target = self.target(prefix)
        if self.kinds.setdefault(target, kept) != kept:
            raise ModelLoadError(f"{self.where}: the parts of the fused {target} are not all FP8 with per-channel "
                                 f"or per-tensor scales ({prefix}.weight differs): they cannot run as one FP8 matrix")


def _strategy(scale: torch.Tensor, n: int, k: int, fp8: Fp8Scheme) -> str | None:
    """Which of the scheme's layouts a scale of this shape is, or None."""
    shape = tuple(scale.shape)
    if "tensor" in fp8.strategies and scale.numel() == 1 and len(shape) <= 2:
        return "tensor"
    if "channel" in fp8.strategies and shape in ((n, 1), (n,)):
        return "channel"
    if "block" in fp8.strategies and fp8.block and shape == (-(-n // fp8.block[0]), -(-k // fp8.block[1])):
        return "block"
    return None


# ---------------------------------------------------------------- the GPU path: keeping weights FP8

def fp8_matmul_available(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 matrices: CUDA with compute capability >= 8.9 and a torch
    with torch._scaled_mm."""
    if device.type != "cuda" or FP8 is None or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def keep_on(tensors, net: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Before loading `tensors` into `net`: where the device multiplies FP8, mark which weights
    stay FP8 (the decoder's linears whose fused [N, K] are multiples of 16, as _scaled_mm needs;
    not the LM head, not MoE experts); log what happens. A no-op for other streams."""
    if not isinstance(tensors, Fp8Weights):
        return
    from eagle_serve.engine.layers import Linear
    from eagle_serve.engine.loader import FUSED
    available = fp8_matmul_available(device)
    if not available or tensors.scheme.strategies == {"block"}:
        why = ("the CPU" if device.type != "cuda" else "this GPU: block-scaled weights run dequantized" if available
               else "a GPU without FP8 matmul (compute capability < 8.9)")
        log.warning("FP8 checkpoint (%s): weights are dequantized to float32 at load on %s, then cast to the "
                    "model dtype", tensors.scheme.describe(), why)
        return
    linears = {name: m for name, m in net.named_modules() if isinstance(m, Linear)}

    def target(prefix: str) -> str:
        parts = prefix.split(".")
        return ".".join(parts[:-1] + [FUSED[parts[-1]][0]]) if parts and parts[-1] in FUSED else prefix

    def keep(prefix: str) -> bool:
        t = target(prefix)
        m = linears.get(t)
        if m is None or t.split(".")[-1] == "lm_head" or ".experts." in f".{t}.":
            return False
        n, k = m.weight.shape
        return n % 16 == 0 and k % 16 == 0

    def parts(t: str) -> int:
        fused = t.split(".")[-1]
        return sum(1 for f, _ in FUSED.values() if f == fused) or 1

    tensors.keep, tensors.device, tensors.target, tensors.parts, tensors.dtype = keep, device, target, parts, dtype
    log.info("FP8 checkpoint (%s): the decoder's linear weights stay FP8 on %s (torch._scaled_mm, dynamic "
                "per-token activation scales); the LM head, MoE experts and block-scaled weights are dequantized",
                tensors.scheme.describe(), torch.cuda.get_device_name(device) if device.type == "cuda" else device)


def attach(tensors, net: torch.nn.Module, device: torch.device) -> None:
    """After loading: give each Linear whose weight was kept FP8 its `fp8_weight` / `fp8_scale`
    (fused parts concatenated in the loader's order) and a NaN `weight` of its shape that takes
    no memory. A no-op for other streams or when nothing was kept."""
    if not isinstance(tensors, Fp8Weights) or not tensors.kept:
        return
    from eagle_serve.engine.loader import FUSED
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for prefix, pair in tensors.kept.items():
        parts = prefix.split(".")
        index = FUSED[parts[-1]][1] if parts[-1] in FUSED else 0
        groups.setdefault(tensors.target(prefix), {})[index] = pair
    tensors.kept.clear()
    modules = dict(net.named_modules())
    dtypes, count = set(), len(groups)
    while groups:  # each module's parts dropped once concatenated: one module's copy at a time
        target, parts = groups.popitem()
        m = modules[target]
        pairs = [parts.pop(i) for i in sorted(parts)]
        w = torch.cat([w.view(torch.uint8) for w, _ in pairs]).view(FP8)  # (as bytes: any torch's cat takes them)
        set_fp8(m, w, torch.cat([s for _, s in pairs]), m.weight.dtype)
        dtypes.add(m.weight.dtype)
        del pairs, w
    for dtype in dtypes:
        probe(device, dtype)
    log.info("FP8: %d linears keep FP8 weights (%d checkpoint tensors), %d tensors dequantized", count,
             tensors.counts["kept"], tensors.counts["dequantized"])


def set_fp8(m, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Make Linear `m` an FP8 one: `fp8_weight` w [N, K] (float8_e4m3fn), `fp8_scale` [N] float32
    (a scalar is expanded), `weight` the placeholder."""
    n, k = w.shape
    m.fp8_weight = w.contiguous()
    m.fp8_scale = scale.float().reshape(-1).expand(n).contiguous().to(w.device)
    m.weight.data = quant.placeholder((n, k), dtype, w.device)


def quantize_(m, dtype: torch.dtype | None = None) -> None:
    """Quantize Linear `m`'s float weight in place to FP8 with a scale per output channel
    (amax / 448), as llm-compressor's FP8-dynamic scheme does: random-weight models in
    bench/gpu_check.py."""
    w = m.weight.data.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    set_fp8(m, q, scale, dtype or m.weight.dtype)


# ---------------------------------------------------------------- the product

# (device, dtype) -> "rowwise" (_scaled_mm's per-row / per-column scales, bf16 out), "tensorwise"
# (unit scales, float32 out, both scales applied after), or "reference" (dequantize, F.linear):
# what a probe of the device found, at load (never during a CUDA graph capture)
_MODES: dict[tuple[torch.device, torch.dtype], str] = {}


def probe(device: torch.device, dtype: torch.dtype) -> str:
    """Find (once) how this device runs FP8 products for `dtype` inputs: a 16x32x32 product of
    each kind, kept if it runs and matches the reference. Off CUDA "reference" (torch's CPU
    _scaled_mm is a slow reference implementation)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key a tensor's .device gives
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    if key in _MODES:
        return _MODES[key]
    mode = "reference"
    if FP8 is not None and hasattr(torch, "_scaled_mm") and device.type == "cuda":
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=gen).to(device, dtype)
        w = torch.randn(32, 32, generator=gen).to(FP8).to(device)
        s = torch.rand(32, generator=gen).add(0.5).to(device)
        ref = emulate(x, w, s, None).float()
        for candidate in (["rowwise", "tensorwise"] if dtype == torch.bfloat16 else ["tensorwise"]):
            try:
                got = scaled(x, w, s, None, candidate).float()  # (rowwise: bf16 out)
                if torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
                    mode = candidate
                    break
                log.warning("FP8: torch._scaled_mm (%s) is off the reference on %s; not used", candidate, device)
            except (RuntimeError, TypeError, NotImplementedError) as e:
                log.info("FP8: torch._scaled_mm (%s) unavailable on %s: %s", candidate, device, str(e)[:200])
    if mode == "reference" and device.type == "cuda":
        log.warning("FP8: no usable torch._scaled_mm on %s for %s inputs; FP8 linears dequantize their weights "
                    "on every call", device, dtype)
    _MODES[key] = mode
    return mode


def linear(m, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    """Linear `m`'s forward with FP8 weights (m.fp8_weight [N, K], m.fp8_scale [N]): x [..., K]
    -> [..., N] in x's dtype (float_out: float32; float64 inputs stay float64)."""
    mode = _MODES.get((x.device, x.dtype), "reference")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if mode == "reference":
        y = reference(x2, m.fp8_weight, m.fp8_scale, m.bias, float_out)
    else:
        y = scaled(x2, m.fp8_weight, m.fp8_scale, m.bias, mode, float_out)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _out_dtype(x: torch.Tensor, float_out: bool) -> torch.dtype:
    if not float_out:
        return x.dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              float_out: bool = False) -> torch.Tensor:
    """x [M, K] @ (w * scale)^T (+ bias) with the weight dequantized, in float32 (float64 for
    float64 inputs): where _scaled_mm is unavailable. No activation rounding."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    wf = w.to(acc) * scale.to(acc).reshape(-1, 1) if scale.numel() > 1 else w.to(acc) * scale.to(acc).reshape(())
    y = F.linear(x.to(acc), wf, None if bias is None else bias.to(acc))
    return y.to(_out_dtype(x, float_out))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, 1] float32): each row scaled so its largest magnitude
    is 448 (an all-zero row gets the smallest normal scale, so 0 / scale stays 0)."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def scaled(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str,
           float_out: bool = False) -> torch.Tensor:
    """x [M, K] @ (w * scale)^T (+ bias) through torch._scaled_mm: x quantized per row
    (quantize_rows), rows padded to a multiple of 16; K and N must be multiples of 16 (keep_on
    keeps only such weights). mode "rowwise": scale_a [M, 1] and scale_b [1, N] applied in the
    kernel, bf16 out (the only output dtype row-wise scaling has); "tensorwise": unit scales,
    float32 out, both scales applied after (any dtype, and float_out)."""
    rows = x.shape[0]
    pad = -rows % 16
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    xq, xs = quantize_rows(x)
    ws = scale.float().reshape(1, -1).expand(1, w.shape[0])
    if mode == "rowwise" and not float_out:
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.contiguous(), out_dtype=torch.bfloat16)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws
    y = y[:rows]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(_out_dtype(x, float_out))


def emulate(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `scaled` computes, in float64 from the same rounded operands: x rounded per row to
    FP8 (quantize_rows), times the FP8 weight, both scales applied. For tests and the probe."""
    xq, xs = quantize_rows(x)
    y = (xq.double() * xs.double()) @ (w.double() * scale.double().reshape(-1, 1)).t()
    return y if bias is None else y + bias.double()
