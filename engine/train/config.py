"""Settings of a train-draft run and what its stages share: the keys that decide whether a
cached stage (regenerated answers, feature shards, training state) still holds, the check of
OUT, and the progress bar."""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

from tqdm import tqdm

from eagle_serve.engine.train.data import DataError


@dataclass


class TrainConfig:
    model: str | None
    out: str
    data: str = "sharegpt"
    max_conversations: int | None = 2000
    max_len: int = 1024
    epochs: int = 3
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    batch_tokens: int = 8192
    noise: float = 0.1  # half-width of the uniform input noise, as a fraction of the features' RMS
    p_weight: float = 0.1
    draft_vocab: int | None = None
    regenerate: bool = False
    init: str | None = None  # a head directory to start from (its weights and draft vocabulary)
    ttt_steps: int = 1  # training-time test: steps of the head fed its own predictions (1 = off)
    ttt_decay: float = 0.8  # loss weight of step s is ttt_decay ** (s - 1)
    regen_max_tokens: int = 384
    regen_max_prompt: int = 512
    regen_max_turns: int = 2  # user turns answered per conversation (later ones are dropped)
    heldout_fraction: float = 0.02
    seed: int = 0
    dtype: str = "auto"  # the target's dtype while computing features
    snapshots: int = 8  # heads saved along training (curve of acceptance vs tokens)
    save_every: int = 50  # optimizer steps between resumable checkpoints
    bias: bool = True
    aux_layers: tuple[int, ...] = ()  # fused features: target layers whose outputs the head also reads
    # eagle2: the EAGLE-1/2 head (published EAGLE layout); eagle3: an EAGLE-3 head over the aux
    # layers' streams (default: EAGLE-3's low / middle / high layers), SpecForge's layout
    arch: str = "eagle2"
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.data, self.out = str(self.data), str(self.out)
        checks = [(self.max_len >= 8, "max_len must be >= 8"), (self.epochs >= 1, "epochs must be >= 1"),
                  (math.isfinite(self.lr) and self.lr > 0, "lr must be a finite number > 0"),
                  (math.isfinite(self.noise) and self.noise >= 0, "noise must be a finite number >= 0"),
                  (self.snapshots >= 0, "snapshots must be >= 0"), (self.batch_tokens >= self.max_len, "batch_tokens must be >= max_len"),
                  (0 <= self.heldout_fraction < 0.5, "heldout_fraction must be in [0, 0.5)"),
                  (self.max_conversations is None or self.max_conversations >= 2, "max_conversations must be >= 2"),
                  (self.draft_vocab is None or self.draft_vocab >= 2, "draft_vocab must be >= 2"),
                  (1 <= self.ttt_steps <= 8, "ttt_steps must be in [1, 8]"),
                  (0 < self.ttt_decay <= 1, "ttt_decay must be in (0, 1]"),
                  (math.isfinite(self.p_weight) and self.p_weight >= 0, "p_weight must be a finite number >= 0"),
                  (math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                   "weight_decay must be a finite number >= 0"),
                  (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
                  (self.regen_max_tokens >= 1, "regen_max_tokens must be >= 1"),
                  (self.regen_max_prompt >= 1, "regen_max_prompt must be >= 1"),
                  (self.regen_max_turns >= 1, "regen_max_turns must be >= 1"),
                  (len(set(self.aux_layers)) == len(self.aux_layers) and all(i >= 0 for i in self.aux_layers),
                   "aux_layers must be distinct layer indices >= 0"),
                  (self.arch in ("eagle2", "eagle3"), f"arch must be eagle2 or eagle3, got {self.arch!r}"),
                  (self.arch != "eagle3" or self.init is None,
                   "--init takes EAGLE-1/2 heads: an EAGLE-3 head is trained from a new head")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    def data_key(self) -> str:
        """What the cached features depend on: resuming with other data settings starts over."""
        # the files as they are, not their names: a file replaced at the same path starts over
        keys = (source_key(self.model or "default"), source_key(self.data), self.max_conversations, self.max_len,
                self.regenerate, self.regen_max_tokens, self.regen_max_prompt, self.regen_max_turns, self.dtype)
        return hashlib.sha256(repr(keys).encode()).hexdigest()[:16]

    def feature_key(self) -> str:
        """What a token's cached target features depend on besides its conversation."""
        model = source_key(self.model or "default")
        if not self.aux_layers:
            return repr((model, self.dtype))
        return repr((model, self.dtype, tuple(self.aux_layers)))

    def train_key(self) -> str:
        """What a resumable training state depends on beyond the data."""
        keys = (self.data_key(), self.init and source_key(self.init, content=True), self.ttt_steps, self.ttt_decay,
                self.p_weight, self.lr, self.batch_tokens, self.draft_vocab, self.epochs, self.noise, self.weight_decay,
                self.warmup_steps, self.seed, self.heldout_fraction, self.bias) + \
            ((tuple(self.aux_layers),) if self.aux_layers else ()) + ((self.arch,) if self.arch != "eagle2" else ())
        return hashlib.sha256(repr(keys).encode()).hexdigest()[:16]


def check_out(cfg: TrainConfig) -> None:
    """OUT must be a new directory or one a train-draft run wrote: a run pointed at the target's
    own directory (--out = --model) would write its head over the target's config.json and weights."""
    if cfg.model and os.path.exists(cfg.model) and os.path.realpath(cfg.model) == os.path.realpath(cfg.out):
        raise DataError(f"--out {cfg.out} is the target model's own directory: the head would overwrite it")
    if cfg.init and os.path.exists(cfg.init) and os.path.realpath(cfg.init) == os.path.realpath(cfg.out):
        raise DataError(f"--out {cfg.out} is the --init head's own directory: the new head would overwrite the "
                        f"one it starts from; pick a new directory")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise DataError(f"--out {cfg.out} is a file, not a directory")
    if os.path.exists(os.path.join(cfg.out, "config.json")) and not os.path.exists(os.path.join(cfg.out, "card.json")):
        raise DataError(f"--out {cfg.out} holds a config.json that no train-draft run wrote (a model, or another "
                        f"head): pick a new directory")

_READ_SUFFIXES = (".json", ".safetensors", ".gguf", ".model", ".bin")  # what a loader reads from a directory


def source_key(name: str, content: bool = False):
    """A data or model source as its files: real path, and each file's size and modification
    time (content: a hash of the files' bytes, for a small head that may be copied afresh);
    a directory as the files a loader reads from it (config, weights, tokenizer; not a README
    or a head's card.json); a name such as `sharegpt` or `default` as it is."""
    if not os.path.exists(name):
        return name
    if os.path.isdir(name):
        paths = [os.path.join(name, f) for f in sorted(os.listdir(name))
                 if f.endswith(_READ_SUFFIXES) and f != "card.json" and os.path.isfile(os.path.join(name, f))]
    else:
        paths = [name]
    if content:
        h = hashlib.sha256()
        for p in paths:
            h.update(os.path.basename(p).encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
        return (os.path.realpath(name), h.hexdigest()[:20])
    stats = [(os.path.basename(p), os.stat(p)) for p in paths]
    return (os.path.realpath(name), tuple((f, st.st_size, st.st_mtime_ns) for f, st in stats))


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    return tqdm(total=total, desc=desc, initial=initial, disable=not enabled, unit="tok" if desc == "features" else "step",
                dynamic_ncols=True, mininterval=5.0)
