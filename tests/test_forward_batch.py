"""`build_forward_batch` against a direct per-query reference: slots through the block table,
visibility (committed keys, causal new tokens, tree masks over the last cached keys), padding."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch

BS = 4


def reference(spans: list[SeqSpan]) -> dict:
    """Every field from its definition, one query and one key at a time."""
    B = len(spans)
    Q = max(len(s.token_ids) for s in spans)
    L = max(s.num_cached + len(s.token_ids) for s in spans)
    slot = lambda s, p: s.block_table[p // BS] * BS + p % BS  # noqa: E731
    gather = [[slot(s, p) if p < s.num_cached + len(s.token_ids) else 0 for p in range(L)] for s in spans]
    mask = torch.zeros(B, Q, L, dtype=torch.bool)
    for b, s in enumerate(spans):
        c, n = s.num_cached, len(s.token_ids)
        for i in range(Q):
            if i >= n:
                mask[b, i, 0] = True  # a padded row sees key 0 only
                continue
            for j in range(L):
                if j < c - s.num_masked_cached:
                    mask[b, i, j] = True
                elif s.tree_mask is not None and j < c + n:
                    mask[b, i, j] = bool(s.tree_mask[i, j - (c - s.num_masked_cached)])
                else:
                    mask[b, i, j] = j < c or (c <= j <= c + i)
    return dict(
        input_ids=[t for s in spans for t in s.token_ids],
        positions=[p for s in spans for p in (s.positions or range(s.num_cached, s.num_cached + len(s.token_ids)))],
        slot_mapping=[slot(s, s.num_cached + i) for s in spans for i in range(len(s.token_ids))],
        kv_gather=[x for row in gather for x in row],
        kv_lens=[s.num_cached + len(s.token_ids) for s in spans],
        q_seq=[b for b, s in enumerate(spans) for _ in s.token_ids],
        q_row=[i for s in spans for i in range(len(s.token_ids))],
        q_index=[b * Q + i for b, s in enumerate(spans) for i in range(len(s.token_ids))] if B > 1 else None,
        mask=mask, shape=(B, Q, L))


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
CASES = {
    "one token": [SeqSpan([5], 9, [7, 2, 9])],
    "prefill": [SeqSpan(list(range(10, 17)), 0, [3, 8])],
    "tree": [SeqSpan([1, 2, 3, 4], 6, [4, 0, 11], positions=[6, 7, 7, 8], tree_mask=TREE)],
    "head level (masked cached keys)": [SeqSpan([7, 8], 8, [5, 6, 1], positions=[6, 6], num_masked_cached=2,
                                                tree_mask=torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool))],
    "batch, padded, unequal tables": [SeqSpan([5], 13, [9, 3, 17, 5]), SeqSpan([1, 2, 3], 2, [1, 10]),
                                      SeqSpan([6, 7, 8, 9], 5, [2, 12, 4], positions=[5, 6, 6, 7], tree_mask=TREE)],
}


def _builder(monkeypatch, native: bool) -> None:
    """Pick the native build_batch or the numpy path (EAGLE_SERVE_NATIVE_BATCH)."""
    from eagle_serve.engine import kernels
    if native and getattr(kernels.native(), "build_batch", None) is None:
        pytest.skip("no native kernels on this CPU or no compiler")
    monkeypatch.setenv("EAGLE_SERVE_NATIVE_BATCH", "1" if native else "0")


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
@pytest.mark.parametrize("name", list(CASES))
def test_build_forward_batch_matches_the_definition(name, native, monkeypatch):
    _builder(monkeypatch, native)
    spans = CASES[name]
    fb = build_forward_batch(spans, BS, torch.device("cpu"))
    want = reference(spans)
    for field in ("input_ids", "positions", "slot_mapping", "kv_gather", "kv_lens", "q_seq", "q_row"):
        got = getattr(fb, field)
        assert got.dtype == torch.int64, field
        assert got.tolist() == want[field], field
    assert (fb.num_seqs, fb.max_query_len, fb.max_kv_len) == want["shape"]
    assert (fb.q_index is None) == (want["q_index"] is None)
    if fb.q_index is not None:
        assert fb.q_index.dtype == torch.int64 and fb.q_index.tolist() == want["q_index"]
    if fb.attn_mask is None:  # one sequence, one token, no tree: every key
        assert want["shape"][1] == 1 and bool(want["mask"].all())
        assert fb.mask_3d().numel() == 0
    else:
        assert fb.attn_mask.dtype == torch.bool and tuple(fb.attn_mask.shape) == (want["shape"][0], 1) + want["shape"][1:]
        assert torch.equal(fb.mask_3d(), want["mask"])


@pytest.mark.parametrize("seed", range(6))
def test_native_and_numpy_builders_agree_on_random_batches(seed, monkeypatch):
    """Random batches (prefill chunks, plain steps, trees over masked cached keys, padding):
    the native builder's tensors are the numpy builder's, field by field."""
    import random
    rng = random.Random(seed)
    spans = []
    for _ in range(rng.randint(1, 5)):
        n, c = rng.randint(1, 9), rng.randint(0, 30)
        table = rng.sample(range(40), (c + n + BS - 1) // BS + rng.randint(0, 2))
        kind = rng.choice(["causal", "tree", "masked"])
        if kind == "causal":
            spans.append(SeqSpan([rng.randrange(300) for _ in range(n)], c, table))
            continue
        m = rng.randint(0, min(c, 3)) if kind == "masked" else 0
        mask = torch.rand(n, m + n, generator=torch.Generator().manual_seed(seed)) < 0.5
        spans.append(SeqSpan([rng.randrange(300) for _ in range(n)], c, table,
                             positions=[c + rng.randint(0, 3) for _ in range(n)], tree_mask=mask, num_masked_cached=m))
    _builder(monkeypatch, True)
    got = build_forward_batch(spans, BS, torch.device("cpu"))
    monkeypatch.setenv("EAGLE_SERVE_NATIVE_BATCH", "0")
    want = build_forward_batch(spans, BS, torch.device("cpu"))
    for field in ("input_ids", "positions", "slot_mapping", "kv_gather", "kv_lens", "q_seq", "q_row", "q_index", "attn_mask"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), field
    assert (got.num_seqs, got.max_query_len, got.max_kv_len, got.prompt_lens) == \
        (want.num_seqs, want.max_query_len, want.max_kv_len, want.prompt_lens)


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_a_span_past_its_block_table_is_refused(native, monkeypatch):
    _builder(monkeypatch, native)
    with pytest.raises(ValueError, match="past its block table"):
        build_forward_batch([SeqSpan([1, 2, 3], 6, [4, 5])], BS, torch.device("cpu"))
