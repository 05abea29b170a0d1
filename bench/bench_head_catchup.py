#!/usr/bin/env python
"""What a draft head's catch-up costs per pair, beside the target's forward of as many tokens.

A sequence that drafts after plain rounds (or for the first time, with its prompt's pairs)
first runs the head over every pending (token, feature) pair. This times that head forward
(`EagleDrafter._head_forward`) for a few shapes (sequences x pending pairs, after a committed
context) on the default model and shipped head, and the target's forward of the same spans,
alternating, in one run: the ratio is what one pair of catch-up costs in target tokens.

    .venv/bin/python bench/bench_head_catchup.py --reps 5
Writes --out (bench/results/head_catchup.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402
import bench_serve as bs  # noqa: E402
import torch  # noqa: E402

from engine.forward_batch import SeqSpan  # noqa: E402
from engine.spec.eagle_drafter import feature_width  # noqa: E402

SHAPES = ((1, 16, 100), (1, 128, 100), (4, 128, 100), (8, 16, 200), (8, 128, 100), (16, 64, 150))


def spans_for(seqs: int, pairs: int, context: int, block_size: int) -> list[SeqSpan]:
    per = -(-(context + pairs) // block_size)
    return [SeqSpan([100 + j for j in range(pairs)], context, list(range(i * per, (i + 1) * per)))
            for i in range(seqs)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "head_catchup.json"))
    args = ap.parse_args(argv)
    llm = bs.build_engine("on")
    runner, drafter = llm.runner, llm.runner.drafter
    # as wide as the target hands the drafter ([f ; aux] for a fused-feature head)
    hidden = feature_width(runner.model.config.hidden_size, runner.model.aux_layers)
    source = bd.source_digest()
    rows = []
    with torch.inference_mode():
        for seqs, pairs, context in SHAPES:
            spans = spans_for(seqs, pairs, context, llm.engine_config.block_size)
            feats = torch.randn(seqs * pairs, hidden, dtype=runner.dtype)
            head, target = [], []
            drafter._head_forward(spans, feats)  # warm-up
            runner.forward(spans)
            for _ in range(args.reps):  # alternating, so machine drift hits both alike
                t = time.perf_counter()
                drafter._head_forward(spans, feats)
                head.append(time.perf_counter() - t)
                t = time.perf_counter()
                runner.forward(spans)
                target.append(time.perf_counter() - t)
            h, g = statistics.median(head), statistics.median(target)
            n = seqs * pairs
            rows.append({"seqs": seqs, "pairs": pairs, "context": context, "head_ms": 1e3 * h,
                         "target_ms": 1e3 * g, "head_us_per_pair": 1e6 * h / n, "head_over_target": h / g})
            print(f"{seqs:>2} seqs x {pairs:>3} pairs (context {context}): head {1e3 * h:7.2f} ms "
                  f"({1e6 * h / n:5.1f} us a pair), target {1e3 * g:7.2f} ms, head / target {h / g:.3f}", flush=True)
    bd.write_result(args.out, {"config": vars(args), "rows": rows, "source_digest": source,
                               "source_changed": source != bd.source_digest(), "git_head": bd.git_head()})


if __name__ == "__main__":
    main()
