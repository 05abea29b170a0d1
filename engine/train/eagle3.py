"""The EAGLE-3 draft head as a trainable torch module, written in SpecForge's layout.

Same computation as `engine.speculative.eagle3_head.Eagle3Head` (which serves it over the paged
cache), on padded [B, T] batches with causal SDPA:

    x = fc([a_low ; a_mid ; a_high])            the target's residual streams (no final feature)
    u = [input_layernorm(embed(x_{t+1})) ; hidden_norm(x)]
    y = x + o_proj(attn(q, k, v of u))          z = y + mlp(post_attention_layernorm(y))
    logits = lm_head(norm(z))                   over the draft vocabulary

Training-time test feeds z back as the next step's x (`TrainHead.forward_steps`, whose attention
pattern is the drafting one), and the loss is the KL of the draft distribution to the target's
over the draft vocabulary at every step, without a feature regression term.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle_serve.engine.layers import RotaryEmbedding
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.train.head import TrainHead

# published EAGLE-3 names of the trainable modules (SpecForge's, the serving loader's)
NAMES = {"fc": "fc", "q_proj": "midlayer.self_attn.q_proj", "k_proj": "midlayer.self_attn.k_proj",
         "v_proj": "midlayer.self_attn.v_proj", "o_proj": "midlayer.self_attn.o_proj",
         "gate_proj": "midlayer.mlp.gate_proj", "up_proj": "midlayer.mlp.up_proj",
         "down_proj": "midlayer.mlp.down_proj", "lm_head": "lm_head"}
NORMS = {"input_norm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
         "post_norm": "midlayer.post_attention_layernorm.weight", "final_norm": "norm.weight"}


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The engine's aux layers (the stream after layer l) of EAGLE-3's default low / middle / high
    capture, Hugging Face output_hidden_states indices 2, L // 2 and L - 3 (what the loader takes
    for a config without ids: engine.speculative.eagle3_config)."""
    return tuple(sorted({2 - 1, num_layers // 2 - 1, num_layers - 3 - 1}))


class Eagle3TrainHead(TrainHead):
    regresses_features = False  # the loss is the draft distribution's alone

    def __init__(self, cfg: ModelConfig, aux_layers: tuple[int, ...], lm_rows: torch.Tensor):
        """lm_rows: the target's LM-head rows of the draft vocabulary [Vd, h] (the draft LM head
        starts as them)."""
        nn.Module.__init__(self)
        h = cfg.hidden_size
        self.cfg, self.aux_layers = cfg, tuple(aux_layers)
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.lm_head = nn.Linear(h, lm_rows.shape[0], bias=False)
        for name in NORMS:
            setattr(self, name, nn.Parameter(torch.ones(h)))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)

    def fuse(self, feats: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """x of a position whose target streams are known (the final feature is not read)."""
        return self.fc(aux)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        return x * torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps).to(x.dtype) * weight

    def _qkv(self, embeds: torch.Tensor, x: torch.Tensor):
        u = torch.cat([self._norm(embeds, self.input_norm), self._norm(x, self.hidden_norm)], dim=-1)
        return (x, *self._heads(u))

    def _out(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        y = x + self.o_proj(a.transpose(1, 2).reshape(B, T, self.cfg.q_size))
        n = self._norm(y, self.post_norm)
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def draft_logits(self, z: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary from the head's own norm and LM head."""
        return self.lm_head(self._norm(z, self.final_norm))

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the published EAGLE-3 names (unfused projections)."""
        out = {f"{name}.weight": getattr(self, mod).weight.detach() for mod, name in NAMES.items()}
        out.update({name: getattr(self, p).detach() for p, name in NORMS.items()})
        return out


def save_eagle3(head: Eagle3TrainHead, out_dir: str, target, d2t: torch.Tensor | None,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """OUT as a SpecForge-layout EAGLE-3 head (config.json + model.safetensors with d2t / t2d and
    the target's token embedding, as SpecForge's model holds one): the serving loader builds
    the head from the trained weights, and its writer writes it."""
    from dataclasses import replace

    from eagle_serve.engine.loader import fill_parameters
    from eagle_serve.engine.speculative.eagle3_head import Eagle3Head, save_eagle3_head
    cfg = replace(head.cfg, num_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False)
    serving = Eagle3Head(cfg, cfg.hidden_size, head.aux_layers, head.lm_head.weight.shape[0], norm_before_residual=False,
                         fc_bias=False, own_embed=False)
    fill_parameters(serving, iter({k: v.float() for k, v in head.eagle_state_dict().items()}.items()), torch.float32,
                    "trained EAGLE-3 head")
    serving.d2t = None if d2t is None else d2t.long().cpu()
    tmp = out_dir.rstrip("/") + ".part"
    save_eagle3_head(serving, tmp, layout="specforge", embed=target.model.embed_tokens.weight.detach().float().cpu(),
                     dtype=dtype)
    import os
    import shutil
    os.makedirs(out_dir, exist_ok=True)
    for name in ("model.safetensors", "config.json"):  # each file replaced whole: a reader never sees half a head
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    shutil.rmtree(tmp, ignore_errors=True)
