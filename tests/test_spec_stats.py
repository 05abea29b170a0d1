"""Sampled speculative decoding follows the target distribution exactly, and the statistical
test that shows it rejects the classic wrong acceptance rules.

A tiny-vocabulary float64 model (V = 8) makes the exact joint distribution of output tokens
2 and 3 computable by enumeration. Token 1 comes from the prefill; tokens 2..3 come from verify
rounds (token 3 is an accepted depth-2 node or a bonus; max_tokens 4 lets the first round
draft two deep). Penalties are on, so a node's
distribution depends on its ancestors.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.server.llm import LLM
from tests.conftest import write_tiny_model
from tests.spec_helpers import write_eagle_head

V = 8
PROMPT = [3, 1, 4, 1, 5]
PARAMS = dict(temperature=1.0, frequency_penalty=1.2, presence_penalty=0.3)
N = 6000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v8"))
    write_tiny_model(path, vocab=V, tokenizer=False, std=0.6, seed=7)
    head = write_eagle_head(str(tmp_path_factory.mktemp("v8-head")), path, seed=3, std=0.5)
    plain = LLM(path, dtype="float64", device="cpu", kv_cache_tokens=8192, block_size=4, skip_tokenizer=True)
    return path, head, TargetDist(plain)


class TargetDist:
    """p(next | outputs so far) of the processed target distribution, by direct forward."""

    def __init__(self, llm):
        self.runner = llm.runner
        self.cache: dict[tuple, torch.Tensor] = {}

    def __call__(self, outputs: tuple, counted: tuple | None = None) -> torch.Tensor:
        counted = outputs if counted is None else counted  # tokens the penalties count
        key = (outputs, counted)
        if key not in self.cache:
            r = self.runner
            ids = PROMPT + list(outputs)
            with torch.inference_mode():
                batch = build_forward_batch([SeqSpan(ids, 0, list(range(100, 110)))], 4, r.device)
                logits = r.model.compute_logits(r.model(batch, r.kv, r.backend))[-1]
            logits = logits.clone()  # a normal tensor, outside inference mode
            counts = torch.bincount(torch.tensor(counted, dtype=torch.long), minlength=V).double()
            logits -= PARAMS["frequency_penalty"] * counts + PARAMS["presence_penalty"] * (counts > 0)
            self.cache[key] = (logits / PARAMS["temperature"]).softmax(-1)
        return self.cache[key]


def exact_joint(p) -> dict[tuple[int, int], float]:
    joint = {}
    p1 = p(())
    for t1 in range(V):
        p2 = p((t1,))
        for t2 in range(V):
            p3 = p((t1, t2))
            for t3 in range(V):
                joint[(t2, t3)] = joint.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return joint


def chi_square_test(samples: list[tuple[int, int]], joint: dict) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001); cells expected < 5 are pooled."""
    n = len(samples)
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, pool_obs, pool_exp, df = 0.0, 0, 0.0, -1
    for cell, prob in joint.items():
        exp = n * prob
        if exp < 5:
            pool_obs, pool_exp = pool_obs + counts.get(cell, 0), pool_exp + exp
            continue
        stat += (counts.get(cell, 0) - exp) ** 2 / exp
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    z = 3.0902  # Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_engine_speculative_sampling_matches_the_exact_distribution(setup):
    path, head, p = setup
    llm = LLM(path, dtype="float64", device="cpu", kv_cache_tokens=65536, block_size=4, skip_tokenizer=True,
              max_num_seqs=1000, draft=head, spec=SpecConfig("eagle2", total_tokens=7, depth=3, top_k=2),
              tree_budget=False)
    samples, deep = [], 0
    for start in range(0, N, 1000):
        params = [SamplingParams(max_tokens=4, seed=start + i, ignore_eos=True, **PARAMS) for i in range(1000)]
        for out in llm.generate([PROMPT] * 1000, params):
            samples.append(tuple(out.token_ids[1:3]))
            deep += len(out.spec.accepted_per_depth) >= 2 and out.spec.accepted_per_depth[1] > 0
    stat, crit = chi_square_test(samples, exact_joint(p))
    print(f"engine: chi2 {stat:.1f} (critical {crit:.1f}); rounds with a depth-2 acceptance: {deep}")
    assert deep >= 200  # the rounds really accepted deep nodes
    assert stat < crit


# ---- the same statistic against a reference simulator with right and wrong rules ------------

def draft_q(outputs: tuple) -> torch.Tensor:
    """A fixed, deterministic draft distribution (differs from the target)."""
    g = torch.Generator().manual_seed(hash(outputs[-2:]) % (2 ** 31))
    return (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).softmax(-1)


def simulate(p, rule: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        outputs = (draw(p(()), rng),)
        while len(outputs) < 3:
            outputs = outputs + tuple(one_round(p, outputs, rule, rng))
        out.append(outputs[1:3])
    return out


def draw(probs: torch.Tensor, rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    for t, q in enumerate(probs.tolist()):
        acc += q
        if u < acc:
            return t
    return V - 1


def one_round(p, outputs: tuple, rule: str, rng: random.Random, depth: int = 2, k: int = 2) -> list[int]:
    """One verify round over a depth-2 tree of top-k draft children at every node."""
    emitted: list[int] = []
    path: tuple = ()
    for _ in range(depth + 1):
        hist = outputs + path
        probs = p(hist, counted=outputs if rule == "penalties_committed" else None).clone()
        q = draft_q(hist)
        children = torch.topk(q, k).indices.tolist() if len(path) < depth else []
        chosen = accept_children(probs, q, children, rule, rng)
        if chosen is None:  # bonus from what remains
            emitted.append(draw(probs, rng))  # accept_children left the residual in probs
            return emitted
        emitted.append(chosen)
        path = path + (chosen,)
    return emitted


def accept_children(probs, q, children, rule, rng):
    residual = probs.clone()
    for x in children:
        if rule in ("exact", "penalties_committed"):
            ok = rng.random() < float(residual[x] / residual.sum())
        elif rule == "unrenormalised":
            ok = rng.random() < float(residual[x])  # forgets to renormalise after rejections
        else:  # min(1, p/q), the rule for *sampled* drafts
            ok = rng.random() < min(1.0, float(residual[x] / residual.sum() / q[x]))
        if ok:
            return x
        if rule == "minpq":
            residual = (residual / residual.sum() - q).clamp(min=0)
        else:
            residual[x] = 0
    probs.copy_(residual / residual.sum())
    return None


@pytest.mark.parametrize("rule, should_pass", [("exact", True), ("minpq", False), ("unrenormalised", False),
                                               ("penalties_committed", False)])
def test_the_statistic_separates_right_from_wrong_rules(setup, rule, should_pass):
    _, _, p = setup
    stat, crit = chi_square_test(simulate(p, rule, N), exact_joint(p))
    print(f"{rule}: chi2 {stat:.1f} (critical {crit:.1f})")
    assert (stat < crit) == should_pass
