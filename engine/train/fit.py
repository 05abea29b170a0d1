"""The fit loop: train (or resume) a head on cached features, evaluate it on the held-out
conversations, and write OUT/model.safetensors, config.json, card.json, train_log.jsonl and the
snapshots along the way."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
from dataclasses import asdict, replace

import torch

from eagle_serve.engine.model_files import ModelLoadError
from eagle_serve.engine.speculative.eagle_head import _read_weights, load_eagle_head, shares_target_rotary
from eagle_serve.engine.train.config import TrainConfig, progress_bar
from eagle_serve.engine.train.data import DataError
from eagle_serve.engine.train.eagle3 import Eagle3TrainHead, save_eagle3
from eagle_serve.engine.train.head import TrainHead, head_config, save_head
from eagle_serve.engine.train.losses import Losses, batches, build_draft_vocab, pad

# Ctrl-C (the CLI sets STOP): training saves its state after the step under way and stops
# (Interrupted); the same command then resumes there. TRAINING: whether the loop that checks
# STOP is running (before it, regeneration and features resume from their last finished chunk
# or shard, so the CLI just exits).
STOP = threading.Event()
TRAINING = threading.Event()


class Interrupted(Exception):
    """Training stopped on STOP with its state saved."""


class Diverged(DataError):
    """Training met a non-finite loss, gradient or weight: no head or checkpoint is written from
    then on."""

    @classmethod
    def at(cls, what: str, where: str) -> "Diverged":
        return cls(f"{what} {where}: training diverged (try a lower --lr); no head written")


def check_finite(head, where: str) -> None:
    if not all(bool(torch.isfinite(p).all()) for p in head.parameters()):
        raise Diverged.at("the head's weights are not finite", where)


def fit(cfg: TrainConfig, loaded, ids, masks, feats, offsets, train_idx, held_idx, log,
        train_key: str | None = None) -> dict:
    """Train (or resume) the head on the cached features; train_key: cfg.train_key() as the
    inputs were when read (default: now)."""
    mcfg = loaded.config
    train_key = train_key or cfg.train_key()
    torch.manual_seed(cfg.seed)
    # each token's embedding as the drafter reads it (the target's embedding module: Gemma 3 scales it)
    with torch.no_grad():
        table = loaded.model.model.embed_tokens
        embed = table(torch.arange(loaded.config.vocab_size, device=table.weight.device)).detach().float()
    lm = loaded.model.lm_head.weight.detach().float()
    vocab = lm.shape[0]
    train_tok = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in train_idx])
    d2t = None
    # a head started from --init keeps that head's shapes (heads, kv heads, MLP width, rope), as
    # the serving loader builds it from its own config.json (read_head), not the target's
    init, bias, shape = read_head(cfg.init, loaded) if cfg.init else (None, cfg.bias, mcfg)
    init_d2t = init.pop("d2t").long() if init is not None and "d2t" in init else None
    if cfg.draft_vocab is not None:
        # (the head's weights do not depend on the vocabulary: --init's head can take a new one)
        d2t = build_draft_vocab(ids[train_tok], masks[train_tok], cfg.draft_vocab, vocab, sorted(loaded.eos_token_ids))
        what = f"{cfg.draft_vocab} of {vocab} tokens" + (
            f" (re-picked on this data; --init's head had {len(init_d2t) if init_d2t is not None else 'all'})"
            if init is not None else "")
    elif init_d2t is not None:
        d2t, what = init_d2t, f"{len(init_d2t)} tokens from {cfg.init}"
    coverage = 1.0 if d2t is None else float(torch.isin(ids[train_tok][masks[train_tok]], d2t).float().mean())
    if d2t is not None:
        log(f"draft vocabulary: {what}, covering {coverage:.4f} of assistant tokens")
    losses = Losses(embed, lm, d2t, cfg.p_weight)
    eagle3 = cfg.arch == "eagle3"
    # the noise's scale: of what the head reads (the final feature, or an EAGLE-3 head's streams)
    base = feats[1] if eagle3 else feats[0] if isinstance(feats, tuple) else feats
    rms = float(base[train_tok[:200000]].float().pow(2).mean().sqrt())
    noise_amp = cfg.noise * rms
    if eagle3:
        head = Eagle3TrainHead(shape, tuple(cfg.aux_layers), losses.lm_rows)
    else:
        head = TrainHead(shape, bias=bias, aux_layers=tuple(cfg.aux_layers))
    if init is not None:
        head.load_eagle_state_dict(init)  # aux layers checked against --init's at the start
        log(f"starting from the head in {cfg.init}")
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    steps_per_epoch = len(batches(train_idx, offsets, cfg.batch_tokens, random.Random(0)))
    total_steps = steps_per_epoch * cfg.epochs
    warmup = min(cfg.warmup_steps, total_steps // 4)  # a short run still reaches --lr
    if warmup < cfg.warmup_steps:
        log(f"warmup: {warmup} steps, a quarter of this run's {total_steps} (--warmup-steps {cfg.warmup_steps})")

    def lr_at(step):
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        prog = (step - warmup) / max(1, total_steps - warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    tokens_per_epoch = int(sum(int(offsets[i + 1] - offsets[i]) for i in train_idx))
    snap_every = max(1, total_steps // max(1, cfg.snapshots)) if cfg.snapshots else None
    ckpt = os.path.join(cfg.out, "train_state.pt")
    log_path = os.path.join(cfg.out, "train_log.jsonl")
    state = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "elapsed": 0.0, "history": []}
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        if saved.get("train_key") == train_key and saved.get("total_steps") == total_steps:
            head.load_state_dict(saved["head"])
            opt.load_state_dict(saved["opt"])
            state = saved["state"]
            log(f"resuming at epoch {state['epoch']}, step {state['step']}")
        else:
            log("train_state.pt is from other settings: starting over")
            # the old run's snapshots and log would mix into this one's curve
            shutil.rmtree(os.path.join(cfg.out, "snapshots"), ignore_errors=True)
            if os.path.exists(log_path):
                os.replace(log_path, log_path + ".old")
    hcfg = head_config(shape, bias, len(d2t) if d2t is not None else None, tuple(cfg.aux_layers))

    def write_head(path: str, extra: dict | None = None) -> None:
        if eagle3:  # SpecForge's layout, which SGLang and vLLM read too
            save_eagle3(head, path, loaded.model, d2t)
        else:
            save_head(head, path, hcfg, d2t, extra=extra)

    def save_state():
        check_finite(head, f"at step {state['step']}")  # (a checkpoint of NaNs would resume into them)
        tmp = ckpt + ".part"
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state,
                    "train_key": train_key, "total_steps": total_steps}, tmp)
        os.replace(tmp, ckpt)

    def evaluate():
        return evaluate_head(head, losses, held_idx, ids, masks, feats, offsets, cfg.batch_tokens, cfg.ttt_steps,
                             cfg.ttt_decay, 1.0 if eagle3 else cfg.p_weight)

    if state["step"] == 0 and not state["history"]:
        ev = evaluate()
        state["history"].append({"epoch": 0, "step": 0, "tokens": 0, **ev})
        log(f"before training: {ev}")
    bar = progress_bar(total_steps, "train", cfg.progress, state["step"])
    g = torch.Generator().manual_seed(cfg.seed + 1000 * state["epoch"] + state["batch"])
    t_resume = time.time() - state["elapsed"]
    TRAINING.set()  # (cleared by train_draft)
    for epoch in range(state["epoch"], cfg.epochs):
        epoch_batches = batches(train_idx, offsets, cfg.batch_tokens, random.Random(cfg.seed + epoch))
        run = {"loss": 0.0, "n": 0, "agree": 0.0}
        for bi in range(state["batch"], len(epoch_batches)):
            for group in opt.param_groups:
                group["lr"] = lr_at(state["step"])
            padded = pad(epoch_batches[bi], ids, masks, feats, offsets)
            r = losses(head, *padded, noise_amp, g, cfg.ttt_steps, cfg.ttt_decay)
            state["batch"] = bi + 1
            state["tokens"] += int(sum(int(offsets[i + 1] - offsets[i]) for i in epoch_batches[bi]))
            if r is None:
                continue
            loss, (v, p, a, n, _, _) = r
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise Diverged.at(f"the loss is {loss_value}", f"at epoch {epoch + 1}, step {state['step'] + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            if not math.isfinite(norm.item()):
                raise Diverged.at("the gradient is not finite", f"at epoch {epoch + 1}, step {state['step'] + 1}")
            opt.step()
            state["step"] += 1
            state["elapsed"] = time.time() - t_resume
            run["loss"] += loss_value * n
            run["agree"] += a
            run["n"] += n
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", top1=f"{a / n:.3f}")
            if state["step"] % cfg.save_every == 0:
                save_state()
            if snap_every and state["step"] % snap_every == 0:
                check_finite(head, f"at step {state['step']}")
                write_head(os.path.join(cfg.out, "snapshots", f"tokens_{state['tokens']:09d}"))
            if STOP.is_set():
                save_state()
                raise Interrupted(f"interrupted at epoch {epoch + 1}, step {state['step']} of {total_steps}: "
                                  f"{ckpt} saved; the same command resumes there")
        ev = evaluate()
        rec = {"epoch": epoch + 1, "step": state["step"], "tokens": state["tokens"],
               "train_loss": run["loss"] / max(run["n"], 1), "train_top1": run["agree"] / max(run["n"], 1),
               "elapsed_s": round(state["elapsed"], 1), **ev}
        state["history"].append(rec)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"epoch {epoch + 1}/{cfg.epochs}: {rec}")
        state["epoch"], state["batch"] = epoch + 1, 0
        save_state()
    bar.close()
    final = state["history"][-1]
    card = {"target": loaded.name, "data": cfg.data, "regenerated": cfg.regenerate,
            "epochs": cfg.epochs, "train_tokens_seen": state["tokens"], "tokens_per_epoch": tokens_per_epoch,
            "draft_vocab": len(d2t) if d2t is not None else vocab, "draft_vocab_coverage": round(coverage, 4),
            "arch": cfg.arch, "aux_layers": list(cfg.aux_layers), "noise": cfg.noise, "init": cfg.init,
            "ttt_steps": cfg.ttt_steps, "p_weight": cfg.p_weight,
            "train_seconds": round(state["elapsed"], 1),
            "history": state["history"], "config": {k: v for k, v in asdict(cfg).items() if k != "extra"},
            **final, **cfg.extra}
    check_finite(head, "at the end")
    write_head(cfg.out, extra={"eagle_serve_card": "card.json"})
    with open(os.path.join(cfg.out, "card.json"), "w") as f:
        json.dump(card, f, indent=2)
    return card


def evaluate_head(head, losses: "Losses", idx: list[int], ids, masks, feats, offsets, batch_tokens: int,
                  steps: int = 1, decay: float = 0.8, p_weight: float = 0.1) -> dict:
    """Held-out figures of `head` on conversations idx: step-1 feature and KL losses, top-1
    agreement (draft vocabulary and full vocabulary) and, with steps > 1, each training-time-test
    step's top-1 (the head fed its own predictions, as when drafting that deep)."""
    was_training = head.training
    head.eval()
    tot = {"v": 0.0, "p": 0.0, "agree": 0.0, "agree_full": 0.0, "n": 0}
    steps_tot = [[0.0, 0] for _ in range(steps)]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in batches(idx, offsets, batch_tokens, random.Random(0)):
            r = losses(head, *pad(b, ids, masks, feats, offsets), 0.0, g, steps, decay, full_vocab=True)
            if r is None:
                continue
            _, (v, p, a, n, af, per_step) = r
            for acc, (sa, sn) in zip(steps_tot, per_step):
                acc[0] += sa
                acc[1] += sn
            tot["v"] += v * n
            tot["p"] += p * n
            tot["agree"] += a
            tot["agree_full"] += af
            tot["n"] += n
    head.train(was_training)
    n = max(tot["n"], 1)
    return {"heldout_vloss": tot["v"] / n, "heldout_ploss": tot["p"] / n,
            "heldout_loss": (tot["v"] + p_weight * tot["p"]) / n,
            "heldout_top1": tot["agree"] / n, "heldout_top1_full_vocab": tot["agree_full"] / n,
            "heldout_tokens": tot["n"],
            **({f"heldout_top1_step{i + 1}": a / max(n, 1) for i, (a, n) in enumerate(steps_tot)}
               if steps > 1 else {})}


def read_head(path: str, loaded):
    """(weights, bias, shape) of a head directory: its weights (float32, published EAGLE names,
    `d2t` kept), whether it has biases, and the layer's ModelConfig from its config.json (with
    the target's rope scaling and table where serving uses the target's rotary for it). The
    serving loader checks it first (config, shapes, d2t), so --init takes exactly the heads
    --draft takes."""
    try:
        shape = load_eagle_head(path, loaded.model, torch.float32).config
        raw = _read_weights(path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise DataError(f"--init {path}: {e}") from e
    if shares_target_rotary(shape, loaded.config):  # rotated as serving rotates it: the target's rotary
        shape = replace(shape, rope_scaling=loaded.config.rope_scaling,
                        max_position_embeddings=loaded.config.max_position_embeddings)
    w = {k.removeprefix("model."): v for k, v in raw.items() if not k.endswith("embed_tokens.weight")}
    return {k: (v if k == "d2t" else v.float()) for k, v in w.items()}, "fc.bias" in w, shape
