#!/usr/bin/env python
"""What a draft head's catch-up costs per pair, beside the target's forward of as many tokens.

A sequence that drafts after plain rounds (or for the first time, with its prompt's pairs)
first runs the head over every pending (token, feature) pair. This times that head forward
(`EagleDrafter._backlog_forward`) for a few shapes (sequences x pending pairs, after a committed
context) on the default model and shipped head, and the target's forward of the same spans,
alternating, in one run: the ratio is what one pair of catch-up costs in target tokens. The
head runs three ways: one forward over every span ("one"), the same with oneDNN's row counts
not rounded up to engine.layers.onednn_rows' buckets ("one-exact": every new row count builds
new kernels), and forwards of at most the native head stack's rows, sequence by sequence
("chunks", where that stack runs). Everything runs on the engine thread, as the engine does (calls
from another thread compete with its OpenMP team: scheduler/worker.py).

    .venv/bin/python bench/bench_head_catchup.py --reps 5 [--fresh-shapes]
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

import engine.layers  # noqa: E402
from engine.forward_batch import SeqSpan  # noqa: E402
from engine.spec.eagle_drafter import feature_width  # noqa: E402
from scheduler.worker import on_engine_thread  # noqa: E402

BUCKETS = engine.layers.onednn_rows


def exact_rows(on: bool) -> None:
    """oneDNN products at their own row count (on) or rounded up to the buckets (off)."""
    engine.layers.onednn_rows = (lambda rows: rows) if on else BUCKETS

SHAPES = ((1, 50, 0), (1, 200, 0), (1, 400, 0), (1, 16, 100), (1, 128, 100), (4, 128, 100), (8, 16, 200),
          (8, 128, 100), (16, 64, 150), (32, 100, 100))


def spans_for(seqs: int, pairs: int, context: int, block_size: int) -> list[SeqSpan]:
    per = -(-(context + pairs) // block_size)
    return [SeqSpan([100 + j for j in range(pairs)], context, list(range(i * per, (i + 1) * per)))
            for i in range(seqs)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fresh-shapes", action="store_true",
                    help="time every repetition at a pair count not run before (scaled to the shape's)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "head_catchup.json"))
    args = ap.parse_args(argv)
    llm = bs.build_engine("on")
    runner, drafter = llm.runner, llm.runner.drafter
    # as wide as the target hands the drafter ([f ; aux] for a fused-feature head)
    hidden = feature_width(runner.model.config.hidden_size, runner.model.aux_layers)
    source = bd.source_digest()
    chunk = drafter._catchup_chunk()  # the native head stack's rows (0: it does not run here)
    rows = on_engine_thread(measure, args, llm, runner, drafter, hidden, chunk)
    bd.write_result(args.out, {"config": vars(args), "rows": rows, "source_digest": source,
                               "source_changed": source != bd.source_digest(), "git_head": bd.git_head()})


def measure(args, llm, runner, drafter, hidden: int, chunk: int) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for seqs, pairs, context in SHAPES:
            spans = spans_for(seqs, pairs, context, llm.engine_config.block_size)
            feats = torch.randn(seqs * pairs, hidden, dtype=runner.dtype)
            modes = {"one": (0, False), "one-exact": (0, True), **({"chunks": (chunk, False)} if chunk else {})}
            head = {m: [] for m in modes}
            target = []
            for c, exact in modes.values():  # warm-up
                exact_rows(exact)
                drafter._backlog_forward(spans, feats, c)
            exact_rows(False)
            runner.forward(spans)
            for r in range(args.reps):  # alternating, so machine drift hits all alike
                # --fresh-shapes: each repetition one pair less a sequence than the last (the head's
                # forward of a new shape, as a serving engine meets catch-ups of every length);
                # the exact and bucketed modes take different cuts, so each meets its own new shape
                for m, (c, exact) in modes.items():
                    sp, ft = cut_spans(spans, feats, seqs, pairs, args.fresh_shapes, r, exact)
                    exact_rows(exact)
                    t = time.perf_counter()
                    drafter._backlog_forward(sp, ft, c)
                    head[m].append((time.perf_counter() - t) * pairs / len(sp[0].token_ids))
                exact_rows(False)
                sp, _ = cut_spans(spans, feats, seqs, pairs, args.fresh_shapes, r, False, target=args.reps)
                t = time.perf_counter()
                runner.forward(sp)
                target.append((time.perf_counter() - t) * pairs / len(sp[0].token_ids))
            g = statistics.median(target)
            n = seqs * pairs
            row = {"seqs": seqs, "pairs": pairs, "context": context, "target_ms": 1e3 * g}
            for m in modes:
                h = statistics.median(head[m])
                key = m.replace("-", "_")
                row.update({f"head_{key}_ms": 1e3 * h, f"head_{key}_us_per_pair": 1e6 * h / n,
                            f"head_{key}_over_target": h / g})
            rows.append(row)
            print(f"{seqs:>2} seqs x {pairs:>3} pairs (context {context}): target {1e3 * g:7.2f} ms; head "
                  + ", ".join(f"{m} {row[f'head_{m.replace(chr(45), chr(95))}_ms']:7.2f} ms" for m in modes), flush=True)
    return rows


def cut_spans(spans, feats, seqs: int, pairs: int, fresh: bool, rep: int, exact: bool, target: int = 0):
    """The spans (and their feature rows) a repetition times: all of them, or with --fresh-shapes
    a pair count no earlier repetition of this mode ran (odd cuts for the exact mode, even for
    the others; target forwards (target: the repetitions) below the head's cuts, down to
    2 pairs, where short shapes repeat), scaled back to `pairs` by the caller."""
    if not fresh:
        return spans, feats
    cut = max(2, pairs - 1 - 2 * rep - (1 if exact else 0) - (2 * target + 1 if target else 0))
    sp = [SeqSpan(s.token_ids[:cut], s.num_cached, s.block_table) for s in spans]
    return sp, feats.view(seqs, pairs, -1)[:, :cut].reshape(seqs * cut, -1)


if __name__ == "__main__":
    main()
