"""When the tree budget's cost profile is taken again: after a profile that ran while other
processes used the CPU, the next one runs when the engine is idle, point by point."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from eagle_serve.scheduler.block_allocator import BlockAllocator

log = logging.getLogger("eagle_serve")


class ProfileRun(Protocol):
    """A cost profile measured one point per call (`engine.profile.ProfileRun`)."""

    def step(self, blocks: list[int]) -> bool:
        """Measure the next point in these KV blocks; True once the profile is complete."""

    def result(self) -> dict:
        """The profile: "verify", "draft" points, "contended", "cpu_share", ..."""


class CostProfiles:
    """Every cost profile taken, the one in use, and the idle work (`loop.IdleWork`) that takes
    another after a contended one. The engine side is injected: `start` begins an idle-time
    profile, `merge(new, old)` carries old points past where a new profile stopped, `adopt`
    hands a profile to the budget. Each point runs in the KV blocks that no sequence holds and
    no prefix caches, lent from `allocator` for that point only."""

    # Seconds from the first contended profile to the next try, doubled after each further one:
    # beside a busy process an idle server spends little CPU on profiles that stay contended.
    REPROFILE_AFTER = 10.0
    MAX_PROFILES = 4  # the start-up profile and at most three idle-time ones

    def __init__(self, start: Callable[[], ProfileRun], merge: Callable[[dict, dict], dict],
                 adopt: Callable[[dict], None], allocator: BlockAllocator):
        self._start, self._merge, self._adopt, self._allocator = start, merge, adopt, allocator
        self.history: list[dict] = []  # every profile taken: {"at", "cpu_share", "contended", "used"}
        self.current: dict | None = None  # the profile the budget's costs came from
        self.due_at: float | None = None  # monotonic time the next idle-time profile is due (None: not needed)
        self.run: ProfileRun | None = None  # the idle-time profile under way

    @property
    def under_way(self) -> bool:
        return self.run is not None

    def record(self, prof: dict) -> dict:
        """Keep a finished profile (the first one, or any clean one) and schedule the next try
        after a contended one."""
        used = not prof["contended"] or self.current is None
        self.history.append({"at": time.time(), "cpu_share": prof["cpu_share"], "contended": prof["contended"],
                             "used": used})
        if used:
            self.current = prof
        shares = ", ".join(f"{s:.2f}" for s in prof["cpu_share"])
        if prof["contended"] and len(self.history) < self.MAX_PROFILES:
            wait = self.REPROFILE_AFTER * 2 ** (sum(p["contended"] for p in self.history) - 1)
            self.due_at = time.monotonic() + wait
            log.warning("the tree budget's cost profile ran while other processes used the CPU (CPU share %s); "
                        "profiling again when the engine is idle, in %.0f s or later", shares, wait)
        else:
            self.due_at = None
            if prof["contended"]:
                log.warning("the tree budget's cost profile ran while other processes used the CPU (CPU share %s) "
                            "%d times: it stays in use, corrected online by the rounds the engine measures",
                            shares, len(self.history))
        return prof

    def idle_due_in(self) -> float | None:
        """Seconds until idle-time profiling is due (<= 0: now; an unfinished profile is always
        due), None when none is needed (the last profile was clean, or the tries are spent)."""
        if self.run is not None:
            return 0.0
        return None if self.due_at is None else self.due_at - time.monotonic()

    def run_idle(self) -> None:
        """Engine thread, no sequence running: measure the next point of the idle-time profile,
        so a request arriving meanwhile waits for one point, not the whole profile. A finished
        clean profile replaces the budget's costs (what the budget learnt online corrected the
        contended one). A point that raises ends the profile, which is not tried again."""
        if self.run is None:
            self.due_at = None
            self.run = self._start()
        run = self.run
        table = self._allocator.take_uncached()
        try:
            done = run.step(table.blocks)
        except BaseException:
            self.run = None
            raise
        finally:
            self._allocator.free(table)
        if not done:
            return
        self.run = None
        old, prof = self.current, run.result()
        if not (prof["verify"] or prof["draft"]):  # the prefix cache held nearly every block: nothing fitted
            log.info("tree budget cost profile not retaken: too few KV blocks free of cached prefixes")
            return
        prof = self.record(prof)
        if not prof["contended"]:  # its grids may stop early (fewer blocks): old's points carry on
            self.current = self._merge(prof, old)
            self._adopt(self.current)
            log.info("tree budget cost profile retaken (CPU share %.2f)", prof["cpu_share"][-1])
