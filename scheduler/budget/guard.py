"""The measured guard: per batch size, running averages of the tokens per second that pure
decode rounds gave, plain and speculating, and the verdicts they support over the cost model.

Where the budget would speculate but its speculating rounds measured slower than its plain
rounds (by more than the averages' noise), it decodes plainly and probes speculation now and
then; where they measured faster, it speculates though the model prices trees out. A batch size
without a verdict of its own takes the largest smaller one's, unprobed.
"""
from __future__ import annotations

from eagle_serve.scheduler.budget.config import BudgetConfig


class MeasuredGuard:
    """Mixed into `TreeBudget`: reads its `config`, `rounds` and `measured`."""

    config: BudgetConfig
    rounds: int
    # batch size -> {"plain" | "spec": [tokens per second (running average), rounds,
    # running variance of one round's rate, the round of its last sample]}
    measured: dict[int, dict[str, list[float]]]

    def guard_verdict(self, n: int, stale: bool = True) -> bool | None:
        """This batch size's own measurement: True where speculating rounds gave fewer tokens
        per second than plain ones by more than guard_z standard errors of the difference,
        False otherwise (the model's choice stands), None before guard_min of each.

        The margin keeps the guard safe at small batches, where one sequence's speculating
        round gives 1, 2 or 3 tokens and its rate swings by half its mean; at larger batches a
        round's tokens sum over its sequences and the standard error shrinks."""
        gap = self._measured_gap(n, stale)
        return None if gap is None else gap[0] > gap[1]

    def _measured_gap(self, n: int, stale: bool = True) -> tuple[float, float] | None:
        """(plain's running rate - speculation's, guard_z standard errors of that difference) at
        batch size n, None before guard_min rounds of each (or with the guard off)."""
        m = self.measured.get(n, {})
        plain, spec = m.get("plain"), m.get("spec")
        least = self.config.guard_min
        if not (least and plain and spec and plain[1] >= least and spec[1] >= least):
            return None
        return plain[0] - spec[0], self.config.guard_z * (self._se2(plain, stale) + self._se2(spec, stale)) ** 0.5

    def guard_promotes(self, n: int) -> bool:
        """The guard's other direction: this batch size's own measurement has speculating rounds
        give more tokens per second than plain ones by more than guard_z standard errors of the
        difference, so speculation runs where the model prices it out (`choose`: its best tree,
        as a model probe would run). The model learns a verify's cost at a token count only from
        rounds that verified that many, so it can keep pricing out trees that measure faster.
        Off with guard_promote=False."""
        gap = self._measured_gap(n) if self.config.guard_promote else None
        return gap is not None and -gap[0] > gap[1]

    def _se2(self, entry: list, stale: bool = True) -> float:
        """Squared standard error of a measured guard entry's running average: its variance
        times the sum of its samples' squared weights (the first sample starts the average, each
        later one enters with weight a), plus the drift since its last sample. An average not
        updated for k rounds (the speculating one while the guard holds speculation off, but for
        probes) is uncertain by k rounds of drift more, so a verdict that rested on an unlucky
        run lapses and the model's choice is measured again; a clear one holds. stale=False
        leaves the drift out: a verdict a larger batch size inherits (`guard`) holds as measured
        (a lapse there would draft every sequence of the larger batch, backlogs included)."""
        a = self.config.guard_ema
        r = (1.0 - a) ** 2
        k = max(entry[1] - 1, 0)  # samples after the first
        weights = r ** k + (a * a * (1.0 - r ** k) / (1.0 - r) if r < 1.0 else 0.0)
        drift = max(self.rounds - entry[3], 0) * a * a / (1.0 - a) if stale and a < 1.0 else 0.0
        return entry[2] * (weights + drift)

    def guard(self, n: int) -> tuple[bool, bool]:
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

    def _probe_every(self, n: int) -> int:
        """Rounds between the guard's speculating probes at batch size n: guard_probe, or
        model_probe_every where the model probes too (small batches, where a probe's head
        backlog is cheap). Each probe moves a noisy speculating average by guard_ema, so probes
        are what turn a wrong verdict of 'slower' back."""
        if self.config.model_probe_every and n <= self.config.model_probe_max_seqs:
            return min(self.config.guard_probe, self.config.model_probe_every)
        return self.config.guard_probe

    def _guard_probe_due(self, n: int, at_n: int, inherited: bool) -> bool:
        """Where the guard holds speculation off at n, whether its round `at_n` probes it (never
        on an inherited verdict: a probe drafts every sequence of the larger batch)."""
        return not inherited and at_n % self._probe_every(n) == 0

    def _model_probe_due(self, n: int, at_n: int, prefill: int) -> bool:
        """Whether round `at_n` at n may try the model's best tree where it chose plain."""
        return bool(self.config.model_probe_every and not prefill and n <= self.config.model_probe_max_seqs
                    and at_n % self.config.model_probe_every == 0)

    def _measure(self, n: int, kind: str, rate: float) -> None:
        """One pure decode round's tokens per second at batch size n, plain or speculating, into
        the running mean and variance (exponentially weighted)."""
        entry = self.measured.setdefault(n, {}).setdefault(kind, [0.0, 0, 0.0, 0])
        entry[3] = self.rounds
        if not entry[1]:
            entry[0], entry[2] = rate, 0.0
        else:
            a = self.config.guard_ema
            diff = rate - entry[0]
            entry[0] += a * diff
            entry[2] = (1.0 - a) * (entry[2] + a * diff * diff)
        entry[1] += 1
