"""GGUF files of the llama, qwen3 and qwen3moe architectures: config, tokenizer and
dequantized weights.

Weights of the block types the native CPU kernels multiply (engine/quant.py: Q8_0, Q4_0, Q4_1,
Q4_K, Q6_K) stay in their blocks where `keep_quantized` is set (the CPU with native kernels):
the loader yields them as `QuantTensor`s. Other types, and every weight where it is not set, are
dequantized to float32 with the `gguf` package (a log line names the quantized types that are). For llama, llama.cpp's converter
permutes the rows of the Q and K projections from Hugging Face's rotate-half RoPE layout into its
interleaved layout; `unpermute` undoes it so the weights fit this engine's (HF) RoPE. qwen3 and
qwen3moe run llama.cpp's rotate-half (NEOX) RoPE, so their rows are stored in HF's order and
read as they are. A qwen3moe file stores each layer's experts as one 3D tensor per projection
([experts, rows, columns]), read back as each expert's HF weight.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch

from eagle_serve.engine.model_config import ModelConfig, UnsupportedModel
from eagle_serve.engine.model_files import ModelLoadError
from eagle_serve.engine.quant import BLOCK_TYPES, QuantTensor

log = logging.getLogger(__name__)
PLAIN_TYPES = ("F32", "F16", "BF16")  # float tensors: read at the model's dtype, nothing to say

LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
ROUTER_NAMES = {"ffn_gate_inp": "mlp.gate"}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF architecture -> (HF architecture, the per-layer tensors its files hold)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", LAYER_NAMES),
    "qwen3": ("Qwen3ForCausalLM", {**LAYER_NAMES, **QK_NORM_NAMES}),
    "qwen3moe": ("Qwen3MoeForCausalLM", {**LAYER_NAMES, **QK_NORM_NAMES, **ROUTER_NAMES, **EXPERT_NAMES}),
}
EXPERT_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _reader(path: str):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except (ValueError, TypeError, IndexError, KeyError, OSError) as e:  # a truncated or corrupt file
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader, path: str) -> dict:
    """An HF-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{path}: GGUF architecture {arch!r} is not supported "
                               f"(supported: {', '.join(repr(a) for a in ARCHITECTURES)})")
    hf_arch, layer_names = ARCHITECTURES[arch]
    p = arch + "."
    moe = arch == "qwen3moe"
    heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    required = [("attention.head_count", heads), ("embedding_length", hidden),
                ("block_count", _field(reader, p + "block_count"))]
    required += [(k, _field(reader, p + k)) for k in
                 (("expert_count", "expert_used_count", "expert_feed_forward_length") if moe else ("feed_forward_length",))]
    for key, v in required:
        if v is None:  # named here, not a traceback further on
            raise UnsupportedModel(f"{path}: GGUF metadata lacks {p}{key}")
    if not moe and _field(reader, p + "expert_count"):
        raise UnsupportedModel(f"{path}: mixture-of-experts GGUF models of architecture {arch!r} are not supported")
    for key in ("expert_shared_count", "expert_group_count"):
        if _field(reader, p + key):
            raise UnsupportedModel(f"{path}: GGUF metadata {p}{key} (shared or grouped experts) is not supported")
    gating = _field(reader, p + "expert_gating_func")
    if gating is not None and gating != EXPERT_GATING_SOFTMAX:
        raise UnsupportedModel(f"{path}: GGUF metadata {p}expert_gating_func {gating} is not supported (only softmax)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, p + "vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise UnsupportedModel(f"{path}: GGUF metadata gives no vocabulary size ({p}vocab_size or tokenizer.ggml.tokens)")
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:  # every tensor is one this loader reads (an unknown one is an error)
        base, _, _ = t.name.rpartition(".")
        parts = base.split(".")
        known = (parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names) or base in TOP_NAMES \
            or (t.name == "rope_freqs.weight" and arch == "llama")
        if not known:
            raise UnsupportedModel(f"{path}: GGUF tensor {t.name!r} is not one a {arch} model has")
    layers = _field(reader, p + "block_count")
    cfg = {
        "architectures": [hf_arch], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length") or _field(reader, p + "expert_feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", heads),
        "head_dim": _field(reader, p + "rope.dimension_count", hidden // heads),
        "rms_norm_eps": _field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, p + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        # end of turn / message count as end of sequence, as llama.cpp stops on them
        "eos_token_id": [i for i in dict.fromkeys(_field(reader, "tokenizer.ggml." + k) for k in
                                                   ("eos_token_id", "eot_token_id", "eom_token_id")) if i is not None]
        or None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    # a layer without a router is a dense one (HF's mlp_only_layers); llama.cpp's qwen3moe always
    # renormalises the chosen experts' weights
    if moe:
        cfg.update(num_experts=_field(reader, p + "expert_count"), num_experts_per_tok=_field(reader, p + "expert_used_count"),
                   moe_intermediate_size=_field(reader, p + "expert_feed_forward_length"),
                   norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])
    value_len = _field(reader, p + "attention.value_length")
    key_len = _field(reader, p + "attention.key_length")
    if value_len is not None and value_len != (key_len if key_len is not None else cfg["head_dim"]):
        raise UnsupportedModel(f"{path}: GGUF value heads of {value_len} wide, key heads of "
                               f"{key_len or cfg['head_dim']}, are not supported")
    rotary = _field(reader, p + "rope.dimension_count")
    if rotary is not None and key_len is not None and rotary != key_len:
        raise UnsupportedModel(f"{path}: partial rotary embeddings (rope.dimension_count {rotary} of a "
                               f"{key_len}-wide head) are not supported")
    if key_len is not None:
        cfg["head_dim"] = key_len
    if _field(reader, p + "rope.scaling.type") not in (None, "none"):
        raise UnsupportedModel(f"{path}: GGUF rope scaling is not supported")
    # llama.cpp writes Llama 3.1's RoPE scaling as a tensor of per-frequency factors (no
    # rope.scaling.* keys); left out, the model would run unscaled RoPE and its logits be wrong
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = [float(x) for x in np.array(freqs.data, dtype=np.float32).reshape(-1)]
        if len(factors) != cfg["head_dim"] // 2:
            raise UnsupportedModel(f"{path}: rope_freqs has {len(factors)} factors for a head of {cfg['head_dim']}")
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
    return cfg


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (heads, D/2, 2) -> (heads, 2, D/2)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(reader, cfg: dict, path: str = "GGUF",
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, float32 tensor) for every weight in the file; with keep_quantized, a
    `QuantTensor` for every 2D weight of a type in quant.BLOCK_TYPES (module doc)."""
    from gguf.quants import dequantize
    permuted = cfg["architectures"] == ["LlamaForCausalLM"]  # (module doc)
    dequantized: dict[str, int] = {}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            name = None if kind in EXPERT_NAMES else \
                f"model.layers.{parts[1]}.{({**LAYER_NAMES, **QK_NORM_NAMES, **ROUTER_NAMES})[kind]}.{suffix}"
        elif base in TOP_NAMES:
            name = f"{TOP_NAMES[base]}.{suffix}"
        else:
            continue  # rope_freqs: read into the config's rope scaling (gguf_config)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        if keep_quantized and int(t.tensor_type) in BLOCK_TYPES and name is not None and len(shape) == 2:
            q = QuantTensor.from_raw(int(t.tensor_type), t.data, shape)
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg["num_attention_heads"] if name.endswith("q_proj.weight") else cfg["num_key_value_heads"]
                q = q.take_rows(unpermute(torch.arange(shape[0]), heads))
            yield name, q
            continue
        if t.tensor_type.name not in PLAIN_TYPES:
            dequantized[t.tensor_type.name] = dequantized.get(t.tensor_type.name, 0) + 1
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # own, writable copy
        except NotImplementedError:  # a type the gguf package cannot unpack: named, not its traceback
            raise UnsupportedModel(f"{path}: GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                                   f"package cannot dequantize") from None
        if name is None:  # [experts, rows, columns]: one HF weight per expert
            if w.dim() != 3 or w.shape[0] != cfg["num_experts"]:
                raise UnsupportedModel(f"{path}: GGUF tensor {t.name!r} has shape {tuple(w.shape)}, not "
                                       f"[{cfg['num_experts']} experts, rows, columns]")
            for e in range(w.shape[0]):
                yield f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_NAMES[kind]}.{suffix}", w[e]
            continue
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        yield name, w
    if dequantized:
        log.info("%s: dequantized at load: %s", os.path.basename(path), ", ".join(
            f"{n} {kind} tensors" for kind, n in sorted(dequantized.items())) + (
            "" if keep_quantized else " (the kept-quantized path needs the CPU with native kernels)"))


def gguf_tokenizer_dir(path: str, cache_root: str) -> str:
    """A folder with tokenizer.json / tokenizer_config.json / chat_template.jinja converted from
    the GGUF's tokenizer (by transformers, once; cached by file identity)."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = os.path.join(cache_root, "gguf-tokenizers", key)
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        tmp = out + ".part"
        tok.save_pretrained(tmp)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        os.replace(tmp, out)
    return out


def load_gguf(path: str, keep_quantized: bool = False) -> tuple[ModelConfig, dict, Iterator[tuple[str, torch.Tensor]]]:
    reader = _reader(path)
    cfg = gguf_config(reader, path)
    return ModelConfig.from_hf(cfg, path), cfg, gguf_tensors(reader, cfg, path, keep_quantized)
