"""EAGLE-3 draft head: fc over the target's captured residual streams, one Llama layer whose
attention reads [input_layernorm(token embedding) ; hidden_norm(x)] (q/k/v of width 2h), and the
head's own final norm and LM head over a draft vocabulary (EAGLE-3, Li et al. 2025).

    x = fc([a_1 ; a_2 ; a_3])                  (target positions; deeper levels feed z as x)
    y = r + o_proj(attn([input_layernorm(e) ; hidden_norm(x)]))   r = x, or hidden_norm(x)
    z = y + mlp(post_attention_layernorm(y))   the next level's x
    logits = lm_head(norm(z))                  [Vd]; target id = draft id + d2t[draft id]

The target captures the streams with the fused-feature mechanism (LlamaForCausalLM.set_aux_layers:
the engine's aux layer l is the stream after layer l, Hugging Face's hidden_states[l + 1]), so the
drafter receives [f ; a_1 ; a_2 ; a_3] per token and this head ignores f. Layouts and captured
layers: engine.speculative.eagle3_config. The forward is a torch path: the native head kernels
run the EAGLE-2 layer only.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import torch
from torch import nn

from eagle_serve.engine import quant
from eagle_serve.engine.attention import AttentionBackend
from eagle_serve.engine.forward_batch import ForwardBatch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.layers import Linear, RMSNorm, RotaryEmbedding
from eagle_serve.engine.loader import ModelLoadError, fill_parameters, read_json
from eagle_serve.engine.model_config import ModelConfig, UnsupportedModel
from eagle_serve.engine.models.llama import MLP, Attention, LlamaForCausalLM
from eagle_serve.engine.speculative.eagle3_config import (EAGLE3_ARCHITECTURE, SPECULATORS_ARCHITECTURE,
                                                         Eagle3ConfigError, Eagle3Layout, is_eagle3, parse_eagle3)
from eagle_serve.engine.speculative.eagle_head import (EagleHead, _read_weights, check_draft_ids, load_eagle_head,
                                                       prepack_head_linears, topk_log_probs)

log = logging.getLogger(__name__)

LAYER_WEIGHTS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
REQUIRED_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight") + tuple("midlayer." + w for w in LAYER_WEIGHTS)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of the fused hidden x
        self.self_attn = Attention(cfg, 0, in_features=2 * cfg.hidden_size)  # over [embedding ; hidden]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                backend: AttentionBackend) -> torch.Tensor:
        """embeds, x [T, h] -> z [T, h] (pre-norm); batch.cos / sin set by the caller."""
        hx = self.hidden_norm(x)
        u = torch.cat([self.input_layernorm(embeds), hx], dim=-1)  # [T, 2h]: embedding first
        y = (hx if self.norm_before_residual else x) + self.self_attn(u, batch, kv, backend)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(nn.Module):
    """The drafter's head contract (EagleHead's): forward, draft_topk, prepack; `level`,
    `native_rows` and `tree_runs` say the native paths do not run it."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, aux_layers: tuple[int, ...], draft_vocab: int,
                 norm_before_residual: bool, fc_bias: bool, own_embed: bool):
        super().__init__()
        self.config, self.target_hidden = cfg, target_hidden
        self.aux_layers = tuple(aux_layers)  # target layers whose output streams the head reads, ascending
        self.fc = Linear(len(aux_layers) * target_hidden, cfg.hidden_size, bias=fc_bias)
        self.midlayer = Eagle3Layer(cfg, norm_before_residual)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, draft_vocab)
        # the head's own token embedding where it has one that is not the target's (else None:
        # the drafter embeds with the target's)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embed else None
        if own_embed:
            self.embed_tokens.weight.requires_grad_(False)
        self.d2t: torch.Tensor | None = None  # [Vd] target id of each draft index; None: Vd is the target's vocabulary
        self.rotary: RotaryEmbedding | None = None  # the draft's RoPE where it differs from the target's

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, batch: ForwardBatch,
                kv: KVCache, backend: AttentionBackend, rotary) -> torch.Tensor:
        """embeds [T, h]; features [T, (1 + n) H] (the target's [f ; a_1 ; ...]) or [T, h] (a
        previous level's z) -> z [T, h]."""
        h, H, n = self.config.hidden_size, self.target_hidden, len(self.aux_layers)
        if features.shape[-1] == (1 + n) * H:
            x = self.fc(features[:, H:])
        elif features.shape[-1] == h:
            x = features
        else:
            raise ValueError(f"EAGLE-3 head features of width {features.shape[-1]}: expected {(1 + n) * H} "
                             f"(target layers {list(self.aux_layers)}) or {h}")
        batch.cos, batch.sin = rotary.lookup(batch.positions, x.dtype)
        return self.midlayer(embeds, x, batch, kv, backend)

    def draft_topk(self, hidden: torch.Tensor, target: LlamaForCausalLM, k: int):
        """(log-probs, target token ids) of the k most likely draft tokens per row of z."""
        logits = self.lm_head(self.norm(hidden), float_out=True)
        return topk_log_probs(logits if logits.dtype == torch.float64 else logits.float(), k, self.d2t)

    def level(self, *args, **kwargs):
        return None  # no native level: the drafter runs forward and draft_topk

    def native_rows(self, backend: AttentionBackend) -> int:
        return 0

    def tree_runs(self, rows: int, backend: AttentionBackend, embed: nn.Embedding, dtype: torch.dtype) -> bool:
        return False

    def prepack(self, native: bool = True, int8: bool = False, int8_inputs: bool = False) -> int:
        """Prepack every linear (prepack_head_linears, as EagleHead.prepack); returns the linears
        prepacked."""
        return prepack_head_linears(self, native, int8, int8_inputs)


def load_draft_head(path: str, target: LlamaForCausalLM, dtype: torch.dtype,
                    method: str) -> EagleHead | Eagle3Head:
    """The head in `path`: EAGLE-3 where its config.json says so, else EAGLE-1/2; spec method
    eagle3 asks for an EAGLE-3 head."""
    cfg_file = os.path.join(path, "config.json")
    raw = read_json(cfg_file) if os.path.exists(cfg_file) else None
    if isinstance(raw, dict) and (is_eagle3(raw) or raw.get("speculators_model_type") is not None):
        return load_eagle3_head(path, target, dtype)
    if method == "eagle3":
        raise ModelLoadError(f"spec eagle3 needs an EAGLE-3 draft head; {path!r} is not one (its config.json "
                             f"names neither {EAGLE3_ARCHITECTURE!r} nor speculators_model_type eagle3): "
                             "use spec eagle2")
    return load_eagle_head(path, target, dtype)


def load_eagle3_head(path: str, target: LlamaForCausalLM, dtype: torch.dtype) -> Eagle3Head:
    cfg_file = os.path.join(path, "config.json")
    raw = read_json(cfg_file) if os.path.exists(cfg_file) else None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"EAGLE-3 head {path!r}: missing config.json, or not a JSON object")
    t = target.config
    try:
        layout = parse_eagle3(raw, cfg_file)
        cfg = ModelConfig.from_hf({**layout.layer, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]},
                                  cfg_file)
    except (Eagle3ConfigError, UnsupportedModel) as e:
        raise ModelLoadError(str(e)) from None
    # the draft's RoPE table covers the target's context: the head's positions are the target's
    cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, t.max_position_embeddings))
    H = layout.target_hidden_size or cfg.hidden_size
    if (H, cfg.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ModelLoadError(f"EAGLE-3 head {path!r} (target hidden {H}, vocab {cfg.vocab_size}) does not fit the "
                             f"target (hidden {t.hidden_size}, vocab {t.vocab_size})")
    aux = aux_layers(layout, t.num_layers, path)
    if cfg.hidden_size == (1 + len(aux)) * H:  # a z and the target's features would be told apart by width
        raise ModelLoadError(f"EAGLE-3 head {path!r}: hidden size {cfg.hidden_size} equals the width of the "
                             "target's features it reads; not supported")
    weights = {_internal_name(k, path): w for k, w in _read_weights(path).items()}
    missing = [k for k in REQUIRED_WEIGHTS if k not in weights]
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {path!r}: weights missing: {', '.join(missing)}")
    token_ids = _token_ids(weights.pop("d2t", None), weights.pop("t2d", None), layout.draft_vocab_size, t.vocab_size,
                           path)
    embed = weights.pop("embed_tokens.weight", None)
    own = quant.dense_weight(target.model.embed_tokens)
    shared = embed is None or (embed.shape == own.shape and torch.equal(embed.to(own.device, dtype), own.to(dtype)))
    if embed is None and H != cfg.hidden_size:
        raise ModelLoadError(f"EAGLE-3 head {path!r}: its hidden size {cfg.hidden_size} differs from the target's "
                             f"{H}, so it needs its own embed_tokens.weight")
    head = Eagle3Head(cfg, H, aux, layout.draft_vocab_size, layout.norm_before_residual, "fc.bias" in weights,
                      own_embed=not shared)
    if not shared:
        weights["embed_tokens.weight"] = embed
    fill_parameters(head, iter(weights.items()), dtype, f"EAGLE-3 head {path!r}")
    if token_ids is not None:
        head.d2t = token_ids.to(device=target.lm_head.weight.device)  # (the head moves to it after loading)
    if (cfg.rope_theta, cfg.head_dim, cfg.rope_scaling) != (t.rope_theta, t.head_dim, t.rope_scaling):
        head.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    log.info("EAGLE-3 head %s (%s layout): target hidden states %s (Hugging Face output_hidden_states indices)",
             path, layout.family, [i + 1 for i in aux])
    return head.eval()


def aux_layers(layout: Eagle3Layout, num_layers: int, path: str) -> tuple[int, ...]:
    """The engine's aux layers (l: the stream after layer l) for the layout's captured states
    (HF index i = l + 1); index 0 (the embeddings) and index L (after the final norm) are not
    residual streams the engine captures."""
    idx = layout.hf_indices(num_layers)
    if len(set(idx)) != len(idx) or not all(1 <= i <= num_layers - 1 for i in idx):
        raise ModelLoadError(f"EAGLE-3 head {path!r}: target hidden states {list(idx)} (Hugging Face "
                             f"output_hidden_states indices) must be distinct and within 1..{num_layers - 1} "
                             f"for this {num_layers}-layer target")
    return tuple(i - 1 for i in idx)


def _internal_name(name: str, path: str) -> str:
    """EAGLE / SpecForge names as they are, speculators' `layers.0.` as `midlayer.`; a second
    draft layer or a variant's weights are refused."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    if name.startswith("layers.") or name.startswith(("fc_norm.", "input_norm.")):
        raise ModelLoadError(f"EAGLE-3 head {path!r}: weight {name!r} belongs to a variant that is not "
                             "supported (more than one draft layer, or norms before fc)")
    return name


def _token_ids(d2t, t2d, draft_vocab: int, vocab: int, path: str) -> torch.Tensor | None:
    """[Vd] target ids of the draft vocabulary (the file's d2t holds offsets: id = i + d2t[i]),
    or None where the draft vocabulary is the target's."""
    if d2t is None:
        if draft_vocab != vocab:
            raise ModelLoadError(f"EAGLE-3 head {path!r}: weights missing: d2t (draft_vocab_size {draft_vocab} "
                                 f"differs from the target's vocabulary {vocab})")
        return None
    if d2t.dim() != 1 or len(d2t) != draft_vocab or d2t.is_floating_point():
        raise ModelLoadError(f"EAGLE-3 head {path!r}: d2t must be {draft_vocab} integer offsets, got "
                             f"{d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(draft_vocab, dtype=torch.long) + d2t.long()
    check_draft_ids(ids, vocab, path)
    marked = None if t2d is None else t2d.bool().nonzero().flatten()
    if t2d is not None and (t2d.shape != (vocab,) or not torch.equal(marked, ids.sort().values)):
        raise ModelLoadError(f"EAGLE-3 head {path!r}: t2d does not mark the target ids d2t maps to")
    return ids


SAVE_LAYOUTS = ("specforge", "speculators")


def save_eagle3_head(head: Eagle3Head, path: str, layout: str = "specforge", embed: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None, verifier: str | None = None) -> str:
    """Write `head` as an EAGLE-3 head directory (config.json + model.safetensors) that this
    loader and the layout's own reads: "specforge" (SpecForge's `LlamaForCausalLMEagle3`,
    EAGLE's layout: `midlayer.*`, captured layers in eagle_config) or "speculators"
    (`Eagle3Speculator`: `layers.0.*`, nested transformer_layer_config, top-level ids).

    The q/k/v and gate/up projections are written unfused, d2t as offsets (target id = i +
    d2t[i]) with t2d marking the target ids. `embed` is the token embedding to write as
    embed_tokens.weight where the head shares the target's (its own is always written): both
    references' models hold one, so without it SpecForge's loader reports embed_tokens.weight
    missing (speculators' takes it from the verifier). dtype None keeps the head's. `verifier`
    (speculators) is the target's name or path written as the verifier's name_or_path:
    speculators' from_pretrained reads the target's config, lm_head and final norm from it."""
    if layout not in SAVE_LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(SAVE_LAYOUTS)}")
    cfg, layer = head.config, head.midlayer
    if layout == "specforge" and layer.norm_before_residual:
        raise ValueError("SpecForge's EAGLE-3 layer has no norm_before_residual: write this head as speculators")
    dtype = dtype or head.lm_head.weight.dtype
    # the engine's fused projections -> the unfused ones every layout names
    unfused = {"midlayer.self_attn.qkv_proj.": (("self_attn.q_proj", cfg.q_size), ("self_attn.k_proj", cfg.kv_size),
                                                ("self_attn.v_proj", cfg.kv_size)),
               "midlayer.mlp.gate_up_proj.": (("mlp.gate_proj", cfg.intermediate_size),
                                              ("mlp.up_proj", cfg.intermediate_size))}
    weights: dict[str, torch.Tensor] = {}
    for name, w in head.named_parameters():
        w = w.detach()
        prefix = next((f for f in unfused if name.startswith(f)), None)
        if name.startswith("embed_tokens."):
            continue
        if prefix is None:
            weights[name] = w
            continue
        suffix = name.removeprefix(prefix)  # weight or bias
        for (part, _), t in zip(unfused[prefix], w.split([n for _, n in unfused[prefix]], dim=0)):
            weights[f"midlayer.{part}.{suffix}"] = t
    own = head.embed_tokens.weight.detach() if head.embed_tokens is not None else embed
    if own is not None:
        if tuple(own.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embed of shape {tuple(own.shape)}: the head's embedding is "
                             f"{(cfg.vocab_size, cfg.hidden_size)}")
        weights["embed_tokens.weight"] = own
    weights = {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in weights.items()}
    draft_vocab = head.lm_head.weight.shape[0]
    if head.d2t is not None or layout == "specforge":  # (SpecForge's model holds the buffers either way)
        ids = head.d2t.cpu() if head.d2t is not None else torch.arange(draft_vocab)
        weights["d2t"] = (ids - torch.arange(draft_vocab)).to(torch.int64)
        weights["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        weights["t2d"][ids] = True
    if layout == "speculators":
        weights = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                   for k, v in weights.items()}
    rope = {"rope_type": "default", **cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    llama = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "num_hidden_layers": 1, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
             "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
             "tie_word_embeddings": False, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
             "rope_theta": cfg.rope_theta, "rope_parameters": rope,
             **({"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {})}
    target_hidden = head.target_hidden if head.target_hidden != cfg.hidden_size else None
    if layout == "specforge":
        config = {"architectures": [EAGLE3_ARCHITECTURE], **llama, "draft_vocab_size": draft_vocab,
                  # ids of the layers whose outputs the head reads: the engine's aux layers
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}}
        if target_hidden is not None:
            config["target_hidden_size"] = target_hidden
    else:
        config = {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
                  "draft_vocab_size": draft_vocab, "norm_before_residual": layer.norm_before_residual,
                  "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": target_hidden,
                  # ids of the layers the states enter (Hugging Face output_hidden_states indices)
                  "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.aux_layers],
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
                  "tie_word_embeddings": False}
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path
