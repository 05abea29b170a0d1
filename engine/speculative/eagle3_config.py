"""EAGLE-3 head directories: which layout a config.json describes, and what it asks of the
target (torch-free: the engine config reads it to name the method).

Two published layouts:
- EAGLE / SpecForge (`architectures: ["LlamaForCausalLMEagle3"]`): a flat one-layer Llama
  config with `draft_vocab_size`, optional `target_hidden_size` and optional
  `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `midlayer.*`.
- speculators (`speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`): the
  layer's config nested in `transformer_layer_config`, with `draft_vocab_size`,
  `norm_before_residual`, `target_hidden_size` and `eagle_aux_hidden_state_layer_ids` at the top;
  weights `layers.0.*`.

Captured states are numbered as Hugging Face's `output_hidden_states` numbers them (index 0 the
embeddings, index i the residual stream after layer i - 1). The two layouts' ids differ by one:
an `eagle_config` id names the layer whose output is taken (index id + 1), a top-level id the
layer the state enters (index id); without ids the head reads indices 2, L // 2 and L - 3.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
# flags of variants this engine does not run: each is refused when set, never ignored
REFUSED_FLAGS = {
    "fc_norm": "an RMSNorm per captured state before fc",
    "norm_before_fc": "an RMSNorm over the captured states before fc",
}


class Eagle3ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Eagle3Layout:
    family: str  # "eagle" (EAGLE / SpecForge) or "speculators"
    layer: dict  # the draft layer's Llama config (hidden_size, heads, rope, vocab_size = target's)
    draft_vocab_size: int
    target_hidden_size: int | None  # None: the draft's hidden size
    norm_before_residual: bool  # the residual is hidden_norm(x) rather than x
    hidden_state_ids: tuple[int, ...] | None  # captured states as HF output_hidden_states indices; None: default

    def hf_indices(self, num_layers: int) -> tuple[int, ...]:
        """The target's captured states, HF output_hidden_states indices in ascending order."""
        ids = self.hidden_state_ids
        if ids is None:
            ids = (2, num_layers // 2, num_layers - 3)
        return tuple(sorted(ids))


def is_eagle3(raw: dict) -> bool:
    """Whether a head config.json (a dict) describes an EAGLE-3 head."""
    archs = raw.get("architectures") or []
    return (raw.get("speculators_model_type") == "eagle3" or EAGLE3_ARCHITECTURE in archs
            or SPECULATORS_ARCHITECTURE in archs)


def _eagle3_config(path: str) -> dict | None:
    """The head directory's config.json where it describes an EAGLE-3 head, else None (also
    where it is missing or unreadable: the head loader reports that)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and is_eagle3(raw) else None


def is_eagle3_dir(path: str) -> bool:
    """Whether the head directory's config.json describes an EAGLE-3 head."""
    return _eagle3_config(path) is not None


def parse_eagle3(raw: dict, source: str) -> Eagle3Layout:
    """The layout of an EAGLE-3 config.json; a missing key or an unsupported variant is an
    Eagle3ConfigError naming it."""
    speculators = raw.get("speculators_model_type") is not None or SPECULATORS_ARCHITECTURE in (
        raw.get("architectures") or [])
    if speculators:
        if raw.get("speculators_model_type") != "eagle3":
            raise Eagle3ConfigError(f"{source}: speculators_model_type {raw.get('speculators_model_type')!r} "
                                    "is not supported (only eagle3)")
        _require(raw, ("transformer_layer_config", "draft_vocab_size", "norm_before_residual"), source)
        layer = raw["transformer_layer_config"]
        if not isinstance(layer, dict):
            raise Eagle3ConfigError(f"{source}: transformer_layer_config must be a JSON object")
        _require(layer, LAYER_KEYS, f"{source} (transformer_layer_config)")
        if raw.get("norm_output"):  # speculators' meaning: the next step reads the normed hidden
            raise Eagle3ConfigError(f"{source}: norm_output true (the next draft step reads the normed "
                                    "hidden state) is not supported")
        ids, shift = raw.get("eagle_aux_hidden_state_layer_ids"), 0
    else:
        _require(raw, LAYER_KEYS + ("draft_vocab_size",), source)
        layer = raw
        if raw.get("norm_output") is False:  # SpecForge's meaning: lm_head without the final norm
            raise Eagle3ConfigError(f"{source}: norm_output false (no norm before lm_head) is not supported")
        eagle_cfg = raw.get("eagle_config") or {}
        if not isinstance(eagle_cfg, dict):
            raise Eagle3ConfigError(f"{source}: eagle_config must be a JSON object")
        ids, shift = eagle_cfg.get("eagle_aux_hidden_state_layer_ids"), 1  # ids of layers whose output is read
        if raw.get("eagle_aux_hidden_state_layer_ids") is not None:  # a flattened speculators config's
            if ids is not None:
                raise Eagle3ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids both at the top level and in "
                                        "eagle_config (their ids count layers differently): keep one")
            ids, shift = raw["eagle_aux_hidden_state_layer_ids"], 0
    for key, what in REFUSED_FLAGS.items():
        if raw.get(key) or layer.get(key):
            raise Eagle3ConfigError(f"{source}: {key} ({what}) is not supported")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise Eagle3ConfigError(f"{source}: draft layer model_type {model_type!r} is not supported (only llama)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise Eagle3ConfigError(f"{source}: num_hidden_layers {layer.get('num_hidden_layers')}: only one-layer "
                                "EAGLE-3 heads are supported")
    nbr = raw.get("norm_before_residual", False)
    target_hidden = raw.get("target_hidden_size")
    for name, v, ok in (("draft_vocab_size", raw["draft_vocab_size"], _positive(raw["draft_vocab_size"])),
                        ("target_hidden_size", target_hidden, target_hidden is None or _positive(target_hidden)),
                        ("norm_before_residual", nbr, isinstance(nbr, bool))):
        if not ok:
            raise Eagle3ConfigError(f"{source}: malformed {name} {v!r}")
    return Eagle3Layout("speculators" if speculators else "eagle", dict(layer), raw["draft_vocab_size"],
                        target_hidden, nbr, _hidden_state_ids(ids, shift, source))


def _hidden_state_ids(ids, shift: int, source: str) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       and i >= 0 for i in ids):
        raise Eagle3ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids must be a non-empty list of "
                                f"layer indices >= 0, got {ids!r}")
    return tuple(i + shift for i in ids)


def _require(d: dict, keys, source: str) -> None:
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise Eagle3ConfigError(f"{source}: EAGLE-3 head config is missing {', '.join(missing)}")


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def eagle3_state_count(path: str) -> int:
    """How many target hidden states the EAGLE-3 head in `path` reads (0: not an EAGLE-3 head,
    or a config the head loader will report)."""
    raw = _eagle3_config(path)
    if raw is None:
        return 0
    try:
        ids = parse_eagle3(raw, "config.json").hidden_state_ids
    except (ValueError, TypeError):
        return 0
    return 3 if ids is None else len(ids)
