"""Load a model: a Hugging Face directory (safetensors, sharded or not) or a GGUF file (llama,
qwen3, qwen3moe).

Both sources yield (HF parameter name, tensor) pairs; `load_weights` fuses q/k/v and gate/up
into this engine's layout and checks that every parameter was filled exactly once.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle_serve.engine.default_model import MODEL_NAME, cache_dir, default_model_path
from eagle_serve.engine.gguf_loader import gguf_tokenizer_dir, load_gguf
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.model_files import ModelLoadError, read_json
from eagle_serve.engine.models.gemma3 import Gemma3ForCausalLM
from eagle_serve.engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from eagle_serve.engine.tokenizer import Tokenizer


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
               skip_tokenizer: bool = False) -> LoadedModel:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        cfg, raw, tensors, tok_dir = _hf_source(path)
    elif path.endswith(".gguf"):
        cfg, raw, tensors = load_gguf(path)
        tok_dir = None if skip_tokenizer else gguf_tokenizer_dir(path, cache_dir())
    else:
        raise ModelLoadError(f"{path}: not a directory and not a .gguf file")
    net = model_class(cfg)(cfg)
    load_weights(net, tensors, dtype)
    net.to(device)
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
    quant = raw.get("quantization_config")
    if quant:  # its weights are not plain tensors of the config's shapes (fp8 / int ones would be cast as if)
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelLoadError(f"{cfg_file}: quantized checkpoints (quant_method {method!r}) are not supported; "
                             f"use an unquantized one or a GGUF file")
    files = _weight_files(path)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files (pytorch_model.bin is not loaded; "
                             f"convert it to safetensors)")
    return cfg, raw, _safetensors(files), path


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
            w = torch.cat([part for _, part in sorted(pending.pop(target).items())], 0)  # q,k,v / gate,up
            name = target
        if name not in params or name in filled:
            raise ModelLoadError(f"unexpected weight {name!r} in {where}")
        p = params[name]
        if tuple(p.shape) != tuple(w.shape):
            raise ModelLoadError(f"weight {name!r} in {where} has shape {tuple(w.shape)}, the config implies "
                                 f"{tuple(p.shape)}")
        p.data = w.to(dtype).contiguous()
        filled.add(name)
    missing = sorted(set(params) - filled) + sorted(pending)
    if missing:
        raise ModelLoadError(f"weights missing from {where}: {missing[:8]}")


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
