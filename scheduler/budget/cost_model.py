"""The tree budget's cost model: seconds of a packed target forward by token count, and of a
drafting round by level and number of drafting sequences, learnt online from measured rounds.

The curves start from the engine's start-up profile (`engine.profile.profile_costs`) and every
observed round moves them at the points it used (`CostModel.observe`), so a noisy profile, the
per-round overhead the profile leaves out and a machine whose speed changes are learnt.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# A further draft level's learnt cost never falls below this share of the first level's: deep
# rounds move only the further levels' curve, and without a floor trees drafted 4-5 levels deep
# looked as cheap as one-level ones. Relative, so a profile taken in a slow spell can still learn
# its way down.
GROW_FLOOR = 0.25


@dataclass
class CostModel:
    """Piecewise-linear seconds (measured points; beyond the last, extrapolated linearly) of a
    target forward by token count, and of drafting by number of drafting sequences.

    Drafting: with `first_points` (a round drafted one level deep) the cost is per level:
    first(n) + grow(n) for every level past the first, grow = (draft - first) / (depth - 1)
    from the profile's full-depth `draft_points`. Without them a draft round costs draft(n)
    whatever its depth."""

    verify_points: list[tuple[int, float]]  # (tokens in the forward, seconds)
    draft_points: list[tuple[int, float]] = field(default_factory=list)  # (sequences, s) at `depth`; [] = free
    first_points: list[tuple[int, float]] = field(default_factory=list)  # (sequences, s) at depth 1
    depth: int = 1

    def __post_init__(self):
        if not self.verify_points:
            raise ValueError("the cost model needs at least one verify point")
        self.verify_points = _dedupe(self.verify_points)
        self.draft_points = _dedupe(self.draft_points)
        self.first_points = _dedupe(self.first_points) if self.depth > 1 and self.draft_points else []
        full = dict(self.draft_points)
        self.grow_points = [(n, max(full[n] - f, 0.0) / (self.depth - 1)) for n, f in self.first_points if n in full]
        if self.first_points and not self.grow_points:
            raise ValueError("first_points need draft_points at the same sequence counts")
        if not self.first_points:  # per-round cost: the full draft is level 1
            self.first_points, self.grow_points = self.draft_points, []
        # memo by count: the search asks for the same counts every round; `observe` drops what
        # it changed
        self._verify: dict[int, float] = {}
        self._first: dict[int, float] = {}
        self._grow: dict[int, float] = {}
        self.observed_rounds = 0

    @property
    def per_level(self) -> bool:
        return bool(self.grow_points)

    def verify(self, tokens: int) -> float:
        return _memo(self._verify, self.verify_points, tokens)

    def level(self, level: int, seqs: int) -> float:
        """Seconds of drafting level `level` (1 = first) for `seqs` sequences."""
        if seqs <= 0:
            return 0.0
        if level == 1:
            return _memo(self._first, self.first_points, seqs) if self.first_points else 0.0
        return _memo(self._grow, self.grow_points, seqs) if self.grow_points else 0.0

    def draft(self, seqs: int, depth: int | None = None) -> float:
        """A draft round of `seqs` sequences, `depth` levels each (None: the profiled depth)."""
        d = self.depth if depth is None else depth
        return self.level(1, seqs) + (max(d, 1) - 1) * self.level(2, seqs)

    def observe(self, tokens: int, levels: list[int] | int, seconds: float, rate: float = 0.1) -> None:
        """A measured round: `tokens` in the target forward, `levels[l - 1]` sequences drafting
        level l (an int n: n sequences at the profiled depth), its wall seconds.

        A plain round (nothing drafted) moves the verify curve by `rate` of its error at `tokens`
        and every larger forward's by as much (`_shift_from`). A drafting round moves only the
        drafting curves, so what a tree adds to a round (draft, tree attention, acceptance) is
        learnt where it is paid and never leaks into what plain rounds of as many tokens cost. A
        round drafted one level deep moves the first level's curve; a deeper one moves only the
        further levels' curve, split by their shares of the modelled draft time, which keeps the
        first level identifiable from one-level rounds alone. The update is normalised
        least-mean-squares on the piecewise-linear curves: the points around x move by their
        interpolation weights."""
        if tokens <= 0 or not seconds > 0:
            return
        if isinstance(levels, int):
            levels = [levels] * (self.depth if self.per_level else 1) if levels > 0 else []
        if not self.per_level:
            levels = levels[:1]
        levels = [n for n in levels if n > 0]
        v = self.verify(tokens)
        parts = Counter()  # (curve, sequences) -> modelled seconds
        for l, n in enumerate(levels, 1):
            parts[(min(l, 2), n)] += self.level(l, n)
        drafted = sum(parts.values())
        err = seconds - (v + drafted)
        if not levels or not self.first_points:
            _shift_from(self.verify_points, self._verify, tokens, rate * err)
        else:
            if len(levels) > 1 and self.grow_points:
                parts = Counter({key: t for key, t in parts.items() if key[0] == 2})
                drafted = sum(parts.values())
            for (curve, n), t in parts.items():
                points, cache = (self.first_points, self._first) if curve == 1 else (self.grow_points, self._grow)
                if points:
                    share = t / drafted if drafted > 0 else 1.0 / len(parts)
                    # the curve's value at n counts once per level drafted by n sequences
                    uses = sum(1 for l, m in enumerate(levels, 1) if m == n and min(l, 2) == curve)
                    # a further level moved below GROW_FLOOR of the first level's cost lands there
                    floor = (lambda x: max(1e-6, GROW_FLOOR * self.level(1, x))) if curve == 2 else None  # noqa: E731
                    _nudge(points, cache, n, rate * err * share / uses, floor)
        self.observed_rounds += 1

    def to_json(self) -> dict:
        return {"verify": self.verify_points, "draft_first": self.first_points, "draft_grow": self.grow_points,
                "depth": self.depth}


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


def _nudge(points: list[tuple[int, float]], cache: dict[int, float], x: int, delta: float,
           floor=None) -> None:
    """Move the curve's value at x by delta (the points that interpolate it, by weight), then
    drop the memoised values that depended on them; `floor(x0)`: a moved point's lowest value
    (None: 1e-6)."""
    floor = floor or (lambda x0: 1e-6)  # noqa: E731
    if len(points) == 1:
        x0, y0 = points[0]
        points[0] = (x0, max(floor(x0), y0 + delta * max(x0, 1) / max(x, 1)))
        cache.clear()
        return
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        moves = [(i, 1.0)]
    else:
        i = min(max(i, 1), len(points) - 1)
        w1 = (x - xs[i - 1]) / (xs[i] - xs[i - 1])  # beyond the ends: an extrapolation weight
        moves = [(i - 1, 1.0 - w1), (i, w1)]
    norm = sum(w * w for _, w in moves)
    for j, w in moves:
        points[j] = (xs[j], max(floor(xs[j]), points[j][1] + delta * w / norm))
    lo = min(j for j, _ in moves)
    hi = max(j for j, _ in moves)
    # a point's value shapes the segments on either side; the end segments extend outwards
    lo_x = xs[lo - 1] if lo > 0 else float("-inf")
    hi_x = xs[hi + 1] if hi + 1 < len(xs) else float("inf")
    if lo <= 1:
        lo_x = float("-inf")
    if hi >= len(xs) - 2:
        hi_x = float("inf")
    for k in [k for k in cache if lo_x < k < hi_x]:
        del cache[k]


def _shift_from(points: list[tuple[int, float]], cache: dict[int, float], x: int, delta: float,
                floor: float = 1e-6) -> None:
    """Move the verify curve at x by delta, and every larger forward's with it: what a plain
    round of x tokens measures over the profile is mostly per-round cost (the loop's plan and
    outputs, sampling, a slower spell of the machine) that a forward of more tokens pays too.

    The curve stays monotonic both ways: a moved point never falls below the one before it (a
    forward of more tokens never costs less), and a smaller forward's point above x's new value
    comes down to it (a forward of fewer tokens never costs more), so x's error always closes
    instead of flattening the points above x onto it. Bringing points down is safe because only
    decode rounds teach the curve (`TreeBudget.observe_round` keeps prefill rounds out)."""
    xs = [p[0] for p in points]
    lo = max(0, bisect.bisect_right(xs, x) - 1)
    if x > xs[-1]:  # extrapolated from the last two points: both move
        lo = max(0, len(points) - 2)
    for j in range(lo, len(points)):
        y = max(floor, points[j][1] + delta)
        points[j] = (xs[j], max(y, points[j - 1][1]) if j > lo else y)
    for j in range(lo - 1, -1, -1):  # smaller forwards above x's new value come down to it
        if points[j][1] <= points[j + 1][1]:
            break
        points[j] = (xs[j], points[j + 1][1])
    cache.clear()


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

