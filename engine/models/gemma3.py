"""Gemma 3 text decoder (Gemma3ForCausalLM) over the paged KV cache.

Follows Hugging Face's Gemma3ForCausalLM numerically and keeps its parameter names, with q/k/v
and gate/up fused as in the Llama decoder (engine/models/llama.py). What differs from Llama:

- token embeddings multiplied by sqrt(hidden_size), rounded to the model's dtype;
- RMSNorm scaling by (1 + weight), computed in float32 (float64 models: float64), four norms a
  layer (input, post-attention, pre- and post-feedforward) and per-head q / k norms;
- a gelu (tanh approximation) MLP;
- attention scale query_pre_attn_scalar ** -0.5;
- sliding-window layers (`ModelConfig.window_layers`): a query at position p sees only keys at
  positions p - window + 1 .. p (`window_mask`), composed with the batch's causal or tree mask;
  their RoPE base is rope_local_base_freq, the global layers' is rope_theta (with its scaling);
- optional soft-capping of the final logits (cap * tanh(logits / cap)).

The paged KV cache keeps every position of every layer (a window layer's keys before its window
stay stored, they are masked out, not evicted), so a sequence's cache grows as a global layer's
does and the model serves its whole max_position_embeddings.

Windows go through the attention mask: the torch, native CPU and padded (CUDA graph) backends
apply a batch's mask as given, so a window layer hands them a batch whose mask has the window
folded in; other backends (flash) do not read the mask that way, and a window layer runs on the
torch backend there. The native decode stack (CPU) is not used: its attention has neither the
per-head norms nor windows.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from eagle_serve.engine.attention import TorchAttention, cuda_sdpa_backends
from eagle_serve.engine.attention_base import AttentionBackend
from eagle_serve.engine.forward_batch import ForwardBatch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.layers import Linear, RotaryEmbedding, apply_rope, rows_as, weights_to_arena
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.models.llama import LlamaForCausalLM

# backends that apply ForwardBatch.attn_mask to every query as given
MASK_BACKENDS = ("torch", "native", "padded")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32 (float64 for float64 inputs), cast back."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(acc)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(acc))).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first
    (bfloat16: sqrt(1152) = 33.94 becomes 34.0), as Gemma was trained."""

    def __init__(self, num: int, dim: int):
        super().__init__(num, dim)
        self.scale = dim ** 0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        factor = torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype)
        return super().forward(ids) * factor.to(self.weight.device)


def window_mask(batch: ForwardBatch, window: int) -> torch.Tensor:
    """The batch's mask [B, 1, Q, L] with the sliding window folded in: the query at position p
    sees key j only if p - j < window, j the key's storage index. That is its position for every
    committed key (the cache holds a sequence's tokens in order) and for a prompt chunk's or a
    decode step's keys; a draft tree's key k sits at storage index >= its position, and a query
    sees only its ancestors in the tree, all within the tree's depth of it, so the result is
    exact while trees are shallower than the window (windows of 512 keys and more, trees of a
    few dozen tokens). Padded rows (padded batches, CUDA graphs) keep key 0. Built with tensor
    ops only (no host sync), so a CUDA graph can capture it."""
    B, Q, L = batch.num_seqs, batch.max_query_len, batch.max_kv_len
    pos = batch.positions
    if batch.q_index is None:
        qpos = pos
    else:
        qpos = torch.zeros(B * Q, dtype=pos.dtype, device=pos.device).index_put((batch.q_index,), pos)
    seen = (qpos.view(B, Q, 1) - torch.arange(L, device=pos.device).view(1, 1, L)) < window  # [B, Q, L]
    mask = seen if batch.attn_mask is None else batch.attn_mask.view(B, Q, L) & seen
    mask[:, :, 0] |= ~mask.any(-1)  # a padded query row keeps key 0 (a finite softmax)
    return mask.unsqueeze(1).contiguous()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.window = cfg.sliding_window if layer in cfg.window_layers else None
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend):
        cfg, T = self.cfg, x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim))
        qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        # the backend scales by its own factor (head_dim ** -0.5): q carries the rest
        scale = getattr(backend, "scale", cfg.head_dim ** -0.5)
        if cfg.attention_scale != scale:
            q = q * (cfg.attention_scale / scale)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        return self.o_proj(backend.forward(q.contiguous(), k.contiguous(), v, self.layer, batch, kv))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h, cos, sin, batch, kv, backend):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, batch, kv, backend))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # `rotary`: the global layers' (what an EAGLE head sharing the target's RoPE reads)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta, {})


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder's interface (forward, forward_aux, compute_logits, aux layers, prepack)
    over Gemma 3's layers; always the Python path."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self._stack = None
        self._stack_max_rows = self._stack_prompt_rows = 0
        self.aux_layers: tuple[int, ...] = ()
        self._fallback: dict[tuple, TorchAttention] = {}

    def forward(self, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend) -> torch.Tensor:
        with rows_as(batch.rows_as, any(batch.prompt_lens)):
            hidden, aux = self.forward_aux(batch, kv, backend, self.aux_layers)
        return hidden if aux is None else torch.cat([hidden, aux], dim=-1)

    def window_backend(self, backend: AttentionBackend, device: torch.device) -> AttentionBackend:
        """The backend a window layer runs on: `backend` where it applies the batch's mask as
        given, else the torch backend with the same scale."""
        if backend.name in MASK_BACKENDS:
            return backend
        scale = getattr(backend, "scale", self.config.head_dim ** -0.5)
        key = (scale, device.type)
        if key not in self._fallback:
            self._fallback[key] = TorchAttention(scale, cuda_sdpa_backends() if device.type == "cuda" else None)
        return self._fallback[key]

    def forward_aux(self, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend,
                    layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.config
        h = self.model.embed_tokens(batch.input_ids)
        batch.cos, batch.sin = self.model.rotary.lookup(batch.positions, h.dtype)
        tables = {False: (batch.cos, batch.sin)}
        windowed = local_backend = None
        if cfg.window_layers:
            tables[True] = self.model.rotary_local.lookup(batch.positions, h.dtype)
            if batch.max_kv_len > cfg.sliding_window:  # else no key can fall outside a window
                windowed = dataclasses.replace(batch, attn_mask=window_mask(batch, cfg.sliding_window))
                local_backend = self.window_backend(backend, h.device)
        aux = {}
        for i, layer in enumerate(self.model.layers):
            sliding = layer.self_attn.window is not None
            cos, sin = tables[sliding]
            if sliding and windowed is not None:
                h = layer(h, cos, sin, windowed, kv, local_backend)
            else:
                h = layer(h, cos, sin, batch, kv, backend)
            if i in layers:
                aux[i] = h
        hidden = self.model.norm(h)
        return hidden, (torch.cat([aux[i] for i in layers], dim=-1) if layers else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepack(self, native: bool = True) -> int:
        """Every linear's fast CPU path; no native decode stack (module doc)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        packed = sum(m.prepack(native) for m in linears)
        weights_to_arena(linears)
        return packed
