"""Token selection: logit processing, then greedy or Gumbel-max sampling with keyed noise.

Sampling draws argmax(logits / T + G) with Gumbel noise G that depends only on
(request seed, output position): the same seeded request picks the same tokens whatever its
batch neighbours are (and, with speculation, whatever tree was drafted). Gumbel-max over the
processed logits samples exactly from softmax(processed logits / T).

Processing order (as vLLM): logit_bias, presence/frequency penalties over the output tokens,
min_tokens (EOS and stop ids masked), then for sampling: temperature, top-k, top-p.
Reported logprobs are the model's raw log-softmax (before any processing).
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import numpy as np
import torch

from eagle_serve.engine import kernels
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.step_io import TokenLogprobs

MASK64 = (1 << 64) - 1
TOP_P_FIRST_K = 256  # candidates top-p looks at first (a nucleus past them widens the search)


@dataclass(frozen=True)
class GrammarMasks:
    """Allowed-token bitmasks (32 tokens an int32 word, xgrammar's layout) for some rows of a
    round's logits: bitmask[r] is row r's, for each r in `rows`; other rows are unmasked."""

    bitmask: torch.Tensor  # [N, ceil(V / 32)] int32, on the CPU
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """In place, before temperature and truncation (as vLLM orders them). On the CPU the bits
        are unpacked and applied by numpy, single-threaded (no contention with torch's threads);
        tests/test_structured.py holds both ways equal to xgrammar's own kernel."""
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            bits = np.unpackbits(self.bitmask[self.rows].numpy().view(np.uint8), axis=-1,
                                 bitorder="little")[:, :logits.shape[1]]
            arr = logits.numpy()
            for j, r in enumerate(self.rows):
                np.putmask(arr[r], bits[j] == 0, -np.inf)
            return
        rows = torch.tensor(self.rows, device=logits.device)
        words = self.bitmask[self.rows].to(logits.device)
        bits = (words.unsqueeze(-1) >> torch.arange(32, device=logits.device, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(self.rows), -1)[:, :logits.shape[1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    seed: int
    output_position: int  # index of the token being drawn among the request's outputs
    history: list[int]  # output tokens before it (penalties, min_tokens)


def noise_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): independent streams for every output position."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(noise_seed(seed, position))
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))  # [V] float64, standard Gumbel


def process_logits(logits: torch.Tensor, rows: list[SampleRow], stop_ids: frozenset[int]) -> torch.Tensor:
    """In place: bias, penalties and min_tokens masking. logits: [N, V]."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                       device=logits.device))
        if p.needs_penalties and row.history:
            counts = torch.bincount(torch.tensor(row.history, device=logits.device), minlength=vocab)[:vocab]
            logits[i] -= counts.to(logits.dtype) * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty
        if len(row.history) < p.min_tokens:
            banned = [t for t in (stop_ids | set(p.stop_token_ids)) if t < vocab]
            logits[i, banned] = float("-inf")
    return logits


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row [V] already divided by temperature: -inf outside top-k and the top-p nucleus."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # keep a token if the mass strictly before it (in descending order) is below top_p; the
        # top token always stays. The nucleus is found among the top k, k growing until it holds
        # a dropped token (then everything past k is dropped too), not a sort of the whole
        # vocabulary
        probs, n, k = logits.softmax(-1), logits.shape[0], TOP_P_FIRST_K
        while True:
            if k * 16 > n:  # a wide nucleus: one full sort (a top-k of most of the vocabulary is slower)
                k = n
                top, order = torch.sort(probs, descending=True)
            else:
                top, order = torch.topk(probs, k)  # descending
            drop = (top.cumsum(-1) - top) >= top_p
            if k == n or bool(drop[-1]):
                break
            k *= 8
        keep = order[~drop]
        logits = torch.full_like(logits, float("-inf")).index_copy_(0, keep, logits[keep])
    return logits


def choose(logits: torch.Tensor, rows: list[SampleRow], skip: Container[int] = frozenset()) -> torch.Tensor:
    """Processed logits [N, V] -> chosen token ids [N] (still on the device). Sampled rows in
    `skip` are left undrawn (their argmax).

    max(-1).indices is argmax with the same first-index rule on ties (and NaN / all -inf rows),
    and faster on the CPU."""
    chosen = greedy_picks(logits)
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy or i in skip:
            continue
        chosen[i] = draw(logits[i], p, gumbel_noise(row.seed, row.output_position, logits.shape[1]))
    return chosen


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> max(-1).indices [N]; float32 on the CPU through the native kernel's
    argmax_rows (the same indices: first among equal maxima, a row's first NaN), several times
    faster than max(-1).indices."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0:
        fn = getattr(kernels.native(), "argmax_rows", None)
        if fn is not None:
            return fn(logits.contiguous())
    return logits.max(-1).indices


def draw(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over one processed row [V] after temperature and truncation (a 0-d tensor)."""
    scaled = truncate(logits.double() / params.temperature, params.top_k, params.top_p)
    return (scaled + noise.to(scaled.device)).max(-1).indices


class Picks:
    """The target's pick at each row. The processing (bias, penalties, min_tokens) of every row,
    the greedy picks and the draws of sampled rows outside `lazy` are made at once, in the
    round's one host sync; a sampled row in `lazy` (a tree's node) is drawn (truncation, then
    noise over the whole vocabulary) only when it is read. Tree acceptance reads a
    node only when the walk reaches it, at most depth + 1 of a tree's nodes, so a sampled request
    with a 60-node tree no longer pays 60 draws a round (each lazy read is a small host sync of
    its own). Logprobs likewise, for the rows read."""

    def __init__(self, logits: torch.Tensor, rows: list[SampleRow], stop_ids: frozenset[int],
                 lazy: Container[int] = frozenset(), masks: GrammarMasks | None = None):
        self.raw, self.rows = logits, rows  # raw: the model's logits (logprobs are reported from them)
        if any(r.params.logit_bias or r.params.needs_penalties or r.params.min_tokens for r in rows):
            logits = process_logits(logits.clone(), rows, stop_ids)
        if masks is not None:  # structured output: what the grammar refuses at each row is -inf
            logits = logits.clone() if logits is self.raw else logits
            masks.apply(logits)
        self.logits = logits
        self._tokens = choose(logits, rows, lazy).tolist()  # the round's one host sync
        self._drawn = [r.params.greedy or i not in lazy for i, r in enumerate(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> int:
        """The token picked at row i."""
        if not self._drawn[i]:
            row = self.rows[i]
            noise = gumbel_noise(row.seed, row.output_position, self.logits.shape[1])
            self._tokens[i] = int(draw(self.logits[i], row.params, noise))
            self._drawn[i] = True
        return self._tokens[i]

    def logprobs(self, i: int) -> TokenLogprobs | None:
        """Row i's raw logprobs with its requested top alternatives (None if it asked for none)."""
        top_n = self.rows[i].params.logprobs
        return None if top_n is None else _logprobs(self.raw[i].log_softmax(-1), self[i], top_n)

    def view(self, start: int) -> "PicksView":
        return PicksView(self, start)


class PicksView:
    """One tree's rows of a round's Picks: view[n] is the pick at node n."""

    def __init__(self, picks: Picks, start: int):
        self.picks, self.start = picks, start

    def __getitem__(self, node: int) -> int:
        return self.picks[self.start + node]

    def logprobs(self, node: int) -> TokenLogprobs | None:
        return self.picks.logprobs(self.start + node)


def sample(logits: torch.Tensor, rows: list[SampleRow], stop_ids: frozenset[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row; also the raw logprobs for rows that asked for them."""
    picks = Picks(logits, rows, stop_ids)
    return [picks[i] for i in range(len(rows))], [picks.logprobs(i) for i in range(len(rows))]


def _logprobs(row: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    top = torch.topk(row, top_n) if top_n else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(logprob=float(row[token]), top=pairs)
