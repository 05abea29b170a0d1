"""Sampling: keyed-noise reproducibility, truncation, processing, and exactness in distribution."""
from __future__ import annotations

import math
import random

import pytest
import torch

from eagle_serve.engine.sampler import SampleRow, choose, draw, process_logits, sample
from eagle_serve.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=torch.float64)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1234) -> list[int]:
    """n independent draws: the same seed at output positions 0..n-1."""
    rows = [SampleRow(params, seed, pos, []) for pos in range(n)]
    return choose(logits.expand(n, -1).clone(), rows).tolist()


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def histogram(tokens: list[int], vocab: int) -> list[int]:
    return [tokens.count(v) for v in range(vocab)]


# chi-square critical values at p = 0.001 (df = vocab - 1)
CRIT_001 = {7: 24.32, 2: 13.82, 3: 16.27}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_empirical_distribution_matches_softmax(temperature):
    n = 20000
    probs = (LOGITS / temperature).softmax(-1).tolist()
    counts = histogram(draws(LOGITS, SamplingParams(temperature=temperature), n), 8)
    assert chi_square(counts, probs) < CRIT_001[7]
    # power: the same draws are far from a wrong rule's distribution (temperature off by 30%)
    wrong = (LOGITS / (1.3 * temperature)).softmax(-1).tolist()
    assert chi_square(counts, wrong) > 10 * CRIT_001[7]


def test_top_p_and_top_k_follow_the_renormalised_distribution():
    n = 12000
    probs = LOGITS.softmax(-1)
    # top_p = 0.7: the mass before token 2 is p0 + p1 < 0.6, before token 3 it is >= 0.7
    assert probs[:2].sum() < 0.7 <= probs[:3].sum()
    counts = histogram(draws(LOGITS, SamplingParams(top_p=0.7), n), 8)
    assert counts[3:] == [0] * 5
    kept = (probs[:3] / probs[:3].sum()).tolist()
    assert chi_square(counts[:3], kept) < CRIT_001[2]
    counts = histogram(draws(LOGITS, SamplingParams(top_k=4), n), 8)
    assert counts[4:] == [0] * 4
    assert chi_square(counts[:4], (probs[:4] / probs[:4].sum()).tolist()) < CRIT_001[3]


def test_truncation_never_emits_excluded_tokens_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        logits = torch.randn(50, generator=gen, dtype=torch.float64) * 3
        k, p = 1 + trial % 7, 0.3 + 0.02 * trial
        params = SamplingParams(top_k=k, top_p=p, temperature=1.3)
        scaled = logits / 1.3
        top = set(torch.topk(scaled, k).indices.tolist())
        order = torch.argsort(scaled, descending=True).tolist()
        probs = scaled.softmax(-1)
        nucleus, mass = set(), 0.0
        for t in order:
            if mass >= p:
                break
            nucleus.add(t)
            mass += float(probs[t])
        allowed = top & nucleus if top & nucleus else {order[0]}
        assert set(draws(logits, params, 200, seed=trial)) <= allowed


@pytest.mark.parametrize("spread", [0.3, 2.0, 6.0], ids=["flat", "medium", "peaked"])
def test_top_p_keeps_exactly_the_full_sort_nucleus(spread):
    """truncate finds the nucleus among a growing top-k (not a sort of the whole vocabulary); the
    kept set is the one the whole sorted distribution gives (up to the softmax sum's rounding,
    which only top_p within ~1e-12 of 1 can see), nuclei from 1 token to most of a 49152-token
    vocabulary (past the first 256 and 2048 candidates) included."""
    from eagle_serve.engine.sampler import truncate
    gen = torch.Generator().manual_seed(int(spread * 10))
    for top_p in (0.3, 0.9, 0.995):
        logits = torch.randn(49152, generator=gen, dtype=torch.float64) * spread
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        want = set(order[(probs.cumsum(-1) - probs) < top_p].tolist())
        got = truncate(logits, -1, top_p)
        assert set(torch.nonzero(~torch.isinf(got)).flatten().tolist()) == want
        assert torch.equal(got[list(want)], logits[list(want)])


def test_temperature_zero_is_argmax_whatever_the_seed():
    logits = torch.randn(6, 100, dtype=torch.float64)
    rows = [SampleRow(SamplingParams(temperature=0, seed=s), s, 0, []) for s in range(6)]
    assert choose(logits.clone(), rows).tolist() == logits.argmax(-1).tolist()


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # logits / 5e-324 are infinite: the first +inf id (0) won, whatever the logits said
    logits = torch.randn(4, 100, dtype=torch.float64)
    logits[:, 0] = logits.min() - 1
    for t in (5e-324, 1e-300, 9e-6):
        rows = [SampleRow(SamplingParams(temperature=t, seed=s), s, 0, []) for s in range(4)]
        assert choose(logits.clone(), rows).tolist() == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy


def test_same_seed_and_position_same_token_different_position_independent():
    p = SamplingParams(temperature=1.0)
    a = draws(LOGITS, p, 300, seed=99)
    b = draws(LOGITS, p, 300, seed=99)
    c = draws(LOGITS, p, 300, seed=100)
    assert a == b and a != c


def test_penalties_bias_and_min_tokens():
    logits = torch.zeros(2, 6, dtype=torch.float64)
    pen = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 3.0}, min_tokens=4)
    rows = [SampleRow(pen, 0, 2, [1, 1, 3]), SampleRow(SamplingParams(), 0, 0, [1])]
    out = process_logits(logits.clone(), rows, stop_ids=frozenset({5}))
    assert out[0].tolist() == [0.0, -1.0, 0.0, -0.75, 3.0, float("-inf")]  # 1: 0.5 + 2 * 0.25
    assert out[1].tolist() == [0.0] * 6  # untouched row
    rows[0] = SampleRow(pen, 0, 4, [1, 1, 3, 0])  # min_tokens reached: EOS allowed again
    assert process_logits(logits.clone(), rows, frozenset({5}))[0, 5] == 0.0


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(1, 30, dtype=torch.float64)
    params = SamplingParams(temperature=0, logprobs=3, logit_bias={7: 50.0})
    tokens, lps = sample(logits.clone(), [SampleRow(params, 0, 0, [])], frozenset())
    ref = logits[0].log_softmax(-1)
    assert tokens == [7]  # the bias picks the token ...
    assert math.isclose(lps[0].logprob, float(ref[7]))  # ... the logprob is the model's own
    assert [t for t, _ in lps[0].top] == torch.topk(ref, 3).indices.tolist()


def test_picks_draw_lazy_rows_when_read_and_the_rest_at_once():
    """Rows outside `lazy` (plain rounds) are drawn when Picks is built, in the round's one sync;
    a lazy row (a tree node) only when read; either way the pick is the eager sample's."""
    from eagle_serve.engine.sampler import Picks
    logits = torch.randn(4, 50, dtype=torch.float64)
    rows = [SampleRow(SamplingParams(temperature=t, top_p=0.9, seed=s), s, 3, [])
            for t, s in ((0.8, 1), (0, 2), (1.2, 3), (0.5, 4))]
    tokens, _ = sample(logits.clone(), rows, frozenset())
    picks = Picks(logits.clone(), rows, frozenset(), lazy=frozenset({2, 3}))
    assert picks._drawn == [True, True, False, False]
    assert picks[3] == tokens[3] and picks._drawn == [True, True, False, True]
    assert [picks[i] for i in range(4)] == tokens


def test_seeded_output_is_independent_of_batch_composition(tiny_llm):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 300) for _ in range(12)]
    target = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = tiny_llm.generate(prompt, target)[0].token_ids
    others = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 30, 17)]
    mixed_params = [SamplingParams(max_tokens=m, temperature=t, seed=s, ignore_eos=True)
                    for m, t, s in ((7, 0.0, None), (25, 1.2, 3), (13, 0.5, None))]
    outs = tiny_llm.generate(others[:2] + [prompt] + others[2:], mixed_params[:2] + [target] + mixed_params[2:])
    assert outs[2].token_ids == alone
    assert tiny_llm.generate(prompt, target)[0].token_ids == alone
    unseeded = tiny_llm.generate([prompt] * 2, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # fresh random seeds


def test_greedy_choice_takes_the_first_of_tied_maxima_and_follows_nan_like_argmax():
    """choose() reads max(-1).indices for speed; it must pick what argmax picks: the first index
    of tied maxima, a NaN where a row has one, index 0 of an all -inf row."""
    torch.manual_seed(0)
    x = torch.randint(0, 3, (5, 4096)).float()  # many ties per row
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3, 4000] = 5.0
    x[3, 10] = 5.0
    rows = [SampleRow(SamplingParams(temperature=0), 0, 0, []) for _ in range(5)]
    got = choose(x, rows)
    assert got.tolist() == x.argmax(-1).tolist()
    assert got[3].item() == 10 and got[2].item() == 0 and got[1].item() == 7
    # draw(): one float64 row, a 0-d index as argmax() gives (huge noise: the noise decides)
    row = torch.zeros(4096, dtype=torch.float64)
    noise = torch.zeros(4096, dtype=torch.float64)
    noise[[5, 9]] = 1.0
    picked = draw(row, SamplingParams(temperature=1.0), noise)
    assert picked.shape == () and picked.item() == 5 == (row + noise).argmax().item()
