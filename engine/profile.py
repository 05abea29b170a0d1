"""Start-up cost profile for the tree budget: seconds of one packed target forward by token
count, and of one drafting round by number of sequences (at the configured depth, and one level
deep), measured on this engine and device.

On the CPU the profile also measures the share of the wall time its thread actually ran (the
calling thread's CPU seconds / wall seconds; that thread is runnable throughout a timed call,
whatever part of the work runs on one thread or all): another process busy on the same cores
(a second engine starting, a benchmark, a build) makes every forward look slower, and a profile
taken then is wrong for the whole run: the online correction fixes the curve's level from plain
rounds but not its slope over the tree sizes they never run.
So a contended profile is taken again (`attempts`, `wait` seconds apart) and every point keeps
its fastest measurement; if every attempt was contended the result says so (`contended`) and
the engine profiles again when it is next idle (`eagle_serve.scheduler.budget.reprofile.CostProfiles.run_idle`)."""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from eagle_serve.engine.forward_batch import SeqSpan
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.drafters import NoDrafter
from eagle_serve.engine.speculative.eagle_drafter import feature_width
from eagle_serve.engine.step_io import SeqStep


VERIFY_GRID = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # linear beyond
SMALL_TOKENS = 16  # verify points up to here are timed in interleaved sweeps (ProfileRun)
DRAFT_GRID = (1, 2, 4, 8, 16, 32, 64)
# committed tokens before the profiled forwards (each sequence's context)
PROFILE_CONTEXT = 128

# Below this CPU share a profile counts as contended: an idle machine is near 1, one shared with
# busy processes near half.
MIN_CPU_SHARE = float(os.environ.get("EAGLE_SERVE_PROFILE_MIN_CPU_SHARE", "0.75"))
RETRY_WAIT = 1.0  # seconds between attempts


def non_decreasing(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The closest non-decreasing curve (least squares, pool-adjacent-violators) to timed
    points sorted by x: a forward of more tokens never costs less, and a noisy profile that said
    otherwise would make trees of that size look cheaper than smaller ones for good, the online
    correction of verify costs coming from plain rounds only."""
    blocks: list[list[float]] = []  # [sum, count]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [(x, y) for (x, _), y in zip(points, ys)]


class CpuShare:
    """Wall and calling-thread CPU seconds of the timed calls: share = cpu / wall, about 1 when
    the process has its cores to itself, lower when another process takes turns on them."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def add(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu

    @property
    def share(self) -> float | None:
        return self.cpu / self.wall if self.wall > 0 else None


def _time(fn, repeats: int, meter: CpuShare | None = None) -> float:
    fn()  # warm-up
    return statistics.median([_time_once(fn, meter) for _ in range(repeats)])


def _time_once(fn, meter: CpuShare | None = None) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    c0, t = time.thread_time(), time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    if meter is not None:
        meter.add(wall, time.thread_time() - c0)
    return wall


def _fastest(runs: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Per x, the fastest time any attempt measured (contention only ever adds time)."""
    best: dict[int, float] = {}
    for run in runs:
        for x, y in run:
            best[x] = min(y, best.get(x, y))
    return sorted(best.items())


@torch.inference_mode()
def profile_costs(runner, max_tokens: int, max_seqs: int, context: int | None = None, repeats: int = 2,
                  small_repeats: int = 15, blocks: list[int] | None = None, attempts: int = 3,
                  min_share: float | None = None, wait: float | None = None) -> dict:
    """{"verify": [(tokens, s)], "draft": [(seqs, s)], "draft_first": [(seqs, s)], "depth": D,
    "cpu_share": [per attempt], "contended": bool}: draft rounds at the configured depth D and
    at depth 1. Forwards of up to SMALL_TOKENS tokens (one sequence's trees; a few ms each) are
    timed `small_repeats` times each in interleaved sweeps, larger ones `repeats` times in a
    row; the verify curve is then made non-decreasing.
    On the CPU, an attempt whose CPU share is below `min_share` (None: MIN_CPU_SHARE) is
    followed by another after `wait` seconds (None: RETRY_WAIT), up to `attempts`; each point keeps its fastest
    time. Uses the runner's KV cache: `blocks` (None: all of it) are overwritten, so call it
    before any request runs or with blocks no sequence holds."""
    min_share = MIN_CPU_SHARE if min_share is None else min_share
    wait = RETRY_WAIT if wait is None else wait
    on_cpu = runner.device.type == "cpu"
    runs, shares = [], []
    for attempt in range(max(attempts, 1)):
        if attempt:
            time.sleep(wait)
        meter = CpuShare()
        runs.append(_profile_once(runner, max_tokens, max_seqs, context, repeats, small_repeats, blocks, meter))
        shares.append(meter.share if on_cpu else None)
        if shares[-1] is None or shares[-1] >= min_share:
            break
    return _result(runner, runs, shares, min_share)


def _result(runner, runs: list, shares: list[float | None], min_share: float) -> dict:
    """The profile dict from attempts' (verify, draft, first) points and CPU shares: per point
    the fastest attempt, the verify curve made non-decreasing; contended if every attempt was."""
    verify = _fastest([r[0] for r in runs])
    draft, first = _fastest([r[1] for r in runs]), _fastest([r[2] for r in runs])
    contended = all(s is not None and s < min_share for s in shares)
    return {"verify": non_decreasing(verify), "draft": draft, "draft_first": first, "depth": runner.spec.max_depth,
            "cpu_share": shares, "contended": contended}


def extend(new: dict, old: dict) -> dict:
    """A profile taken over fewer KV blocks than `old` (an idle-time one: the blocks no sequence
    holds and no prefix caches) stops its grids early: beyond its last point each curve keeps
    old's points, scaled by new / old at that last point (a contended profile is slow by about
    one factor throughout)."""
    out = dict(new)
    for key in ("verify", "draft", "draft_first"):
        pts, prev = list(new[key]), dict(old.get(key, []))
        if not pts:  # nothing of this kind fitted: old's curve as it was (an empty draft curve read as free drafting)
            pts = sorted(prev.items())
        elif pts[-1][0] in prev and prev[pts[-1][0]] > 0:
            last, scale = pts[-1][0], pts[-1][1] / prev[pts[-1][0]]
            pts += [(x, y * scale) for x, y in sorted(prev.items()) if x > last]
        out[key] = non_decreasing(pts) if key == "verify" else pts
    return out


def _profile_once(runner, max_tokens, max_seqs, context, repeats, small_repeats, blocks, meter):
    run = ProfileRun(runner, max_tokens, max_seqs, context, repeats, small_repeats, meter)
    ids = list(range(runner.num_blocks)) if blocks is None else list(blocks)
    while not run.step(ids):
        pass
    return run.verify, run.draft, run.first


class ProfileRun:
    """One attempt's points, measured one at a time (`step`), each over the KV blocks it is
    given then: the idle-time profile runs a point per idle turn of the serving loop, so a
    request that arrives meanwhile waits for one point instead of the whole profile, and the
    blocks go back between points. A point that does not fit in its blocks ends its grid there.
    full_context: a verify point that does not fit with the whole `context` of keys does not fit
    (the idle-time profile: its points join a curve measured at that context); otherwise the
    context shrinks to what the blocks hold (a small KV cache's start-up profile)."""

    def __init__(self, runner, max_tokens: int, max_seqs: int, context: int | None = None, repeats: int = 2,
                 small_repeats: int = 15, meter: CpuShare | None = None, full_context: bool = False):
        context = PROFILE_CONTEXT if context is None else context
        self.full_context = full_context
        self.runner, self.context, self.repeats, self.small_repeats = runner, context, repeats, small_repeats
        self.meter = meter if meter is not None else CpuShare()
        # one sequence's trees (up to SMALL_TOKENS) differ by less a token than the noise of a few
        # consecutive timings, so they are timed in sweeps, every size once per sweep (a step), and
        # the sweeps' medians kept: timed one after another, a tree's extra rows look nearly free
        self.small = [t for t in VERIFY_GRID if t <= min(SMALL_TOKENS, max_tokens)]
        self.small_times: dict[int, list[float]] = {t: [] for t in self.small}
        self.todo = [("sweep", r) for r in range(small_repeats + 1)]  # sweep 0 warms up
        self.todo += [("verify", t) for t in VERIFY_GRID if SMALL_TOKENS < t <= max_tokens]
        if not isinstance(runner.drafter, NoDrafter):
            self.todo += [("draft", n) for n in DRAFT_GRID if n <= max_seqs]
        self.verify: list[tuple[int, float]] = []
        self.draft: list[tuple[int, float]] = []
        self.first: list[tuple[int, float]] = []
        self.gen = torch.Generator().manual_seed(0)

    @property
    def done(self) -> bool:
        return not self.todo

    @torch.inference_mode()
    def step(self, blocks: list[int]) -> bool:
        """Measure the next point over `blocks` (overwritten: no sequence may hold them); True
        once every point is measured or cut."""
        if self.todo:
            kind, x = self.todo.pop(0)
            if kind == "sweep":
                self._sweep(x, blocks)
                return self.done
            fits = self._verify(x, blocks) if kind == "verify" else self._draft(x, blocks)
            if not fits:  # larger points of this kind fit even less
                self.todo = [(k, y) for k, y in self.todo if k != kind]
        return self.done

    def _sweep(self, r: int, blocks: list[int]) -> None:
        """One forward of every small size (starting at a different one each sweep); after the
        last sweep, their medians become the curve's first points."""
        sizes = self.small[r % len(self.small):] + self.small[:r % len(self.small)] if self.small else []
        for T in sizes:
            run = self._verify_run(T, blocks)
            if run is None:  # larger sizes fit even less: the grid ends before T
                self.small = [t for t in self.small if t < T]
                self.todo = [(k, y) for k, y in self.todo if k != "verify"]
                if not self.small:  # nothing left to sweep
                    self.todo = [(k, y) for k, y in self.todo if k != "sweep"]
                continue
            if r == 0:
                run()  # warm-up
            else:
                self.small_times[T].append(_time_once(run, self.meter))
        if not any(k == "sweep" for k, _ in self.todo):
            self.verify = [(T, statistics.median(self.small_times[T])) for T in self.small
                           if self.small_times[T]] + self.verify

    def _verify(self, T: int, ids_of: list[int]) -> bool:
        run = self._verify_run(T, ids_of)
        if run is None:
            return False
        self.verify.append((T, _time(run, self.repeats, self.meter)))
        return True

    def _verify_run(self, T: int, ids_of: list[int]):
        """A forward of T tokens as the engine runs it (a CUDA graph replay where one fits,
        greedy picks over every row), over `ids_of`; None where it does not fit."""
        runner, bs = self.runner, self.runner.config.block_size
        vocab = runner.loaded.config.vocab_size
        per_seq = 8 if T >= 8 else T
        B = -(-T // per_seq)
        ctx = min(self.context, (len(ids_of) // B) * bs - per_seq)
        if ctx < 1 or (self.full_context and ctx < self.context):
            return None
        blocks_per = -(-(ctx + per_seq) // bs)
        spans, left = [], T
        for b in range(B):
            n = min(per_seq, left)
            left -= n
            ids = torch.randint(vocab, (n,), generator=self.gen).tolist()
            spans.append(SeqSpan(ids, ctx, ids_of[b * blocks_per:(b + 1) * blocks_per]))

        def run():
            runner.model.compute_logits(runner.forward(spans)).max(-1).indices.tolist()  # as sampler.choose
        return run

    def _draft(self, n: int, ids_of: list[int]) -> bool:
        runner, bs, context, repeats = self.runner, self.runner.config.block_size, self.context, self.repeats
        drafter, vocab = runner.drafter, runner.loaded.config.vocab_size
        h = feature_width(runner.loaded.config.hidden_size, runner.model.aux_layers)
        blocks_per = -(-(context + runner.spec.scratch_slots + 2 * repeats + 8) // bs)
        if n * blocks_per > len(ids_of):
            return False
        steps = [SeqStep(seq_id=-1 - i, token_ids=[1], num_cached=context,
                         block_table=ids_of[i * blocks_per:(i + 1) * blocks_per],
                         params=SamplingParams(max_tokens=64), seed=0, output_token_ids=[1],
                         max_new_tokens=runner.spec.max_depth + 1,
                         prompt_token_ids=torch.randint(vocab, (context,), generator=self.gen).tolist())
                 for i in range(n)]
        feats = torch.randn(context, h, generator=self.gen).to(runner.dtype).to(runner.device)

        def run(depth):
            for s in steps:  # one accepted token's pair pending, as after a verify round
                drafter.observe(s, [1], feats[-1:], reset=False)
            drafter.propose(steps, [depth] * n)
        # the points' catch-ups (the warm-up rounds consume each sequence's prompt pairs) are not
        # what requests cost: the drafter's cumulative counters come back as they were, so the
        # benchmarks' catch-up seconds leave the start-up profile's out
        counters = drafter.catchup_seconds, drafter.catchup_pairs
        try:
            for s in steps:  # the prompt's pairs, consumed by the untimed warm-up round
                drafter.observe(dataclasses.replace(s, num_cached=0), s.prompt_token_ids[1:] + [1], feats, reset=True)
            self.draft.append((n, _time(lambda: run(runner.spec.max_depth), repeats, self.meter)))
            self.first.append((n, _time(lambda: run(1), repeats, self.meter)))
        finally:
            for s in steps:
                drafter.release(s.seq_id)
            drafter.catchup_seconds, drafter.catchup_pairs = counters
        return True

    def result(self, min_share: float | None = None) -> dict:
        """The profile_costs dict of this single attempt."""
        share = self.meter.share if self.runner.device.type == "cpu" else None
        return _result(self.runner, [(self.verify, self.draft, self.first)], [share],
                       MIN_CPU_SHARE if min_share is None else min_share)
