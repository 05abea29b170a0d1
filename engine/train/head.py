"""The EAGLE head as a trainable torch module, saved in the published EAGLE layout.

Same computation as `engine.speculative.eagle_head.EagleHead` (which serves it over the paged cache):
x = fc([embed(x_{t+1}) ; f_t]); one Llama decoder layer without its input norm; output = the
predicted feature f_{t+1}. Here attention is plain causal SDPA over padded [B, T] batches
(right padding never reaches real tokens under a causal mask).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from eagle_serve.engine.layers import RotaryEmbedding
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.speculative.eagle_head import aux_norm


class TrainHead(nn.Module):
    regresses_features = True  # the loss includes the predicted feature's regression

    def __init__(self, cfg: ModelConfig, bias: bool = True, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.aux_layers = tuple(aux_layers)
        self.fc = nn.Linear(2 * h, h, bias=bias)
        # fused features: f + fc_aux([rms(a_1) ; ...]) over the residual streams of aux_layers
        self.fc_aux = nn.Linear(len(aux_layers) * h, h, bias=False) if aux_layers else None
        self.q_proj = nn.Linear(h, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.o_bias)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.norm_weight = nn.Parameter(torch.ones(h))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.fc_aux is not None:  # starts as the plain EAGLE-2 head: only the final feature counts
            nn.init.zeros_(self.fc_aux.weight)

    def fuse(self, feats: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The input feature of a position whose target features are known: the final-norm
        feature plus a learnt projection of the aux layers' outputs, each RMS-normalised
        (no weight). Positions fed the head's own predictions take those unchanged."""
        return feats + self.fc_aux(aux_norm(aux, len(self.aux_layers), self.cfg.rms_norm_eps))

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """embeds, feats: [B, T, h] -> predicted next features [B, T, h]."""
        x, q, k, v = self._qkv(embeds, feats)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._out(x, a)

    def forward_steps(self, embeds: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3's idea, on EAGLE-1/2 features): step 1 is `forward`; at
        step s >= 2 position i takes the head's own step s-1 prediction of f_i (made at i - 1)
        instead of the true feature, and attends to what it would see while drafting depth s:
        the true pairs up to i - s + 1, then the depth 2..s-1 pairs of the same draft path (step r's
        pair at position i - (s - r)), then itself. Returns each step's predictions [B, T, h];
        rows i < s - 1 have no such path (the caller drops them from the loss)."""
        T = embeds.shape[1]
        x1, q1, k1, v1 = self._qkv(embeds, feats)
        preds = [self._out(x1, F.scaled_dot_product_attention(q1, k1, v1, is_causal=True))]
        diag_k, diag_v = [], []  # steps 2..s-1: keys/values at their own positions
        scale = self.cfg.head_dim ** -0.5
        for s in range(2, steps + 1):
            prev = preds[-1].detach()
            f_in = torch.cat([feats[:, :1], prev[:, :-1]], dim=1)  # position i takes pred of f_i (made at i-1)
            x, q, k, v = self._qkv(embeds, f_in)
            diag_k.append(k)
            diag_v.append(v)
            # true keys j <= i - s + 1; scores and weights in float32, as SDPA keeps them for step 1
            acc = torch.promote_types(q.dtype, torch.float32)
            qf = q.to(acc)
            scores = (qf @ k1.to(acc).transpose(-1, -2)) * scale  # [B, H, T, T]
            allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-(s - 1))
            scores = scores.masked_fill(~allowed, float("-inf"))
            extra, extra_v = [], []
            for r, (kr, vr) in enumerate(zip(diag_k, diag_v), start=2):  # the path's pairs, r = s is itself
                shift = s - r
                ks, vs = _shift(kr.to(acc), shift), _shift(vr.to(acc), shift)
                sc = (qf * ks).sum(-1) * scale  # [B, H, T]
                if shift:
                    sc[:, :, :shift] = float("-inf")
                extra.append(sc)
                extra_v.append(vs)
            allsc = torch.cat([scores, torch.stack(extra, dim=-1)], dim=-1).softmax(-1)
            a = allsc[..., :T] @ v1.to(acc) + (allsc[..., T:, None] * torch.stack(extra_v, dim=-2)).sum(-2)
            preds.append(self._out(x, a.to(q.dtype)))
        return preds

    def _qkv(self, embeds: torch.Tensor, feats: torch.Tensor):
        """fc input, then rotated q and k and v as [B, H, T, D] (kv heads repeated for GQA)."""
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        return (x, *self._heads(x))

    def _heads(self, u: torch.Tensor):
        """Rotated q and k and v of the attention input u [B, T, .] as [B, H, T, D] (kv heads
        repeated for GQA)."""
        cfg = self.cfg
        B, T, _ = u.shape
        cos, sin = self.rotary.lookup(torch.arange(T, device=u.device), u.dtype)
        q = _rope(self.q_proj(u).view(B, T, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rope(self.k_proj(u).view(B, T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = self.v_proj(u).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _out(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """a: attention output [B, H, T, D] -> the layer's output."""
        cfg = self.cfg
        B, T = x.shape[:2]
        h = x + self.o_proj(a.transpose(1, 2).reshape(B, T, cfg.q_size))
        acc = torch.promote_types(h.dtype, torch.float32)  # float64 heads (tests) keep float64
        n = h * torch.rsqrt(h.to(acc).pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).to(h.dtype) * self.norm_weight
        return h + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def draft_logits(self, pred: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary: the target's LM head (its draft-vocabulary rows)."""
        return pred @ lm_rows.T

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the published EAGLE names."""
        names = {"fc": "fc", "q_proj": "layers.0.self_attn.q_proj", "k_proj": "layers.0.self_attn.k_proj",
                 "v_proj": "layers.0.self_attn.v_proj", "o_proj": "layers.0.self_attn.o_proj",
                 "gate_proj": "layers.0.mlp.gate_proj", "up_proj": "layers.0.mlp.up_proj",
                 "down_proj": "layers.0.mlp.down_proj"}
        out = {}
        for mod, name in names.items():
            for pname, p in getattr(self, mod).named_parameters():
                out[f"{name}.{pname}"] = p.detach()
        out["layers.0.post_attention_layernorm.weight"] = self.norm_weight.detach()
        if self.fc_aux is not None:
            out["fc_aux.weight"] = self.fc_aux.weight.detach()
        return out

    def load_eagle_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        mine = self.eagle_state_dict()
        if "fc_aux.weight" not in weights:
            mine.pop("fc_aux.weight", None)  # a plain head to start from: fc_aux stays zero
        missing = set(mine) - set(weights)
        if missing:
            raise ValueError(f"head weights lack {sorted(missing)}")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(weights[k])


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [B, H, T, D] moved n positions later along T (zeros in front)."""
    if n == 0:
        return t
    return torch.cat([torch.zeros_like(t[:, :, :n]), t[:, :, :-n]], dim=2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [T, D] (rotate-half, as the serving path)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def head_config(target: ModelConfig, bias: bool, draft_vocab: int | None, aux_layers: tuple[int, ...] = ()) -> dict:
    """config.json of a one-layer decoder with `target`'s shapes (the EAGLE layout): a Llama, or
    for a target whose attention has q/k/v biases only (Qwen2) a Qwen2 layer, so the serving
    loader builds the layer the weights are for (a Llama config lost the biases: the head
    trained for a Qwen2 target did not load)."""
    qwen = target.qkv_bias and not target.o_bias
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama", "num_hidden_layers": 1,
        "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim, "vocab_size": target.vocab_size, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "max_position_embeddings": target.max_position_embeddings,
        "bias": bias, "torch_dtype": "bfloat16",
    }
    if target.qkv_bias and target.o_bias:
        cfg["attention_bias"] = True
    if target.mlp_bias:
        cfg["mlp_bias"] = True
    if target.rope_scaling:
        cfg["rope_scaling"] = target.rope_scaling
    if draft_vocab:
        cfg["draft_vocab_size"] = draft_vocab
    if aux_layers:
        cfg["aux_layers"] = list(aux_layers)
    return cfg


def save_head(head: TrainHead, out_dir: str, config: dict, draft_vocab: torch.Tensor | None,
              dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> None:
    """config.json + model.safetensors (+ `d2t`: the draft vocabulary's target ids, ascending
    by draft index). Written to a temporary name first, so a reader never sees half a head."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in head.eagle_state_dict().items()}
    if draft_vocab is not None:
        tensors["d2t"] = draft_vocab.to(torch.int64).contiguous()
    tmp = os.path.join(out_dir, "model.safetensors.part")
    save_file(tensors, tmp, metadata={k: str(v) for k, v in (extra or {}).items()})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
