"""The tree search: for a batch of decoding sequences that all expect the budget's running
prior, the depth and tree size with the highest modelled tokens per second, plain decoding
included as a candidate.

A round with B decoding sequences, each verifying t tokens (root included) drafted d levels
deep, and P prefill tokens in the same forward is modelled as

    time  = verify(P + sum t) + draft(sequences drafting, d)
    tokens = B + c * sum over sequences of prior[d - 1][:t - 1]

with `c` the running calibration (accepted / predicted). A best-first prefix of a depth's prior
is a tree (a child's confidence never exceeds its parent's).
"""
from __future__ import annotations

from eagle_serve.scheduler.budget.config import BudgetConfig
from eagle_serve.scheduler.budget.cost_model import CostModel


class TreeSearch:
    """Mixed into `TreeBudget`: reads its `config`, `costs`, `prior`, `calibration`, `rounds`."""

    config: BudgetConfig
    costs: CostModel
    prior: list[tuple[float, ...]]
    calibration: float
    rounds: int
    _search: dict[tuple[int, int, int], tuple]

    def _min_gain(self, n: int) -> float:
        """The modelled gain a tree must show over plain decoding at n decoding sequences."""
        return self.config.min_gain_one if n == 1 else self.config.min_gain

    def _search_shared(self, n: int, prefill: int, m: int | None = None):
        """The best shared tree for n decoding sequences of which m (None: all) may draft."""
        m = n if m is None else m
        c = self.calibration
        verify = self.costs.verify
        plain = n / max(verify(prefill + n), 1e-12)
        spec_best = (0.0, 0, 0)  # (rate, depth, additions): the best tree whatever its rate (a model probe's)
        sums, drafted = [], []
        for conf in self.prior:
            acc = [0.0]
            for p in conf:
                acc.append(acc[-1] + p)
            sums.append(acc)
            drafted.append(sum(1 for p in conf if p > 0))
        cost = {}  # (sequences drafting, depth) -> seconds

        def rate(d: int, k: int) -> float:
            base, extra = divmod(k, m)
            acc = sums[d - 1]
            emitted = n + c * (m * acc[base] + (extra * (acc[base + 1] - acc[base]) if extra else 0.0))
            seqs = m if base else extra
            dc = cost.get((seqs, d))
            if dc is None:
                dc = cost[(seqs, d)] = self.costs.draft(seqs, d)
            return emitted / max(verify(prefill + n + k) + dc, 1e-12)

        top = self.config.max_tree_tokens - 1
        if m <= 0:
            return (plain, 0, 0), plain, spec_best
        for d in range(1, len(self.prior) + 1):
            for t in range(1, min(top, drafted[d - 1]) + 1):  # past the drafted nodes, nothing gains
                r = rate(d, m * t)
                if r > spec_best[0]:
                    spec_best = (r, d, m * t)
        # speculation must beat plain by min_gain at a whole tree per sequence; only then is the
        # size refined (sequences taking one node more or less)
        pays = spec_best[0] > plain * (1 + self._min_gain(n))
        if spec_best[2]:
            d, t = spec_best[1], spec_best[2] // m
            for k in range(m * (t - 1) + 1, min(m * (t + 1), m * min(top, drafted[d - 1]))):
                r = rate(d, k)
                if r > spec_best[0]:
                    spec_best = (r, d, k)
        return (spec_best if pays else (plain, 0, 0)), plain, spec_best

    def _choose_shared(self, caps: list[int], prefill: int, probe: bool = False):
        """Every sequence expects the prior: the best round gives each the same tree (or one
        node more for some), drafted to one common depth; returns (sizes, depths, modelled rate,
        plain's rate). probe: the best tree even where it models below plain (a model probe)."""
        n = len(caps)
        able = [s for s in range(n) if caps[s] > 1]  # sequences that may draft
        best, plain, spec_best = self._searched(n, len(able), prefill)
        rate_, d, k = spec_best if probe else best
        sizes, deep = [1] * n, [0] * n
        if not k or not able:
            return sizes, deep, rate_, plain
        base, extra = divmod(k, len(able))
        for j, s in enumerate(able):
            grow = base + (1 if j < extra else 0)
            if grow:
                dd = min(d, caps[s] - 1)
                if dd < d and self.config.max_depth:  # a capped sequence: no more nodes than that depth drafts
                    grow = min(grow, sum(1 for p in self.prior[dd - 1] if p > 0))
                sizes[s] = 1 + grow
                deep[s] = dd
        return sizes, deep, rate_, plain

    def _searched(self, n: int, m: int, prefill: int):
        """_search_shared(n, prefill, m), reused for research_every rounds: the prior and the
        costs move slowly, and searching every round costs a visible share of a round at 8
        sequences."""
        key = (n, m, prefill)
        hit = self._search.get(key)
        if hit is not None and self.rounds - hit[0] < self.config.research_every:
            return hit[1], hit[2], hit[3]
        best, plain, spec_best = self._search_shared(n, prefill, m)
        if len(self._search) > 256:
            self._search.clear()
        self._search[key] = (self.rounds, best, plain, spec_best)
        return best, plain, spec_best
