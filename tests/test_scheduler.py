"""The asyncio scheduler: continuous batching, chunked prefill, prefix caching, preemption,
aborts, per-sequence errors and the load-aware tree budget (tiny float64 models: exact)."""
from __future__ import annotations

import asyncio
import random

import pytest

from engine.sampling_params import SamplingParams
from engine.spec.config import SpecConfig
from scheduler.async_engine import AsyncEngine
from scheduler.budget import CostModel, TreeBudget
from server.llm import LLM
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


def test_budget_flat_verify_cost_picks_large_trees_steep_picks_small_or_none():
    flat = CostModel([(1, 0.010), (64, 0.0105), (512, 0.012)], [(1, 0.001), (64, 0.002)])
    steep = CostModel([(1, 0.010), (2, 0.020), (64, 0.640)], [(1, 0.001), (64, 0.002)])
    b_flat, b_steep = TreeBudget(flat, 32), TreeBudget(steep, 32)
    big = b_flat.choose([CONF] * 4, [8] * 4)
    small = b_steep.choose([CONF] * 4, [8] * 4)
    assert min(big) >= 16
    assert max(small) <= 2
    assert big != small


def test_budget_depends_on_batch_size_and_never_models_below_plain():
    # verify grows with tokens past a knee (compute-bound batches): at batch 1 a big tree is
    # nearly free, at batch 32 it is not
    knee = CostModel([(1, 0.010), (32, 0.011), (64, 0.020), (1024, 0.320)], [(1, 0.002), (32, 0.004)])
    budget = TreeBudget(knee, 32)
    one = budget.choose([CONF], [8])
    many = budget.choose([CONF] * 32, [8] * 32)
    assert one[0] > max(many)
    rng = random.Random(0)
    for _ in range(200):
        pts = sorted({(1, rng.uniform(0.001, 0.02))} | {(rng.randrange(2, 600), rng.uniform(0.001, 0.5)) for _ in range(4)})
        pts = [(x, y) for x, y in pts]
        costs = CostModel(pts, [(1, rng.uniform(0, 0.01)), (64, rng.uniform(0.01, 0.1))])
        b = TreeBudget(costs, 32)
        n = rng.randrange(1, 40)
        confs = [tuple(sorted((rng.random() for _ in range(31)), reverse=True)) for _ in range(n)]
        b.choose(confs, [rng.randrange(1, 9) for _ in range(n)], prefill_tokens=rng.randrange(0, 100))
        chosen, plain = b.last_modelled
        assert chosen >= plain


def test_budget_calibration_learns_from_accepted_tokens():
    b = TreeBudget(CostModel([(1, 0.01), (64, 0.0101)]), 16)
    for _ in range(200):
        b.observe(CONF, 8, 2)  # predicted sum(CONF[:7]) ~ 4.2 accepted, only 2 came
    assert 0.4 < b.calibration < 0.55


def test_startup_profiler_runs_on_a_tiny_model(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048, draft=head_dir,
              spec=SpecConfig("eagle2", total_tokens=8, depth=3, top_k=2), max_num_seqs=8, max_num_batched_tokens=64)
    prof = llm.cost_profile
    assert [t for t, _ in prof["verify"]][:4] == [1, 2, 3, 4] and prof["verify"][-1][0] <= 64
    assert [n for n, _ in prof["draft"]] == [1, 2, 4, 8]
    assert all(s > 0 for _, s in prof["verify"] + prof["draft"])
    # the profile left nothing behind: generation afterwards equals a fixed-tree engine's
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    fixed = LLM(tiny_llama[0], **KW, kv_cache_tokens=2048)
    assert llm.generate([5, 6, 7, 8], params)[0].token_ids == fixed.generate([5, 6, 7, 8], params)[0].token_ids
    assert llm.loop.scheduler.budget is llm.budget


class AlternatingBudget:
    """Speculate one round in nine: idle rounds must keep the head's backlog bounded."""

    def __init__(self):
        self.rounds = 0

    def choose(self, confidences, caps, prefill_tokens=0):
        self.rounds += 1
        return [8 if self.rounds % 9 == 0 else 1 for _ in confidences]

    def observe(self, *args):
        pass


def test_rounds_without_drafting_keep_the_head_in_sync(tiny_llama, head_dir, monkeypatch):
    from engine.spec import eagle_drafter
    monkeypatch.setattr(eagle_drafter, "SYNC_BACKLOG", 5)  # small enough for these short requests
    reqs = workload(4, seed=3)
    ref = one_at_a_time(LLM(tiny_llama[0], **KW, kv_cache_tokens=4096), reqs)
    llm = LLM(tiny_llama[0], **KW, kv_cache_tokens=4096, draft=head_dir, tree_budget=False,
              spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3))
    llm.loop.scheduler.budget = AlternatingBudget()
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


def test_heap_trimmer_runs_on_its_interval_and_when_idle(monkeypatch):
    from scheduler import async_engine
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
    thread and stepped on another decodes at ~0.6x on the 2-core CPU (bench/bench_threads.py)."""
    import threading
    from engine.model_runner import ModelRunner
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
