"""The tree budget's cost profile, kept on disk between starts.

A profile measures this engine on this machine, so its key holds everything the timings depend
on: the model and head files (path, size, modification time), the engine config, the resolved
dtype and device, the CPU model, core and thread counts, the torch version, the native kernels'
build (instruction set, sources, flags; none when they are off), and the profile's own arguments. Only clean profiles are stored (one taken while other
processes used the CPU is not worth reusing). `EAGLE_SERVE_PROFILE_CACHE` names another folder,
or `off` turns the cache off.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os

import torch

from eagle_serve.engine.default_model import cache_dir
from eagle_serve.engine import kernels
from eagle_serve.engine.config import ENV_FALSE

log = logging.getLogger("eagle_serve")
FORMAT = 1  # bumped when a profile's content or meaning changes


def cache_folder() -> str | None:
    """Where profiles are kept, or None when the cache is off."""
    setting = os.environ.get("EAGLE_SERVE_PROFILE_CACHE", "")
    if setting.strip().lower() in ENV_FALSE:
        return None
    return setting or os.path.join(cache_dir(), "profiles")


def _files(path: str | None) -> list:
    """(name, size, mtime_ns) of a model file, or of a directory's files: a changed file is a new key."""
    if not path or not os.path.exists(path):
        return []
    paths = sorted(glob.glob(os.path.join(path, "*"))) if os.path.isdir(path) else [path]
    return [(os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths if os.path.isfile(p)]


def _kernels(device: torch.device) -> str | None:
    """The native kernels' build in use (its name holds the instruction set and a digest of the
    sources, compiler flags and torch version), None where they are off or not for this device."""
    return getattr(kernels.native(), "__name__", None) if device.type == "cpu" else None


def profile_key(runner, **profile_args) -> dict:
    """What a profile of `runner` with these profile_costs arguments depends on."""
    config = {k: repr(v) for k, v in dataclasses.asdict(runner.config).items()}
    device = runner.device
    return {
        "format": FORMAT,
        "model": _files(runner.loaded.path),
        "draft": _files(runner.config.draft),
        "config": config,
        "dtype": str(runner.dtype),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else kernels.cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": _kernels(device),
        "profile": {k: repr(v) for k, v in sorted(profile_args.items())},
    }


def _path(folder: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(folder, f"profile-{digest}.json")


def load(key: dict) -> dict | None:
    """The stored profile for `key`, or None (no cache, no file, or one that does not read back)."""
    folder = cache_folder()
    if folder is None:
        return None
    path = _path(folder, key)
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    if stored.get("key") != json.loads(json.dumps(key)):  # a digest collision, or a hand-edited file
        return None
    prof = stored["profile"]
    for name in ("verify", "draft", "draft_first"):  # JSON turned the (x, seconds) pairs into lists
        prof[name] = [tuple(p) for p in prof[name]]
    return prof


def store(key: dict, prof: dict) -> None:
    """Keep a clean profile for the next start; a cache that cannot be written is only logged."""
    folder = cache_folder()
    if folder is None or prof["contended"]:
        return
    path = _path(folder, key)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": key, "profile": prof}, f)
        os.replace(tmp, path)  # atomic: two engines starting at once never read half a file
    except OSError as e:
        log.warning("the tree budget's cost profile was not cached (%s)", e)
