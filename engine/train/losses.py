"""The losses of draft-head training, and the padded batches they take.

From (f_t, x_{t+1}) the head predicts f_{t+1}; loss = SmoothL1(feature) + p_weight x soft
cross-entropy of lm_head(prediction) against softmax(lm_head(f_{t+1})) (an EAGLE-3 head: the
soft cross-entropy of its own LM head's distribution alone), on positions whose
next-next token is an assistant token, with uniform noise on the input features. The
cross-entropy is reported as KL (minus the target's entropy, a constant), so 0 is perfect. With a
draft vocabulary of K tokens both distributions are taken over those K tokens.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F


def build_draft_vocab(ids: torch.Tensor, masks: torch.Tensor, k: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The k most frequent assistant tokens (ties by id), plus `always` (end-of-turn ids), sorted by id."""
    counts = torch.bincount(ids[masks], minlength=vocab).float()
    counts[always] = float("inf")
    top = torch.topk(counts + torch.arange(vocab, 0, -1) * 1e-9, k).indices  # deterministic ties
    return top.sort().values


def batches(idx: list[int], offsets: torch.Tensor, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Conversations grouped by length into padded batches of <= batch_tokens; batch order shuffled."""
    lengths = {i: int(offsets[i + 1] - offsets[i]) for i in idx}
    srt = sorted(idx, key=lambda i: (lengths[i], i))
    out, cur = [], []
    for i in srt:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:  # sorted: i is the longest so far
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def pad(batch: list[int], ids, masks, feats, offsets):
    """Padded (ids, mask, features) of the batch's conversations; feats may be (feats, aux), and
    then the features come back as (features, aux) too."""
    if isinstance(feats, tuple):
        bid, bmask, bfeat = pad(batch, ids, masks, feats[0], offsets)
        return bid, bmask, (bfeat, pad(batch, ids, masks, feats[1], offsets)[2])
    lens = [int(offsets[i + 1] - offsets[i]) for i in batch]
    T = max(lens)
    h = feats.shape[1]
    bid = torch.zeros(len(batch), T, dtype=torch.long)
    bmask = torch.zeros(len(batch), T, dtype=torch.bool)
    bfeat = torch.zeros(len(batch), T, h, dtype=torch.float32)
    for r, (i, n) in enumerate(zip(batch, lens)):
        s = int(offsets[i])
        bid[r, :n], bmask[r, :n], bfeat[r, :n] = ids[s:s + n], masks[s:s + n], feats[s:s + n].float()
    return bid, bmask, bfeat


class Losses:
    """The training objective of a head: feature regression plus KL of its LM-head distribution to
    the target's, over the draft vocabulary."""

    def __init__(self, embed: torch.Tensor, lm: torch.Tensor, d2t: torch.Tensor | None, p_weight: float):
        """lm: the target's LM head [vocab, h]; d2t: the draft vocabulary's target ids (None: all)."""
        self.embed, self.full_lm, self.p_weight = embed, lm, p_weight
        self.d2t = d2t if d2t is not None else torch.arange(lm.shape[0])
        self.lm_rows = lm[d2t] if d2t is not None else lm

    def __call__(self, head, bid, bmask, bfeat, noise_amp: float, generator=None, steps: int = 1,
                 decay: float = 0.8, full_vocab: bool = False):
        """Returns loss, and (vloss, ploss, agree, n, agree_full, step_agree) for logging:
        step 1's figures, and with training-time test (steps > 1) each step's (agree, n); step s
        weighs decay**(s-1) in the loss. agree_full (agreement with the target's argmax over its
        whole vocabulary) only with full_vocab: the full LM head over every row costs more than
        the rest of a training step, so only evaluation asks for it."""
        bfeat, baux = bfeat if isinstance(bfeat, tuple) else (bfeat, None)
        emb = self.embed[bid[:, 1:]]
        f_in = bfeat[:, :-1]
        a_in = baux[:, :-1] if baux is not None else None
        if noise_amp > 0:  # on what the head reads: the final feature, or an EAGLE-3 head's streams
            if head.regresses_features:
                f_in = f_in + (torch.rand(f_in.shape, generator=generator) * 2 - 1) * noise_amp
            else:
                a_in = a_in + (torch.rand(a_in.shape, generator=generator) * 2 - 1) * noise_amp
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfeat.device.type == "cpu"):
            if baux is not None:
                f_in = head.fuse(f_in, a_in)
            preds = head.forward_steps(emb, f_in, steps) if steps > 1 else [head(emb, f_in)]
        tgt = bfeat[:, 1:]
        w = torch.zeros_like(bmask[:, 1:])
        w[:, :-1] = bmask[:, 2:]
        n = int(w.sum())
        if n == 0:
            return None
        t_sel = tgt[w]
        with torch.no_grad():
            t_logits = t_sel @ self.lm_rows.T
            t_logp = t_logits.log_softmax(-1)
            t_prob = t_logp.exp()
            t_entropy = -(t_prob * t_logp).sum(-1)
            t_top = t_logits.argmax(-1)
        total, step_agree, first = 0.0, [], None
        for s, pred in enumerate(preds, start=1):
            valid = torch.ones_like(w)
            valid[:, :s - 1] = False  # no draft path of s steps ends there
            keep = valid[w]  # rows of t_sel this step counts
            if not bool(keep.any()):
                step_agree.append((0.0, 0))
                continue
            p_sel = pred.float()[w][keep]
            vloss = F.smooth_l1_loss(p_sel, t_sel[keep], reduction="none").mean(-1).mean() \
                if head.regresses_features else torch.zeros((), dtype=p_sel.dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfeat.device.type == "cpu"):
                p_logits = head.draft_logits(p_sel, self.lm_rows)
            p_logp = p_logits.float().log_softmax(-1)
            # soft cross-entropy minus the target's entropy (a constant): KL(target || draft), so
            # the reported loss reaches 0 for a perfect draft; the gradient is the cross-entropy's
            ploss = (-(t_prob[keep] * p_logp).sum(-1) - t_entropy[keep]).mean()
            # (a head without feature regression, EAGLE-3's, learns from the distribution alone)
            total = total + decay ** (s - 1) * (vloss + (self.p_weight if head.regresses_features else 1.0) * ploss)
            with torch.no_grad():
                p_top = p_logits.argmax(-1)
                agree = (p_top == t_top[keep]).float().sum().item()
                step_agree.append((agree, int(keep.sum())))
                if s == 1:
                    agree_full = float("nan")
                    if full_vocab:
                        full_top = (t_sel @ self.full_lm.T).argmax(-1)
                        agree_full = (self.d2t[p_top] == full_top).float().sum().item()
                    first = (vloss.item(), ploss.item(), agree, n, agree_full)
        return total, first + (step_agree,)
