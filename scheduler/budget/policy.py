"""The tree budget: how many tokens each decoding sequence verifies this round, how deep its
draft goes, and whether its draft head keeps in step.

`TreeBudget` searches the modelled tokens per second of every tree (`TreeSearch`, priced by the
online-learnt `CostModel`), plain decoding included, so the model never chooses below plain; a
measured guard (`MeasuredGuard`) overrules the model where its own rounds measured otherwise.
"""
from __future__ import annotations

from eagle_serve.scheduler.budget.config import BudgetConfig
from eagle_serve.scheduler.budget.cost_model import CostModel
from eagle_serve.scheduler.budget.guard import MeasuredGuard
from eagle_serve.scheduler.budget.interface import BudgetPolicy, RoundPlan
from eagle_serve.scheduler.budget.search import TreeSearch

CATCHUP_MIN_PAIRS = 16  # catch-ups of fewer pairs do not time the per-pair cost (a forward's fixed cost dominates)


class TreeBudget(TreeSearch, MeasuredGuard, BudgetPolicy):
    def __init__(self, costs: CostModel, config: BudgetConfig):
        """A budget that sizes each round's trees to the most modelled tokens per second and
        learns as it goes: the cost curves from every round's wall time, the expected node
        confidences per draft depth (one running prior shared by all sequences: a sequence's own
        last round barely predicts its next one) and their
        calibration from every verified tree, and the measured guard's rates from pure decode
        rounds. A tree runs only where it models `min_gain` over plain; while speculating, one
        round in `explore_every` runs plain (and one at full depth) so what speculation is
        compared against stays measured."""
        self.costs = costs
        self.config = config
        self.rounds = 0
        self.spec_rounds = 0  # rounds that drafted (the choice, its probes and explorations)
        self.explored = 0  # plain rounds run to keep plain's cost measured
        self.explored_depth = 0  # full-depth drafts run to keep the deeper levels' confidences measured
        self.guarded = 0  # rounds the guard turned plain
        self.promoted = 0  # rounds the guard turned to speculation where the model chose plain
        self.model_probes = 0  # rounds that drafted where the model chose plain (model_probe_every)
        self.retired = 0  # sequence-rounds left plain because their backlog would not pay back
        self.calibration = 1.0  # accepted tokens / predicted accepted tokens (running)
        self._accepted = self._predicted = 1.0
        # expected confidences, best first, of a tree drafted d levels deep: prior[d - 1]. A
        # chain before any round, learnt from every drafted round: a round drafted D deep says
        # what every depth d <= D would have drafted (EAGLE-2's frontier at a level does not
        # depend on how deep the draft goes on)
        n = config.max_tree_tokens - 1
        chain = tuple(config.prior) or tuple(0.6 ** (i + 1) for i in range(n))
        self.prior = [(chain[:d] + (0.0,) * n)[:n] if config.max_depth else (chain + (0.0,) * n)[:n]
                      for d in range(1, (config.max_depth or 1) + 1)]
        # (sequences, of them drafting, prefill) -> (round, best, plain, best tree whatever its rate)
        self._search: dict[tuple[int, int, int], tuple] = {}
        self.last_modelled: tuple[float, float] = (0.0, 0.0)  # (chosen, plain) tokens per second
        self.measured: dict[int, dict[str, list[float]]] = {}
        self.catchup_per_seq = 0.0  # head catch-up seconds per sequence of a chosen speculating round (running)
        self.catchup_rate: float | None = None  # seconds a catch-up takes per pending pair (running; None before one)
        self._pending: tuple[int, int, str, bool] | None = None  # this round's (sequences, prefill, kind, probe)
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
        self._accepted += self.config.ema * (accepted - self._accepted)
        self._predicted += self.config.ema * (predicted - self._predicted)
        self.calibration = min(max(self._accepted / self._predicted, 0.05), 5.0)
        n = self.config.max_tree_tokens - 1
        if not self.config.max_depth:
            levels = [tuple(confidence)]
        else:
            if len(depths) != len(confidence):
                return
            top = min(drafted_depth or max(depths), self.config.max_depth)
            levels = [tuple(p for p, x in zip(confidence, depths) if x <= d) for d in range(1, top + 1)]
        for d, conf in enumerate(levels):
            conf = (conf + (0.0,) * n)[:n]
            self.prior[d] = tuple(p + self.config.ema * (c - p) for p, c in zip(self.prior[d], conf))

    def observe_round(self, tokens: int, levels: list[int] | int, seconds: float,
                      committed: int | None = None, catchup: float = 0.0, prefill: bool | None = None,
                      catchup_pairs: int = 0) -> None:
        """A round's measured wall time teaches the cost model (`CostModel.observe`) all but
        its `catchup` seconds (a backlog of head pairs is not what a round of its size costs),
        and, for a pure decode round, the measured guard its tokens per second.

        The guard charges a speculating round the budget chose its whole catch-up: the pairs of
        sequences drafted for the first time, and what plain rounds in between left behind, are
        what speculating at this load costs (bench/bench_serve.py). A probe follows a stretch of
        plain rounds by design, so it is charged what chosen rounds pay per sequence
        (`catchup_per_seq`, a running average from 0), at most its own. Rounds with a prefill
        chunk (`prefill`; None: as the round's `choose` was told) teach the cost model nothing
        unless the budget speculates in them: the curves price decode rounds, and one long
        chunk costs far less than as many tokens spread over many trees. `catchup_pairs`: the
        pairs those seconds consumed, which time a pair (`catchup_rate`)."""
        if catchup_pairs >= CATCHUP_MIN_PAIRS and catchup > 0:
            per_pair = catchup / catchup_pairs
            self.catchup_rate = per_pair if self.catchup_rate is None else \
                self.catchup_rate + self.config.guard_ema * (per_pair - self.catchup_rate)
        pending, self._pending = self._pending, None
        if prefill is None:
            prefill = pending is not None and pending[1] > 0
        if self.config.cost_rate > 0 and not (prefill and not self.config.spec_with_prefill):
            self.costs.observe(tokens, levels, seconds - catchup, self.config.cost_rate)
        if committed is None or pending is None or not seconds > 0:
            return
        n, prefill_tokens, kind, probe = pending
        if prefill_tokens or kind not in ("plain", "spec"):
            return
        charge = 0.0  # catch-up seconds counted against the round
        if kind == "spec":
            if not probe:
                charge = catchup
                self.catchup_per_seq += self.config.guard_ema * (catchup / n - self.catchup_per_seq)
            else:
                charge = min(catchup, self.catchup_per_seq * n)
        self._measure(n, kind, committed / max(seconds - catchup + charge, 1e-9))

    def skip_round(self) -> None:
        """The round that the last choice was made for is not observed (a sequence failed in it):
        its choice must not be charged to a later round that makes none (a prefill's)."""
        self._pending = None

    def choose(self, caps: list[int], prefill_tokens: int = 0, backlogs: list[int] | None = None,
               remaining: list[int] | None = None) -> RoundPlan:
        """The round's plan for len(caps) decoding sequences (see `BudgetPolicy.choose`).

        A sequence left plain for a while has a backlog of head pairs that its next draft pays
        in one head forward, `catchup_rate` seconds a pair; drafting saves it at most
        1 / plain - 1 / best seconds (the modelled rates at this batch size) per token it still
        emits. Where the backlog costs more than that over its remaining tokens, the sequence
        is retired: it decodes plainly, its head is not kept in step (`sync` False), and the
        tree is searched for the others."""
        n = len(caps)
        promotes = not prefill_tokens and self.guard_promotes(n)  # judged once a round; the retirement prices it too
        retired = self._retire(caps, backlogs, remaining, prefill_tokens, promotes)
        if any(retired):
            caps = [1 if r else c for c, r in zip(caps, retired)]
        if prefill_tokens and not self.config.spec_with_prefill:
            sizes, deep, best_rate, plain = [1] * n, [0] * n, 0.0, 0.0
        else:
            sizes, deep, best_rate, plain = self._choose_shared(caps, prefill_tokens)
        self.rounds += 1
        self.last_modelled = (best_rate, plain)
        at_n = self._guard_rounds[n] = self._guard_rounds.get(n, 0) + 1
        sizes, deep, kind, probe = self._overrule(caps, prefill_tokens, sizes, deep, at_n, promotes)
        self._pending = (n, prefill_tokens, kind, probe)
        if kind != "plain":
            self.spec_rounds += 1
        depths = tuple(d if d and self.config.max_depth else None for d in deep)
        return RoundPlan(tuple(sizes), depths, tuple(not r for r in retired))

    def _overrule(self, caps: list[int], prefill: int, sizes: list[int], deep: list[int], at_n: int,
                  promotes: bool) -> tuple[list[int], list[int], str, bool]:
        """The model's choice, overruled where the measured guard, a due probe or an
        exploration says so: (sizes, depths, kind, probe), kind "plain", "spec" or "explore" (a
        full-depth exploration, kept out of the guard)."""
        n, cfg = len(caps), self.config
        plain_sizes, plain_deep = [1] * n, [0] * n
        kind = model_kind = "spec" if any(x > 1 for x in sizes) else "plain"
        probe = False
        if kind == "spec" and cfg.guard_min:
            plain_wins, inherited = self.guard(n)  # measured on pure decode rounds, applied to all at this size
            if plain_wins:
                if not self._guard_probe_due(n, at_n, inherited):
                    sizes, deep, kind = plain_sizes, plain_deep, "plain"
                    self.guarded += 1
                else:
                    probe = True  # keep measuring what speculation gives here
            elif cfg.explore_every and not prefill and at_n % 4 == 0 \
                    and self.measured.get(n, {}).get("plain", (0.0, 0))[1] < cfg.guard_min:
                sizes, deep, kind = plain_sizes, plain_deep, "plain"  # plain's rate at this size, early
                self.explored += 1
        if model_kind == "plain" and promotes:
            alt_sizes, alt_deep, _, _ = self._choose_shared(caps, prefill, probe=True)
            if any(x > 1 for x in alt_sizes):  # measured: speculation wins here, whatever the model says
                sizes, deep, kind = alt_sizes, alt_deep, "spec"
                self.promoted += 1
        if kind == "plain" and model_kind == "plain" and self._model_probe_due(n, at_n, prefill):
            # the model prices speculation out here: try its best tree now and then, if it is close
            alt_sizes, alt_deep, alt_rate, alt_plain = self._choose_shared(caps, prefill, probe=True)
            close = alt_rate >= alt_plain * (1 - cfg.model_probe_margin)
            far = cfg.model_probe_far and at_n % (cfg.model_probe_every * cfg.model_probe_far) == 0
            if any(x > 1 for x in alt_sizes) and (close or far):
                sizes, deep, kind, probe = alt_sizes, alt_deep, "spec", True
                self.model_probes += 1
        if cfg.explore_every and kind == "spec" and not probe:
            if self.rounds % cfg.explore_every == 0:
                # measure plain now and then: its modelled cost is what speculation must beat
                sizes, deep, kind = plain_sizes, plain_deep, "plain"
                self.explored += 1
            elif cfg.max_depth and self.rounds % cfg.explore_every == cfg.explore_every // 2 \
                    and any(0 < d < cfg.max_depth for d in deep):
                # and the full depth: the deeper levels' confidences are learnt from such rounds
                deep = [min(cfg.max_depth, caps[s] - 1) if d else 0 for s, d in enumerate(deep)]
                self.explored_depth += 1
                kind = "explore"
        return sizes, deep, kind, probe

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
        would still consume a kept sequence's backlog). Where the measured guard holds
        speculation off, drafting saves nothing, so every sequence with a backlog is retired,
        except in a round where a probe is due (a probe pays its backlogs by design, or a
        verdict could never be measured again). A sequence at its last token is always retired
        (nothing left to save); `retired` counts the others."""
        n = len(caps)
        if backlogs is None or remaining is None or self.catchup_rate is None:
            return [False] * n
        last = [b > 0 and c <= 1 for c, b in zip(caps, backlogs)]
        at_n = self._guard_rounds.get(n, 0) + 1  # this round's count at n (choose adds it)
        plain_wins, inherited = self.guard(n)
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
