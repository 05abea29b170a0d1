"""Drafters propose one `DraftTree` per decoding sequence per round.

Contract: `propose(steps, max_depths)` returns a tree per step whose depth never exceeds the
step's `max_depths` entry; `observe(step, tokens, features)` hands over what the target
produced (emitted tokens, with the target features of the positions before them, for heads
that need them); `release(seq_id)` drops a finished sequence's state.
"""
from __future__ import annotations

import abc

import torch

from eagle_serve.engine.speculative.tree import DraftTree, chain, root_only
from eagle_serve.engine.step_io import SeqStep


class Drafter(abc.ABC):
    needs_features = False
    # Head forwards spent consuming backlogs of observed pairs, and the pairs they consumed
    # (cumulative; the loop leaves these seconds out of the round time the budget learns from).
    catchup_seconds: float = 0.0
    catchup_pairs: int = 0
    # Set by the engine for a round with structured sequences: allowed(seq_id, tokens, parents)
    # says which of a sequence's candidates its grammar allows (parents: -1 the root; None: the
    # sequence has no grammar). A drafter that ranks candidates (`filters_candidates`) keeps only
    # allowed ones; the engine prunes the trees of the others.
    allowed = None
    filters_candidates = False

    @abc.abstractmethod
    def propose(self, steps: list[SeqStep], max_depths: list[int]) -> list[DraftTree]:
        ...

    def observe(self, step: SeqStep, tokens: list[int], features: torch.Tensor | None, reset: bool) -> None:
        """`tokens[i]` follows the position whose target feature is `features[i]`."""

    def observe_many(self, items: list[tuple[SeqStep, list[int], bool]], features: torch.Tensor | None) -> None:
        """observe() for several sequences' (step, tokens, reset), `features` their rows in order."""
        row = 0
        for step, tokens, reset in items:
            self.observe(step, tokens, None if features is None else features[row:row + len(tokens)], reset)
            row += len(tokens)

    def release(self, seq_id: int) -> None:
        pass

    def backlog(self, seq_id: int) -> int:
        """Pairs observed for the sequence and still unconsumed (what its next draft pays first)."""
        return 0

    def sync(self, steps: list[SeqStep]) -> None:
        """Bring state up to date for decoding sequences that draft nothing this round (called
        every round with any such sequence; `steps` holds those the budget keeps in step)."""

    def confidence(self, seq_id: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The last proposed tree's node confidences (estimated P(path accepted)), best first,
        and each node's depth; ((), ()) when the drafter has no such estimate."""
        return (), ()


class NoDrafter(Drafter):
    """Speculates nothing: every round is a root-only tree, i.e. plain decoding."""

    def propose(self, steps, max_depths):
        return [root_only(s.token_ids[-1]) for s in steps]


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens
    (n from n_max down to n_min) and propose the tokens that followed it, as one chain."""

    def __init__(self, n_max: int, n_min: int, depth: int):
        self.n_max, self.n_min, self.depth = n_max, n_min, depth

    def propose(self, steps, max_depths):
        return [chain(s.token_ids[-1], self.lookup(s.history, min(self.depth, d)))
                for s, d in zip(steps, max_depths)]

    def lookup(self, history: list[int], depth: int) -> list[int]:
        if depth <= 0:
            return []
        for n in range(min(self.n_max, len(history) - 1), self.n_min - 1, -1):
            suffix = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # latest match first
                if history[start:start + n] == suffix:
                    return history[start + n:start + n + depth]
        return []
