"""Default sampling settings for requests that leave them out, as vLLM's `--generation-config`.

`auto` reads the model directory's generation_config.json (the embedded default model has its
own, below); `vllm` uses the server's neutral defaults (temperature 1, top-p 1, no top-k); any
other value is a folder holding a generation_config.json, or the file itself. A request's own
fields always win. `max_new_tokens` there caps every request's output, as in vLLM.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, fields

log = logging.getLogger("eagle_serve")
FILE = "generation_config.json"
# keys vLLM takes from the file that eagle-serve has no sampling parameter for: named in a warning
UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": 0.0}
# SmolLM2-135M-Instruct's authors sample it at temperature 0.2, top-p 0.9; a 135M model still
# rambles on some prompts, and capping answers at 256 tokens keeps those to a few seconds on a CPU
DEFAULT_MODEL = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None  # cap on every request's output tokens
    source: str = "vllm"  # where they came from, for the start-up log

    def __post_init__(self):
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"{self.source}: temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"{self.source}: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"{self.source}: top_k must be >= -1, got {self.top_k}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"{self.source}: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def cap(self, max_tokens: int) -> int:
        """A request's output-token limit under max_new_tokens."""
        return max_tokens if self.max_new_tokens is None else min(max_tokens, self.max_new_tokens)

    def describe(self) -> str:
        set_ = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source" and getattr(self, f.name) is not None}
        return f"{self.source}: " + (", ".join(f"{k}={v}" for k, v in set_.items()) or "none")


def _read(path: str) -> GenerationDefaults:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path} ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    ignored = [k for k, neutral in UNSUPPORTED.items() if k in cfg and cfg[k] not in (None, neutral)]
    if ignored:
        log.warning("%s sets %s, which eagle-serve does not implement: requests sample without it",
                    path, ", ".join(f"{k}={cfg[k]}" for k in ignored))
    values = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("max_new_tokens", int)):
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"--generation-config: {path}: {key} must be a number, got {value!r}")
        values[key] = kind(value)
    if values.get("top_k") == 0:  # transformers' "no top-k"
        values["top_k"] = -1
    return GenerationDefaults(**values, source=path)


def load_defaults(setting: str, model_path: str, is_default_model: bool) -> GenerationDefaults:
    """The defaults for `--generation-config setting` with the model at `model_path`."""
    if setting == "vllm":
        return GenerationDefaults()
    if setting == "auto":
        if is_default_model:
            return GenerationDefaults(**DEFAULT_MODEL, source="the embedded default model")
        path = os.path.join(model_path, FILE) if os.path.isdir(model_path) else None
        return _read(path) if path and os.path.exists(path) else GenerationDefaults(source="the model has none")
    path = os.path.join(setting, FILE) if os.path.isdir(setting) else setting
    if not os.path.exists(path):
        raise ValueError(f"--generation-config {setting!r}: expected auto, vllm, or a folder holding {FILE} "
                         f"(or the file); {path} does not exist")
    return _read(path)
