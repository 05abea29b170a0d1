"""Load a model: a Hugging Face directory (safetensors, sharded or not) or a GGUF file (llama,
qwen3, qwen3moe).

Both sources yield (HF parameter name, tensor) pairs; `load_weights` fuses q/k/v and gate/up
into this engine's layout and checks that every parameter was filled exactly once.
"""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle_serve.engine import fp8, kernels, quant
from eagle_serve.engine.config import QUANTIZATIONS
from eagle_serve.engine.default_model import MODEL_NAME, cache_dir, default_model_path
from eagle_serve.engine.gguf_loader import gguf_tokenizer_dir, load_gguf
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.model_files import ModelLoadError, read_json
from eagle_serve.engine.layers import Linear
from eagle_serve.engine.models.gemma3 import Gemma3ForCausalLM
from eagle_serve.engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from eagle_serve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]
    name: str
    path: str


def resolve_model_path(model: str | None) -> str:
    if model in (None, "", "default"):
        return default_model_path()
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model!r} does not exist (give a Hugging Face model "
                             f"directory or a .gguf file; nothing is downloaded from a hub)")
    return model


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               skip_tokenizer: bool = False, quantization: str = "auto") -> LoadedModel:
    """quantization (QUANTIZATIONS): auto keeps a GGUF file's block-quantized weights in their
    blocks on the CPU where the native kernels run (engine/quant.py; not the embedded default
    model's), none dequantizes them to `dtype`, int8 quantizes a Hugging Face checkpoint's
    linears to Q8_0 blocks at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    path = resolve_model_path(model)
    # the embedded default model (135M, Q4_1) runs dequantized under auto: at its size a step is
    # per-call overheads and the bf16 kernels' AMX / packed paths, not the weights' bytes
    # (bench/results/quantized.json measures it both ways); its file given as --model keeps blocks
    default = model in (None, "", "default")
    blocks = (quantization == "int8" or (quantization == "auto" and not default)) and device.type == "cpu" \
        and kernels.native() is not None
    if quantization == "int8" and not blocks:
        raise ModelLoadError("quantization int8 runs on the CPU with the native kernels (engine/kernels), "
                             "which are not available here")
    if os.path.isdir(path):
        cfg, raw, tensors, tok_dir = _hf_source(path)
    elif path.endswith(".gguf"):
        if quantization == "int8":
            raise ModelLoadError(f"{path}: quantization int8 quantizes a Hugging Face checkpoint; a GGUF file "
                                 f"keeps its own quantization (quantization auto)")
        cfg, raw, tensors = load_gguf(path, keep_quantized=blocks)
        tok_dir = None if skip_tokenizer else gguf_tokenizer_dir(path, cache_dir())
    else:
        raise ModelLoadError(f"{path}: not a directory and not a .gguf file")
    net = model_class(cfg)(cfg)
    fp8.keep_on(tensors, net, device, dtype)  # FP8 checkpoints: which weights stay FP8 (CUDA, capability >= 8.9)
    load_weights(net, tensors, dtype)
    fp8.attach(tensors, net, device)
    if quantization == "int8":
        quantize_linears(net, dtype)
    net.to(device)
    held = quant.quantized_bytes(net)
    if held:
        dense = sum(p.numel() * p.element_size() for p in net.parameters() if p.is_contiguous())
        log.info("start-up: weights: %.1f MiB in quantized blocks (%s) + %.1f MiB dense", held / 2**20,
                 ", ".join(sorted({t for m in net.modules() if quant.is_quantized(m)
                                   for t in quant.packed_types(m.gguf_weight)})), dense / 2**20)
    tokenizer = None
    if not skip_tokenizer:  # imported here: the engine itself runs without jinja2 / tokenizers
        from eagle_serve.engine.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(tok_dir)
    eos = _eos_ids(raw, path if os.path.isdir(path) else None, tokenizer)
    name = os.path.basename(os.path.normpath(path))
    if model in (None, "", "default"):
        name = MODEL_NAME
    return LoadedModel(net.eval(), cfg, tokenizer, eos, name, path)


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for a config: Gemma 3's, else the Llama family's."""
    return Gemma3ForCausalLM if cfg.is_gemma3 else LlamaForCausalLM


def _hf_source(path: str):
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ModelLoadError(f"{path}: missing config.json")
    raw = read_json(cfg_file)
    cfg = ModelConfig.from_hf(raw, cfg_file)
    qcfg = raw.get("quantization_config")
    # FP8 ones load (engine/fp8.py); any other is refused: its tensors are not plain weights of the config's shapes
    scheme = fp8.scheme(qcfg, cfg_file) if qcfg else None
    files = _weight_files(path)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files (pytorch_model.bin is not loaded; "
                             f"convert it to safetensors)")
    tensors = _safetensors(files)
    return cfg, raw, fp8.Fp8Weights(tensors, scheme, path) if scheme else tensors, path


def _weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint, as transformers picks them: model.safetensors,
    else the shards its index (model.safetensors.index.json) names, else every *.safetensors (a
    glob took a Mistral repo's consolidated.safetensors, an adapter or a stale shard too)."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        raw = read_json(index)
        wmap = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
            raise ModelLoadError(f"{index}: no weight_map of tensor names to shard files")
        files = [os.path.join(path, f) for f in sorted(set(wmap.values()))]
        gone = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if gone:
            raise ModelLoadError(f"{index} names shard files that are not there: {', '.join(gone[:4])}")
        return files
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def _safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # a truncated or foreign file: name it, not a traceback
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None


FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_weights(net: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    tied = net.config.tie_word_embeddings
    if tied:  # one parameter under two names; a stored lm_head.weight is ignored
        net.lm_head.weight = net.model.embed_tokens.weight
    fill_parameters(net, ((n, w) for n, w in tensors
                          if "rotary_emb" not in n and not (tied and n == "lm_head.weight")), dtype, "the checkpoint")
    if tied and quant.is_quantized(net.model.embed_tokens):  # the LM head multiplies the same blocks
        net.lm_head.set_gguf(net.model.embed_tokens.gguf_weight, dtype)


def quantize_linears(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every dense Linear of `net` (in_features a multiple of 32) as Q8_0 blocks (quantization int8)."""
    for m in net.modules():
        if isinstance(m, Linear) and not quant.is_quantized(m) and m.weight.shape[1] % 32 == 0:
            m.set_gguf(quant.pack([quant.quantize_q8_0(m.weight.data)]), dtype)


def _fuse(parts: list) -> torch.Tensor | list:
    """Fused q/k/v or gate/up from their parts: the QuantTensors to pack where every part is
    one, else one float tensor (quantized parts among float ones dequantized)."""
    if all(isinstance(p, quant.QuantTensor) for p in parts):
        return parts
    return torch.cat([p.dequantize() if isinstance(p, quant.QuantTensor) else p for p in parts], 0)


def fill_parameters(module: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                    where: str) -> None:
    """Copy HF-named tensors into `module`'s parameters (q/k/v and gate/up concatenated into
    the fused ones), checking shapes and that every parameter is filled exactly once."""
    params = dict(module.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    filled: set[str] = set()
    for name, w in tensors:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED:
            fused, index = FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            pending.setdefault(target, {})[index] = w
            if len(pending[target]) < (3 if fused == "qkv_proj" else 2):
                continue
            w = _fuse([part for _, part in sorted(pending.pop(target).items())])  # q,k,v / gate,up
            name = target
        if name not in params or name in filled:
            raise ModelLoadError(f"unexpected weight {name!r} in {where}")
        p = params[name]
        if isinstance(w, quant.QuantTensor):
            w = [w]
        shape = (sum(q.shape[0] for q in w), w[0].shape[1]) if isinstance(w, list) else tuple(w.shape)
        if tuple(p.shape) != shape:
            raise ModelLoadError(f"weight {name!r} in {where} has shape {shape}, the config implies "
                                 f"{tuple(p.shape)}")
        if isinstance(w, list):
            _set_quantized(module, name, quant.pack(w), dtype, where)
        else:
            p.data = w.to(dtype).contiguous()
        filled.add(name)
    missing = sorted(set(params) - filled) + sorted(pending)
    if missing:
        raise ModelLoadError(f"weights missing from {where}: {missing[:8]}")


def _set_quantized(module: torch.nn.Module, name: str, packed: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    """Give the Linear or embedding that owns parameter `name` the packed quantized blocks."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path)
    if leaf == "weight" and isinstance(owner, Linear):
        owner.set_gguf(packed, dtype)
    elif leaf == "weight" and type(owner) is torch.nn.Embedding:
        parent, _, attr = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, quant.QuantizedEmbedding(packed, dtype))
    else:
        raise ModelLoadError(f"weight {name!r} in {where} is block-quantized where this engine takes only a dense one")


def _eos_ids(raw: dict, hf_dir: str | None, tokenizer: Tokenizer | None) -> frozenset[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(raw.get("eos_token_id"))
    gen_file = os.path.join(hf_dir, "generation_config.json") if hf_dir else None
    if gen_file and os.path.exists(gen_file):
        gen = read_json(gen_file)  # malformed or not an object: an error naming the file
        if not isinstance(gen, dict):
            raise ModelLoadError(f"{gen_file}: not a JSON object")
        add(gen.get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token:
        add(tokenizer.token_to_id(tokenizer.eos_token))
    return frozenset(ids)
