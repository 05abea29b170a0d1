"""Helpers for the speculative decoding tests: random EAGLE and EAGLE-3 heads on disk, an oracle drafter."""
from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save_file

from eagle_serve.engine.speculative.drafters import Drafter
from eagle_serve.engine.speculative.tree import chain, root_only


# float64 engines on the CPU verifying fixed trees: exact, so speculative output must equal plain
KW = dict(dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4, tree_budget=False)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of 2-29 token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def write_eagle_head(path: str, target_dir: str, seed: int = 0, std: float = 0.1, stray_embed: bool = True,
                     hidden: int | None = None, inter: int | None = None, heads: int | None = None,
                     kv: int | None = None, head_dim: int | None = None, rope_theta: float = 10000.0) -> str:
    """A random EAGLE-1/2 head in the published layout for the model in `target_dir` (its
    shapes the target's unless given)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        tcfg = json.load(f)
    h = hidden or tcfg["hidden_size"]
    inter = inter or tcfg["intermediate_size"]
    heads = heads or tcfg["num_attention_heads"]
    kv = kv or tcfg["num_key_value_heads"]
    d = head_dim or h // heads
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * std)  # noqa: E731
    w = {"fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h),
         "layers.0.self_attn.q_proj.weight": rnd(heads * d, h), "layers.0.self_attn.k_proj.weight": rnd(kv * d, h),
         "layers.0.self_attn.v_proj.weight": rnd(kv * d, h), "layers.0.self_attn.o_proj.weight": rnd(h, heads * d),
         "layers.0.mlp.gate_proj.weight": rnd(inter, h), "layers.0.mlp.up_proj.weight": rnd(inter, h),
         "layers.0.mlp.down_proj.weight": rnd(h, inter),
         "layers.0.post_attention_layernorm.weight": 1 + rnd(h)}
    if stray_embed:
        from safetensors import safe_open
        with safe_open(os.path.join(target_dir, "model.safetensors"), "pt") as f:
            w["embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "bias": True, "hidden_size": h, "intermediate_size": inter,
           "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
           "vocab_size": tcfg["vocab_size"], "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
           "rope_theta": rope_theta, "hidden_act": "silu", **({"head_dim": head_dim} if head_dim else {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_eagle3_head(path: str, target_dir: str, layout: str = "eagle", seed: int = 0, std: float = 0.1,
                      draft_vocab: int | None = 64, norm_before_residual: bool = False, hidden_state_ids=None,
                      hidden: int | None = None, heads: int | None = None, kv: int | None = None,
                      rope_theta: float | None = None, max_positions: int = 2048) -> str:
    """A random EAGLE-3 head for the model in `target_dir`, in the EAGLE / SpecForge layout
    (`layout="eagle"`: `midlayer.*`, flat config, ids in eagle_config) or the speculators one
    (`"speculators"`: `layers.0.*`, nested transformer_layer_config, top-level ids).
    draft_vocab None: the target's vocabulary, no d2t / t2d; hidden below the target's writes
    target_hidden_size and the head's own embedding; rope_theta
    None leaves it out (10000)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        tcfg = json.load(f)
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    h = hidden or H
    heads = heads or tcfg["num_attention_heads"]
    kv = kv or tcfg["num_key_value_heads"]
    d, inter, n = h // heads, 2 * h, len(hidden_state_ids or (0, 0, 0))
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * std)  # noqa: E731
    layer = {"hidden_norm.weight": 1 + rnd(h), "input_layernorm.weight": 1 + rnd(h),
             "post_attention_layernorm.weight": 1 + rnd(h),
             "self_attn.q_proj.weight": rnd(heads * d, 2 * h), "self_attn.k_proj.weight": rnd(kv * d, 2 * h),
             "self_attn.v_proj.weight": rnd(kv * d, 2 * h), "self_attn.o_proj.weight": rnd(h, heads * d),
             "mlp.gate_proj.weight": rnd(inter, h), "mlp.up_proj.weight": rnd(inter, h),
             "mlp.down_proj.weight": rnd(h, inter)}
    prefix = "midlayer." if layout == "eagle" else "layers.0."
    w = {prefix + k: v for k, v in layer.items()}
    w.update({"fc.weight": rnd(h, n * H), "norm.weight": 1 + rnd(h), "lm_head.weight": rnd(draft_vocab or V, h)})
    if draft_vocab is not None:
        used = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
        w["d2t"] = used - torch.arange(draft_vocab)
        w["t2d"] = torch.zeros(V, dtype=torch.bool)
        w["t2d"][used] = True
    if h != H:
        w["embed_tokens.weight"] = rnd(V, h) * 10
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    llama = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv, "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-5,
             "max_position_embeddings": max_positions, "hidden_act": "silu", "tie_word_embeddings": False,
             **({"rope_theta": rope_theta} if rope_theta is not None else {})}
    top = {"draft_vocab_size": draft_vocab or V, "target_hidden_size": H if h != H else None}
    if layout == "eagle":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **llama, **top,
               **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(hidden_state_ids)}}
                  if hidden_state_ids is not None else {})}
        if cfg["target_hidden_size"] is None:
            del cfg["target_hidden_size"]
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]}, **top,
               "norm_before_residual": norm_before_residual, "norm_before_fc": False, "fc_norm": False,
               "eagle_aux_hidden_state_layer_ids": list(hidden_state_ids) if hidden_state_ids is not None else None,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class OracleDrafter(Drafter):
    """Proposes the reference continuation of each sequence (a chain), with the token at depth
    `corrupt_at` (1-based, None = never) replaced by a wrong one."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int, corrupt_at=None):
        self.refs, self.vocab, self.corrupt_at = references, vocab, corrupt_at
        self.calls = 0

    def propose(self, steps, max_depths):
        trees = []
        for s, d in zip(steps, max_depths):
            ref = self._continuation(s.prompt_token_ids, s.output_token_ids)
            if ref is None:
                trees.append(root_only(s.token_ids[-1]))
                continue
            draft = ref[:d]
            c = self.corrupt_at(self.calls) if callable(self.corrupt_at) else self.corrupt_at
            if c is not None and c <= len(draft):
                draft[c - 1] = (draft[c - 1] + 1) % self.vocab
            self.calls += 1
            trees.append(chain(s.token_ids[-1], draft))
        return trees

    def _continuation(self, prompt, outputs):
        full = self.refs.get(tuple(prompt))
        if full is None or full[:len(outputs)] != list(outputs):
            return None
        return list(full[len(outputs):])
