"""Start-up cost profile for the tree budget: seconds of one packed target forward by token
count, and of one drafting round by number of sequences (at the configured depth, and one level
deep), measured on this engine and device."""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from engine.forward_batch import SeqSpan
from engine.spec.drafters import NoDrafter
from engine.step_io import SeqStep
from engine.sampling_params import SamplingParams

VERIFY_GRID = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # linear beyond
DRAFT_GRID = (1, 2, 4, 8, 16, 32, 64)


def non_decreasing(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The closest non-decreasing curve (least squares, pool-adjacent-violators) to timed
    points sorted by x: a forward of more tokens never costs less, and a noisy profile that said
    otherwise (4 tokens at 14.9 ms after 3 at 15.8 ms: the budget's profile in eagle_v6.json) made trees of
    that size look cheaper than smaller ones for good, the online correction of verify costs
    coming from plain rounds only."""
    blocks: list[list[float]] = []  # [sum, count]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [(x, y) for (x, _), y in zip(points, ys)]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


@torch.inference_mode()
def profile_costs(runner, max_tokens: int, max_seqs: int, context: int = 128, repeats: int = 2,
                  small_repeats: int = 5) -> dict:
    """{"verify": [(tokens, s)], "draft": [(seqs, s)], "draft_first": [(seqs, s)], "depth": D}:
    draft rounds at the configured depth D and at depth 1. Forwards of up to 16 tokens (one
    sequence's trees; a few ms each) are timed `small_repeats` times, larger ones `repeats`;
    the verify curve is then made non-decreasing. Uses the runner's KV cache: call it before
    any request runs (it overwrites cache slots)."""
    bs = runner.config.block_size
    n_blocks = runner.num_blocks
    vocab = runner.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    verify = []
    for T in VERIFY_GRID:
        if T > max_tokens:
            break
        per_seq = 8 if T >= 8 else T
        B = -(-T // per_seq)
        ctx = min(context, (n_blocks // B) * bs - per_seq)
        if ctx < 1:
            break
        blocks_per = -(-(ctx + per_seq) // bs)
        spans, left = [], T
        for b in range(B):
            n = min(per_seq, left)
            left -= n
            ids = torch.randint(vocab, (n,), generator=gen).tolist()
            spans.append(SeqSpan(ids, ctx, list(range(b * blocks_per, (b + 1) * blocks_per))))

        def run():  # as the engine runs it: a CUDA graph replay where one fits
            runner.model.compute_logits(runner.forward(spans))
        verify.append((T, _time(run, small_repeats if T <= 16 else repeats)))
    draft, first = [], []
    drafter = runner.drafter
    if not isinstance(drafter, NoDrafter):
        h = runner.loaded.config.hidden_size
        for n in DRAFT_GRID:
            if n > max_seqs:
                break
            blocks_per = -(-(context + runner.spec.scratch_slots + 2 * repeats + 8) // bs)
            if n * blocks_per > n_blocks:
                break
            steps = [SeqStep(seq_id=-1 - i, token_ids=[1], num_cached=context,
                             block_table=list(range(i * blocks_per, (i + 1) * blocks_per)),
                             params=SamplingParams(max_tokens=64), seed=0, output_token_ids=[1],
                             max_new_tokens=runner.spec.max_depth + 1,
                             prompt_token_ids=torch.randint(vocab, (context,), generator=gen).tolist())
                     for i in range(n)]
            feats = torch.randn(context, h, generator=gen).to(runner.dtype).to(runner.device)

            def run(depth):
                for s in steps:  # one accepted token's pair pending, as after a verify round
                    drafter.observe(s, [1], feats[-1:], reset=False)
                drafter.propose(steps, [depth] * n)
            for s in steps:  # the prompt's pairs, consumed by the untimed warm-up round
                drafter.observe(dataclasses.replace(s, num_cached=0), s.prompt_token_ids[1:] + [1], feats, reset=True)
            draft.append((n, _time(lambda: run(runner.spec.max_depth), repeats)))
            first.append((n, _time(lambda: run(1), repeats)))
            for s in steps:
                drafter.release(s.seq_id)
    return {"verify": non_decreasing(verify), "draft": draft, "draft_first": first, "depth": runner.spec.max_depth}
