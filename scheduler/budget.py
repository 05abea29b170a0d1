"""Load-aware tree budget: how many tokens each decoding sequence verifies this round, and how
deep its draft goes.

Model of one round with B decoding sequences, sequence s verifying t_s tokens (root included)
drafted d_s levels deep, and P prefill tokens in the same forward:

    time(t)   = verify(P + sum_s t_s) + first(n_1) + sum_{l >= 2} grow(n_l)
    tokens(t) = sum_s (1 + c * sum_{i < t_s - 1} conf_s[i])

with n_l the number of sequences drafting at least l levels. `verify(T)` is one packed target
forward of T tokens; `first(n)` a drafting round's first level for n sequences (consuming the
pending pairs, the root's children) and `grow(n)` each further level (`CostModel`). They start
from a start-up profile of the real engine (`engine.profile.profile_costs`: drafts at depth 1
and at the configured depth) and are corrected online: every round's measured wall time (plan,
engine step, outputs) moves the curves at the points the round used (`CostModel.observe`), so a
noisy profile, the per-round overhead the profile leaves out and a machine whose speed changes
are learnt within a few hundred rounds. When the budget speculates, one round in
`explore_every` runs plain so the plain cost it compares against stays measured too (the other
way round is never explored: that would choose below plain's modelled throughput).

`conf_s` are the confidences the sequence's draft is expected to give: for each drafted node,
the estimated probability that the target accepts its whole path, best first, with the node's
depth; their sum over a tree is its expected accepted length if the draft is calibrated. A
best-first prefix of them is a tree (a child's confidence never exceeds its parent's), and its
deepest node is how deep this round must draft: a small tree of likely siblings drafts one
level, at a fraction of a full draft's cost. The scheduler uses one running prior per draft
depth, shared by all sequences (a sequence's own last round predicts its next round no better:
`bench/bench_budget_stats.py`), and the search runs over depth x tree size; callers with
per-sequence confidences get nodes added best-first across the batch instead. `c` is a running
calibration (accepted / predicted), learned from every verified round. Plain decoding is one of
the candidates, so the modelled throughput never drops below plain decoding, and a tree is
chosen only where it models `min_gain` over plain (`min_gain_one` at a single sequence).

The model can still be wrong (its cost curves are learnt from noisy rounds, the confidences are
an average), so a measured guard sits on top: per batch size, running averages of the tokens
per second that pure decode rounds actually gave, plain and speculating. Where the budget would
speculate but its speculating rounds measured slower than its plain rounds (by more than the
averages' noise: `guard_verdict`), it decodes plainly
(prefill rounds included) and probes speculation every `guard_probe` rounds; a batch size
without a verdict of its own takes the largest smaller one's, unprobed. Plain rounds are
explored more often until each batch size has `guard_min` of them. Rounds that carry a prefill
chunk decode plainly. `bench/bench_round_kinds.py` shows why, at 4 clients: speculating decode
rounds 194 tok/s against 281 plain, prefill rounds with trees 120 ms against 37 without
(`--spec-with-prefill`).
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# A further draft level's learnt cost is floored at this share of the first level's whenever a
# deep round moves it (the start-up profiles of budget_c1_s26.json and budget_c1_s26_growfloor.json
# put a further level at 1.17x / 1.03x the first at one sequence, 1.95x / 2.05x at 8). A deep
# round's error moves only the further levels' curve, which takes the first level's as right:
# with the first level's learnt cost inflated by slow one-level rounds (0.39 -> 4.6 ms at one
# sequence), deep rounds measured below the model pushed the further levels' cost to the old
# floor (1e-6), deep trees looked as cheap as one-level ones, and the budget drafted 8 tokens 4-5
# levels deep in 425 of 882 rounds, at 1.10x plain where the fixed 3-token tree ran 1.23x
# (bench/results/budget_c1_s26.json). Not a floor from the profile itself: a profile taken in a
# slow spell must be able to learn its way down.
GROW_FLOOR = 0.25
CATCHUP_MIN_PAIRS = 16  # catch-ups of fewer pairs do not time the per-pair cost (a forward's fixed cost dominates)


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
        # memo by count: `TreeBudget.choose` asks for every count along its additions, each
        # round (a few thousand lookups at 32 sequences); `observe` drops what it changed
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

    def draft_levels(self, levels: list[int]) -> float:
        """A draft round with levels[l - 1] sequences drafting level l."""
        return sum(self.level(l, n) for l, n in enumerate(levels, 1))

    def observe(self, tokens: int, levels: list[int] | int, seconds: float, rate: float = 0.1) -> None:
        """A measured round: `tokens` in the target forward, `levels[l - 1]` sequences drafting
        level l (an int n: n sequences at the profiled depth), its wall seconds. A plain round
        (nothing drafted) moves the verify curve by `rate` of its error at `tokens` and every
        larger forward's by as much (`_shift_from`); a drafting
        round moves only the drafting curves, so the cost a tree adds to a round (draft, tree
        attention, acceptance) is learnt where it is paid and never leaks into what plain rounds
        of as many tokens cost. A round drafted one level deep moves the first level's curve; a
        deeper one moves only the further levels' curve, split by their shares of the modelled
        draft time. Splitting a deep round's error over every level instead left the first
        level unidentifiable: once the budget drafted deep rounds only (its full-depth
        explorations), their excess fed the first level too, with no one-level round to pull it
        back, and at one sequence it climbed from the profile's 0.6-0.9 ms to 4.4 and 12.1 ms
        (`cost_model_on_end` of bench_serve's two sweeps at commit 26eee89), which priced every
        small tree out. Normalised
        least-mean-squares on the piecewise-linear curves: the measured points around a point
        move by their interpolation weights."""
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
    Moving only the points around x taught one sequence's plain rounds (x = 1) ~1-3 ms that its
    trees (3-8 tokens, whose verify cost only plain rounds of that many sequences correct) never
    paid in the model: trees looked up to that much cheaper than they were, the deeper ones
    most. Points from the last one at or below x move (so the value at x moves by exactly
    delta); smaller forwards keep theirs unless they would then cost more (below). A moved point never falls below the one before it:
    a forward of more tokens never costs less. Without that, cheap prefill rounds of ~150-250
    tokens pulled verify(192) to 65.8 ms under verify(128)'s 82.9 (`cost_model_on_end` of
    bench_serve's sweep at commit 4c93350), 32 sequences' trees of 4-6 tokens looked cheap,
    and the budget speculated at 32 clients, at 386 tok/s against 825 plain by its own guard.
    The order is kept from the other side too: where x's rounds measure below a smaller
    forward's point, that point comes down to the moved point's value (a forward of fewer tokens never costs
    more). Held up by it instead, x's error never closed, and every round at x pulled the
    points above x on down until they met it: over HTTP at 4 clients, a few slow plain rounds
    of 3 sequences (as requests finished and new ones came in) raised verify(3), the faster
    4-sequence rounds could not take verify(4) below it, and verify(4..20) flattened onto it;
    trees of 20 tokens then looked as cheap as a plain round and the model probes drafted 5
    tokens for each of 4 sequences (test_fast_rounds_lower_slower_smaller_forwards_instead_of_
    flattening_the_curve reproduces the collapse). Bringing points down is safe where the rounds that teach the
    curve are decode rounds only: prefill rounds, whose many cheap tokens would drag smaller
    forwards down with them, teach it nothing (`TreeBudget.observe_round`)."""
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


class TreeBudget:
    def __init__(self, costs: CostModel, max_tree_tokens: int, prior: tuple[float, ...] = (),
                 ema: float = 0.02, explore_every: int = 32, cost_rate: float = 0.1, max_depth: int | None = None,
                 research_every: int = 8, min_gain: float = 0.05, min_gain_one: float = 0.0,
                 guard_min: int = 8, guard_probe: int = 64,
                 guard_ema: float = 0.1, guard_z: float = 1.0, spec_with_prefill: bool = False, model_probe_every: int = 16,
                 model_probe_margin: float = 0.1, model_probe_max_seqs: int = 4, model_probe_far: int = 4,
                 guard_promote: bool = True):
        """max_tree_tokens: the configured tree (the most a round may verify); prior: node
        confidences (best first) assumed before any round is seen; explore_every: when
        speculating, run every this many rounds plain, and as many at the full depth (0: never);
        cost_rate: online cost correction step (0: keep the start-up profile); max_depth: the
        configured draft depth (None: the budget sizes trees only, every draft runs the
        engine's depth and costs a profiled draft round); research_every: rounds a shared-prior
        choice is reused for the same batch size and prefill (1: searched every round);
        min_gain: speculate only where the model gains at least this fraction over plain (its
        error on these machines is about that: a 0-5% modelled gain lost 5-9% at 4 clients);
        min_gain_one: the same for a single decoding sequence, where the measured guard (its
        margin scaled to one sequence's noise) and the model probes are there to catch a wrong
        choice: with bench_spec's 20 prompts in one run the budget at 5% drafted 632
        rounds for 1.02x / 1.12x (MT-bench / HumanEval), at 0 1325 rounds for 1.17x / 1.12x,
        where the fixed 3-token tree ran 1.16x / 1.14x (bench/results/eagle_min_gain.json); a
        repeat (eagle_budget_final.json) gave 1.00x / 1.10x at 5%, 1.05x / 1.05x at 0: no
        clear speed difference (the drafting rounds, 1325 vs 632, are what it changes);
        guard_min: measured pure-decode rounds of each kind (plain, speculating) a batch size
        needs before the measured guard overrides the model (0: no guard); guard_probe: while
        the guard holds speculation off, speculate every this many rounds to keep measuring it;
        guard_ema: the running averages' step; guard_z: how many standard errors of the
        difference speculation must measure below plain before the guard overrides the model
        (`guard_verdict`); spec_with_prefill: speculate in rounds that also
        carry a prefill chunk (off: such rounds decode plainly; at 4 clients they took 120 ms
        with trees against 37 ms without, for 1.4 more tokens: bench/bench_round_kinds.py);
        model_probe_every: where the model itself picks plain decoding at up to
        model_probe_max_seqs sequences, but its best tree models within model_probe_margin of
        plain, that tree still runs every this many rounds at the batch size (0: never). Without
        it a model that came to price speculation out never measured it again: its drafting
        costs and the guard's speculating rate are learnt from drafting rounds only, so a slow
        spell of the machine, or a first-level cost drifted up, left them stale for good (a
        bench_spec run at one sequence drafted in 9 of its first 10 prompts, then in none of the
        last 10, and ran at 1.08x where the fixed 3-token tree ran at 1.18x). Larger batches are not probed this way: a
        probe after a while of plain rounds pays every sequence's backlog of head pairs.
        model_probe_far: a tree modelled further below plain than the margin still runs every
        model_probe_every x this many rounds (0: never): a cost learnt in a slow spell can price
        trees out by more than any margin (bench/trace_budget.py on commit 6bce3d2: the first
        level's cost climbed from 0.64 ms to 4.63 ms in the first request and 5.57 ms by the
        sixth, the margin probes stopped, and the budget drafted in none of requests 6-21, 133
        of 2847 rounds in all); a probe moves the cost by a tenth of its error, so a stale one
        comes back within the margin (in the test, 20 ms against a true 1 ms: about a thousand
        rounds), at one speculating round in 64. guard_promote: the measured guard also turns
        speculation on where the model prices it out but its own rounds measure it faster
        (`guard_promotes`)."""
        self.costs = costs
        self.min_gain, self.min_gain_one = min_gain, min_gain_one
        self.research_every = research_every
        self.max_tree = max_tree_tokens
        self.max_depth = max_depth
        self.ema = ema
        self.explore_every = explore_every
        self.cost_rate = cost_rate
        self.rounds = 0
        self.explored = 0  # plain rounds run to keep plain's cost measured
        self.explored_depth = 0  # full-depth drafts run to keep the deeper levels' confidences measured
        self.calibration = 1.0  # accepted tokens / predicted accepted tokens (running)
        self._accepted = self._predicted = 1.0
        # expected confidences, best first, of a tree drafted d levels deep: prior[d - 1]. A
        # chain before any round (node i at depth i + 1), learnt from every drafted round:
        # a round drafted D_r deep says what every depth d <= D_r would have drafted (EAGLE-2's
        # frontier at a level does not depend on how deep the draft goes on)
        chain = tuple(prior) or tuple(0.6 ** (i + 1) for i in range(max_tree_tokens - 1))
        n = max_tree_tokens - 1
        self.prior = [(chain[:d] + (0.0,) * n)[:n] if max_depth else (chain + (0.0,) * n)[:n]
                      for d in range(1, (max_depth or 1) + 1)]
        # (sequences, of them drafting, prefill) -> (round, best, plain, best tree whatever its rate)
        self._search: dict[tuple[int, int, int], tuple] = {}
        self.last_choice: list[int] = []
        self.last_depths: list[int | None] = []
        self.last_modelled: tuple[float, float] = (0.0, 0.0)  # (chosen, plain) tokens per second
        if guard_min and guard_probe < 1:  # (the probes are what can lift a verdict of 'slower')
            raise ValueError(f"guard_probe must be >= 1 while the guard is on (guard_min {guard_min}), got {guard_probe}")
        self.guard_min, self.guard_probe, self.guard_ema = guard_min, guard_probe, guard_ema
        self.guard_z = guard_z
        self.spec_with_prefill = spec_with_prefill
        self.model_probe_every, self.model_probe_margin = model_probe_every, model_probe_margin
        self.model_probe_far = model_probe_far
        self.model_probe_max_seqs = model_probe_max_seqs
        self.model_probes = 0  # rounds that drafted where the model chose plain (model_probe_every)
        self.guard_promote = guard_promote
        self.promoted = 0  # rounds the guard turned to speculation where the model chose plain (`guard_promotes`)
        # batch size -> {"plain" | "spec": [tokens per second (running average), rounds,
        # running variance of one round's rate, the round of its last sample]}
        self.measured: dict[int, dict[str, list[float]]] = {}
        self.guarded = 0  # rounds the guard turned plain
        # head catch-up seconds per sequence of a chosen speculating round (running, from 0)
        self.catchup_per_seq = 0.0
        # seconds a catch-up forward takes per pending pair (running; None before the first)
        self.catchup_rate: float | None = None
        self.last_sync: list[bool] = []  # per decoding sequence of the last choice: keep its head in step
        self.retired = 0  # sequence-rounds left plain because their backlog would not pay back (not at their last token)
        self.spec_rounds = 0  # rounds that drafted (the choice, its probes and explorations)
        # this round's (sequences, prefill, kind, probe)
        self._pending: tuple[int, int, str, bool] | None = None
        self._guard_rounds: dict[int, int] = {}  # batch size -> rounds chosen at it

    def observe(self, confidence: tuple[float, ...], tree_tokens: int, accepted: int,
                depths: tuple[int, ...] = (), drafted_depth: int = 0) -> None:
        """A verified round: the confidences of the nodes it drafted (best first) and their
        depths, the tokens verified, the drafted tokens accepted, the levels drafted."""
        predicted = sum(confidence[:tree_tokens - 1])
        if predicted <= 0:
            return
        # a ratio of running sums, not a running ratio: one round's accepted / predicted is 0 or
        # several times the prediction, so its average swings and clipping it biases it
        self._accepted += self.ema * (accepted - self._accepted)
        self._predicted += self.ema * (predicted - self._predicted)
        self.calibration = min(max(self._accepted / self._predicted, 0.05), 5.0)
        n = self.max_tree - 1
        if not self.max_depth:
            levels = [tuple(confidence)]
        else:
            if len(depths) != len(confidence):
                return
            top = min(drafted_depth or max(depths), self.max_depth)
            levels = [tuple(p for p, x in zip(confidence, depths) if x <= d) for d in range(1, top + 1)]
        for d, conf in enumerate(levels):
            conf = (conf + (0.0,) * n)[:n]
            self.prior[d] = tuple(p + self.ema * (c - p) for p, c in zip(self.prior[d], conf))

    def observe_round(self, tokens: int, levels: list[int] | int, seconds: float,
                      committed: int | None = None, catchup: float = 0.0, prefill: bool | None = None,
                      catchup_pairs: int = 0) -> None:
        """A round's measured wall time (see `CostModel.observe`); `committed`: the tokens it
        emitted, for the measured guard (pure decode rounds only: a prefill chunk's cost and
        its sequence's first token say nothing about decoding); `catchup`: seconds of it the
        drafter spent consuming a backlog of pending pairs. The cost model leaves them out: a
        backlog is not what a round of its size costs. The guard charges a speculating round
        the budget chose its whole catch-up: the prompt pairs of sequences drafted for the first
        time, and what plain rounds in between (explorations, a verdict's plain stretch at a
        size the batch toggles around) left behind, are what speculating at this load costs.
        Left out, they hid a loss: in an in-thread HTTP run at 8 clients the guard measured
        speculating rounds at 542 tok/s against 504 plain at 8 sequences and kept drafting,
        while the catch-ups took 0.44 s of the 4.76 s run, which ran at 0.89x the engine
        without speculation (bench/results/serve_http_c8_uncharged.json). A probe (the guard's
        or the model's) follows a stretch of plain rounds by design, and its own backlog is that
        stretch's: while the guard held speculation off, probes that paid it measured 44 tok/s
        against 119 plain at one sequence and the verdict could never turn. So a probe is
        charged what chosen rounds pay per sequence (`catchup_per_seq`, a running average from
        0, so it errs low), at most its own. Catch-ups in plain rounds (a non-drafting
        sequence's backlog past SYNC_BACKLOG) and in full-depth explorations are charged to
        neither kind. Rounds that carry a prefill chunk (`prefill`; None: as the round's
        `choose` was told) teach the cost model nothing unless the budget speculates in them
        (`spec_with_prefill`): the curves price decode rounds, and a forward of one long chunk
        plus a few decode tokens costs far less than as many tokens spread over many sequences'
        trees (a 192-token profile point, 24 sequences x 8 tokens, read 148 ms; prefill rounds
        of about that size pulled it to 65.8 ms in bench_serve's sweep at commit 4c93350).
        `catchup_pairs`: the pending pairs those seconds consumed; their ratio is what a
        backlog costs per pair (`catchup_rate`, see `choose`)."""
        if catchup_pairs >= CATCHUP_MIN_PAIRS and catchup > 0:
            per_pair = catchup / catchup_pairs
            self.catchup_rate = per_pair if self.catchup_rate is None else \
                self.catchup_rate + self.guard_ema * (per_pair - self.catchup_rate)
        pending, self._pending = self._pending, None
        if prefill is None:  # the loop says; else what the round's choice was told
            prefill = pending is not None and pending[1] > 0
        if self.cost_rate > 0 and not (prefill and not self.spec_with_prefill):
            self.costs.observe(tokens, levels, seconds - catchup, self.cost_rate)
        if committed is None or pending is None or not seconds > 0:
            return
        n, prefill_tokens, kind, probe = pending
        if prefill_tokens or kind not in ("plain", "spec"):
            return
        entry = self.measured.setdefault(n, {}).setdefault(kind, [0.0, 0, 0.0, 0])
        charge = 0.0  # catch-up seconds counted against the round (see above)
        if kind == "spec":
            if not probe:
                charge = catchup
                self.catchup_per_seq += self.guard_ema * (catchup / n - self.catchup_per_seq)
            else:
                charge = min(catchup, self.catchup_per_seq * n)
        rate = committed / max(seconds - catchup + charge, 1e-9)
        entry[3] = self.rounds
        if not entry[1]:
            entry[0], entry[2] = rate, 0.0
        else:  # exponentially weighted mean and variance
            a = self.guard_ema
            diff = rate - entry[0]
            entry[0] += a * diff
            entry[2] = (1.0 - a) * (entry[2] + a * diff * diff)
        entry[1] += 1

    def guard_verdict(self, n: int, stale: bool = True) -> bool | None:
        """This batch size's own measurement: True where speculating rounds gave fewer tokens
        per second than plain ones by more than guard_z standard errors of the difference,
        False otherwise (the model's choice stands), None before guard_min of each.

        The margin is what makes the guard safe at small batches: one sequence's speculating
        round gives 1, 2 or 3 tokens, so its rate swings by half its mean from round to round,
        and the running average lags: while the guard holds speculation off it moves only at
        probes, so an average that one unlucky run left under plain's stayed there for hundreds
        of rounds. Simulated (tests/test_scheduler.py,
        test_guard_needs_a_significant_loss_to_override_the_model): a tree 18% faster than
        plain with such rounds was held off in ~half the rounds by the plain comparison. At
        larger batches a round's tokens are a sum over its sequences, the standard error
        shrinks, and the guard is as sharp as before; deterministic rates need no margin."""
        gap = self._measured_gap(n, stale)
        return None if gap is None else gap[0] > gap[1]

    def _measured_gap(self, n: int, stale: bool = True) -> tuple[float, float] | None:
        """(plain's running rate - speculation's, guard_z standard errors of that difference) at
        batch size n, None before guard_min rounds of each (or with the guard off)."""
        m = self.measured.get(n, {})
        plain, spec = m.get("plain"), m.get("spec")
        if not (self.guard_min and plain and spec and plain[1] >= self.guard_min and spec[1] >= self.guard_min):
            return None
        return plain[0] - spec[0], self.guard_z * (self._se2(plain, stale) + self._se2(spec, stale)) ** 0.5

    def guard_promotes(self, n: int) -> bool:
        """The guard's other direction: this batch size's own measurement has speculating rounds
        give more tokens per second than plain ones by more than guard_z standard errors of the
        difference (stale averages widen it, as for `guard_verdict`), so speculation runs where
        the model prices it out (`choose`: its best tree, as a model probe would run). The cost
        model learns a verify's cost at a token count from the rounds that verified that many,
        and at 4 sequences it had learnt trees of 8-12 tokens as 1.4-1.8x a 4-token round;
        the budget then drafted in 15-30% of the rounds at 4 clients (its model probes) while
        those rounds measured 456.6 tok/s against 418.1 plain, and the run read 0.97x the engine
        without speculation (bench/results/serve_s44_zen4_huge.json). Off with guard_promote=False."""
        gap = self._measured_gap(n) if self.guard_promote else None
        return gap is not None and -gap[0] > gap[1]

    def _se2(self, entry: list, stale: bool = True) -> float:
        """Squared standard error of a measured guard entry's running average: its variance
        times the sum of its samples' squared weights (which the entry's sample count gives:
        the first sample starts the average, each later one enters with weight a), plus the
        drift since its last sample. An exponential average with step a is what tracks a rate
        that drifts by a variance of a^2 / (1 - a) of one round's per round; an average not
        updated for k rounds (the speculating one while the guard holds speculation off, but
        for probes) is uncertain by k times that more, so a verdict that rested on an unlucky
        run lapses after a while and the model's choice is measured again; a clear one holds.
        stale=False leaves the drift out: a verdict a larger batch size inherits (`_guard`) holds as it was measured, unprobed, as before the margin
        (a lapse there would draft every sequence of the larger batch, backlogs included)."""
        a = self.guard_ema
        r = (1.0 - a) ** 2
        k = max(entry[1] - 1, 0)  # samples after the first
        weights = r ** k + (a * a * (1.0 - r ** k) / (1.0 - r) if r < 1.0 else 0.0)
        drift = max(self.rounds - entry[3], 0) * a * a / (1.0 - a) if stale and a < 1.0 else 0.0
        return entry[2] * (weights + drift)

    def _guard(self, n: int) -> tuple[bool, bool]:
        """(plain, inherited): speculation measured slower than plain decoding at this batch
        size; before it has a measurement of its own, the verdict of the largest smaller batch
        size that has one (speculation gains less as the batch grows: a batch size never
        learns from scratch what a smaller one has shown), inherited = True."""
        own = self.guard_verdict(n)
        if own is not None:
            return own, False
        for m in sorted((k for k in self.measured if k < n), reverse=True):
            verdict = self.guard_verdict(m, stale=False)
            if verdict is not None:
                return verdict, True
        return False, True

    def skip_round(self) -> None:
        """The round that the last choice was made for is not observed (a sequence failed in it):
        its choice must not be charged to a later round that makes none (a prefill's)."""
        self._pending = None

    def _probe_every(self, n: int) -> int:
        """Rounds between the guard's speculating probes at batch size n: guard_probe, or
        model_probe_every where the model probes too (small batches, where a probe's head
        backlog is cheap). A one-round rate of speculation swings with the tokens the round
        accepted (1-3 at one sequence), so its running average is noisy (by estimate ~10% at
        guard_ema 0.1) and a verdict of 'slower' can be wrong; each probe moves it by
        guard_ema, so one in 64 rounds turns a wrong verdict back four times slower than one in 16."""
        if self.model_probe_every and n <= self.model_probe_max_seqs:
            return min(self.guard_probe, self.model_probe_every)
        return self.guard_probe

    def guard_says_plain(self, n: int) -> bool:
        return self._guard(n)[0]

    def choose(self, confidences: list[tuple[float, ...]], caps: list[int], prefill_tokens: int = 0,
               depths: list[tuple[int, ...]] | None = None, backlogs: list[int] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """Tokens to verify for each decoding sequence (1 = no speculation); `last_depths` then
        holds how deep each drafts (None where it does not). caps[s]: most tokens the sequence
        may still emit this round (max_tokens / context), bounding its depth. confidences[s]
        (with depths[s], their nodes' depths): what the sequence's draft is expected to give,
        best first; () for the learnt prior. The scheduler passes () for all: the last round's
        confidences barely predict the next round's acceptance (correlation 0.04 for the
        shipped head: bench/bench_budget_stats.py), the running prior does better.

        backlogs[s]: the pairs the sequence's head has pending (what its next draft consumes
        first); remaining[s]: the most tokens it may still emit. A sequence left plain for a
        while (the batch was too large to speculate) has a backlog its next draft pays in one
        head forward, catchup_rate seconds a pair; drafting then saves at most
        1 / plain - 1 / best seconds (the modelled rates of this batch size) per token it still
        emits. Where the backlog costs more than that saving over the remaining tokens, the
        sequence is retired: it decodes plainly and its head is not kept in step
        (`last_sync[s]` False; the engine's sync skips it), and the tree is searched again
        for the others. At 8 clients the rounds after a plain stretch, as requests finished,
        drafted every sequence and paid each one's backlog (2.30 s off against 2.58 s on over
        2-7 sequences: bench/results/round_overhead_c8_s25.json)."""
        n = len(confidences)
        # the measured guard's promotion, judged once a round (the retirement prices it too)
        promotes = not prefill_tokens and not any(confidences) and self.guard_promotes(n)
        retired = [False] * n if any(confidences) else self._retire(caps, backlogs, remaining, prefill_tokens,
                                                                   promotes)
        if any(retired):
            caps = [1 if r else c for c, r in zip(caps, retired)]
        if prefill_tokens and not self.spec_with_prefill:
            sizes, deep, best_rate, plain = [1] * n, [0] * n, 0.0, 0.0
        elif any(confidences):
            sizes, deep, best_rate, plain = self._choose_each(confidences, caps, prefill_tokens, depths)
        else:
            sizes, deep, best_rate, plain = self._choose_shared(caps, prefill_tokens)
        self.last_sync = [not r for r in retired]
        self.rounds += 1
        self.last_modelled = (best_rate, plain)
        kind = model_kind = "spec" if any(x > 1 for x in sizes) else "plain"
        at_n = self._guard_rounds[n] = self._guard_rounds.get(n, 0) + 1
        probe = False
        if kind == "spec" and self.guard_min:
            plain_wins, inherited = self._guard(n)  # measured on pure decode rounds, applied to all at this size
            if plain_wins:
                if not self._guard_probe_due(n, at_n, inherited):
                    # measured: speculation loses here (or at a smaller batch size, which is not
                    # probed from here: a probe drafts every sequence, and after a while of plain
                    # rounds each one's backlog of head pairs, ~1 s at 32 sequences)
                    sizes, deep, kind = [1] * n, [0] * n, "plain"
                    self.guarded += 1
                else:
                    probe = True  # keep measuring what speculation gives here
            elif self.explore_every and not prefill_tokens and at_n % 4 == 0 \
                    and self.measured.get(n, {}).get("plain", (0.0, 0))[1] < self.guard_min:
                sizes, deep, kind = [1] * n, [0] * n, "plain"  # plain's rate at this size, early
                self.explored += 1
        if model_kind == "plain" and promotes:
            alt_sizes, alt_deep, _, _ = self._choose_shared(caps, prefill_tokens, probe=True)
            if any(x > 1 for x in alt_sizes):  # measured: speculation wins here, whatever the model says
                sizes, deep, kind = alt_sizes, alt_deep, "spec"
                self.promoted += 1
        if kind == "plain" and model_kind == "plain" and not any(confidences) \
                and self._model_probe_due(n, at_n, prefill_tokens):
            # the model prices speculation out here: try its best tree now and then, if it is close
            alt_sizes, alt_deep, alt_rate, alt_plain = self._choose_shared(caps, prefill_tokens, probe=True)
            close = alt_rate >= alt_plain * (1 - self.model_probe_margin)
            far = self.model_probe_far and at_n % (self.model_probe_every * self.model_probe_far) == 0
            if any(x > 1 for x in alt_sizes) and (close or far):
                sizes, deep, kind, probe = alt_sizes, alt_deep, "spec", True
                self.model_probes += 1
        if self.explore_every and kind == "spec" and not probe:
            if self.rounds % self.explore_every == 0:
                # measure plain now and then: its modelled cost is what speculation must beat
                sizes, deep, kind = [1] * n, [0] * n, "plain"
                self.explored += 1
            elif self.max_depth and self.rounds % self.explore_every == self.explore_every // 2 \
                    and any(0 < d < self.max_depth for d in deep):
                # and the full depth: the deeper levels' confidences are learnt from such rounds
                deep = [min(self.max_depth, caps[s] - 1) if d else 0 for s, d in enumerate(deep)]
                self.explored_depth += 1
                kind = "explore"  # not the budget's choice: kept out of the measured guard
        self._pending = (n, prefill_tokens, kind, probe)
        if kind != "plain":
            self.spec_rounds += 1
        self.last_choice = sizes
        self.last_depths = [d if d and self.max_depth else None for d in deep]
        return sizes

    def set_costs(self, costs: CostModel) -> None:
        """Replace the cost model (a profile taken again); the memoised searches priced with the
        old one go with it."""
        self.costs = costs
        self._search.clear()

    def _retire(self, caps: list[int], backlogs: list[int] | None, remaining: list[int] | None,
                prefill: int = 0, promotes: bool = False) -> list[bool]:
        """Sequences whose backlog of head pairs costs more to consume than drafting could
        save them over their remaining tokens (see `choose`); none before a catch-up was timed.
        Judged in every round, prefill rounds too (they decode plainly, but the drafter's sync
        would still consume a kept sequence's backlog), at the saving of decode rounds of this
        batch size. Where the measured guard holds speculation off, drafting saves nothing, so
        every sequence with a backlog is retired (the model alone kept sequences in step at 8
        clients, with syncs of over a thousand pairs), except in a round where a probe is due
        (the guard's or the model's): a probe pays its sequences' backlogs by design, or a
        verdict could never be measured again. A sequence at its last token is always retired
        (nothing left to save); `retired` counts the others."""
        n = len(caps)
        if backlogs is None or remaining is None or self.catchup_rate is None:
            return [False] * n
        last = [b > 0 and c <= 1 for c, b in zip(caps, backlogs)]
        at_n = self._guard_rounds.get(n, 0) + 1  # this round's count at n (choose adds it)
        plain_wins, inherited = self._guard(n)
        if (plain_wins and self._guard_probe_due(n, at_n, inherited)) or self._model_probe_due(n, at_n, prefill):
            return last
        m = sum(1 for c in caps if c > 1)
        _, plain, spec_best = self._searched(n, m, 0)
        saving = 1.0 / plain - 1.0 / spec_best[0] if spec_best[0] > plain > 0 and not plain_wins else 0.0
        if not saving and promotes:  # the measured rates, as `choose` then drafts (`guard_promotes`)
            meas = self.measured[n]
            saving = 1.0 / meas["plain"][0] - 1.0 / meas["spec"][0]
        out = [x or (b > 0 and self.catchup_rate * b > saving * r) for x, b, r in zip(last, backlogs, remaining)]
        self.retired += sum(o and not x for o, x in zip(out, last))
        return out

    def _guard_probe_due(self, n: int, at_n: int, inherited: bool) -> bool:
        """Where the guard holds speculation off at n, whether its round `at_n` probes it (never
        on an inherited verdict: a probe drafts every sequence of the larger batch)."""
        return not inherited and at_n % self._probe_every(n) == 0

    def _model_probe_due(self, n: int, at_n: int, prefill: int) -> bool:
        """Whether round `at_n` at n may try the model's best tree where it chose plain."""
        return bool(self.model_probe_every and not prefill and n <= self.model_probe_max_seqs
                    and at_n % self.model_probe_every == 0)

    def _min_gain(self, n: int) -> float:
        """The modelled gain a tree must show over plain decoding at n decoding sequences."""
        return self.min_gain_one if n == 1 else self.min_gain

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

        top = self.max_tree - 1
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
        node more for some), drafted to one common depth. Searched over depth x tree size,
        then over the sequences that take one node more around the best size; the search is
        redone every `research_every` rounds per (batch size, sequences that may draft, prefill
        tokens), the prior and
        costs moving slowly (at 8 sequences it was ~2% of a round done every round). probe: the
        best tree even where it models below plain (see model_probe_every)."""
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
                if dd < d and self.max_depth:  # a capped sequence: no more nodes than that depth drafts
                    grow = min(grow, sum(1 for p in self.prior[dd - 1] if p > 0))
                sizes[s] = 1 + grow
                deep[s] = dd
        return sizes, deep, rate_, plain

    def _searched(self, n: int, m: int, prefill: int):
        """_search_shared(n, prefill, m), reused for research_every rounds."""
        key = (n, m, prefill)
        hit = self._search.get(key)
        if hit is not None and self.rounds - hit[0] < self.research_every:
            return hit[1], hit[2], hit[3]
        best, plain, spec_best = self._search_shared(n, prefill, m)
        if len(self._search) > 256:
            self._search.clear()
        self._search[key] = (self.rounds, best, plain, spec_best)
        return best, plain, spec_best

    def _nodes(self, conf: tuple[float, ...], depths: tuple[int, ...]) -> list[tuple[float, int]]:
        """A sequence's candidate nodes (confidence, depth), best first."""
        if not self.max_depth:
            return [(p, 1) for p in conf]
        if len(depths) != len(conf):
            depths = tuple(min(i + 1, self.max_depth) for i in range(len(conf)))
        nodes = list(zip(conf, depths))
        deepest = max(depths, default=0)
        if 0 < deepest < self.max_depth:
            # the last draft stopped short: extend its best chain at its last level's rate
            best = {}
            for p, d in nodes:
                best[d] = max(p, best.get(d, 0.0))
            last = best[deepest]
            rate = last / best[deepest - 1] if deepest > 1 and best.get(deepest - 1) else last
            rate = min(rate, 0.95)
            for d in range(deepest + 1, self.max_depth + 1):
                last *= rate
                nodes.append((last, d))
            nodes.sort(key=lambda x: -x[0])
        return nodes

    def _choose_each(self, confidences, caps, prefill, depths):
        """Per-sequence confidences: nodes are added best-first across the whole batch and the
        prefix of additions with the highest modelled tokens per second is kept."""
        n = len(confidences)
        c = self.calibration
        gains = []  # (gain, seq, depth)
        for s, conf in enumerate(confidences):
            dep = depths[s] if depths is not None else ()
            if not conf:
                conf = self.prior[-1]
                dep = ()
            limit = self.max_tree - 1 if caps[s] > 1 else 0
            k = 0
            for p, d in self._nodes(conf, dep):
                if k >= limit:
                    break
                if self.max_depth and d > min(self.max_depth, caps[s] - 1):
                    continue  # deeper than it may draft or emit (its descendants are deeper still)
                gains.append((c * p, s, d))
                k += 1
        gains.sort(key=lambda g: -g[0])
        sizes, deep = [1] * n, [0] * n
        levels = [0] * ((self.max_depth or 1) + 1)  # levels[l]: sequences drafting level l
        level_cost = self.costs.level
        plain = n / max(self.costs.verify(prefill + n), 1e-12)
        best_rate, best_k = plain * (1 + self._min_gain(n)), 0
        tokens, emitted, drafting = prefill + n, float(n), 0.0
        for k, (g, s, d) in enumerate(gains, 1):
            sizes[s] += 1
            tokens += 1
            emitted += g
            while deep[s] < d:  # this sequence now drafts one level deeper
                deep[s] += 1
                lv = deep[s]
                drafting += level_cost(lv, levels[lv] + 1) - level_cost(lv, levels[lv])
                levels[lv] += 1
            rate = emitted / max(self.costs.verify(tokens) + drafting, 1e-12)
            if rate > best_rate:
                best_rate, best_k = rate, k
        sizes, deep = [1] * n, [0] * n
        for g, s, d in gains[:best_k]:
            sizes[s] += 1
            deep[s] = max(deep[s], d)
        return sizes, deep, best_rate if best_k else plain, plain
