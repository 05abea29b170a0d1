#!/usr/bin/env python
"""Where a speculative round's time goes, call by call, on the default model and shipped head:
MT-bench first turns decoded greedily (bf16, 128 new tokens) by plain decoding and by EAGLE-2 at
the given trees, each tree drafted both ways (the native draft tree, and level by level from
Python: EagleDrafter.native_tree off), alternating per prompt in one process. Wrapped and timed
in every round: the engine step (ModelRunner.execute), the target's native stack and its LM
head, the drafter's propose, and on the per-level path each EagleHead.level call, which also
runs a second time at once with the same inputs (it rewrites the same draft KV) to time it with
its weights cached ("hot") against as the round found them ("cold"); the enclosing timings
leave those repeats out, the tok/s do not (compare tok/s between the native rows and none).
With --draft-only each tree also runs as "<tree>-draftonly": the native draft tree is grown every
round as usual and then thrown away, the target verifying the root alone (a plain step), which
separates what the tree's extra rows cost the verify from what drafting does to the step after
it (the target's stack timed after a draft, against none's).

    .venv/bin/python bench/bench_draft_calls.py [--trees 4x2x2,7x3x3] [--prompts 10] [--draft-only]
Writes --out (bench/results/round_cost_mtbench.json): per system the median ms of each call (level
calls by row count) and tok/s.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)

from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.engine.speculative.tree import root_only  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402

HEAD = os.path.join(os.path.dirname(HERE), "engine", "heads", "smollm2-135m-instruct")


def timed(times: dict, key: str, fn, repeats: list[float]):
    """fn timed into times[key], less the repeated level calls made inside it (`repeats[0]`)."""
    def wrapper(*a, **kw):
        r0, t0 = repeats[0], time.perf_counter()
        out = fn(*a, **kw)
        times[key].append(time.perf_counter() - t0 - (repeats[0] - r0))
        return out
    return wrapper


def level_timer(times: dict, fn, repeats: list[float]):
    """EagleHead.level, timed as called ("cold") and once more at once ("hot"), by rows; the
    repeat's seconds go to repeats[0], which the enclosing timers leave out."""
    def wrapper(batch, *a, **kw):
        rows = batch.input_ids.shape[0]
        t0 = time.perf_counter()
        out = fn(batch, *a, **kw)
        t1 = time.perf_counter()
        fn(batch, *a, **kw)
        t2 = time.perf_counter()
        times[f"level_cold_rows{rows}"].append(t1 - t0)
        times[f"level_hot_rows{rows}"].append(t2 - t1)
        repeats[0] += t2 - t1
        return out
    return wrapper


def discard_trees(drafter) -> None:
    """drafter.propose grows its trees as usual (head KV written, pending pairs consumed) and
    hands back the root alone: the target verifies a plain step, and the trees' confidences are
    dropped (no tree reached it). Accepting nothing, the round feeds the head the root's pair as
    a plain step does."""
    propose = drafter.propose

    def root_only_propose(steps, max_depths):
        propose(steps, max_depths)
        for s in steps:
            drafter.confidence(s.seq_id)
        return [root_only(s.token_ids[-1]) for s in steps]
    drafter.propose = root_only_propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default="4x2x2,7x3x3", help="total_tokens x depth x top_k, comma-separated")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--draft-only", action="store_true",
                    help="also run each tree drafted every round but verified as the root alone")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "round_cost_mtbench.json"))
    args = ap.parse_args()
    systems = {"none": LLM(None, dtype="bfloat16", spec=SpecConfig("none"), kv_cache_tokens=4096, tree_budget=False)}
    for tree in args.trees.split(","):
        t, d, k = (int(x) for x in tree.split("x"))
        for mode in ("native", "pylevels") + (("draftonly",) if args.draft_only else ()):
            llm = LLM(None, dtype="bfloat16", spec=SpecConfig("eagle2", total_tokens=t, depth=d, top_k=k),
                      draft=HEAD, kv_cache_tokens=4096, tree_budget=False)
            llm.runner.drafter.native_tree = mode != "pylevels"
            if mode == "draftonly":
                discard_trees(llm.runner.drafter)
            systems[f"{tree}-{mode}"] = llm
    params = SamplingParams(max_tokens=128, temperature=0)
    prompts = bd.mtbench_ids(args.prompts + 1)
    warmup, prompts = prompts[-1], prompts[:-1]
    times = {name: collections.defaultdict(list) for name in systems}
    for name, llm in systems.items():
        llm.generate([warmup], params)  # untimed: first calls (kernel set-up, caches)
        r, tm, rep = llm.runner, times[name], [0.0]
        r.execute = timed(tm, "execute", r.execute, rep)
        r.model.forward = timed(tm, "target_stack", r.model.forward, rep)
        r.model.compute_logits = timed(tm, "target_lm_head", r.model.compute_logits, rep)
        if r.drafter.needs_features:
            r.drafter.propose = timed(tm, "propose", r.drafter.propose, rep)
            if not r.drafter.native_tree:
                r.drafter.head.level = level_timer(tm, r.drafter.head.level, rep)
    source = bd.source_digest()
    names = list(systems)
    tokens, seconds = collections.Counter(), collections.Counter()
    for i, p in enumerate(prompts):
        for j in range(len(names)):  # rotated per prompt: machine drift hits every system alike
            name = names[(i + j) % len(names)]
            t0 = time.perf_counter()
            out = systems[name].generate([p], params)[0]
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(out.token_ids)
    result = {}
    for name in names:
        ms = {key: 1e3 * statistics.median(v) for key, v in sorted(times[name].items()) if len(v) >= 5}
        result[name] = {"tok_s": tokens[name] / seconds[name],
                        "x_none": tokens[name] / seconds[name] / (tokens["none"] / seconds["none"]),
                        "median_ms": ms, "calls": {key: len(v) for key, v in times[name].items()}}
        print(f"{name:16} {result[name]['tok_s']:6.1f} tok/s (x{result[name]['x_none']:.3f})  "
              + "  ".join(f"{key} {v:.2f}" for key, v in ms.items()), flush=True)
    bd.write_result(args.out, {"config": vars(args), "systems": result, "source_digest": source,
                               "source_changed": source != bd.source_digest(), "git_head": bd.git_head()})


if __name__ == "__main__":
    main()
