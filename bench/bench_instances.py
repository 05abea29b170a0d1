#!/usr/bin/env python
"""How much two builds of the same engine differ: several engines (e.g. off,off,on-plain,on-plain;
kinds as bench_serve.build_engine), each with the same N requests admitted and prefilled, then
--rounds plain decode rounds each, interleaved round by round (the starting engine rotating), so
machine drift hits all alike. Per instance: median round time (plan, engine step, outputs) and
its engine-step phases. The spread between instances of one kind is the bias a benchmark that
builds each engine once carries into every repetition (bench_serve --instances).

    .venv/bin/python bench/bench_instances.py --engines off,off,on-plain,on-plain --seqs 16
    .venv/bin/python bench/bench_instances.py --engines on-plain,off,on-nodraft,on-nofeat --rounds 100
    .venv/bin/python bench/bench_instances.py --engines off,off+lifo,on-nodraft,on-nodraft+lifo
Writes --out (bench/results/instances.json).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_serve as bs  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402


def build(kind: str):
    """bench_serve's kinds, and variants that take one difference between "on-plain" and "off"
    away: on-nodraft (on-plain with its drafter replaced by none after the build: no head work
    at all), on-nofeat (its drafter keeps no features: observe and sync do nothing), off-slots
    ("off" reserving on's scratch slots past each sequence's committed length every round),
    on-noslots (on-plain reserving none), on-noaux (on-nofeat whose target forward returns no
    fused-head features either), on-noretire ("on" whose budget retires no sequence for its
    backlog of head pairs: the budget before session 26). Any kind may end in modifiers: +lifo (the block
    allocator hands out the block freed last, its order before the lowest-id heap), +shuffle
    (the free blocks in a random order to start with, then the block freed last), +hold (plain
    rounds keep their scratch reservation instead of giving it back; +hold+lifo is "on-plain"
    as it was before either change), +lazyfeat (the drafter's feature cache in fresh memory that
    no page of has been touched, as torch.empty left it before session 42)."""
    from engine.spec.config import SpecConfig
    from engine.spec.drafters import NoDrafter
    kind, *mods = kind.split("+")
    base = {"on-nodraft": "on-plain", "on-nofeat": "on-plain", "on-noaux": "on-plain", "off-slots": "off",
            "on-noslots": "on-plain", "on-noretire": "on"}
    llm = bs.build_engine(base.get(kind, kind))
    if kind == "on-nodraft":
        llm.runner.drafter = NoDrafter()
    elif kind == "on-nofeat":
        # the runner hands a round's features over through observe_many (since session 25)
        llm.runner.drafter.observe = llm.runner.drafter.observe_many = lambda *a, **k: None
        llm.runner.drafter.sync = lambda *a, **k: None
    elif kind == "on-noaux":
        llm.runner.model.set_aux_layers(())
        llm.runner.drafter.observe = llm.runner.drafter.observe_many = lambda *a, **k: None
        llm.runner.drafter.sync = lambda *a, **k: None
    elif kind == "on-noretire":
        llm.budget._retire = lambda caps, *a, **k: [False] * len(caps)
    elif kind == "off-slots":
        llm.loop.scheduler.spec_slots = SpecConfig("eagle2").scratch_slots
    elif kind == "on-noslots":
        llm.loop.scheduler.spec_slots = 1
    for mod in mods:
        alloc = llm.allocator
        if mod == "lifo":
            alloc.set_order(lowest_first=False)
        elif mod == "shuffle":  # a random order to start with, then the block freed last
            alloc.set_order(lowest_first=False)
            random.Random(0).shuffle(alloc._free)
        elif mod == "hold":
            llm.loop.scheduler.release_scratch = False
        elif mod == "lazyfeat":  # the head's feature cache as it was before session 42: never touched
            import torch
            f = llm.runner.drafter.features
            llm.runner.drafter.features = torch.empty(f.shape, dtype=f.dtype, device=f.device)
        else:
            raise SystemExit(f"unknown modifier +{mod} (+lifo, +shuffle, +hold, +lazyfeat)")
    return llm


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="off,off,on-plain,on-plain")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "instances.json"))
    args = ap.parse_args(argv)
    kinds = args.engines.split(",")
    engines = [build(k) for k in kinds]
    prompts = bs.load_prompts(args.seqs)
    first = []  # each engine's first all-decode step, planned and not yet run
    for llm in engines:  # admit and prefill until every sequence decodes one token a round
        loop = llm.loop
        for p in prompts[:args.seqs]:
            loop.add_request(p["ids"], SamplingParams(max_tokens=args.rounds + 64, temperature=0, ignore_eos=True))
        while True:
            seqs, steps = loop.plan()
            if len(steps) == args.seqs and all(len(s.token_ids) == 1 for s in steps):
                first.append((seqs, steps))
                break
            loop.complete(seqs, loop.execute(seqs, steps))
    source = bd.source_digest()
    rounds = [[] for _ in engines]
    phases = [[] for _ in engines]
    tokens = [[] for _ in engines]
    for it in range(args.rounds):
        k = it % len(engines)
        for i in list(range(k, len(engines))) + list(range(k)):
            loop, tm = engines[i].loop, engines[i].runner.timings
            before = (tm.draft, tm.verify, tm.accept)
            t0 = time.perf_counter()
            seqs, steps = loop.plan() if it else first[i]
            out = loop.execute(seqs, steps)
            loop.complete(seqs, out)
            rounds[i].append(time.perf_counter() - t0)
            phases[i].append(tuple(a - b for a, b in zip((tm.draft, tm.verify, tm.accept), before)))
            tokens[i].append(tuple(tuple(r.token_ids) for r in out))
    rows = []
    for i, kind in enumerate(kinds):
        d, v, a = (statistics.median(p) for p in zip(*phases[i]))
        rows.append({"instance": i, "kind": kind, "round_ms_median": 1e3 * statistics.median(rounds[i]),
                     "draft_ms": 1e3 * d, "verify_ms": 1e3 * v, "accept_ms": 1e3 * a,
                     "same_tokens_as_instance_0": tokens[i] == tokens[0]})
        print(f"{i} {kind:>9}: round {rows[-1]['round_ms_median']:.3f} ms (verify {1e3 * v:.3f}), "
              f"same tokens as instance 0: {rows[-1]['same_tokens_as_instance_0']}", flush=True)
    by_kind = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r["round_ms_median"])
    spread = {k: max(v) / min(v) for k, v in by_kind.items() if len(v) > 1}
    print("spread within a kind (slowest / fastest):", {k: round(x, 3) for k, x in spread.items()})
    bd.write_result(args.out, {"config": vars(args), "rows": rows, "spread_within_kind": spread,
                               "source_digest": source, "source_changed": source != bd.source_digest(),
                               "git_head": bd.git_head()})


if __name__ == "__main__":
    main()
