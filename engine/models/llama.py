"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3 and Qwen3-MoE, SmolLM2) over a paged KV
cache (Gemma 3: engine/models/gemma3.py, on this class's interface).

Follows Hugging Face's LlamaForCausalLM numerically and keeps its parameter names, except that
q/k/v and gate/up are fused (`qkv_proj`, `gate_up_proj`); the loader concatenates them.
Input is a packed batch of any number of new tokens per sequence (prefill, decode and tree
verification share this forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle_serve.engine.attention import AttentionBackend, NativeCPUAttention
from eagle_serve.engine.forward_batch import ForwardBatch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine import kernels
from eagle_serve.engine.layers import FAST_DTYPES, Linear, RMSNorm, RotaryEmbedding, apply_rope, rows_as, weights_to_arena
from eagle_serve.engine.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, in_features: int | None = None):
        """in_features: the width q, k and v are projected from (default: the hidden size; an
        EAGLE-3 draft layer's is twice it)."""
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        self.qkv_proj = Linear(in_features or cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: each head's query and key RMS-normalised (one weight over head_dim)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend):
        cfg, T = self.cfg, x.shape[0]
        qk, v = self.qkv_proj(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.reshape(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :cfg.num_heads]), self.k_norm(qk[:, cfg.num_heads:])], dim=1)
        # q and k heads rotated in one go: [T, H + Hkv, D]
        qk = apply_rope(qk, batch.cos, batch.sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        return self.o_proj(backend.forward(q, k, v, self.layer, batch, kv))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int | None = None):
        super().__init__()
        self.inter = intermediate or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


GROUPED_SYNC_FREE_ROWS = 128  # batches up to this many tokens pad every expert to all of them


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE, Hugging Face's names: `gate` is the router, `experts.i`
    each an MLP of width moe_intermediate_size): each token goes to the experts with its top-k
    router probabilities (softmax in float32), their outputs summed with those
    probabilities (renormalised over the chosen with norm_topk_prob).

    Two ways to run the experts, with the same sums in the same order: on the CPU one expert at a
    time over the rows routed to it (each expert's linears take the native kernels), and on a GPU
    grouped (`grouped`): the routed rows sorted by expert into one padded [experts, rows, hidden]
    batch, two batched matmuls over the experts' weights stacked once, no Python loop over the
    experts at all."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.inter = cfg.moe_intermediate_size
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, chosen experts [T, k])."""
        logits = self.gate(x)
        probs = logits.softmax(-1, dtype=torch.float32)  # float32 whatever the model's dtype, as HF's
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if x.device.type != "cpu" and self.experts[0].gate_up_proj.bias is None:
            return self.grouped(x, weights, chosen)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.stacked()
        T, k = chosen.shape
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (row, slot) pairs by expert, rows ascending within one
        experts, rows = flat[order], order // k
        counts = torch.bincount(flat, minlength=gate_up.shape[0])
        # an expert gets each token once at most: T rows always suffice, with no host sync (CUDA
        # graphs capture decode and verify batches); longer batches pad to the busiest expert's
        width = T if T <= GROUPED_SYNC_FREE_ROWS else int(counts.max())
        pos = torch.arange(T * k, device=x.device) - (counts.cumsum(0) - counts)[experts]
        batch = x.new_zeros(gate_up.shape[0], width, x.shape[1])
        batch[experts, pos] = x[rows]
        gate, up = torch.bmm(batch, gate_up.transpose(1, 2)).split(self.inter, dim=-1)
        y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))
        return torch.zeros_like(x).index_add_(0, rows, y[experts, pos] * weights.reshape(-1)[order, None])

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' gate/up and down weights stacked [E, 2I, H] and [E, H, I], once; each
        expert's own weights become views into them (no second copy)."""
        if self._stacked is None or self._stacked[0].device != self.experts[0].gate_up_proj.weight.device:
            gate_up = torch.stack([e.gate_up_proj.weight.data for e in self.experts])
            down = torch.stack([e.down_proj.weight.data for e in self.experts])
            for i, e in enumerate(self.experts):
                e.gate_up_proj.weight.data, e.down_proj.weight.data = gate_up[i], down[i]
            self._stacked = (gate_up, down)
        return self._stacked


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if layer in cfg.moe_layers else MLP(cfg)

    def forward(self, h, residual, batch, kv, backend):
        """(h, residual) -> (h, residual): the residual add is fused into the next norm, so a
        layer's output is h + residual (residual None: h is the first layer's input)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(x, batch, kv, backend)
        x, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self._stack = None  # native decode stack, set by prepack() where available
        self._stack_max_rows = 0  # batches of up to this many tokens run through it
        self._stack_prompt_rows = 0  # the same for batches holding prompt tokens (Linear.prompt_max_rows)
        self.aux_layers: tuple[int, ...] = ()  # see set_aux_layers

    def set_aux_layers(self, layers: tuple[int, ...]) -> None:
        """Make every forward return [final feature ; the residual stream after each of these
        layers] per token, [T, (1 + n) hidden]: the features a fused-feature draft head reads
        (EAGLE-3's low and middle layers). compute_logits reads the first `hidden` columns."""
        self.aux_layers = tuple(layers)
        if self._stack is not None:
            self._stack.set_aux(list(self.aux_layers))

    def forward(self, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of every new token (with aux layers set: [T,
        (1 + n) hidden], see set_aux_layers)."""
        rows = batch.rows_as  # (a prompt chunk: its whole prompt's, see ForwardBatch.prompt_lens)
        prompt = any(batch.prompt_lens)
        limit = self._stack_prompt_rows if prompt else self._stack_max_rows
        if self._stack is not None and rows <= limit and backend.name == "native":
            return self._native_forward(batch, kv)
        with rows_as(rows, prompt):
            hidden, aux = self.forward_aux(batch, kv, backend, self.aux_layers)
        return hidden if aux is None else torch.cat([hidden, aux], dim=-1)

    def forward_aux(self, batch: ForwardBatch, kv: KVCache, backend: AttentionBackend,
                    layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-norm hidden states [T, hidden], the residual stream after each of `layers`
        side by side [T, len(layers) * hidden], or None for no layers). The Python path."""
        h = self.model.embed_tokens(batch.input_ids)
        batch.cos, batch.sin = self.model.rotary.lookup(batch.positions, h.dtype)
        residual, aux = None, {}
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, batch, kv, backend)
            if i in layers:
                aux[i] = h + residual
        hidden = self.model.norm.add_forward(h, residual)[0]
        return hidden, (torch.cat([aux[i] for i in layers], dim=-1) if layers else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (float64 models stay float64); wider rows
        (features with aux layers) use their first `hidden` columns."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = hidden[:, :self.config.hidden_size].contiguous()
        logits = self.lm_head(hidden, float_out=True)
        return logits if logits.dtype == torch.float64 else logits.float()

    def prepack(self, native: bool = True) -> int:
        """Set up the fast CPU paths: every linear's, and the native decode stack."""
        packed = sum(m.prepack(native) for m in self.modules() if isinstance(m, Linear))
        weights_to_arena([m for m in self.modules() if isinstance(m, Linear)], also=(self.model.embed_tokens,))
        self._stack, self._stack_max_rows = native_stack(self.model.layers, self.model.norm, self.config,
                                                         self.lm_head.weight.dtype, native)
        linears = [m for m in self.model.layers.modules() if isinstance(m, Linear)]
        self._stack_prompt_rows = 0 if self._stack is None else stack_rows(linears, prompt=True)
        self.set_aux_layers(self.aux_layers)  # a stack built after them returns them too
        return packed

    def _native_forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The whole stack in one native call (decode-sized batches on the CPU)."""
        return native_stack_forward(self._stack, self.model.embed_tokens(batch.input_ids), batch, kv,
                                    self.model.rotary)


STACK_ALL_ROWS = NativeCPUAttention.MAX_QUERIES  # a stack's rows where its linears take any number


def stack_rows(linears: list[Linear], prompt: bool = False) -> int:
    """The most rows a stack over these (prepacked) linears takes: what they all take natively
    (their prompt limit for batches holding prompt tokens)."""
    if all(m.native_all_rows for m in linears):
        return STACK_ALL_ROWS
    return min(m.prompt_max_rows if prompt else m.native_max_rows for m in linears)


def native_stack(layers, final_norm, cfg: ModelConfig, dtype: torch.dtype, native: bool = True):
    """(the native DecodeStack over prepacked `layers`, the most rows a call may carry: what
    their linears take natively), or (None, 0) where the native kernels cannot run them. A layer
    whose input norm is not an RMSNorm (the EAGLE head's nn.Identity), or a `final_norm` of
    None, is passed as an empty weight: no norm."""
    mod = kernels.native() if native else None
    # (the stack's attention has no per-head q / k norm and no windows, its MLP is SiLU's: Qwen3
    # and Gemma 3 layers run the Python path)
    if mod is None or cfg.mlp_bias or cfg.qk_norm or cfg.moe_layers or cfg.window_layers or cfg.hidden_act != "silu" \
            or dtype not in FAST_DTYPES:
        return None, 0
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
    # linears that take every row count natively (no oneDNN bf16 here): the stack takes as many
    # rows as the native attention kernel does, past which the Python path's SDPA takes them
    rows = stack_rows(linears)
    none = torch.empty(0)
    bias = lambda lin: lin.bias.data if lin.bias is not None else none  # noqa: E731
    norm = lambda n: n.weight.data if isinstance(n, RMSNorm) else none  # noqa: E731
    stack = mod.DecodeStack(
        [norm(l.input_layernorm) for l in layers], [l.self_attn.qkv_proj.native_weight for l in layers],
        [bias(l.self_attn.qkv_proj) for l in layers], [l.self_attn.o_proj.native_weight for l in layers],
        [bias(l.self_attn.o_proj) for l in layers], [l.post_attention_layernorm.weight.data for l in layers],
        [l.mlp.gate_up_proj.native_weight for l in layers], [l.mlp.down_proj.native_weight for l in layers],
        norm(final_norm), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
    int8 = [m for m in linears if m.int8_weight is not None]
    if int8:  # a draft head's int8 weights (Linear.quantize_int8) for calls of few rows
        w8 = lambda lin: lin.int8_weight if lin.int8_weight is not None else none  # noqa: E731
        stack.set_int8([w8(l.self_attn.qkv_proj) for l in layers], [w8(l.self_attn.o_proj) for l in layers],
                       [w8(l.mlp.gate_up_proj) for l in layers], [w8(l.mlp.down_proj) for l in layers],
                       min(m.int8_max_rows for m in int8))
    return stack, rows


def native_stack_forward(stack, h: torch.Tensor, batch: ForwardBatch, kv: KVCache, rotary) -> torch.Tensor:
    """One native call over a decode-sized batch: h [T, hidden] in, the stack's output out."""
    return stack.forward(h, kv.data, batch.slot_mapping, batch.kv_gather.view(batch.num_seqs, -1),
                         batch.kv_lens, batch.q_seq, batch.q_row, batch.mask_3d(),
                         rotary.cos_table[batch.positions], rotary.sin_table[batch.positions])
