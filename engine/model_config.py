"""Model architecture settings parsed from a Hugging Face config.json (torch-free)."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3_text",
}
GEMMA3 = "Gemma3ForCausalLM"
# Gemma 3 layer types (config.json `layer_types`)
SLIDING, FULL = "sliding_attention", "full_attention"
# freq_factors: per-frequency divisors, as a GGUF's rope_freqs tensor gives them (engine/gguf_loader.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., factor, ...}
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    # sparse mixture of experts (Qwen3-MoE): the layers whose MLP is `num_experts` experts of
    # width moe_intermediate_size, each token routed to its top num_experts_per_tok (softmax
    # over the router's logits, renormalised over the chosen when norm_topk_prob)
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Gemma 3: the MLP's activation, the layers that attend only within `sliding_window` (their
    # RoPE base `rope_local_theta`, unscaled), the attention scale query_pre_attn_scalar ** -0.5
    # (None: head_dim ** -0.5) and cap * tanh(logits / cap) on the final logits (None: none)
    hidden_act: str = "silu"
    window_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if self.moe_layers and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise UnsupportedModel(f"mixture of experts: num_experts_per_tok {self.num_experts_per_tok} must be in "
                                   f"[1, num_experts {self.num_experts}] and moe_intermediate_size positive")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_attention_heads {self.num_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_kv_heads}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"rope scaling type {rope_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        # the fields each type reads, checked here: a missing one would fail deep in the rotary
        # table, a factor of 0 would fill it with NaNs
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")}.get(rope_type, ())
        for key in need:
            v = self.rope_scaling.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UnsupportedModel(f"rope scaling {rope_type!r}: {key} must be a positive number, got {v!r}")
        if rope_type == "llama3" and self.rope_scaling["low_freq_factor"] >= self.rope_scaling["high_freq_factor"]:
            raise UnsupportedModel("rope scaling 'llama3': low_freq_factor must be below high_freq_factor")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_gemma3(self) -> bool:
        return self.architecture == GEMMA3

    @property
    def attention_scale(self) -> float:
        """The factor on q.k before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_model_len(self) -> int:
        """Longest context the model handles correctly. Gemma 3 applies its windows
        (engine/models/gemma3.py); for the other families sliding-window attention is not
        implemented, so a window shorter than the trained context caps it."""
        if self.sliding_window and not self.is_gemma3:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        """The config of a Hugging Face config.json's dict; a missing or malformed field is an
        UnsupportedModel naming the file (a KeyError or TypeError surfaced as a traceback)."""
        if not isinstance(cfg, dict):
            raise UnsupportedModel(f"{source}: not a JSON object")
        try:
            out = cls._from_hf(cfg, source)
        except UnsupportedModel as e:  # (the dataclass's own checks do not know the file)
            msg = str(e)
            raise UnsupportedModel(msg if msg.startswith(source) else f"{source}: {msg}") from None
        except KeyError as e:
            raise UnsupportedModel(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise UnsupportedModel(f"{source}: malformed config ({e})") from None
        for name, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                          ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                          ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                          ("head_dim", "head_dim"), ("max_position_embeddings", "max_position_embeddings")):
            v = getattr(out, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UnsupportedModel(f"{source}: {key} must be a positive integer, got {v!r}")
        if not (isinstance(out.rms_norm_eps, (int, float)) and not isinstance(out.rms_norm_eps, bool)
                and 0 < out.rms_norm_eps < 1):
            raise UnsupportedModel(f"{source}: rms_norm_eps must be a number in (0, 1), got {out.rms_norm_eps!r}")
        if not math.isfinite(out.rope_theta) or out.rope_theta <= 0:
            raise UnsupportedModel(f"{source}: rope_theta must be a positive number, got {out.rope_theta!r}")
        w = out.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise UnsupportedModel(f"{source}: sliding_window must be a positive integer or null, got {w!r}")
        return out

    @classmethod
    def _from_hf(cls, cfg: dict, source: str) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if "Gemma3ForConditionalGeneration" in archs or cfg.get("model_type") == "gemma3":
            raise UnsupportedModel(f"{source}: Gemma3ForConditionalGeneration (the image-text model) is not supported; "
                                   f"only the text model Gemma3ForCausalLM (model_type gemma3_text) is served")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(cfg.get("model_type", ""))
        if arch is None:
            raise UnsupportedModel(
                f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if arch == GEMMA3:
            return cls._gemma3(cfg, source)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"{source}: hidden_act {act!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers' order: a config's rope_scaling over its rope_parameters (v5 writes the
        # latter; a rope_scaling a user adds must apply here as it does there)
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        theta = rope.pop("rope_theta") if "rope_theta" in rope else cfg.get("rope_theta", 10000.0)  # (0 is refused, not 10000)
        qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        moe = {}
        if arch == "Qwen3MoeForCausalLM":
            experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
            step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
            moe = dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(cfg["num_hidden_layers"])
                                        if i not in dense and experts > 0 and step > 0 and (i + 1) % step == 0))
        # Qwen: a window only where use_sliding_window or a layer type says so (it then caps the
        # context, see max_model_len)
        sliding = cfg.get("use_sliding_window", not qwen) or SLIDING in (cfg.get("layer_types") or [])
        window = cfg.get("sliding_window") if sliding else None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else {},
            sliding_window=window, architecture=arch, qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            **moe)

    @classmethod
    def _gemma3(cls, cfg: dict, source: str) -> ModelConfig:
        """Gemma 3's text model; defaults as transformers' Gemma3TextConfig. Keys whose behaviour
        is not implemented are refused, naming the key."""
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModel(f"hidden_activation {act!r} is not supported for Gemma 3 (only gelu_pytorch_tanh)")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModel(f"attn_logit_softcapping {cfg['attn_logit_softcapping']!r} is not supported "
                                   f"(soft-capped attention scores are not implemented)")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModel("use_bidirectional_attention is not supported (only causal attention)")
        layers = cfg.get("num_hidden_layers", 26)
        types = cfg.get("layer_types")
        if types is None:  # older configs: every sliding_window_pattern-th layer global
            pattern = cfg.get("sliding_window_pattern", 6)
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise UnsupportedModel(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
            raise UnsupportedModel(f"layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                                   f"{layers} layers, got {types!r}")
        window = cfg.get("sliding_window", 4096)
        windowed = tuple(i for i, t in enumerate(types) if t == SLIDING)
        # RoPE: transformers' nested rope_parameters (per layer type), or rope_theta /
        # rope_local_base_freq / rope_scaling (the global layers' scaling) of older configs
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and (FULL in params or SLIDING in params):
            glob, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        else:
            glob = dict(params or {})
            local = {}
        glob.update(cfg.get("rope_scaling") or {})
        glob.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        for rope in (glob, local):
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"rope scaling {local['rope_type']!r} on the sliding-window layers is not "
                                   f"supported (only on the global ones)")
        theta, local_theta = glob.pop("rope_theta"), local["rope_theta"]
        if isinstance(local_theta, bool) or not isinstance(local_theta, (int, float)) \
                or not math.isfinite(local_theta) or local_theta <= 0:
            raise UnsupportedModel(f"rope_local_base_freq must be a positive number, got {local_theta!r}")
        scalar = cfg.get("query_pre_attn_scalar", 256)
        cap = cfg.get("final_logit_softcapping")
        for key, v in (("query_pre_attn_scalar", scalar), ("final_logit_softcapping", cap)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise UnsupportedModel(f"{key} must be a positive number, got {v!r}")
        heads, bias = cfg.get("num_attention_heads", 8), bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg.get("vocab_size", 262_208), hidden_size=cfg.get("hidden_size", 2304),
            intermediate_size=cfg.get("intermediate_size", 9216), num_layers=layers, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 256,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=bias, o_bias=bias,
            rope_scaling=glob if glob.get("rope_type", "default") != "default" else {},
            sliding_window=window if windowed else None, architecture=GEMMA3, qk_norm=True,
            hidden_act=act, window_layers=windowed if window else (), rope_local_theta=float(local_theta),
            query_pre_attn_scalar=float(scalar), final_logit_softcapping=None if cap is None else float(cap))
