"""The tree budget's settings, fixed when it is built."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetConfig:
    """How `TreeBudget` searches, learns and guards its choices. The defaults are the served
    engine's; benchmarks vary them through `dataclasses.replace`."""

    max_tree_tokens: int  # the configured tree, root included: the most one sequence verifies
    # the configured draft depth (None: size trees only; every draft costs a profiled round)
    max_depth: int | None = None
    prior: tuple[float, ...] = ()  # node confidences, best first, assumed before any round (): a 0.6^i chain
    ema: float = 0.02  # step of the running prior and calibration
    cost_rate: float = 0.1  # step of the online cost correction (0: keep the start-up profile)
    explore_every: int = 32  # while speculating, one round in this many plain, one at full depth (0: never)
    research_every: int = 8  # rounds a shared-prior search is reused for the same batch shape (1: every round)
    # modelled gain over plain a tree must show: the model's error is about 5% at 4 clients; at one
    # sequence the measured guard and the model probes catch a wrong choice (bench/bench_spec.py
    # --budget-min-gain)
    min_gain: float = 0.05
    min_gain_one: float = 0.0
    guard_min: int = 8  # measured pure-decode rounds of each kind a batch size needs for a verdict (0: no guard)
    guard_probe: int = 64  # while the guard holds speculation off, speculate every this many rounds
    guard_ema: float = 0.1  # step of the guard's running rates
    guard_z: float = 1.0  # standard errors of the difference a verdict needs (`MeasuredGuard.guard_verdict`)
    guard_promote: bool = True  # the guard also turns speculation on where it measures faster than plain
    # speculate in rounds that carry a prefill chunk: off, as a tree beside a prompt chunk costs
    # the round far more than the tokens it adds
    spec_with_prefill: bool = False
    # where the model picks plain at up to model_probe_max_seqs sequences but its best tree models
    # within model_probe_margin of plain, run that tree every model_probe_every rounds (0: never),
    # and every model_probe_every x model_probe_far rounds however far below (0: never), so a
    # cost learnt in a slow spell is measured again
    model_probe_every: int = 16
    model_probe_margin: float = 0.1
    model_probe_max_seqs: int = 4
    model_probe_far: int = 4

    def __post_init__(self):
        if self.max_tree_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1, got {self.max_tree_tokens}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1 or None, got {self.max_depth}")
        for name in ("ema", "guard_ema"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("cost_rate", "min_gain", "min_gain_one", "guard_z", "model_probe_margin", "explore_every",
                     "guard_min", "model_probe_every", "model_probe_max_seqs", "model_probe_far"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.research_every < 1:
            raise ValueError(f"research_every must be >= 1, got {self.research_every}")
        if self.guard_min and self.guard_probe < 1:  # (the probes are what can lift a verdict of 'slower')
            raise ValueError(f"guard_probe must be >= 1 while the guard is on (guard_min {self.guard_min}), "
                             f"got {self.guard_probe}")
