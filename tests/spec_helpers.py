"""Helpers for the speculative decoding tests: a random EAGLE head on disk, an oracle drafter."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from eagle_serve.engine.speculative.drafters import Drafter
from eagle_serve.engine.speculative.tree import chain, root_only


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
