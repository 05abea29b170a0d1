"""EAGLE-1/2 draft head: fc over [token embedding ; target feature], one Llama decoder layer
without an input norm, and the target's own embedding and LM head.

The feature is the target's last hidden state *after* its final RMSNorm, i.e. the input of the
LM head: the EAGLE reference takes `outputs[0]` of its Llama model, whose forward ends with
`self.norm`. The head's output feature goes to the LM head directly (no norm of its own).
Published layout: config.json of a one-layer Llama (optional `bias`, default true), weights
`fc.weight` [h, 2h] (+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, in
model.safetensors or pytorch_model.bin; a stray `embed_tokens.weight` must equal the target's.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.layers import Linear
from engine.loader import ModelLoadError, fill_parameters
from engine.model_config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.config = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.layer = DecoderLayer(cfg, 0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, batch: ForwardBatch,
                kv: KVCache, backend: AttentionBackend, rotary) -> torch.Tensor:
        """embeds, features: [T, h] -> predicted next features [T, h]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        batch.cos, batch.sin = rotary.lookup(batch.positions, x.dtype)
        h, residual = self.layer(x, None, batch, kv, backend)
        return h + residual

    def prepack(self, native: bool = True) -> int:
        return sum(m.prepack(native) for m in self.modules() if isinstance(m, Linear))


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st)
    pt = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{path}: no model.safetensors or pytorch_model.bin for the draft head")


def load_eagle_head(path: str, target: LlamaForCausalLM, dtype: torch.dtype) -> EagleHead:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ModelLoadError(f"draft head {path!r}: missing config.json")
    with open(cfg_file) as f:
        raw = json.load(f)
    raw = {**raw, "num_hidden_layers": 1}
    raw.setdefault("architectures", ["LlamaForCausalLM"])
    cfg = ModelConfig.from_hf(raw, cfg_file)
    t = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ModelLoadError(f"draft head {path!r} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does "
                             f"not fit the target (hidden {t.hidden_size}, vocab {t.vocab_size})")
    weights = _read_weights(path)
    head = EagleHead(cfg, bias="fc.bias" in weights)
    _load(head, weights, target, dtype, path)
    return head.eval()


def _load(head: EagleHead, weights: dict, target: LlamaForCausalLM, dtype: torch.dtype, path: str) -> None:
    def renamed():
        for name, w in weights.items():
            if name.endswith("embed_tokens.weight"):  # tolerated if it is the target's own
                if not torch.equal(w.to(dtype), target.model.embed_tokens.weight.data.to(dtype)):
                    raise ModelLoadError(f"draft head {path!r}: its embed_tokens differ from the target's")
                continue
            yield name.removeprefix("model.").replace("layers.0.", "layer."), w
    fill_parameters(head, renamed(), dtype, f"draft head {path!r}")
