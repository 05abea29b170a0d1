"""The asyncio scheduler: continuous batching, chunked prefill, prefix caching, preemption,
aborts, per-sequence errors and the load-aware tree budget (tiny float64 models: exact)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import time
from pathlib import Path

import pytest

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.scheduler.async_engine import AsyncEngine
from eagle_serve.scheduler.budget import BudgetConfig, BudgetPolicy, CostModel, CostProfiles, RoundPlan, TreeBudget
from eagle_serve.server.llm import LLM
from tests.spec_helpers import write_eagle_head

KW = dict(dtype="float64", device="cpu", block_size=4)


@pytest.fixture(scope="module")
def head_dir(tiny_llama, tmp_path_factory):
    return write_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), tiny_llama[0])


def workload(n=8, seed=0):
    """Mixed prompt lengths and output lengths, greedy and seeded sampling."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))]
        kw = dict(max_tokens=rng.randrange(4, 24), ignore_eos=True)
        params = SamplingParams(temperature=0, **kw) if i % 2 == 0 else SamplingParams(temperature=0.9, seed=i, **kw)
        reqs.append((prompt, params))
    return reqs


def one_at_a_time(llm, reqs):
    return [llm.generate(p, sp)[0].token_ids for p, sp in reqs]


async def run_concurrently(llm, reqs, stagger=0.0):
    eng = AsyncEngine(llm.loop)
    await eng.start()

    async def client(i, prompt, params):
        await asyncio.sleep(stagger * i)
        last = None
        async for out in eng.generate(prompt, params):
            last = out
        return last

    try:
        outs = await asyncio.gather(*(client(i, p, sp) for i, (p, sp) in enumerate(reqs)))
    finally:
        await eng.stop()
    return outs


def _uniform(n: int, size: int, depth: int | None = None) -> RoundPlan:
    """The same tree for each of n sequences, every head kept in step."""
    return RoundPlan((size,) * n, (depth,) * n, (True,) * n)


class RecordingBudget(BudgetPolicy):
    """A budget double: subclasses choose; it learns nothing and records the rounds observed."""

    def __init__(self):
        self.rounds, self.seen, self.skipped = 0, [], 0

    def choose(self, caps, prefill_tokens=0, backlogs=None, remaining=None) -> RoundPlan:
        raise NotImplementedError

    def observe(self, *args, **kw):
        pass

    def observe_round(self, tokens, levels, seconds, committed=None, catchup=0.0, prefill=None, catchup_pairs=0):
        self.seen.append((self.rounds, seconds, catchup, catchup_pairs))

    def skip_round(self):
        self.skipped += 1


class FixedBudget(RecordingBudget):
    """A tree budget that gives every decoding sequence `size` tokens, drafted `depth` deep."""

    def __init__(self, size: int, depth: int | None = None):
        super().__init__()
        self.size, self.depth = size, depth

    def choose(self, caps, prefill_tokens=0, backlogs=None, remaining=None) -> RoundPlan:
        return _uniform(len(caps), self.size, self.depth)


@pytest.mark.parametrize("spec", ["none", "eagle2-fixed", "eagle2-budget"])
def test_concurrent_requests_equal_one_at_a_time(tiny_llama, head_dir, spec):
    kw = dict(KW, kv_cache_tokens=4096)
    if spec != "none":
        kw.update(draft=head_dir, spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3),
                  tree_budget=spec == "eagle2-budget", max_num_seqs=8, max_num_batched_tokens=256)
    reqs = workload()
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=4096), reqs)
    llm = LLM(tiny_llama[0], **kw)
    free0 = llm.allocator.num_free_blocks
    outs = asyncio.run(run_concurrently(llm, reqs, stagger=0.002))
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.allocator.num_free_blocks == free0
    if spec == "eagle2-fixed":  # (the budget may rightly refuse to speculate with a random head)
        assert sum(o.spec.verify_steps for o in outs) > 0


@pytest.mark.parametrize("budget", [False, True])
def test_max_num_batched_tokens_bounds_a_steps_trees(tiny_llama, head_dir, budget):
    # a decode's tree counts every node against the step's limit: counted as one token, 8
    # sequences of 8-token trees would verify 64 tokens under a limit of 20
    reqs = workload(8, seed=2)
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=4096), reqs)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=4096, draft=head_dir, max_num_seqs=8, max_num_batched_tokens=20,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), tree_budget=budget)
    if budget:
        llm.loop.scheduler.budget = FixedBudget(8, 4)  # (a random head: the real one may not speculate)
    sizes, real = [], llm.runner.execute

    def execute(steps):
        results = real(steps)
        sizes.append(sum(len(s.token_ids) for s in steps)
                     + sum(r.num_draft_tokens for r in results if not isinstance(r, BaseException)))
        return results
    llm.runner.execute = execute
    outs = asyncio.run(run_concurrently(llm, reqs))
    assert [o.token_ids for o in outs] == ref
    assert max(sizes) <= 20 and max(sizes) >= 16, sizes  # the limit is reached: trees are cut to it
    assert sum(o.spec.verify_steps for o in outs) > 0


def test_prefix_cache_counters_count_admissions_not_attempts(tiny_llama):
    # a sequence that waits for room is counted once, when admitted: counted at every step,
    # KV pressure would inflate the hit rate with no reuse behind it
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=256, block_size=16)
    alloc, sched = llm.allocator, llm.loop.scheduler
    admissions = []
    real = alloc.count_lookup
    alloc.count_lookup = lambda q, h: (admissions.append((q, h)), real(q, h))[1]
    prompts = [[10 + i] * 64 for i in range(6)]
    llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 6)
    assert sched.num_preemptions > 0
    # every admission looks up at most the prompt's full blocks plus its output so far (a
    # preempted one is looked up again when it comes back): no more admissions than that
    assert len(admissions) <= 6 + sched.num_preemptions
    assert alloc.prefix_queried_tokens == sum(q for q, _ in admissions) <= (6 + sched.num_preemptions) * 112
    assert alloc.prefix_hit_tokens == sum(h for _, h in admissions) <= alloc.prefix_queried_tokens


@pytest.mark.parametrize("caching", [False, True])
def test_without_prefix_caching_shared_first_blocks_are_admitted_together(tiny_llama, caching):
    """Admission waits for a block another sequence is computing only to take it from the cache
    next step. Without prefix caching that wait admitted the n choices of one prompt (or chats
    sharing a system prompt) one a step, and every lookup counted as a miss."""
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, enable_prefix_caching=caching)
    loop, prompt = llm.loop, list(range(10, 42))  # 32 tokens: one prefill chunk
    seqs = [loop.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for _ in range(4)]
    fed = []
    while loop.has_unfinished:
        planned, steps = loop.plan()
        fed.append([len(s.token_ids) for s in steps])
        loop.complete(planned, loop.execute(planned, steps))
    if caching:  # the first computes the blocks, the others take them from the cache
        assert fed[:2] == [[32], [1, 4, 4, 4]]
        assert llm.allocator.prefix_hit_tokens > 0
    else:
        assert fed[0] == [32] * 4
        assert llm.allocator.prefix_queried_tokens == llm.allocator.prefix_hit_tokens == 0
    assert all(len(s.output_token_ids) == 4 for s in seqs)


def test_a_failed_rounds_choice_is_not_charged_to_the_next_round():
    """A round in which a sequence fails is not observed; its pending choice is dropped, so the
    next round that chooses nothing (a prompt's prefill alone) is not recorded as a decode round."""
    costs = CostModel([(1, .010), (4, .011), (8, .013), (16, .017), (64, .040)], [(1, .004), (2, .005), (4, .006)],
                      [(1, .001), (2, .0012), (4, .0015)], depth=4)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=4, explore_every=0, model_probe_every=0))
    b.choose([5])
    assert b._pending is not None
    b.skip_round()  # what the loop does for a round it does not observe
    b.observe_round(40, [], 0.050, committed=1, prefill=True)
    assert b.measured == {}
    with pytest.raises(ValueError, match="guard_probe"):  # a held guard probes every guard_probe rounds: 0 is refused
        TreeBudget(costs, BudgetConfig(8, guard_min=1, guard_probe=0))
    TreeBudget(costs, BudgetConfig(8, guard_min=0, guard_probe=0))  # no guard: nothing to probe


def test_the_loop_drops_the_budgets_choice_for_a_failed_round(tiny_llama):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)

    loop = llm.loop
    loop.scheduler.budget = budget = FixedBudget(1)
    poison = 297

    def hook(steps):
        if any(poison in s.history for s in steps):
            raise RuntimeError("injected fault")
    llm.runner.fault_hook = hook
    loop.add_request([5, 6, poison], SamplingParams(max_tokens=2, temperature=0))
    while loop.has_unfinished:
        seqs, steps = loop.plan()
        loop.complete(seqs, loop.execute(seqs, steps))
    assert budget.skipped


def test_small_cache_completes_through_preemption(tiny_llama, head_dir):
    reqs = workload(8, seed=1)
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=4096), reqs)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=96, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2))
    free0 = llm.allocator.num_free_blocks
    outs = asyncio.run(run_concurrently(llm, reqs))
    assert [o.token_ids for o in outs] == ref
    assert llm.loop.scheduler.num_preemptions > 0
    assert llm.allocator.num_free_blocks == free0


def test_stop_does_not_wait_forever_for_a_stuck_step(tiny_llama, monkeypatch):
    # SIGTERM's shutdown awaits the loop task, which may await a step stuck in the engine thread:
    # stop gives up after STOP_TIMEOUT and the request is aborted, so the process exits
    import eagle_serve.scheduler.async_engine as ae
    monkeypatch.setattr(ae, "STOP_TIMEOUT", 0.3)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    llm.runner.fault_hook = lambda steps: time.sleep(2.0)  # "stuck" (short, so later tests are not held up)

    async def main():
        eng = AsyncEngine(llm.loop)
        await eng.start()
        seq_id, q = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
        await asyncio.sleep(0.2)  # the step is in flight
        t0 = time.monotonic()
        await eng.stop()
        waited = time.monotonic() - t0
        return waited, await q.get()

    waited, out = asyncio.run(main())
    assert waited < 1.0 and out.finished and out.finish_reason == "abort"
    time.sleep(2.0)  # let the sleeping step end before the engine thread serves the next test


def test_abort_mid_generation_frees_blocks(tiny_llama):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    free0 = llm.allocator.num_free_blocks

    async def main():
        eng = AsyncEngine(llm.loop)
        await eng.start()
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        gen = eng.generate(list(range(5, 40)), params)
        seen = 0
        async for out in gen:
            seen = len(out.token_ids)
            if seen >= 3:
                break  # the client goes away
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not llm.loop.has_unfinished:
                break
        await eng.stop()
        return seen

    assert asyncio.run(main()) >= 3
    assert not llm.loop.has_unfinished
    assert llm.allocator.num_free_blocks == free0


def test_shared_prefix_is_computed_once_and_reuse_is_exact(tiny_llama):
    system = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 4 full blocks + 1
    reqs = [(system + [30 + i, 40 + i, 50 + i], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            for i in range(4)]
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=1024, enable_prefix_caching=False), reqs)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    outs = llm.generate([p for p, _ in reqs], reqs[0][1])  # all at once: later ones wait for the prefix
    assert [o.token_ids for o in outs] == ref
    alloc = llm.allocator
    assert alloc.prefix_hit_tokens == 3 * 16  # 4 blocks of 4 computed by the first, reused by 3
    # n choices of one prompt: the prompt is prefilled once
    before = alloc.prefix_hit_tokens
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    outs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(3)])
    assert alloc.prefix_hit_tokens - before == 2 * 20
    alone = [llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=i))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_is_exact_and_decodes_keep_running(tiny_llama):
    long_prompt = [random.Random(3).randrange(3, 300) for _ in range(150)]
    short = [5, 6, 7]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=2048), [(long_prompt, params), (short, params)])
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, max_prefill_chunk=16, enable_prefix_caching=False)
    loop = llm.loop
    s_short = loop.add_request(short, params)
    loop.step()  # the short one is decoding
    s_long = loop.add_request(long_prompt, params)
    grew = []
    while not s_long.output_token_ids:
        before = len(s_short.output_token_ids)
        loop.step()
        grew.append(len(s_short.output_token_ids) > before or s_short.is_finished)
    assert len(grew) >= 150 // 16  # the prompt went in chunks ...
    assert all(grew)  # ... and the running decode got a token in every one of those steps
    loop.run_to_completion()
    assert list(s_long.output_token_ids) == ref[0]
    assert list(s_short.output_token_ids) == ref[1]


@pytest.mark.parametrize("spec", ["none", "eagle2"])
def test_a_prompt_longer_than_a_prefill_chunk_alone(tiny_llama, head_dir, spec):
    """A lone prompt over several chunks: its first rounds sample nothing (no row reaches the
    prompt's end); output as with one chunk, and the head is fed every chunk's pairs."""
    prompt = [random.Random(5).randrange(3, 300) for _ in range(45)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048).generate(prompt, params)[0].token_ids
    kw = dict(draft=head_dir, tree_budget=False, spec=SpecConfig("eagle2", total_tokens=4, depth=2, top_k=2)) \
        if spec == "eagle2" else {}
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, max_prefill_chunk=16, **kw)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref
    if spec == "eagle2":
        assert out.spec.verify_steps > 0 and llm.runner.drafter.catchup_pairs >= len(prompt) - 16


def test_engine_error_fails_only_that_request(tiny_llama):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    runner = llm.runner
    real = runner.execute
    poison = 299

    def execute(steps):
        if any(poison in s.token_ids for s in steps):
            raise RuntimeError("poisoned token")
        return real(steps)
    runner.execute = execute
    free0 = llm.allocator.num_free_blocks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def main():
        eng = AsyncEngine(llm.loop)
        await eng.start()

        async def run(prompt):
            last = None
            async for out in eng.generate(prompt, params):
                last = out
            return last
        outs = await asyncio.gather(run([5, 6, 7]), run([8, poison, 9]), run([10, 11]))
        alive = eng.alive
        await eng.stop()
        return outs, alive

    outs, alive = asyncio.run(main())
    assert alive
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "poisoned token" in outs[1].error
    assert llm.allocator.num_free_blocks == free0
    runner.execute = real
    assert outs[0].token_ids == llm.generate([5, 6, 7], params)[0].token_ids


# ---- the tree budget ---------------------------------------------------------------------

CONF = tuple(0.9 ** (i + 1) for i in range(31))  # a confident draft



def test_a_sequence_that_can_never_fit_fails_alone_and_other_plan_errors_are_the_loops(tiny_llama):
    """KVCacheTooSmall names its sequence: that request fails, the others run on. Any other
    error while planning is a fault of the loop, reported as itself, not as 'the head of the
    queue cannot fit' failing whichever request waited first."""
    from eagle_serve.scheduler.scheduler import KVCacheTooSmall
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    sched = llm.loop.scheduler
    real = sched.schedule
    free0 = llm.allocator.num_free_blocks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    fault = {}

    def schedule():
        if fault.get("kind") == "too-small":
            victim = next((s for s in sched.waiting if s.prompt_token_ids[0] == 8), None)
            if victim is not None:
                fault.clear()
                sched.allocator.free(victim.table)
                raise KVCacheTooSmall(victim.seq_id, f"KV cache too small: sequence {victim.seq_id}")
        if fault.get("kind") == "bug" and sched.running and not sched.waiting:
            fault.clear()
            raise RuntimeError("a bug in planning")
        return real()
    sched.schedule = schedule

    async def main(kind):
        eng = AsyncEngine(llm.loop)
        await eng.start()
        fault["kind"] = kind

        async def run(prompt):
            last = None
            async for out in eng.generate(prompt, params):
                last = out
            return last
        outs = await asyncio.gather(run([5, 6, 7]), run([8, 9]), run([10, 11]), return_exceptions=True)
        alive, error = eng.alive, eng.error
        await eng.stop()
        return outs, alive, error

    outs, alive, _ = asyncio.run(main("too-small"))
    assert alive and [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "KV cache too small" in outs[1].error
    assert llm.allocator.num_free_blocks == free0
    outs, alive, error = asyncio.run(main("bug"))
    assert not alive and isinstance(error, RuntimeError) and str(error) == "a bug in planning", repr(error)
    assert all("a bug in planning" in str(o) for o in outs), outs
    assert llm.allocator.num_free_blocks == free0

def test_budget_flat_verify_cost_picks_large_trees_steep_picks_small_or_none():
    flat = CostModel([(1, 0.010), (64, 0.0105), (512, 0.012)], [(1, 0.001), (64, 0.002)])
    steep = CostModel([(1, 0.010), (2, 0.020), (64, 0.640)], [(1, 0.001), (64, 0.002)])
    b_flat, b_steep = TreeBudget(flat, BudgetConfig(32, prior=CONF)), TreeBudget(steep, BudgetConfig(32, prior=CONF))
    big = b_flat.choose([8] * 4).sizes
    small = b_steep.choose([8] * 4).sizes
    assert min(big) >= 16
    assert max(small) <= 2
    assert big != small


def test_budget_depends_on_batch_size_and_never_models_below_plain():
    # verify grows with tokens past a knee (compute-bound batches): at batch 1 a big tree is
    # nearly free, at batch 32 it is not
    knee = CostModel([(1, 0.010), (32, 0.011), (64, 0.020), (1024, 0.320)], [(1, 0.002), (32, 0.004)])
    budget = TreeBudget(knee, BudgetConfig(32, prior=CONF))
    one = budget.choose([8]).sizes
    many = budget.choose([8] * 32).sizes
    assert one[0] > max(many)
    rng = random.Random(0)
    for _ in range(200):
        pts = sorted({(1, rng.uniform(0.001, 0.02))} | {(rng.randrange(2, 600), rng.uniform(0.001, 0.5)) for _ in range(4)})
        pts = [(x, y) for x, y in pts]
        costs = CostModel(pts, [(1, rng.uniform(0, 0.01)), (64, rng.uniform(0.01, 0.1))])
        conf = tuple(sorted((rng.random() for _ in range(31)), reverse=True))
        b = TreeBudget(costs, BudgetConfig(32, prior=conf, spec_with_prefill=True))  # the model's choice in prefill rounds too
        n = rng.randrange(1, 40)
        b.choose([rng.randrange(1, 9) for _ in range(n)], prefill_tokens=rng.randrange(0, 100))
        chosen, plain = b.last_modelled
        assert chosen >= plain


def test_budget_calibration_learns_from_accepted_tokens():
    b = TreeBudget(CostModel([(1, 0.01), (64, 0.0101)]), BudgetConfig(16))
    for _ in range(200):
        b.observe(CONF, 8, 2)  # predicted sum(CONF[:7]) ~ 4.2 accepted, only 2 came
    assert 0.4 < b.calibration < 0.55


def _draft(costs: CostModel, levels: list[int]) -> float:
    """Modelled seconds of a draft round with levels[l - 1] sequences drafting level l."""
    return sum(costs.level(lv, n) for lv, n in enumerate(levels, 1))


def test_cost_model_learns_measured_round_times_and_memo_stays_consistent():
    true_v = lambda t: 0.010 + 0.0012 * t  # noqa: E731 - the machine's real verify cost
    true_d = lambda n: 0.002 * n  # noqa: E731
    # a start-up profile off by up to 2x, both ways
    costs = CostModel([(1, 0.020), (4, 0.010), (8, 0.011), (32, 0.100), (64, 0.070)], [(1, 0.004), (8, 0.008)])
    rng = random.Random(0)
    rounds = [(1, 0), (4, 0), (8, 0), (32, 0), (64, 0), (8, 1), (32, 4), (64, 8)]
    for _ in range(3000):
        t, n = rng.choice(rounds)
        costs.verify(rng.randrange(1, 120))  # fill the memo in between, as choose() does
        costs.draft(rng.randrange(1, 12))
        costs.observe(t, n, true_v(t) + true_d(n) * rng.uniform(0.95, 1.05))
    for t, n in rounds:
        assert costs.verify(t) + costs.draft(n) == pytest.approx(true_v(t) + true_d(n), rel=0.05)
    # the memo never serves a value from before an update
    fresh = CostModel(list(costs.verify_points), list(costs.draft_points))
    assert [costs.verify(t) for t in range(1, 200)] == [fresh.verify(t) for t in range(1, 200)]
    assert [costs.draft(n) for n in range(1, 20)] == [fresh.draft(n) for n in range(1, 20)]
    assert costs.observed_rounds == 3000


def test_drafting_rounds_teach_the_draft_cost_not_plain_verify():
    costs = CostModel([(1, 0.010), (8, 0.012)], [(1, 0.004), (8, 0.008)], [(1, 0.001), (8, 0.002)], depth=3)
    verify = [costs.verify(t) for t in range(1, 9)]
    for _ in range(300):  # speculative rounds at one sequence, 4 tokens: 6 ms more than modelled
        costs.observe(4, [1], 0.0179)
    assert [costs.verify(t) for t in range(1, 9)] == verify  # plain rounds of 4 tokens cost what they did
    assert costs.verify(4) + _draft(costs, [1]) == pytest.approx(0.0179, rel=0.02)
    costs.observe(4, [], 0.020)
    assert costs.verify(4) > verify[3]  # a plain round moves verify


def _simulate(budget, true_v, true_d, n_seqs, rounds):
    """Rounds of a budget against a machine whose round time is true_v(tokens) + true_d(drafting);
    returns the chosen sizes of every round."""
    chosen = []
    for _ in range(rounds):
        sizes = list(budget.choose([8] * n_seqs).sizes)
        drafting = sum(1 for s in sizes if s > 1)
        budget.observe_round(sum(sizes), drafting, true_v(sum(sizes)) + true_d(drafting))
        chosen.append(sizes)
    return chosen


@pytest.mark.parametrize("profile", ["verify(8) too cheap", "verify(1) too dear"])
def test_budget_stops_speculating_where_measured_rounds_show_it_does_not_pay(profile):
    """The failure of a noisy start-up profile: it makes speculation look cheap at one sequence.
    Measured rounds correct it either way (speculative rounds correct the tree's cost, the
    exploring plain rounds correct plain's), and the budget settles on plain decoding."""
    true_v = lambda t: 0.010 * (1 + 0.12 * (t - 1))  # noqa: E731 - verify(8) = 1.84 x verify(1)
    true_d = lambda n: 0.004 * n  # noqa: E731
    conf = (0.3, 0.1, 0.04, 0.02, 0.01, 0.005, 0.002)  # no tree pays: 1.3 tokens cost 1.52 rounds at 2
    pts = {"verify(8) too cheap": [(1, 0.010), (2, 0.0102), (4, 0.0104), (8, 0.0108), (16, 0.030)],
           "verify(1) too dear": [(1, 0.018), (2, 0.0181), (4, 0.0182), (8, 0.0184), (16, 0.028)]}[profile]
    budget = TreeBudget(CostModel(pts, [(1, 0.001), (8, 0.008)]), BudgetConfig(8, prior=conf, model_probe_every=0))  # probes: their own tests
    first = budget.choose([8]).sizes
    assert first[0] > 1  # the profile says speculate
    chosen = _simulate(budget, true_v, true_d, 1, 600)
    assert all(s == [1] for s in chosen[-200:])
    assert budget.costs.verify(1) == pytest.approx(0.010, rel=0.05)


def test_budget_explores_plain_rounds_only_while_speculating():
    flat = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.001), (64, 0.002)])
    b = TreeBudget(flat, BudgetConfig(8, prior=CONF, explore_every=8, cost_rate=0, guard_min=0))  # the measured guard's own plain rounds: below
    sizes = [list(b.choose([8] * 2).sizes) for _ in range(64)]
    plain = [i for i, s in enumerate(sizes) if s == [1, 1]]
    assert plain == list(range(7, 64, 8)) and b.explored == 8  # one round in 8, the rest the full tree
    assert all(s == [8, 8] for i, s in enumerate(sizes) if i not in plain)
    steep = CostModel([(1, 0.010), (2, 0.020), (64, 0.640)], [(1, 0.001)])
    b = TreeBudget(steep, BudgetConfig(8, prior=CONF, explore_every=8, cost_rate=0, model_probe_every=0))
    assert all(b.choose([8]).sizes == (1,) for _ in range(64)) and b.explored == 0  # never speculates to explore


def test_measured_guard_stops_speculation_that_measures_slower_than_plain():
    """The model says a tree pays (flat verify, cheap drafts) but the rounds say otherwise: after
    guard_min pure decode rounds of each kind at a batch size, plain, with a speculating probe
    every guard_probe rounds; a batch size whose speculation measures faster keeps it."""
    flat = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.001), (64, 0.002)])

    def run(spec_rate, plain_rate, n, rounds=400, prefill=0, b=None, catchup=0.0, probe_catchup=0.0, **kw):
        b = b or TreeBudget(flat, BudgetConfig(8, explore_every=32, cost_rate=0, guard_min=8, guard_probe=16, **kw))
        kinds = []
        for _ in range(rounds):
            sizes = list(b.choose([8] * n, prefill).sizes)
            spec = any(x > 1 for x in sizes)
            kinds.append(spec)
            committed = n * (2 if spec else 1)
            # a backlog consumed before the draft, timed apart: a probe's, or a chosen round's
            extra = (probe_catchup if b._pending[3] else catchup) if spec else 0.0
            b.observe_round(sum(sizes) + prefill, [n] if spec else [],
                            committed / (spec_rate if spec else plain_rate) + extra, committed=committed, catchup=extra)
        return b, kinds

    b, kinds = run(spec_rate=800.0, plain_rate=1000.0, n=4)
    assert b.measured[4]["plain"][1] >= 8 and b.measured[4]["spec"][1] >= 8
    assert b.guard(4)[0] and b.guarded > 300
    assert sum(kinds[-160:]) == 10  # then plain, but one speculating probe in 16 rounds
    b, kinds = run(spec_rate=1200.0, plain_rate=1000.0, n=4)
    assert not b.guard(4)[0] and b.guarded == 0
    # head pairs a chosen speculating round consumes first (new prompts' pairs, what plain
    # rounds in between left) are what speculating costs: 8 ms of them a round turn the verdict
    # (and probes, whose own backlogs are the plain stretch's, are charged as much)
    b, charged = run(spec_rate=1200.0, plain_rate=1000.0, n=4, catchup=0.008, probe_catchup=0.030)
    assert b.guard(4)[0] and b.measured[4]["spec"][0] == pytest.approx(8 / (8 / 1200 + 0.008), rel=0.06)
    assert 0.0015 < b.catchup_per_seq < 0.002 and sum(charged[-160:]) == 10
    b, _ = run(spec_rate=1200.0, plain_rate=1000.0, n=4, catchup=0.0005)
    assert not b.guard(4)[0] and b.guarded == 0
    assert kinds[:32].count(False) == 8  # plain's rate measured early: one round in 4 until it has 8
    assert kinds[-160:].count(False) == 5  # then only explore_every's one in 32
    # the guard's verdict follows the measurements: speculation that turns faster comes back,
    # though every probe pays the backlog of the plain stretch before it (not charged to it)
    b, _ = run(spec_rate=800.0, plain_rate=1000.0, n=4)
    b, kinds = run(spec_rate=1500.0, plain_rate=1000.0, n=4, b=b, probe_catchup=0.030)
    assert not b.guard(4)[0] and sum(kinds[-100:]) >= 90
    # rounds with a prefill chunk decode plainly; allowed to speculate, they measure nothing
    # (their cost is not decoding's)
    b, kinds = run(spec_rate=800.0, plain_rate=1000.0, n=4, prefill=32, rounds=100)
    assert b.measured == {} and not any(kinds)
    b, kinds = run(spec_rate=800.0, plain_rate=1000.0, n=4, prefill=32, rounds=100, spec_with_prefill=True)
    assert b.measured == {} and kinds.count(False) == 3  # explore_every's plain rounds only
    # the guard is per batch size: measurements at 4 sequences say nothing about 2
    b, _ = run(spec_rate=800.0, plain_rate=1000.0, n=4, spec_with_prefill=True)
    assert b.guard(4)[0] and not b.guard(2)[0]
    # a larger batch size without a measurement of its own takes the plain verdict of the
    # largest smaller one that has one; its own measurement, once there, decides
    assert b.guard(8)[0] and b.guard_verdict(8) is None
    assert all(x == 1 for _ in range(200) for x in list(b.choose([8] * 8).sizes))  # and no probes there
    b2, _ = run(spec_rate=1500.0, plain_rate=1000.0, n=6)
    b2, _ = run(spec_rate=800.0, plain_rate=1000.0, n=4, b=b2)
    assert b2.guard_verdict(6) is False and b2.guard_verdict(4) is True
    assert not b2.guard(8)[0] and b2.guard(5)[0]  # the nearest smaller verdict decides
    # what pure decode rounds measured holds for rounds with a prefill chunk too
    assert sum(any(x > 1 for x in list(b.choose([8] * 4, 32).sizes)) for _ in range(160)) == 10
    assert any(x > 1 for x in list(b.choose([8] * 2).sizes))


def test_model_probes_speculation_it_has_priced_out_and_recovers():
    """A stale drafting cost (a slow spell, a drifted curve) makes the model choose plain; since
    drafting costs are learnt from drafting rounds only, nothing would correct it by itself.
    Where its best tree models close to plain, the budget runs that tree every model_probe_every
    rounds at small batches, the measured rounds correct the cost, and speculation comes back;
    where the model is right, the probes stay one round in model_probe_every."""
    true_v = lambda t: 0.010 + 0.0005 * (t - 1)  # noqa: E731

    def run(true_draft, n=1, rounds=600, **kw):
        stale = CostModel([(1, 0.010), (2, 0.0105), (64, 0.0415)], [(1, 0.0045), (8, 0.0045)])
        b = TreeBudget(stale, BudgetConfig(2, prior=(0.5,), explore_every=0, guard_min=0, **kw))
        kinds = []
        for _ in range(rounds):
            sizes = list(b.choose([8] * n).sizes)
            drafting = sum(1 for x in sizes if x > 1)
            kinds.append(drafting > 0)
            b.observe_round(sum(sizes), drafting, true_v(sum(sizes)) + (true_draft if drafting else 0.0))
        return b, kinds

    assert list(TreeBudget(CostModel([(1, 0.010), (2, 0.0105)], [(1, 0.0045)]), BudgetConfig(2, prior=(0.5,))).choose([8]).sizes) == [1]
    b, kinds = run(true_draft=0.001)  # the draft really costs 1 ms: a 2-token tree gains ~30%
    assert b.model_probes >= 1 and sum(kinds[-100:]) == 100
    assert b.costs.draft(1) == pytest.approx(0.001, rel=0.1)
    b, kinds = run(true_draft=0.001, model_probe_every=0)  # without probes: plain for good
    assert not any(kinds) and b.costs.draft(1) == pytest.approx(0.0045)
    b, kinds = run(true_draft=0.0045)  # the model was right: a probe every 16 rounds, no more
    assert sum(kinds[-160:]) == 10 and b.model_probes == 600 // 16
    b, kinds = run(true_draft=0.001, n=8)  # larger batches are not probed (head backlogs)
    assert not any(kinds)


def test_model_probes_a_tree_priced_far_below_plain_now_and_then():
    """A drafting cost learnt in a slow spell (20 ms where a draft costs 1 ms) prices every tree
    further below plain than the probes' margin: the margin probes never fire, and without the
    far probes nothing is drafted again. With them one round in 64 drafts, each moves the cost
    by a tenth of its error, and once it is back within the margin speculation returns."""
    true_v = lambda t: 0.010 + 0.0005 * (t - 1)  # noqa: E731

    def run(**kw):
        stale = CostModel([(1, 0.010), (2, 0.0105), (64, 0.0415)], [(1, 0.020), (8, 0.020)])
        b = TreeBudget(stale, BudgetConfig(2, prior=(0.5,), explore_every=0, guard_min=0, **kw))
        kinds = []
        for _ in range(1200):
            sizes = list(b.choose([8]).sizes)
            kinds.append(sizes[0] > 1)
            b.observe_round(sum(sizes), int(sizes[0] > 1), true_v(sum(sizes)) + (0.001 if sizes[0] > 1 else 0.0))
        return b, kinds

    b, kinds = run(model_probe_far=0)
    assert not any(kinds) and b.model_probes == 0
    b, kinds = run()
    assert sum(kinds[:320]) == 5  # one in 64 while the tree models far below plain
    assert sum(kinds[-100:]) == 100 and b.costs.draft(1) == pytest.approx(0.001, rel=0.2)


def test_guard_probes_small_batches_more_often():
    """Where the guard holds speculation off, it probes every guard_probe rounds, and every
    model_probe_every at small batches (a one-round rate is noisy, a wrong verdict must turn
    back soon, and a probe there pays little head backlog)."""
    flat = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.001), (64, 0.002)])
    for n, every in ((1, 16), (4, 16), (8, 64)):
        b = TreeBudget(flat, BudgetConfig(8, explore_every=0, cost_rate=0, guard_min=8, guard_probe=64))
        b.measured[n] = {"plain": [1000.0, 8, 0.0, 0], "spec": [800.0, 8, 0.0, 0]}  # measured: speculation loses here
        spec = [any(x > 1 for x in list(b.choose([8] * n).sizes)) for _ in range(256)]
        assert sum(spec) == 256 // every, n


def _noisy_guard_run(p1: float, spec_ms: float, seed: int, n: int = 1, rounds: int = 2000, **kw):
    """A budget whose model says speculate, over rounds whose outcome is random as in serving: each
    speculating sequence gains 0, 1 or 2 tokens (the first with probability p1, the second with
    half that), round times jitter +-10%. Returns (speculating fraction, tokens per second)."""
    costs = CostModel([(1, 0.0122), (2, 0.0126), (3, 0.0130), (4, 0.0140), (8, 0.018), (32, 0.020)],
                      [(1, 0.0030), (8, 0.006)], [(1, 0.0015), (8, 0.003)], depth=2)
    b = TreeBudget(costs, BudgetConfig(4, prior=(0.45, 0.15, 0.05), max_depth=2, cost_rate=0.0, **kw))
    kinds, tok_s = _simulate_rounds(b, n, rounds, p1, spec_ms, 12.2 if n == 1 else 18.0, random.Random(seed))
    return sum(kinds) / rounds, tok_s


def _simulate_rounds(b: TreeBudget, n: int, rounds: int, p1: float, spec_ms: float, plain_ms: float, rng):
    """Rounds of n decoding sequences as the budget chooses them: each speculating sequence gains
    0, 1 or 2 tokens (the first with probability p1, the second with half that), a speculating
    round takes spec_ms and a plain one plain_ms, each +-10%. Returns (per round: whether it
    speculated, tokens per second)."""
    kinds, tokens, seconds = [], 0, 0.0
    for _ in range(rounds):
        sizes = list(b.choose([100] * n).sizes)
        if any(x > 1 for x in sizes):
            acc = [(rng.random() < p1) * (1 + (rng.random() < 0.5)) for _ in range(n)]
            secs = spec_ms / 1e3 * rng.uniform(0.9, 1.1)
            for a, size in zip(acc, sizes):
                b.observe((0.45, 0.15, 0.05), size, a, (1, 1, 2), 1)
            b.observe_round(sum(sizes), [n], secs, committed=n + sum(acc))
            tokens += n + sum(acc)
        else:
            secs = plain_ms / 1e3 * rng.uniform(0.9, 1.1)
            b.observe_round(n, [], secs, committed=n)
            tokens += n
        kinds.append(any(x > 1 for x in sizes))
        seconds += secs
    return kinds, tokens / seconds


def _priced_out_run(spec_ms: float, seed: int, n: int = 4, rounds: int = 2000, **kw):
    """A budget whose cost model prices every tree far below plain at n sequences (a verify of
    2n tokens modelled at twice n's), and cannot learn otherwise (cost_rate 0), over
    _simulate_rounds: plain rounds take 10 ms, speculating ones `spec_ms`. Returns
    (speculating fraction over the last half, tokens per second, the budget)."""
    costs = CostModel([(1, 0.0030), (4, 0.010), (8, 0.020), (16, 0.036), (32, 0.070)],
                      [(1, 0.0020), (8, 0.004)], [(1, 0.0010), (8, 0.002)], depth=2)
    b = TreeBudget(costs, BudgetConfig(4, prior=(0.45, 0.15, 0.05), max_depth=2, cost_rate=0.0, **kw))
    kinds, tok_s = _simulate_rounds(b, n, rounds, 0.45, spec_ms, 10.0, random.Random(seed))
    return sum(kinds[rounds // 2:]) / (rounds - rounds // 2), tok_s, b


def test_guard_promotes_speculation_the_model_prices_out_where_it_measures_faster():
    """The guard's other direction (TreeBudget.guard_promotes): a learnt verify curve can price
    every tree below plain while the model probes measure speculating rounds faster. Where
    speculation measures faster by the guard's margin it runs; where it measures slower, or
    the guard is off, only the probes draft."""
    # truth: 4 + 2.7 tokens per 12 ms round = 558 tok/s against 400 plain
    promoting = [_priced_out_run(12.0, seed) for seed in range(2)]
    model_only = [_priced_out_run(12.0, seed, guard_promote=False) for seed in range(2)]
    assert all(f > 0.8 and b.promoted > 500 for f, _, b in promoting)
    assert all(f < 0.05 and b.promoted == 0 for f, _, b in model_only)
    assert all(r_on > 1.2 * r_off for (_, r_on, _), (_, r_off, _) in zip(promoting, model_only))
    # truth: 6.7 tokens per 20 ms = 335 tok/s against 400: the probes alone, nothing promoted
    for seed in range(2):
        f, _, b = _priced_out_run(20.0, seed)
        assert f < 0.05 and b.promoted == 0


def test_guard_needs_a_significant_loss_to_override_the_model():
    """One sequence's speculating rounds give 1-3 tokens, so their running rate is noisy, and it
    moves only at probes while the guard holds speculation off: a plain comparison of the two
    averages turns a tree that is 18% faster than plain off in about half the rounds. The guard
    overrides the model only where speculation measures slower by more than guard_z standard
    errors; where it is really slower it still holds it off, at one sequence and at eight (where
    a round sums eight sequences' tokens and the margin is small)."""
    # truth: 1.45 tokens per 15 ms round = 97 tok/s against 82 plain
    plain_compare = [_noisy_guard_run(0.3, 15.0, seed, guard_z=0.0) for seed in range(3)]
    significant = [_noisy_guard_run(0.3, 15.0, seed) for seed in range(3)]
    assert sum(f for f, _ in plain_compare) / 3 < 0.6
    assert sum(f for f, _ in significant) / 3 > 0.75
    assert sum(r for _, r in significant) > 1.03 * sum(r for _, r in plain_compare)
    # truth: 1.15 tokens per 18 ms = 64 tok/s against 82: plain but for probes and explorations
    assert all(f < 0.12 for f, _ in (_noisy_guard_run(0.1, 18.0, seed) for seed in range(3)))
    # eight sequences, truth 8 * 1.45 tokens per 25 ms = 464 tok/s against 444 plain: kept (the
    # plain comparison: about half the rounds); per 30 ms = 387: held off. (The model is probed
    # at eight here: its calibration, learnt from speculating rounds only, freezes low otherwise.)
    kw = dict(n=8, model_probe_max_seqs=8)
    assert all(f > 0.7 for f, _ in (_noisy_guard_run(0.3, 25.0, seed, **kw) for seed in range(2)))
    assert all(f < 0.6 for f, _ in (_noisy_guard_run(0.3, 25.0, seed, guard_z=0.0, **kw) for seed in range(2)))
    assert all(f < 0.12 for f, _ in (_noisy_guard_run(0.3, 30.0, seed, **kw) for seed in range(2)))
    # a verdict whose speculating average went stale lapses (the model's choice is measured
    # again); the same verdict inherited by a larger batch size holds
    b = TreeBudget(CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.001), (64, 0.002)]), BudgetConfig(8, guard_min=8))
    b.measured[4] = {"plain": [1000.0, 50, 100.0 ** 2, 0], "spec": [800.0, 50, 400.0 ** 2, 0]}
    assert b.guard_verdict(4) is True and b.guard(8)[0]
    b.rounds = 400  # 400 rounds without a sample: 200 tok/s apart is within the drift
    assert b.guard_verdict(4) is False and b.guard_verdict(4, stale=False) is True and b.guard(8)[0]


def test_plain_rounds_carry_their_per_round_cost_to_larger_forwards():
    """What one sequence's plain rounds measure over the profile (loop overhead, a slow spell)
    a tree of a few tokens at that sequence pays too: the whole curve above moves with it, so
    trees do not look cheaper than plain by that much. Plain rounds of more tokens correct
    their own part of the curve and leave the smaller forwards alone."""
    costs = CostModel([(1, 0.010), (2, 0.0105), (4, 0.0115), (8, 0.0135), (32, 0.030)])
    for _ in range(300):
        costs.observe(1, [], 0.012)  # plain rounds at one sequence: 2 ms over the profile
    assert costs.verify(1) == pytest.approx(0.012, rel=0.01)
    for t, base in ((2, 0.0105), (4, 0.0115), (8, 0.0135), (32, 0.030), (6, 0.0125)):
        assert costs.verify(t) == pytest.approx(base + 0.002, rel=0.01), t
    for _ in range(300):
        costs.observe(32, [], 0.030)  # 32 sequences: their own measurement wins there
    assert costs.verify(32) == pytest.approx(0.030, rel=0.01)
    assert costs.verify(4) == pytest.approx(0.0135, rel=0.01) and costs.verify(1) == pytest.approx(0.012, rel=0.01)


def test_profile_times_small_verify_sizes_interleaved(tiny_llama, monkeypatch):
    """The verify points of one sequence's trees are timed in sweeps, every size once per
    sweep: a slow spell hits every size alike instead of the sizes timed during it. Here the
    machine slows down for the last 7 of the 15 sweeps (each forward 20 ms more): timed one size
    after another, the later sizes would read 20 ms slower than the earlier ones; in sweeps,
    every size keeps its own cost."""
    import torch

    import eagle_serve.engine.profile as prof_mod
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, tree_budget=False)
    runner, clock = llm.runner, {"t": 0.0, "calls": 0}
    per_token = 1e-3

    def forward(spans):
        clock["calls"] += 1
        clock["t"] += 5e-3 + per_token * sum(len(s.token_ids) for s in spans)
        clock["t"] += 20e-3 if clock["calls"] > 9 * 9 else 0.0  # the slow spell: sweeps 9-15
        return torch.zeros(sum(len(s.token_ids) for s in spans), runner.loaded.config.hidden_size,
                           dtype=runner.dtype)
    monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(prof_mod.time, "perf_counter", lambda: clock["t"])
    run = prof_mod.ProfileRun(runner, 16, 1, small_repeats=15)
    while not run.step(list(range(runner.num_blocks))):
        pass
    small = dict(run.verify)
    assert sorted(small) == [t for t in prof_mod.VERIFY_GRID if t <= 16] == run.small
    for t in run.small:  # the median of 8 fast and 7 slow sweeps
        assert abs(small[t] - (5e-3 + per_token * t)) < 1e-9


def test_profile_curve_is_made_non_decreasing():
    from eagle_serve.engine.profile import non_decreasing
    noisy = [(1, 10.4), (2, 10.2), (3, 12.6), (4, 12.4), (5, 11.5), (6, 16.6), (8, 16.3), (12, 21.6)]
    got = non_decreasing(noisy)
    assert [x for x, _ in got] == [x for x, _ in noisy]
    ys = [y for _, y in got]
    assert all(a <= b for a, b in zip(ys, ys[1:]))
    assert ys[0] == ys[1] == pytest.approx(10.3) and ys[2] == ys[3] == ys[4] == pytest.approx(12.1667, rel=1e-4)
    assert ys[5] == ys[6] == pytest.approx(16.45) and ys[7] == 21.6
    assert non_decreasing([(1, 1.0), (2, 2.0)]) == [(1, 1.0), (2, 2.0)]


def test_per_level_draft_cost_and_its_online_correction():
    costs = CostModel([(1, 0.010), (64, 0.020)], [(1, 0.005), (8, 0.013)], [(1, 0.002), (8, 0.005)], depth=4)
    assert costs.level(1, 1) == pytest.approx(0.002) and costs.level(2, 1) == pytest.approx(0.001)
    assert costs.draft(1) == pytest.approx(0.005) and costs.draft(8, depth=2) == pytest.approx(0.005 + 0.008 / 3)
    assert _draft(costs, [8, 8, 1]) == pytest.approx(0.005 + 0.008 / 3 + 0.001)
    true = lambda t, lv: 0.010 + 0.0002 * t + sum(0.003 if i == 0 else 0.0015 * n ** 0.5 for i, n in enumerate(lv))  # noqa: E731
    rng = random.Random(1)
    for _ in range(6000):  # plain rounds of all sizes teach verify, drafting rounds the levels
        lv = sorted((rng.randrange(1, 9) for _ in range(rng.randrange(1, 5))), reverse=True) if rng.random() < 0.5 else []
        t = sum(lv) * 2 + rng.randrange(1, 9) if lv else rng.randrange(1, 80)
        costs.observe(t, lv, true(t, lv))
    for t, lv in [(3, []), (12, [4, 2]), (30, [8, 8, 8, 8]), (9, [1])]:
        assert costs.verify(t) + _draft(costs, lv) == pytest.approx(true(t, lv), rel=0.05)


def test_deep_rounds_leave_the_first_level_cost_to_one_level_rounds():
    """A deep round's excess goes to the further levels' curve only: with full-depth rounds
    alone the first level keeps its profiled cost (drifting up with them, it would price
    one-level trees out); one-level rounds correct it."""
    costs = CostModel([(1, 0.010), (64, 0.020)], [(1, 0.005), (8, 0.013)], [(1, 0.001), (8, 0.005)], depth=5)
    deep = costs.verify(5) + costs.draft(1) + 0.006  # every deep round: 6 ms more than modelled
    for _ in range(300):
        costs.observe(5, [1] * 5, deep)
    assert costs.level(1, 1) == pytest.approx(0.001)
    assert costs.verify(5) + costs.draft(1) == pytest.approx(deep, rel=0.01)
    one = costs.verify(3) + 0.0025  # one-level rounds: 1.5 ms more than modelled
    for _ in range(300):
        costs.observe(3, [1], one)
    assert costs.level(1, 1) == pytest.approx(0.0025, rel=0.01)


def test_further_levels_cost_stays_above_a_quarter_of_the_first_when_it_inflates():
    """Slow one-level rounds inflate the first level's cost; deep rounds, measured below a model
    that takes that inflated first level as right, push the further levels' cost down, but not
    below GROW_FLOOR of the first level's (at a floor near zero deep trees would look as cheap
    as one-level ones)."""
    from eagle_serve.scheduler.budget import GROW_FLOOR
    costs = CostModel([(1, 0.010), (64, 0.020)], [(1, 0.009), (8, 0.02)], [(1, 0.001), (8, 0.005)], depth=5)
    grow = costs.level(2, 1)
    assert grow == pytest.approx(0.002)  # (0.009 - 0.001) / 4 levels
    for _ in range(300):  # one-level rounds 4 ms over the model: the first level climbs to ~5 ms
        costs.observe(4, [1], costs.verify(4) + 0.005)
    first = costs.level(1, 1)
    assert first > 0.004 and GROW_FLOOR * first < grow
    costs.observe(4, [1] * 5, costs.verify(4) + 0.012)  # a deep round a little under the model
    assert GROW_FLOOR * first < costs.level(2, 1) < grow  # learnt down, above the floor
    for _ in range(300):  # deep rounds that really cost the profile's 9 ms of drafting
        costs.observe(4, [1] * 5, costs.verify(4) + 0.009)
    assert costs.level(2, 1) == pytest.approx(GROW_FLOOR * first)  # pushed down to the floor, no further
    assert costs.level(1, 1) == first  # deep rounds leave the first level alone (see above)


SIBLINGS = ((0.45, 0.35, 0.08, 0.05, 0.03, 0.02, 0.01), (1, 1, 2, 2, 1, 2, 3))  # likely first tokens, weak chains


def test_budget_prior_learns_each_depth_from_the_rounds_drafted_that_deep():
    costs = CostModel([(1, 0.010), (64, 0.02)], [(1, 0.005), (8, 0.013)], [(1, 0.002), (8, 0.005)], depth=3)
    b = TreeBudget(costs, BudgetConfig(6, max_depth=3, ema=1.0))  # ema 1: the prior is the last round's
    deep3 = b.prior[2]
    b.observe((0.5, 0.3, 0.2, 0.1), 3, 1, (1, 2, 1, 2), drafted_depth=2)
    assert b.prior[0] == (0.5, 0.2, 0.0, 0.0, 0.0)  # depth <= 1 nodes, best first
    assert b.prior[1] == (0.5, 0.3, 0.2, 0.1, 0.0)
    assert b.prior[2] == deep3  # a depth-2 round says nothing of depth 3
    assert b.calibration == pytest.approx(1 / 0.8)


def test_shared_budget_picks_the_depth_and_size_that_pay():
    # verify nearly flat to 8 tokens per sequence, a level past the first costs 2 ms
    costs = CostModel([(1, 0.010), (8, 0.0105), (64, 0.014), (256, 0.05)], [(1, 0.009), (8, 0.02)],
                      [(1, 0.001), (8, 0.004)], depth=5)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=5, explore_every=0, ema=1.0, research_every=1))
    b.calibration = 1.0
    b.observe(SIBLINGS[0], 8, 1, SIBLINGS[1], drafted_depth=3)
    plan = b.choose([8])
    assert plan.sizes == (4,) and plan.depths == (1,)  # 0.45 + 0.35 + 0.03 at depth 1; depth 2 does not pay
    chain = (tuple(0.9 ** (i + 1) for i in range(5)), tuple(range(1, 6)))
    b.observe(*chain[:1], 6, 4, chain[1], drafted_depth=5)
    b.calibration = 1.0
    assert b.choose([8]) == RoundPlan((6,), (5,), (True,))
    assert b.choose([3]) == RoundPlan((3,), (2,), (True,))  # two tokens left: two levels
    # many sequences: verify grows past 64 tokens, so fewer nodes each, down to plain
    many = list(b.choose([8] * 32).sizes)
    assert max(many) < 6
    b.calibration = 0.05
    assert b.choose([8] * 32) == _uniform(32, 1)


def test_shared_budget_explores_plain_and_full_depth_while_speculating():
    costs = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.005), (8, 0.013)], [(1, 0.0005), (8, 0.001)], depth=4)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=4, explore_every=8, cost_rate=0, ema=1.0, guard_min=0))  # guard: its own test
    b.observe((0.9, 0.8, 0.05), 4, 2, (1, 1, 2), drafted_depth=2)
    rounds = [(plan.sizes, plan.depths[0]) for plan in (b.choose([8]) for _ in range(32))]
    plain = [i for i, (sz, _) in enumerate(rounds) if sz == (1,)]
    full = [i for i, (_, d) in enumerate(rounds) if d == 4]
    assert plain == [7, 15, 23, 31] and full == [3, 11, 19, 27]
    assert all(d == 1 for i, (_, d) in enumerate(rounds) if i not in plain + full)


def test_shared_budget_reuses_its_search_for_a_few_rounds():
    costs = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.005), (8, 0.013)], [(1, 0.0005), (8, 0.001)], depth=4)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=4, explore_every=0, cost_rate=0, ema=1.0, research_every=4))
    b.observe((0.9, 0.8, 0.05), 4, 2, (1, 1, 2), drafted_depth=2)
    first = list(b.choose([8]).sizes)
    assert first[0] > 1
    b.observe((0.001,), 2, 0, (1,), drafted_depth=1)  # the draft turns useless
    b.calibration = 0.01
    assert [list(b.choose([8]).sizes) for _ in range(3)] == [first] * 3  # the search of round 1, reused
    assert list(b.choose([8]).sizes) == [1]  # round 5 searches again
    assert list(b.choose([8] * 2).sizes) == [1, 1]  # another batch size is its own search


@pytest.mark.parametrize("n,min_gain,min_gain_one,drafts", [
    (1, 0.05, 0.05, False), (1, 0.05, 0.0, True), (2, 0.05, 0.0, False), (2, 0.0, 0.0, True)])
def test_budget_speculates_only_past_a_minimum_modelled_gain(n, min_gain, min_gain_one, drafts):
    """A tree modelled 3% over plain runs only where the required gain is below that: min_gain
    for batches, min_gain_one (default 0) for a single sequence."""
    costs = CostModel([(1, 0.010), (64, 0.0101)], [(1, 0.0045), (8, 0.0045)], [(1, 0.004), (8, 0.004)], depth=2)
    b = TreeBudget(costs, BudgetConfig(4, max_depth=2, explore_every=0, cost_rate=0, ema=1.0, min_gain=min_gain, min_gain_one=min_gain_one))
    b.observe((0.442,), 2, 0, (1,), drafted_depth=2)
    b.calibration = 1.0  # one node at 0.442 for ~0.0140 s a round: 3% over plain
    sizes = list(b.choose([8] * n).sizes)
    assert sizes == ([2] * n if drafts else [1] * n)
    chosen, plain = b.last_modelled
    assert chosen >= plain and (chosen / plain > 1.02 if drafts else chosen == plain)
    assert BudgetConfig(4).min_gain_one == 0.0 and BudgetConfig(4).min_gain == 0.05


def test_engine_drafts_no_deeper_than_the_step_asks(tiny_llama, head_dir):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048).generate([5, 6, 7, 8], params)[0].token_ids
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3))
    llm.loop.scheduler.budget = FixedBudget(4, depth=1)
    results = []
    real = llm.runner.execute
    llm.runner.execute = lambda steps: (lambda r: (results.extend(r), r)[1])(real(steps))
    out = llm.generate([5, 6, 7, 8], params)[0]
    assert out.token_ids == ref
    drafted = [r for r in results if r.num_draft_tokens]
    assert drafted and all(r.draft_depth == 1 and r.num_draft_tokens == 3 and r.num_accepted <= 1 for r in drafted)
    assert all(set(r.draft_depths) == {1} for r in drafted)


def test_engine_loop_reports_each_round_to_the_budget(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=8, max_num_batched_tokens=64)
    llm.budget.costs = CostModel([(1, 0.01), (64, 0.0101)])  # free drafts, flat verify: it speculates
    seen = []
    real = llm.budget.observe_round
    llm.budget.observe_round = lambda t, n, s, **kw: (seen.append((t, n, s, kw)), real(t, n, s, **kw))
    before = llm.budget.costs.observed_rounds
    outs = llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert seen[0][:2] == (8, []) and seen[0][3]["prefill"]  # both prompts prefilled in one forward, nothing drafted
    assert not any(kw["prefill"] for _, _, _, kw in seen[1:])
    # the cost model learns from decode rounds only: a prefill round is not what a tree costs
    assert len(seen) == llm.loop.num_steps and llm.budget.costs.observed_rounds - before == len(seen) - 1
    drafted = sum(o.spec.draft_tokens for o in outs)
    # every later round: one root per sequence still running plus the drafted nodes verified
    assert sum(t for t, _, _, _ in seen[1:]) - drafted == sum(len(o.token_ids) for o in outs) - 2 - sum(
        o.spec.accepted_tokens for o in outs)
    assert all(s > 0 for _, _, s, _ in seen)
    # and every token emitted, for the measured guard
    assert sum(kw["committed"] for _, _, _, kw in seen) == sum(len(o.token_ids) for o in outs)
    # levels: sequences drafting each level, at most the 2 sequences, at most depth 3, nested
    assert any(lv for _, lv, _, _ in seen)
    assert all(len(lv) <= 3 and all(2 >= a >= b >= 1 for a, b in zip(lv, lv[1:] + [1])) for _, lv, _, _ in seen)


def test_learnt_verify_curve_never_falls_with_more_tokens():
    """A round of many tokens measured cheap must not make the curve fall there: a forward of
    more tokens never costs less, or large batches' trees look cheaper than their plain rounds.
    Smaller forwards measured dearer come down with it (one of fewer tokens never costs more)."""
    m = CostModel([(1, 0.010), (32, 0.040), (128, 0.085), (192, 0.148), (256, 0.199)])
    for _ in range(200):
        m.observe(192, [], 0.050, rate=0.1)  # far cheaper than even verify(128)
    ys = [m.verify(x) for x in (1, 32, 64, 128, 160, 192, 224, 256, 300)]
    assert all(b >= a for a, b in zip(ys, ys[1:]))
    assert m.verify(192) == pytest.approx(0.050) and m.verify(128) == pytest.approx(0.050)
    assert m.verify(32) == pytest.approx(0.040) and m.verify(256) == pytest.approx(0.101)  # 0.199 - 0.098
    # a slower round still moves its size and every larger one up by its error
    m.observe(32, [], 0.050, rate=1.0)
    assert m.verify(32) == pytest.approx(0.050) and m.verify(256) >= m.verify(192) >= 0.060 - 1e-12


def test_fast_rounds_lower_slower_smaller_forwards_instead_of_flattening_the_curve():
    """A few slow plain rounds of 3 tokens (request turnover over HTTP) and many fast ones of 4:
    the 4-token rounds bring verify(3) down with verify(4) rather than being held above it, so
    verify(4) learns their time and the curve above keeps the profile's shape. Held up by
    verify(3), their error never closed and pulled verify(6..20) down onto it: trees of 20
    tokens priced as plain rounds of 4."""
    prof = [(1, 0.0053), (2, 0.0057), (3, 0.0058), (4, 0.0060), (6, 0.0066), (8, 0.0072), (12, 0.0099),
            (16, 0.0113), (20, 0.0157)]
    m = CostModel(list(prof))
    for i in range(1500):
        if i % 40 == 0:
            m.observe(3, [], 0.0148)
        else:
            m.observe(4, [], 0.0093)
    assert m.verify(4) == pytest.approx(0.0093, rel=0.05)
    # 3 tokens sit between the profile's 0.0058 and the slow rounds' 0.0148, never above verify(4)
    assert 0.0058 < m.verify(3) <= m.verify(4)
    for t in (6, 8, 12, 16, 20):  # the profile's increments over 4 tokens stand
        assert m.verify(t) - m.verify(4) == pytest.approx(dict(prof)[t] - 0.0060, rel=0.02), t
    ys = [m.verify(t) for t in range(1, 24)]
    assert all(b >= a for a, b in zip(ys, ys[1:]))


def test_rounds_with_a_prefill_chunk_teach_the_cost_model_nothing():
    """Unless the budget speculates in prefill rounds, their cost is not what decode rounds of as
    many tokens cost: the cost model leaves them out (the measured guard already does)."""
    b = TreeBudget(CostModel([(1, 0.010), (256, 0.200)]), BudgetConfig(8))
    b.choose([8, 8], prefill_tokens=150)
    b.observe_round(152, [], 0.030, committed=2)
    assert b.costs.observed_rounds == 0 and b.costs.verify(152) == pytest.approx(0.010 + 151 * 0.190 / 255)
    b.observe_round(152, [], 0.030, prefill=True)  # the loop says so, whatever choose was told
    b.observe_round(2, [], 0.012, prefill=False)
    assert b.costs.observed_rounds == 1
    b.config = dataclasses.replace(b.config, spec_with_prefill=True)  # then the curve prices trees in prefill rounds: it learns them
    b.choose([8, 8], prefill_tokens=150)
    b.observe_round(152, [], 0.030, committed=2)
    assert b.costs.observed_rounds == 2


def test_startup_profiler_runs_on_a_tiny_model(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=8, max_num_batched_tokens=64)
    prof = llm.cost_profile
    assert [t for t, _ in prof["verify"]][:4] == [1, 2, 3, 4] and prof["verify"][-1][0] <= 64
    assert [n for n, _ in prof["draft"]] == [n for n, _ in prof["draft_first"]] == [1, 2, 4, 8]
    assert prof["depth"] == 3 and llm.budget.config.max_depth == 3 and llm.budget.costs.per_level
    assert all(s > 0 for _, s in prof["verify"] + prof["draft"])
    ys = [s for _, s in prof["verify"]]
    assert all(a <= b for a, b in zip(ys, ys[1:]))  # a forward of more tokens never costs less
    # its draft points' catch-ups are not counted as the catch-ups of requests
    assert llm.runner.catchup_seconds == 0 and llm.runner.catchup_pairs == 0
    # the profile left nothing behind: generation afterwards equals a fixed-tree engine's
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    fixed = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048)
    assert llm.generate([5, 6, 7, 8], params)[0].token_ids == fixed.generate([5, 6, 7, 8], params)[0].token_ids
    assert llm.loop.scheduler.budget is llm.budget


def test_budget_retires_a_sequence_whose_backlog_would_not_pay_back():
    """A sequence with a large backlog of head pairs and few tokens left decodes plainly (and
    its head is not kept in step) while the others draft; with many tokens left, or before
    any catch-up was timed, it drafts. The per-pair cost is learnt from the rounds' catch-ups."""
    costs = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.005), (8, 0.013)], [(1, 0.0005), (8, 0.001)], depth=4)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=4, explore_every=0, cost_rate=0, ema=1.0, guard_min=0, research_every=1))
    b.observe((0.9, 0.8, 0.05), 4, 2, (1, 1, 2), drafted_depth=2)
    plan = b.choose([8] * 3, backlogs=[5000, 2, 5000], remaining=[10, 10, 10 ** 4])
    sizes = list(plan.sizes)
    assert all(x > 1 for x in sizes) and plan.sync == (True,) * 3  # no per-pair cost yet
    b.observe_round(sum(sizes), [3], 0.06, catchup=0.05, catchup_pairs=1000)
    assert b.catchup_rate == pytest.approx(5e-5)
    b.observe_round(3, [], 0.01, catchup=0.001, catchup_pairs=4)  # too few pairs to time the rate
    assert b.catchup_rate == pytest.approx(5e-5)
    # 5000 pairs cost 0.25 s; drafting saves ~2 ms a token here: not over 10 tokens, over 10^4 yes
    plan = b.choose([8] * 3, backlogs=[5000, 2, 5000], remaining=[10, 10, 10 ** 4])
    assert plan.sizes[0] == 1 and plan.sizes[1] > 1 and plan.sizes[2] > 1
    assert plan.sync == (False, True, True) and plan.depths[0] is None and b.retired == 1
    chosen, plain = b.last_modelled
    assert chosen > plain
    # a round with a prefill chunk decodes plainly, and still keeps the retired one out of sync
    plan = b.choose([8] * 3, 64, backlogs=[5000, 2, 5000], remaining=[10, 10, 10 ** 4])
    assert plan.sizes == (1,) * 3 and plan.sync == (False, True, True)
    # a sequence down to its last token: no draft, and no catch-up of its backlog either
    assert b.choose([1, 8], backlogs=[200, 2], remaining=[1, 10]).sync == (False, True)
    # every sequence retired: plain decoding, and nothing asks the head to keep in step
    assert b.choose([8] * 2, backlogs=[5000, 5000], remaining=[10, 10]) == RoundPlan((1, 1), (None, None), (False, False))


def test_retirement_under_the_guard_leaves_its_probes_alone():
    """Where the measured guard holds speculation off, drafting saves nothing and every sequence
    with a backlog is retired, but a round where the guard's probe is due drafts (and pays the
    backlogs), or the verdict could never be measured again."""
    costs = CostModel([(1, 0.010), (64, 0.0105)], [(1, 0.005), (8, 0.013)], [(1, 0.0005), (8, 0.001)], depth=4)
    b = TreeBudget(costs, BudgetConfig(8, max_depth=4, explore_every=0, cost_rate=0, ema=1.0, research_every=1, guard_probe=4, model_probe_every=0))
    b.observe((0.9, 0.8, 0.05), 4, 2, (1, 1, 2), drafted_depth=2)
    b.catchup_rate = 5e-5
    b.measured[3] = {"plain": [1000.0, 50, 1.0, 0], "spec": [500.0, 50, 1.0, 0]}  # speculation measured slower
    assert b.guard(3)[0]
    rounds = [(plan.sizes, plan.sync) for plan in (b.choose([8] * 3, backlogs=[40, 40, 40], remaining=[100] * 3)
                                                   for _ in range(8))]
    drafted = [i for i, (sizes, _) in enumerate(rounds) if max(sizes) > 1]
    assert drafted == [3, 7]  # the guard's probes, every 4th round at this size
    assert all(sync == (False,) * 3 for i, (_, sync) in enumerate(rounds) if i not in drafted)
    assert b.retired == 18


class AlternatingBudget(RecordingBudget):
    """Speculate one round in nine: idle rounds must keep the head's backlog bounded."""

    def choose(self, caps, prefill_tokens=0, backlogs=None, remaining=None) -> RoundPlan:
        self.rounds += 1
        return _uniform(len(caps), 8 if self.rounds % 9 == 0 else 1)


def _alternating_engine(tiny_llama, head_dir, monkeypatch, budget):
    """Four short requests, their plain outputs, and an EAGLE-2 engine under `budget` whose
    drafter syncs a non-drafting sequence at 5 pending pairs."""
    from eagle_serve.engine.speculative import eagle_drafter
    monkeypatch.setattr(eagle_drafter, "SYNC_BACKLOG", 5)  # small enough for these short requests
    reqs = workload(4, seed=3)
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=4096), reqs)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=4096, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3))
    llm.loop.scheduler.budget = budget
    return reqs, ref, llm


def test_rounds_without_drafting_keep_the_head_in_sync(tiny_llama, head_dir, monkeypatch):
    reqs, ref, llm = _alternating_engine(tiny_llama, head_dir, monkeypatch, AlternatingBudget())
    drafter = llm.runner.drafter
    backlog, seen = [], set()
    real = drafter.propose

    def propose(steps, depths):
        for s in steps:
            if s.seq_id in drafter.states and s.seq_id in seen:  # the first round consumes the prompt
                backlog.append(len(drafter.states[s.seq_id].tokens))
            seen.add(s.seq_id)
        return real(steps, depths)
    drafter.propose = propose
    synced = []
    real_sync = drafter.sync

    def sync(steps):
        before = sum(len(drafter.states[s.seq_id].tokens) for s in steps if s.seq_id in drafter.states)
        real_sync(steps)
        synced.append(before - sum(len(drafter.states[s.seq_id].tokens) for s in steps if s.seq_id in drafter.states))
    drafter.sync = sync
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.verify_steps for o in outs) > 0
    # idle rounds catch up once 5 pairs wait: without it, 8 idle rounds after a drafted one would
    # leave up to 13 pending at the next drafting round
    assert sum(synced) > 0
    assert max(backlog) <= 5


class UnsyncedBudget(AlternatingBudget):
    """AlternatingBudget that retires every sequence it leaves plain (sync False)."""

    def choose(self, caps, prefill_tokens=0, backlogs=None, remaining=None) -> RoundPlan:
        plan = super().choose(caps, prefill_tokens, backlogs, remaining)
        return RoundPlan(plan.sizes, plan.depths, tuple(size > 1 for size in plan.sizes))


def test_a_retired_sequences_head_is_not_kept_in_step_and_its_backlog_is_reported(tiny_llama, head_dir, monkeypatch):
    """A step the budget marks head_sync=False is left out of the drafter's sync (its backlog
    grows until it drafts again), outputs stay exact, and every result reports the backlog
    the drafter holds, which the scheduler hands the budget."""
    reqs, ref, llm = _alternating_engine(tiny_llama, head_dir, monkeypatch, UnsyncedBudget())
    drafter = llm.runner.drafter
    backlog, reported = [], []
    real = drafter.propose

    def propose(steps, depths):
        for s in steps:
            seq = llm.loop._seqs[s.seq_id]
            reported.append((seq.head_backlog, drafter.backlog(s.seq_id)))
            backlog.append(drafter.backlog(s.seq_id))
        return real(steps, depths)
    drafter.propose = propose
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [o.token_ids for o in outs] == ref
    assert drafter.catchup_pairs > 0  # drafting rounds consumed what piled up
    assert max(backlog) > 5  # no sync at 5 pairs: 8 plain rounds pile up 9
    assert reported and all(a == b for a, b in reported)


class ResumingBudget(RecordingBudget):
    """Speculate in rounds 2 and `resume` only, recording what the loop reports."""

    def __init__(self, resume):
        super().__init__()
        self.resume = resume

    def choose(self, caps, prefill_tokens=0, backlogs=None, remaining=None) -> RoundPlan:
        self.rounds += 1
        return _uniform(len(caps), 4 if self.rounds in (2, self.resume) else 1)


def test_head_catch_up_waits_for_the_next_draft_once_the_engine_stops_drafting(tiny_llama, head_dir, monkeypatch):
    """Plain for a long stretch (the budget under load): the head's backlog is not consumed
    round by round (sequences that finish plainly never pay for it) until MAX_BACKLOG; the
    next drafting round consumes it in a forward of its own, timed apart, and the loop keeps
    those seconds out of the cost the budget learns. Outputs stay exact."""
    from eagle_serve.engine.speculative import eagle_drafter
    monkeypatch.setattr(eagle_drafter, "SYNC_BACKLOG", 5)
    monkeypatch.setattr(eagle_drafter, "IDLE_ROUNDS", 8)
    monkeypatch.setattr(eagle_drafter, "MAX_BACKLOG", 1000)
    prompt, params = [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama[0], **KW, kv_cache_tokens=4096).generate(prompt, params)[0].token_ids
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=4096, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=4, depth=3, top_k=2))
    budget = llm.loop.scheduler.budget = ResumingBudget(resume=30)
    drafter = llm.runner.drafter
    pending = []
    real_sync = drafter.sync

    def sync(steps):
        real_sync(steps)
        pending.append(max(len(drafter.states[s.seq_id].tokens) for s in steps))
    drafter.sync = sync
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref
    assert out.spec.verify_steps == 2
    # rounds 3-5 still catch up at 5 pairs; from the 4th idle round on the backlog only grows
    # pending pairs after each plain round: caught up at 5 while the engine drafted within 8
    # rounds, then left to grow until the drafting round 30 (which catches up 22 + 1)
    assert pending[:28] == [0, 1, 2, 3, 4] + list(range(0, 23))
    assert pending[28:] == [1, 2, 3, 4, 0, 1, 2, 3, 4]  # drafted recently again: caught up at 5
    assert drafter.catchup_seconds > 0
    by_round = {r: (sec, cu) for r, sec, cu, _ in budget.seen}
    assert by_round[30][1] > 0 and by_round[30][1] < by_round[30][0]  # the resuming round's catch-up
    pairs = {r: n for r, _, _, n in budget.seen}
    assert pairs[30] == 22 and sum(pairs.values()) == drafter.catchup_pairs  # and the pairs it consumed
    assert all(cu == 0 for r, (_, cu) in by_round.items() if 8 < r < 30)  # the stretch without catch-ups
    # with the default limit the same engine would have caught up every SYNC_BACKLOG pairs
    monkeypatch.setattr(eagle_drafter, "IDLE_ROUNDS", 10 ** 6)
    llm.loop.scheduler.budget = ResumingBudget(resume=30)
    pending.clear()
    assert llm.generate(prompt, params)[0].token_ids == ref
    assert max(pending) <= 5


def test_heap_trimmer_runs_on_its_interval_and_when_idle(monkeypatch):
    from eagle_serve.scheduler import async_engine
    calls = []
    trim = async_engine._HeapTrimmer(interval=60.0)
    if trim._fn is None:
        pytest.skip("no malloc_trim in this C library")
    trim._fn = lambda pad: calls.append(pad)
    trim.maybe()
    assert calls == []  # busy, interval not reached
    trim.maybe(idle=True)
    trim.maybe(idle=True)  # idle again within a second: once is enough
    assert calls == [0]
    trim.last -= 61
    trim.maybe()
    assert calls == [0, 0]
    assert async_engine._HeapTrimmer(interval=None)._fn is None


def test_model_is_built_and_stepped_on_one_engine_thread(tiny_llama, monkeypatch):
    """Every torch computation runs on the process's engine thread (scheduler/worker.py): the
    load and start-up profile, LLM.generate, and the async engine's steps; a model built on one
    thread and stepped on another decodes slower."""
    import threading
    from eagle_serve.engine.model_runner import ModelRunner
    seen = {"init": set(), "execute": set()}
    real_init, real_execute = ModelRunner.__init__, ModelRunner.execute

    def init(self, *a, **k):
        seen["init"].add(threading.get_ident())
        real_init(self, *a, **k)

    def execute(self, steps):
        seen["execute"].add(threading.get_ident())
        return real_execute(self, steps)
    monkeypatch.setattr(ModelRunner, "__init__", init)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)
    llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))

    async def run():
        engine = AsyncEngine(llm.loop)
        await engine.start()
        async for _ in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0)):
            pass
        await engine.stop()
    asyncio.run(run())
    assert len(seen["init"]) == 1 and seen["execute"] == seen["init"]
    assert threading.get_ident() not in seen["init"]


def test_contended_profile_is_taken_again_and_keeps_the_fastest_points(tiny_llama, head_dir, monkeypatch):
    """Another process busy on the cores makes every forward of a start-up profile slower: an
    attempt whose thread gets too little of the wall time is repeated, and each point keeps its
    fastest time."""
    import eagle_serve.engine.profile as prof_mod
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, max_num_batched_tokens=32)
    shares, attempts = iter([0.4, 0.95]), []
    real_once = prof_mod._profile_once

    def once(*a):
        v, d, f = real_once(*a)
        if not attempts:  # the contended attempt: everything 3x slower
            v, d, f = ([(x, 3 * y) for x, y in pts] for pts in (v, d, f))
        attempts.append((v, d, f))
        return v, d, f
    monkeypatch.setattr(prof_mod, "_profile_once", once)
    monkeypatch.setattr(prof_mod.CpuShare, "share", property(lambda self: next(shares)))
    out = prof_mod.profile_costs(llm.runner, 32, 4, wait=0.0, min_share=0.75)
    assert out["cpu_share"] == [0.4, 0.95] and not out["contended"] and len(attempts) == 2
    best = {x: min(y for v, _, _ in attempts for xx, y in v if xx == x) for x, _ in attempts[0][0]}
    assert out["verify"] == prof_mod.non_decreasing(sorted(best.items()))
    assert out["draft_first"] == [(n, min(a[2][i][1] for a in attempts)) for i, (n, _) in enumerate(attempts[0][2])]
    # contended every time: all attempts run, and the result says so
    attempts.clear()
    monkeypatch.setattr(prof_mod.CpuShare, "share", property(lambda self: 0.3))
    out = prof_mod.profile_costs(llm.runner, 32, 4, wait=0.0, attempts=3, min_share=0.75)
    assert out["cpu_share"] == [0.3] * 3 and out["contended"] and len(attempts) == 3


def test_contended_start_up_profile_is_retaken_when_idle(tiny_llama, head_dir, monkeypatch):
    """A profile contended in every attempt is used (nothing better yet) and taken again when
    the engine is next idle, over KV blocks no sequence holds and no prefix caches; a clean one
    replaces the budget's costs, and cached prefixes still give the same output."""
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)  # no attempt can reach it: contended
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(CostProfiles, "REPROFILE_AFTER", 0.0)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, max_num_batched_tokens=32)
    assert [(len(p["cpu_share"]), p["contended"], p["used"]) for p in llm.cost_profiles.history] == [(3, True, True)]
    assert llm.loop.idle_due()
    prompt, params = list(range(5, 29)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids  # re-profiles before it runs: contended again, not used
    assert [(p["contended"], p["used"]) for p in llm.cost_profiles.history] == [(True, True), (True, False)]
    costs, hits = llm.budget.costs, llm.allocator.prefix_hit_tokens
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 0.0)  # the machine is free again
    again = llm.generate(prompt, params)[0].token_ids
    assert [(p["contended"], p["used"]) for p in llm.cost_profiles.history][-1] == (False, True)
    assert llm.budget.costs is not costs and llm.cost_profile["contended"] is False
    assert llm.loop.idle_due_in() is None and not llm.loop.idle_due()
    assert again == first and llm.allocator.prefix_hit_tokens > hits  # the cached prefix survived
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_async_engine_runs_idle_work_while_no_request_is_running(tiny_llama):
    """The serving loop wakes for due idle work even with no request arriving, runs it on the
    engine thread, and serves requests as before."""
    import threading
    import time as time_mod
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=1024)

    class Work:
        def __init__(self):
            self.at, self.threads = time_mod.monotonic() + 0.1, []

        def idle_due_in(self):
            return None if self.at is None else self.at - time_mod.monotonic()

        def run_idle(self):
            self.threads.append(threading.get_ident())
            self.at = None
    work = llm.loop.idle_work = Work()

    async def run():
        engine = AsyncEngine(llm.loop)
        await engine.start()
        await asyncio.sleep(0.5)
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))]
        await engine.stop()
        return outs
    outs = asyncio.run(run())
    assert len(work.threads) == 1 and work.threads[0] != threading.get_ident()
    assert outs[-1].finished and len(outs[-1].token_ids) == 4


def test_idle_profile_over_fewer_blocks_keeps_the_current_curve_beyond_its_grid():
    from eagle_serve.engine.profile import extend
    old = {"verify": [(1, 0.04), (4, 0.05), (16, 0.10), (64, 0.30)], "draft": [(1, 0.004), (8, 0.02)],
           "draft_first": [(1, 0.002), (8, 0.01)], "depth": 3}
    new = {"verify": [(1, 0.01), (4, 0.0125)], "draft": [(1, 0.001)], "draft_first": [(1, 0.0005), (8, 0.0025)],
           "depth": 3, "contended": False}
    out = extend(new, old)
    assert out["verify"] == [(1, 0.01), (4, 0.0125), (16, 0.025), (64, 0.075)]  # old x new(4) / old(4)
    assert out["draft"] == [(1, 0.001), (8, 0.005)] and out["draft_first"] == new["draft_first"]
    assert out["depth"] == 3 and out["contended"] is False


def test_idle_profile_that_fits_nothing_keeps_the_current_curves(tiny_llama, head_dir, monkeypatch):
    """Once the prefix cache holds nearly every block, the idle-time profile fits no draft point
    and only verify points at a shortened context. A kind without points keeps its current curve
    (an empty one would make drafting cost nothing to the budget), and verify points need the
    profile's whole context, as the curve they join was measured over it."""
    from eagle_serve.engine.profile import extend
    old = {"verify": [(1, 0.04), (4, 0.05)], "draft": [(1, 0.004)], "draft_first": [(1, 0.002)], "depth": 3}
    out = extend({"verify": [(1, 0.01)], "draft": [], "draft_first": [], "depth": 3, "contended": False}, old)
    assert out["draft"] == old["draft"] and out["draft_first"] == old["draft_first"]
    assert out["verify"] == [(1, 0.01), (4, 0.0125)]
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)  # the start-up profile is contended
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(CostProfiles, "REPROFILE_AFTER", 0.0)
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", block_size=16, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), max_num_seqs=4, max_num_batched_tokens=64)
    draft, first = llm.budget.costs.draft_points, llm.budget.costs.first_points
    assert draft and first
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(64)] for _ in range(40)]  # distinct: they fill the cache
    monkeypatch.setattr(CostProfiles, "MAX_PROFILES", 1)  # no idle profile while these run
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    free = llm.allocator.take_uncached()
    few = len(free.blocks)
    llm.allocator.free(free)
    assert few < 8  # the rest cache prefixes
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 0.0)  # the machine is free again
    monkeypatch.setattr(CostProfiles, "MAX_PROFILES", 10)
    llm.cost_profiles.due_at = 0.0
    llm._finish_idle()
    costs = llm.budget.costs
    assert costs.draft_points == draft and costs.first_points == first
    assert costs.draft(4, 4) > 0
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_idle_profile_runs_a_point_at_a_time_and_requests_run_between_points(tiny_llama, head_dir, monkeypatch):
    """The idle-time profile measures one point per idle turn, its KV blocks back after each: a
    request arriving meanwhile runs next (same output), and the profile then goes on where it
    stopped; only the finished clean profile replaces the budget's costs."""
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)  # the start-up profile is contended
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(CostProfiles, "REPROFILE_AFTER", 0.0)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, max_num_batched_tokens=32)
    prompt, params = list(range(5, 29)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = llm.generate(prompt, params)[0].token_ids  # drains one idle profile (contended again)
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr(CostProfiles, "MAX_PROFILES", 10)
    llm.cost_profiles.due_at = 0.0  # due now
    costs, n_profiles = llm.budget.costs, len(llm.cost_profiles.history)
    llm.loop.run_idle()  # one step: the first sweep over the small verify sizes (a warm-up)
    run = llm.cost_profiles.run
    assert run is not None and not run.verify and not run.draft and not run.done
    assert llm.loop.idle_due() and llm.loop.idle_due_in() == 0.0
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    seq = llm.loop.add_request(prompt, params)  # a request arrives: it runs before the next point
    assert not llm.loop.idle_due()
    assert llm.loop.run_to_completion()[seq.seq_id].token_ids == expected
    assert llm.cost_profiles.run is run and llm.budget.costs is costs and len(llm.cost_profiles.history) == n_profiles
    points = 1
    while llm.cost_profiles.under_way:
        llm.loop.run_idle()
        points += 1
    # a step per sweep (the warm-up's and small_repeats more), per larger verify point, per draft point
    sweeps, larger = run.small_repeats + 1, len(run.verify) - len(run.small)
    assert run.small and [t for t, _ in run.verify[:len(run.small)]] == run.small
    assert points == sweeps + larger + len(run.draft) and len(run.draft) == len(run.first) >= 1
    assert llm.budget.costs is not costs and llm.cost_profiles.history[-1]["used"] and not llm.cost_profiles.history[-1]["contended"]
    assert llm.loop.idle_due_in() is None
    assert llm.generate(prompt, params)[0].token_ids == expected
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_async_engine_serves_a_request_that_arrives_during_the_idle_profile(tiny_llama, head_dir, monkeypatch):
    """Over the serving loop: a request submitted while the idle-time profile is under way is
    answered before the profile ends (it waits for one point, not the whole profile)."""
    import time as time_mod
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(CostProfiles, "REPROFILE_AFTER", 0.0)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, max_num_batched_tokens=32)
    real_step, points = prof_mod.ProfileRun.step, []

    def slow_step(self, blocks):
        time_mod.sleep(0.05)
        points.append(time_mod.monotonic())
        return real_step(self, blocks)
    monkeypatch.setattr(prof_mod.ProfileRun, "step", slow_step)

    async def run():
        engine = AsyncEngine(llm.loop)
        await engine.start()
        while len(points) < 2:  # the idle profile is under way
            await asyncio.sleep(0.01)
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))]
        done_at, under_way = time_mod.monotonic(), llm.cost_profiles.under_way
        while llm.cost_profiles.under_way:
            await asyncio.sleep(0.02)
        await engine.stop()
        return outs, done_at, under_way
    outs, done_at, under_way = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    assert under_way and done_at < points[-1]  # answered before the profile's last point
    assert llm.cost_profiles.history[-1]["contended"] and llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_failing_idle_profile_fails_no_request_and_is_not_retried(tiny_llama, head_dir, monkeypatch):
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(CostProfiles, "REPROFILE_AFTER", 0.0)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, max_num_batched_tokens=32)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("profile failed")
    monkeypatch.setattr(prof_mod.ProfileRun, "step", broken)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm.loop.idle_due()
    out = llm.generate([5, 6, 7, 8], params)[0]
    assert len(out.token_ids) == 6 and calls == [1]
    llm.generate([5, 6, 7, 8], params)
    assert calls == [1] and llm.loop.idle_due_in() is None
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_plain_rounds_give_their_scratch_reservation_back(tiny_llama, head_dir):
    """A decoding sequence the budget decodes plainly holds the blocks of one more token, as
    without speculation; one that drafts holds its scratch slots. Outputs are unchanged."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048).generate([5, 6, 7, 8], params)[0].token_ids
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=3))
    sched = llm.loop.scheduler
    budget = sched.budget = FixedBudget(1)
    assert sched.spec_slots == 8
    for size, scratch in ((1, 1), (8, 8)):
        budget.size = size
        held = []
        real = sched.schedule

        def schedule():
            out = real()
            held.extend((s.table.num_committed, len(s.table.blocks)) for s in out if s.num_scheduled == 1)
            return out

        sched.schedule = schedule
        assert llm.generate([5, 6, 7, 8], params)[0].token_ids == ref
        sched.schedule = real
        assert held and all(n == -(-(c + scratch) // 4) for c, n in held), (size, held)
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def test_a_prompts_one_token_last_chunk_reserves_one_slot():
    # computed as a prompt (no tree on it), it still reserved a tree's scratch: 12 slots for 1
    from eagle_serve.scheduler.block_allocator import BlockAllocator
    from eagle_serve.scheduler.scheduler import Scheduler, SchedulerConfig
    from eagle_serve.scheduler.sequence import Sequence
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=128, max_prefill_chunk=8), alloc, frozenset(), spec_tokens=5,
                      spec_slots=12, tree_tokens=8)
    a = Sequence(0, list(range(10, 19)), SamplingParams(max_tokens=4, ignore_eos=True), 0, alloc.new_table())
    sched.add(a)
    sched.update(sched.schedule(), [])  # its first 8 prompt tokens
    step = sched.schedule()  # its last one
    assert step == [a] and a.num_scheduled == 1 and not a.decoding
    assert len(a.table.blocks) == 3  # 9 tokens in blocks of 4 (the scratch made it 5)


def test_llm_builds_its_budget_with_the_given_overrides_and_profile_context(tiny_llama, head_dir, monkeypatch):
    """LLM(budget_overrides=..., profile_context=...) reaches the budget's config and the start-up
    profile; an unknown budget field is refused."""
    import eagle_serve.engine.profile as prof_mod
    contexts = []
    real = prof_mod.ProfileRun.__init__

    def spy(self, runner, max_tokens, max_seqs, context=None, *a, **k):
        contexts.append(context)
        real(self, runner, max_tokens, max_seqs, context, *a, **k)

    monkeypatch.setattr(prof_mod.ProfileRun, "__init__", spy)
    spec = SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir, spec=spec, max_num_seqs=4,
              max_num_batched_tokens=32, budget_overrides={"guard_z": 2.5, "min_gain": 0.2}, profile_context=16)
    assert (llm.budget.config.guard_z, llm.budget.config.min_gain) == (2.5, 0.2)
    assert llm.budget.config.min_gain_one == BudgetConfig(8).min_gain_one
    started = len(contexts)
    llm.cost_profiles.due_at = 0.0  # an idle-time profile measures at the same context, so its curve joins
    llm.loop.run_idle()
    assert started and len(contexts) == started + 1 and set(contexts) == {16}
    with pytest.raises(TypeError, match="no_such_field"):
        LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir, spec=spec, max_num_seqs=4,
            max_num_batched_tokens=32, budget_overrides={"no_such_field": 1})


def _budget_llm(tiny_llama, head_dir, **kw):
    return LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
               spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=4, **kw)


def test_a_second_start_reads_the_cost_profile_from_the_cache(tiny_llama, head_dir, tmp_path, monkeypatch):
    """A clean start-up profile is stored; an engine built the same way reads it instead of
    profiling; a changed key (the engine config, the model's files) profiles again."""
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setenv("EAGLE_SERVE_PROFILE_CACHE", str(tmp_path / "profiles"))
    calls = []
    real = prof_mod.profile_costs
    monkeypatch.setattr(prof_mod, "profile_costs", lambda *a, **k: calls.append((k["max_tokens"], k["max_seqs"])) or real(*a, **k))
    first = _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=32)
    assert len(calls) == 1 and len(list((tmp_path / "profiles").iterdir())) == 1
    second = _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=32)
    assert len(calls) == 1  # read, not measured
    assert second.cost_profile == first.cost_profile
    assert second.budget.costs.verify_points == first.budget.costs.verify_points
    _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=48)  # another config: another key
    assert calls == [(32, 4), (48, 4)]
    weights = next(p for p in Path(tiny_llama[0]).iterdir() if p.suffix == ".safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the model's files changed
    _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=32)
    assert len(calls) == 3
    # the cache off: always measured
    monkeypatch.setenv("EAGLE_SERVE_PROFILE_CACHE", "off")
    _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=32)
    assert len(calls) == 4


def test_a_contended_profile_is_not_cached_and_its_retries_back_off_then_stop(tiny_llama, head_dir, tmp_path,
                                                                              monkeypatch):
    """Contended profiles are never stored; idle-time retries wait twice as long each time and
    stop after MAX_PROFILES, leaving no idle work due."""
    import eagle_serve.engine.profile as prof_mod
    monkeypatch.setenv("EAGLE_SERVE_PROFILE_CACHE", str(tmp_path / "profiles"))
    monkeypatch.setattr(prof_mod, "MIN_CPU_SHARE", 2.0)  # every attempt contended
    monkeypatch.setattr(prof_mod, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(prof_mod, "profile_costs", functools.partial(prof_mod.profile_costs, attempts=1))
    llm = _budget_llm(tiny_llama, head_dir, max_num_batched_tokens=32)
    profiles = llm.cost_profiles
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").iterdir())
    waits = []
    while profiles.idle_due_in() is not None:
        waits.append(round(profiles.due_at - time.monotonic()))
        profiles.due_at = time.monotonic()  # due now
        while True:  # the idle-time profile, a point at a time
            llm.loop.run_idle()
            if not profiles.under_way:
                break
    assert waits == [10, 20, 40]
    assert len(profiles.history) == CostProfiles.MAX_PROFILES and all(p["contended"] for p in profiles.history)
    assert not llm.loop.idle_due()
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").iterdir())
