"""Load-aware tree budget: how many tokens each decoding sequence verifies this round.

Model of one round with B decoding sequences, sequence s verifying t_s tokens (root included)
and P prefill tokens in the same forward:

    time(t)   = verify(P + sum_s t_s) + draft(number of sequences with t_s > 1)
    tokens(t) = sum_s (1 + c * sum_{i < t_s - 1} conf_s[i])

`verify(T)` (one packed target forward of T tokens) and `draft(n)` (one drafting round for n
sequences at the configured depth) come from a start-up profile of the real engine
(`CostModel`, measured by `ModelRunner.profile_costs`). `conf_s` are the draft's confidences
from the sequence's last round: for each drafted node, the estimated probability that the
target accepts its whole path, best first; their sum over a tree is its expected accepted
length if the draft is calibrated. `c` is a running calibration (accepted / predicted), learned
from every verified round. The policy adds nodes best-first across the whole batch and keeps
the prefix of additions with the highest tokens per second; t = 1 for all (plain decoding) is
one of the candidates, so the modelled throughput never drops below plain decoding.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Piecewise-linear seconds of a target forward by token count, and of a draft round by
    number of drafting sequences (measured points; beyond the last, extrapolated linearly)."""

    verify_points: list[tuple[int, float]]  # (tokens in the forward, seconds)
    draft_points: list[tuple[int, float]] = field(default_factory=list)  # (sequences, seconds); [] = free

    def __post_init__(self):
        if not self.verify_points:
            raise ValueError("the cost model needs at least one verify point")
        self.verify_points = _dedupe(self.verify_points)
        self.draft_points = _dedupe(self.draft_points)
        # memo by count: `TreeBudget.choose` asks for every count along its additions, each
        # round (a few thousand lookups at 32 sequences)
        self._verify: dict[int, float] = {}
        self._draft: dict[int, float] = {}

    def verify(self, tokens: int) -> float:
        return _memo(self._verify, self.verify_points, tokens)

    def draft(self, seqs: int) -> float:
        if seqs <= 0 or not self.draft_points:
            return 0.0
        return _memo(self._draft, self.draft_points, seqs)

    def to_json(self) -> dict:
        return {"verify": self.verify_points, "draft": self.draft_points}


def _dedupe(points) -> list[tuple[int, float]]:
    """Sorted by x; a repeated x keeps its largest (most pessimistic) time."""
    best: dict[int, float] = {}
    for x, y in points:
        best[int(x)] = max(float(y), best.get(int(x), float(y)))
    return sorted(best.items())


def _memo(cache: dict[int, float], points: list[tuple[int, float]], x: int) -> float:
    t = cache.get(x)
    if t is None:
        t = cache[x] = _interp(points, x)
    return t


def _interp(points: list[tuple[int, float]], x: float) -> float:
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1] * max(x, 1) / max(points[0][0], 1)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class TreeBudget:
    def __init__(self, costs: CostModel, max_tree_tokens: int, prior: tuple[float, ...] = (),
                 ema: float = 0.05):
        """max_tree_tokens: the configured tree (the most a round may verify); prior: node
        confidences assumed for a sequence with no round yet."""
        self.costs = costs
        self.max_tree = max_tree_tokens
        self.ema = ema
        self.calibration = 1.0  # accepted tokens / predicted accepted tokens (running)
        self.prior = tuple(prior) or tuple(0.6 ** (i + 1) for i in range(max_tree_tokens - 1))
        self.last_choice: list[int] = []
        self.last_modelled: tuple[float, float] = (0.0, 0.0)  # (chosen, plain) tokens per second

    def observe(self, confidence: tuple[float, ...], tree_tokens: int, accepted: int) -> None:
        """A verified round: its node confidences, tokens verified and drafted tokens accepted."""
        predicted = sum(confidence[:tree_tokens - 1])
        if predicted <= 0:
            return
        ratio = min(max(accepted / predicted, 0.05), 5.0)
        self.calibration += self.ema * (ratio - self.calibration)
        if confidence:
            n = len(self.prior)
            padded = tuple(confidence[:n]) + (0.0,) * (n - min(n, len(confidence)))
            self.prior = tuple(p + self.ema * (c - p) for p, c in zip(self.prior, padded))

    def choose(self, confidences: list[tuple[float, ...]], caps: list[int], prefill_tokens: int = 0) -> list[int]:
        """Tokens to verify for each decoding sequence (1 = no speculation). caps[s]: most tokens
        the sequence may still emit this round (max_tokens / context), bounding its depth."""
        n = len(confidences)
        c = self.calibration
        gains = []  # (gain, seq)
        for s, conf in enumerate(confidences):
            conf = conf or self.prior
            limit = self.max_tree - 1 if caps[s] > 1 else 0
            for p in conf[:limit]:
                gains.append((c * p, s))
        gains.sort(key=lambda g: -g[0])
        sizes = [1] * n
        plain = n / max(self.costs.verify(prefill_tokens + n), 1e-12)
        best_rate, best_k = plain, 0
        tokens, emitted, drafting = prefill_tokens + n, float(n), 0
        for k, (g, s) in enumerate(gains, 1):
            if sizes[s] == 1:
                drafting += 1
            sizes[s] += 1
            tokens += 1
            emitted += g
            rate = emitted / max(self.costs.verify(tokens) + self.costs.draft(drafting), 1e-12)
            if rate > best_rate:
                best_rate, best_k = rate, k
        sizes = [1] * n
        for g, s in gains[:best_k]:
            sizes[s] += 1
        self.last_choice = sizes
        self.last_modelled = (best_rate, plain)
        return sizes
