"""What the scheduler and the loop need from a tree budget: one plan per round, then what the
round measured."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPlan:
    """One round's trees, one entry per decoding sequence in the order the budget was asked."""

    sizes: tuple[int, ...]  # tokens to verify, root included (1 = no speculation)
    depths: tuple[int | None, ...]  # levels to draft (None: the engine's configured depth)
    sync: tuple[bool, ...]  # keep the sequence's draft head in step (False: its backlog waits)

    def __post_init__(self):
        if not len(self.sizes) == len(self.depths) == len(self.sync):
            raise ValueError("a round plan needs one size, depth and sync per sequence")


class BudgetPolicy(ABC):
    """Sizes each round's draft trees from what earlier rounds measured.

    Contract, per round: the scheduler calls `choose` once for the round's decoding sequences;
    after the engine step it calls `observe` for each sequence that verified a drafted tree;
    then the loop calls exactly one of `observe_round` (the round ran: its wall time) or
    `skip_round` (a sequence failed in it: its plan is dropped, charged to no later round).
    Implementations are torch-free and run on the engine thread."""

    @abstractmethod
    def choose(self, caps: list[int], prefill_tokens: int = 0, backlogs: list[int] | None = None,
               remaining: list[int] | None = None) -> RoundPlan:
        """The round's plan. caps[s]: most tokens sequence s may emit this round (bounds its
        depth); prefill_tokens: prompt tokens in the same forward; backlogs[s]: pairs its draft
        head has pending; remaining[s]: most tokens it may still emit."""

    @abstractmethod
    def observe(self, confidence: tuple[float, ...], tree_tokens: int, accepted: int,
                depths: tuple[int, ...] = (), drafted_depth: int = 0) -> None:
        """A verified tree: its nodes' confidences (best first) and depths, the tokens verified,
        the drafted tokens accepted, the levels drafted."""

    @abstractmethod
    def observe_round(self, tokens: int, levels: list[int] | int, seconds: float,
                      committed: int | None = None, catchup: float = 0.0, prefill: bool | None = None,
                      catchup_pairs: int = 0) -> None:
        """The chosen round ran: `tokens` in its target forward, `levels[l - 1]` sequences
        drafting level l, its wall seconds, the tokens it committed, the seconds (and pairs) of
        draft-head backlog it consumed, whether it carried a prefill chunk."""

    @abstractmethod
    def skip_round(self) -> None:
        """The chosen round is not observed (a sequence failed in it)."""
