"""Speculative decoding: trees, masks, acceptance power, and the lossless guarantee."""
from __future__ import annotations

import random

import pytest
import torch

from eagle_serve.engine import kernels
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.layers import Linear
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.accept import walk
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.tree import Candidates, build_tree, from_paths, select_best
from eagle_serve.server.llm import LLM
from tests.spec_helpers import KW, OracleDrafter, prompts, write_eagle_head



@pytest.fixture(scope="module")
def head_dir(tiny_llama, tmp_path_factory):
    return write_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), tiny_llama[0])


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(tiny_llama[0], **KW)


# ---- trees -------------------------------------------------------------------------------

def test_tree_builder_matches_hand_computed_tree():
    # root children: a(-0.1) b(-1.0); a's children: c(-0.3) d(-2.5); b's child: e(-1.2); c's child f(-0.9)
    cands = Candidates(tokens=[10, 11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 1, 2],
                       scores=[-0.1, -1.0, -0.3, -2.5, -1.2, -0.9])
    keep = select_best(cands, 4)
    assert keep == [0, 1, 2, 5]  # a, b, c, f: d (-2.5) and e (-1.2) lose
    tree = build_tree(7, cands, keep)
    assert tree.tokens == [7, 10, 11, 12, 15]
    assert tree.parents == [-1, 0, 0, 1, 3]
    assert tree.depths == [0, 1, 1, 2, 3]
    assert tree.ancestor_mask().int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert tree.leaf_paths() == [[0, 2], [0, 1, 3, 4]]
    assert walk(tree, chosen=[10, 12, 99, 15, 42]).tokens == [10, 12, 15, 42]
    assert walk(tree, chosen=[11, 0, 5, 0, 0]).tokens == [11, 5]
    assert walk(tree, chosen=[3, 0, 0, 0, 0]).tokens == [3]


@pytest.mark.parametrize("nodes", [[1], [2], [1, 2], [1, 3], [2, 3], [3, 5, 6], [1, 2, 3, 4]])
def test_compaction_moves_accepted_nodes_as_one_gather_and_scatter_would(nodes):
    # node by node, in order, skipping nodes already in place, across a block boundary: the KV a
    # single advanced-index gather then scatter leaves (every source read before any write)
    from types import SimpleNamespace

    from eagle_serve.engine.model_runner import ModelRunner
    data = torch.randn(2, 2, 32, 3, 4, dtype=torch.float64)
    table, root, bs = [5, 2, 7], 5, 4  # root at position 5: nodes spill from block 2 into block 7
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    want = data.clone()
    src = torch.tensor([slot(root + n) for n in nodes])
    dst = torch.tensor([slot(root + j) for j in range(1, len(nodes) + 1)])
    want[:, :, dst] = want[:, :, src]
    runner = SimpleNamespace(config=SimpleNamespace(block_size=bs), kv=SimpleNamespace(data=data))
    ModelRunner._compact(runner, table, root, nodes)
    assert torch.equal(data, want)


def test_take_rows_views_consecutive_rows_and_gathers_the_rest():
    from eagle_serve.engine.forward_batch import take_rows
    t = torch.arange(40.0).view(10, 4)
    for rows in ([3], [3, 4], [2, 3, 4, 5], [4, 3], [1, 0, 2], [0, 2], [5, 1, 2, 3], [0, 2, 1, 3]):
        got = take_rows(t, rows)
        assert torch.equal(got, t[torch.tensor(rows)]), rows
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        assert (got.data_ptr() == t[rows[0]].data_ptr() and got.is_contiguous()) == consecutive, rows
    assert take_rows(t[:, :2], [2, 3]).shape == (2, 2)  # a column slice's rows: a view too


def test_ties_keep_the_parent_and_static_paths_merge():
    cands = Candidates([1, 2], [-1, 0], [-0.5, -0.5])  # child ties its parent (log p = 0)
    assert select_best(cands, 1) == [0]
    tree = from_paths(9, [[1], [1, 2], [3], [1, 4]])
    assert tree.tokens == [9, 1, 2, 3, 4] and tree.parents == [-1, 0, 1, 0, 1]


def test_tree_verify_forward_equals_each_path_alone(plain):
    """No tree token sees a sibling branch: every node's logits equal a plain causal forward of
    the prefix plus that node's root-to-node path (float64, 1e-9)."""
    runner = plain.runner
    model, kv = runner.model, runner.kv
    prefix = [5, 9, 33, 41, 2, 17, 8]
    tree = from_paths(prefix[-1], [[3, 4, 5], [3, 6], [7, 8], [7, 9, 10], [11]])
    blocks = list(range(40, 20, -1))  # non-contiguous, descending
    with torch.inference_mode():
        model(build_forward_batch([SeqSpan(prefix[:-1], 0, blocks)], 4, runner.device), kv, runner.backend)
        span = SeqSpan(tree.tokens, len(prefix) - 1, blocks, positions=[len(prefix) - 1 + d for d in tree.depths],
                       tree_mask=tree.ancestor_mask())
        got = model.compute_logits(model(build_forward_batch([span], 4, runner.device), kv, runner.backend))
        for node in range(len(tree)):
            ids = prefix[:-1] + [tree.tokens[n] for n in tree.path(node)]
            ref = model.compute_logits(model(build_forward_batch([SeqSpan(ids, 0, list(range(60, 80)))], 4,
                                                                 runner.device), kv, runner.backend))[-1]
            torch.testing.assert_close(got[node], ref, rtol=1e-9, atol=1e-9)


def test_draft_frontier_sees_only_its_ancestors(tiny_llama, head_dir):
    """Every candidate's cumulative draft score equals the one computed by running the head
    sequentially along that candidate's own path."""
    llm = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=12, depth=4, top_k=3), **KW)
    drafter = llm.runner.drafter
    grown = []
    original = drafter._tree
    drafter._tree = lambda root, g, *rest: (grown.append(g), original(root, g, *rest))[1]
    prompt = prompts(1, seed=4)[0]
    llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    g = grown[0]
    seq_tokens = prompt + llm_first_tokens(llm, prompt, 1)
    head, target = drafter.head, llm.runner.model
    with torch.inference_mode():
        feats = target(build_forward_batch([SeqSpan(seq_tokens[:-1], 0, list(range(200, 230)))], 4,
                                           llm.runner.device), llm.runner.kv, llm.runner.backend)
        for c in range(len(g.cands)):
            path = []
            node = c
            while node >= 0:
                path.append(g.cands.tokens[node])
                node = g.cands.parents[node]
            score = sequential_score(head, target, drafter, seq_tokens, feats, path[::-1])
            assert abs(score - g.cands.scores[c]) < 1e-9


def test_pending_pairs_reach_the_head_whatever_the_rounds_and_batches(tiny_llama, head_dir):
    """The feature cache: pairs observed for two sequences at once and one by one, over blocks
    out of order, some consumed by a catch-up forward (more than CATCHUP_SPLIT pending), give
    the same first-level draft as the head run along each sequence alone."""
    from eagle_serve.engine.speculative.eagle_drafter import CATCHUP_SPLIT
    from eagle_serve.engine.step_io import SeqStep
    llm = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=4, depth=1, top_k=3), **KW)
    drafter, target = llm.runner.drafter, llm.runner.model
    rng = random.Random(7)
    seqs = [[rng.randrange(3, 300) for _ in range(CATCHUP_SPLIT + 9)], [rng.randrange(3, 300) for _ in range(7)]]
    tables = [[40, 3, 17, 5, 21, 8, 30], [41, 14, 6, 25]]  # laid out as if contiguous, they would overlap
    with torch.inference_mode():  # every position's target feature, in a scratch part of the cache
        feats = [target(build_forward_batch([SeqSpan(s[:-1], 0, list(range(200, 210)))], 4, llm.runner.device),
                        llm.runner.kv, llm.runner.backend) for s in seqs]

    def step(b, num_cached, restart=False):
        return SeqStep(seq_id=b, token_ids=[seqs[b][num_cached]], num_cached=num_cached, block_table=tables[b],
                       params=SamplingParams(max_tokens=8), seed=0, output_token_ids=[], max_new_tokens=8,
                       prompt_token_ids=seqs[b], restart=restart)

    # pairs j = (token j + 1, feature j): both prompts' first pairs in one call, then one by one
    first = [CATCHUP_SPLIT + 2, 3]
    drafter.observe_many([(step(b, 0, True), seqs[b][1:first[b] + 1], True) for b in (0, 1)],
                         torch.cat([feats[b][:first[b]] for b in (0, 1)]))
    for j in range(max(len(s) - 1 for s in seqs)):
        for b in (0, 1):
            if first[b] <= j < len(seqs[b]) - 1:
                drafter.observe(step(b, j), [seqs[b][j + 1]], feats[b][j:j + 1], reset=False)
    grown = []
    original = drafter._tree
    drafter._tree = lambda root, g, *rest: (grown.append(g), original(root, g, *rest))[1]
    drafter.propose([step(b, len(seqs[b]) - 1) for b in (0, 1)], [1, 1])
    assert len(grown) == 2 and drafter.catchup_seconds > 0  # both drafted; the first through a catch-up
    for b, g in enumerate(grown):
        assert len(g.cands) == 3
        for c in range(3):
            ref = sequential_score(drafter.head, target, drafter, seqs[b], feats[b], [g.cands.tokens[c]])
            assert abs(ref - g.cands.scores[c]) < 1e-9


@pytest.mark.parametrize("consumed", [False, True], ids=["prefix-pairs-pending", "prefix-pairs-consumed"])
def test_a_prefix_cache_hit_drafts_as_if_the_prefix_were_computed(tiny_llama, head_dir, consumed):
    """Sequence B hits the prefix cache on A's first two blocks. Whether A's head consumed the
    prefix's pairs (its head KV there written) or not (A decoded plainly: the head's KV there is
    whatever the slots held before, so B consumes them itself), B's first-level draft equals
    the head run along B alone; where A wrote them, B leaves A's head KV as it was."""
    from eagle_serve.engine.step_io import SeqStep
    llm = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=4, depth=1, top_k=3), **KW)
    drafter, target = llm.runner.drafter, llm.runner.model
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(8)]  # two blocks of 4
    a = shared + [5, 6, 7, 8, 9, 10]
    # pending: B differs from A right after the prefix; consumed: B shares the token after it
    # (the last prefix position's pair in the shared block is A's), then differs
    b = shared + ([5] if consumed else []) + [rng.randrange(11, 300) for _ in range(5)]
    tables = {0: [40, 3, 17, 5], 1: [40, 3, 22, 9]}
    seqs = {0: a, 1: b}
    with torch.inference_mode():
        feats = {k: target(build_forward_batch([SeqSpan(t[:-1], 0, list(range(200, 210)))], 4, llm.runner.device),
                           llm.runner.kv, llm.runner.backend) for k, t in seqs.items()}

    def step(k, num_cached, restart=False):
        t = seqs[k]
        return SeqStep(seq_id=k, token_ids=t[num_cached:] if restart else [t[num_cached]], num_cached=num_cached,
                       block_table=tables[k], params=SamplingParams(max_tokens=8), seed=0, output_token_ids=[],
                       max_new_tokens=8, prompt_token_ids=t, restart=restart)

    drafter.observe_many([(step(0, 0, True), a[1:], True)], feats[0][:len(a) - 1])
    if consumed:
        drafter.propose([step(0, len(a) - 1)], [1])
    else:  # stale head KV in the slots A never wrote
        drafter.kv.data.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(0))
    shared_slots = [40 * 4 + i for i in range(4)] + [3 * 4 + i for i in range(4)]
    before = drafter.kv.data[:, :, shared_slots].clone()
    grown = []
    original = drafter._tree
    drafter._tree = lambda root, g, *rest: (grown.append(g), original(root, g, *rest))[1]
    # B's prefill from the hit on: its own pairs from position 8 on
    drafter.observe_many([(step(1, 8, True), b[9:], True)], feats[1][8:len(b) - 1])
    drafter.propose([step(1, len(b) - 1)], [1])
    assert len(grown) == 1 and len(grown[0].cands) == 3
    for c in range(3):
        ref = sequential_score(drafter.head, target, drafter, b, feats[1], [grown[0].cands.tokens[c]])
        assert abs(ref - grown[0].cands.scores[c]) < 1e-9
    assert torch.equal(drafter.kv.data[:, :, shared_slots], before) == consumed  # written by B only if A had not


def test_kv_budget_on_the_cpu_counts_the_heads_kv_and_feature_cache(tiny_llama, head_dir, monkeypatch):
    """Sized from memory, an engine with a head gets fewer KV blocks, by the head's one-layer
    KV and feature row per token; its feature cache is as wide as the budget counted."""
    import eagle_serve.engine.model_runner as mr
    from eagle_serve.engine.gpu_memory import draft_feature_width, kv_bytes_per_token
    monkeypatch.setattr(mr, "_memory_bytes", lambda device: 1 << 22)
    kw = {**KW, "kv_cache_tokens": None, "kv_cache_memory_fraction": 0.5, "max_num_seqs": 4096}
    plain_llm = LLM(tiny_llama[0], **kw)
    head_llm = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=4, depth=2, top_k=2), **kw)
    m = plain_llm.runner.loaded.config
    width = draft_feature_width(head_llm.runner.config, m.hidden_size)
    assert width == m.hidden_size and head_llm.runner.drafter.features.shape == (head_llm.runner.num_blocks * 4, width)
    for llm, per_token in ((plain_llm, kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, 8)),
                           (head_llm, kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, 8, 1, width))):
        assert llm.runner.num_blocks == (1 << 21) // per_token // 4


def llm_first_tokens(llm, prompt, n):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def sequential_score(head, target, drafter, tokens, feats, path):
    """Pairs (x_{j+1}, f_j) for the true prefix, then the path's pairs on predicted features."""
    from eagle_serve.engine.kv_cache import KVCache
    cfg = head.config
    kv = KVCache(1, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    blocks = list(range(64))
    ids, fs = list(tokens[1:]), [feats[j] for j in range(len(tokens) - 1)]
    total, n_done = 0.0, 0
    for step in range(len(path) + 1):
        span = SeqSpan(ids[n_done:], n_done, blocks)
        batch = build_forward_batch([span], 4, torch.device("cpu"))
        out = head(target.model.embed_tokens(batch.input_ids), torch.stack(fs[n_done:]), batch, kv,
                   drafter.backend, drafter.rotary)
        n_done = len(ids)
        if step == len(path):
            break
        logp = target.compute_logits(out[-1:]).log_softmax(-1)[0]
        total += float(logp[path[step]])
        ids.append(path[step])
        fs.append(out[-1])
    return total


# ---- acceptance power and greedy losslessness ---------------------------------------------

def oracle_llm(tiny_llama, refs, depth, corrupt_at):
    llm = LLM(tiny_llama[0], spec=SpecConfig("ngram", total_tokens=depth + 1, depth=depth), **KW)
    llm.runner.drafter = OracleDrafter(refs, 320, corrupt_at)
    return llm


def test_oracle_drafts_are_accepted_at_every_depth(tiny_llama, plain):
    D = 5
    ps = prompts(12, seed=1)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    refs = {tuple(p): o.token_ids for p, o in zip(ps, plain.generate(ps, params))}
    rng = random.Random(0)
    llm = oracle_llm(tiny_llama, refs, D, corrupt_at=lambda _: rng.choice([1, 2, 3, 4, 5, None, None, None]))
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in ps]
    per_depth = [0] * D
    for o in outs:
        for d, n in enumerate(o.spec.accepted_per_depth):
            per_depth[d] += n
    assert min(per_depth) >= 100, per_depth
    clean = oracle_llm(tiny_llama, refs, D, corrupt_at=None)
    s = [o.spec for o in clean.generate(ps, params)]
    assert sum(x.accepted_tokens + x.verify_steps for x in s) / sum(x.verify_steps for x in s) >= 0.8 * D


SPECS = [
    ("eagle2-small", SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2)),
    ("eagle2-wide", SpecConfig("eagle2", total_tokens=20, depth=5, top_k=4)),
    ("eagle1-default", SpecConfig("eagle1")),
    ("ngram", SpecConfig("ngram", total_tokens=6, depth=5)),
]


@pytest.mark.parametrize("name, spec", SPECS, ids=[s[0] for s in SPECS])
def test_greedy_speculative_equals_plain(tiny_llama, plain, head_dir, name, spec):
    ps = prompts(6, seed=2)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 7, 1, 22, 40, 13)]
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(tiny_llama[0], draft=head_dir if spec.uses_head else None, spec=spec, **KW)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref  # batched
    assert llm.generate(ps[0], params[0])[0].token_ids == ref[0]  # alone
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks  # no scratch left behind


@pytest.mark.parametrize("name, spec", SPECS[:2] + SPECS[3:], ids=[s[0] for s in SPECS[:2] + SPECS[3:]])
def test_seeded_sampling_speculative_equals_plain(tiny_llama, plain, head_dir, name, spec):
    ps = prompts(5, seed=3)
    params = [SamplingParams(max_tokens=25, temperature=t, top_p=tp, top_k=k, seed=i, ignore_eos=True,
                             frequency_penalty=fp, presence_penalty=pp)
              for i, (t, tp, k, fp, pp) in enumerate([(0.8, 1.0, -1, 0, 0), (1.2, 0.9, -1, 0.5, 0),
                                                      (0.5, 1.0, 20, 0, 0.3), (1.0, 0.7, 5, 1.0, 1.0),
                                                      (0.0, 1.0, -1, 0.8, 0)])]
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(tiny_llama[0], draft=head_dir if spec.uses_head else None, spec=spec, **KW)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref


def test_sampled_trees_draw_only_the_nodes_the_walk_reads(tiny_llama, plain, head_dir, monkeypatch):
    """A sampled request's tree is verified by drawing (top-p sort, noise) only at the nodes the
    acceptance walk reaches, at most depth + 1 a round, not at all 20 nodes; the output is the
    same seeded plain output, logprobs included."""
    import eagle_serve.engine.sampler as sampler
    draws, noises, real_truncate, real_noise = [], [], sampler.truncate, sampler.gumbel_noise
    monkeypatch.setattr(sampler, "truncate", lambda *a: draws.append(1) or real_truncate(*a))
    monkeypatch.setattr(sampler, "gumbel_noise", lambda *a: noises.append(a[:2]) or real_noise(*a))
    spec = SpecConfig("eagle2", total_tokens=20, depth=5, top_k=4)
    ps = prompts(3, seed=7)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=i, ignore_eos=True, logprobs=1)
              for i in range(3)]
    ref = plain.generate(ps, params)
    llm = LLM(tiny_llama[0], draft=head_dir, spec=spec, **KW)
    draws.clear(), noises.clear()
    got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        assert [round(x.logprob, 9) for x in a.logprobs] == [round(x.logprob, 9) for x in b.logprobs]
    rounds = sum(o.spec.verify_steps for o in got)
    nodes = sum(o.spec.draft_tokens for o in got) + rounds
    emitted = sum(len(o.token_ids) for o in got)
    # one draw per emitted token (the prompt's first pick included), no node drawn twice
    assert len(draws) == emitted and len(noises) == len(set(noises)) == emitted
    assert nodes > 3 * len(draws), (nodes, len(draws))  # the trees were wide: drawing them all would cost more


def test_oracle_sampling_with_penalties_equals_plain(tiny_llama, plain):
    """Deep acceptances under sampling with penalties: the oracle proposes the seeded plain
    continuation, so most nodes are accepted and per-node penalties are exercised."""
    ps = prompts(4, seed=5)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, frequency_penalty=0.7, presence_penalty=0.4,
                             ignore_eos=True, logprobs=2) for i in range(4)]
    outs = plain.generate(ps, params)
    refs = {tuple(p): o.token_ids for p, o in zip(ps, outs)}
    llm = oracle_llm(tiny_llama, refs, 4, corrupt_at=lambda i: [None, 2, None, 4][i % 4])
    got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in outs]
    for a, b in zip(got, outs):  # logprobs come from the target's verify logits
        assert [round(x.logprob, 9) for x in a.logprobs] == [round(x.logprob, 9) for x in b.logprobs]
    assert sum(o.spec.accepted_tokens for o in got) > 40


def test_kv_after_many_rounds_equals_plain(tiny_llama, plain):
    p = prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = plain.generate(p, params)[0].token_ids
    llm = oracle_llm(tiny_llama, {tuple(p): ref}, 4, corrupt_at=lambda i: [None, 1, 3][i % 3])
    kv_of = {}
    for name, engine in (("plain", LLM(tiny_llama[0], **KW)), ("spec", llm)):
        captured = {}
        finish = engine.loop.scheduler.finish

        def capture(seq, *args, finish=finish, captured=captured, **kwargs):
            captured.setdefault("table", (list(seq.table.blocks), seq.table.num_committed))
            return finish(seq, *args, **kwargs)
        engine.loop.scheduler.finish = capture
        assert engine.generate(p, params)[0].token_ids == ref
        blocks, committed = captured["table"]
        slots = [blocks[i // 4] * 4 + i % 4 for i in range(committed)]
        kv_of[name] = engine.runner.kv.data[:, :, slots].clone()
    assert kv_of["spec"].shape == kv_of["plain"].shape
    torch.testing.assert_close(kv_of["spec"], kv_of["plain"], rtol=1e-12, atol=1e-12)


def test_eagle_on_a_model_without_head_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="needs a draft head"):
        LLM(tiny_llama[0], spec=SpecConfig("eagle2"), **KW)


def test_head_fixture_with_published_names_loads_and_mismatch_errors(tiny_llama, tmp_path):
    from eagle_serve.engine.loader import ModelLoadError
    bad = write_eagle_head(str(tmp_path / "wide"), tiny_llama[0], hidden=96, stray_embed=False)
    with pytest.raises(ModelLoadError, match="does not fit the target"):
        LLM(tiny_llama[0], draft=bad, spec=SpecConfig("eagle2"), **KW)
    ok = write_eagle_head(str(tmp_path / "ok"), tiny_llama[0], stray_embed=True)
    from safetensors.torch import load_file, save_file
    w = load_file(str(tmp_path / "ok" / "model.safetensors"))
    w["embed_tokens.weight"] = w["embed_tokens.weight"] + 1
    save_file(w, str(tmp_path / "ok" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="embed_tokens differ"):
        LLM(tiny_llama[0], draft=ok, spec=SpecConfig("eagle2"), **KW)


def test_float32_native_paths_speculative_equals_plain(tiny_llama):
    """On the CPU fast paths (native decode stack for trees of <= 4 tokens, oneDNN + native
    attention above), oracle speculation still reproduces plain greedy decoding."""
    kw = dict(KW, dtype="float32")
    plain32 = LLM(tiny_llama[0], **kw)
    ps = prompts(4, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in plain32.generate(ps, params)]
    refs = {tuple(p): r for p, r in zip(ps, ref)}
    for depth in (3, 7):  # trees of 4 tokens (native stack) and 8 (Python path)
        llm = LLM(tiny_llama[0], spec=SpecConfig("ngram", total_tokens=depth + 1, depth=depth), **kw)
        llm.runner.drafter = OracleDrafter(refs, 320, corrupt_at=lambda i: [None, 2][i % 2])
        outs = llm.generate(ps, params)
        assert [o.token_ids for o in outs] == ref
        assert sum(o.spec.accepted_tokens for o in outs) > 20


# ---- the context's end and one-token prompt chunks -------------------------------------------

def test_trees_at_the_context_end_never_write_outside_their_blocks(tiny_llama, head_dir):
    # Q runs to max_model_len with a 20-token tree: its last rounds reserve every slot a tree
    # writes, so no position past its block table lands in block 0, P's (or the prefix cache's):
    # P's greedy output stays the same, batched beside Q and in a later call alone
    spec = SpecConfig("eagle2", total_tokens=20, depth=5, top_k=4)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    p, q = [5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 60))
    ref = LLM(tiny_llama[0], max_model_len=64, **KW)
    want20, want50, want_q = (ref.generate(p, greedy(20))[0].token_ids, ref.generate(p, greedy(50))[0].token_ids,
                              ref.generate(q, greedy(64 - len(q)))[0].token_ids)
    llm = LLM(tiny_llama[0], max_model_len=64, draft=head_dir, spec=spec, **KW)
    assert llm.generate(p, greedy(20))[0].token_ids == want20  # P's blocks (block 0 first) stay in the prefix cache
    assert llm.generate(q, greedy(64 - len(q)))[0].token_ids == want_q
    assert llm.generate(p, greedy(20))[0].token_ids == want20
    free0 = llm.allocator.num_free_blocks
    out = llm.generate([p, q], [greedy(50), greedy(64 - len(q))])
    assert [o.token_ids for o in out] == [want50, want_q]
    assert llm.allocator.num_free_blocks == free0


def test_a_span_past_its_block_table_is_refused():
    with pytest.raises(ValueError, match="past its block table"):
        build_forward_batch([SeqSpan([1, 2, 3], 6, [4, 5])], 4, torch.device("cpu"))  # positions 6-8, 8 slots
    build_forward_batch([SeqSpan([1, 2], 6, [4, 5])], 4, torch.device("cpu"))  # positions 6-7: fits


@pytest.mark.parametrize("method", ["ngram", "eagle2"])
def test_one_token_prompt_chunks_are_not_drafted(tiny_llama, head_dir, method):
    # a prefill budget with one token of room schedules a one-token chunk of a longer prompt,
    # which is a prompt chunk, not a decoding step: drafting on it would change ngram's output
    # and make eagle2 write a tree past its one reserved slot
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batch = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [5, 6, 7, 8] * 6]
    want = [o.token_ids for o in LLM(tiny_llama[0], **KW).generate(batch, greedy)]
    spec = SpecConfig("ngram", total_tokens=6, depth=5) if method == "ngram" else \
        SpecConfig("eagle2", total_tokens=8, depth=4, top_k=2)
    draft = head_dir if method == "eagle2" else None
    one = LLM(tiny_llama[0], draft=draft, spec=spec, max_prefill_chunk=1, **KW)
    assert [o.token_ids for o in one.generate(batch, greedy)] == want
    assert one.generate(batch[0], greedy)[0].token_ids == want[0]
    # chunks of 4 under a 7-token budget leave one-token remainders mid-prompt
    rng = random.Random(5)
    five = [[rng.randrange(3, 300) for _ in range(rng.randrange(10, 40))] for _ in range(5)]
    want = [o.token_ids for o in LLM(tiny_llama[0], **KW).generate(five, greedy)]
    tight = LLM(tiny_llama[0], draft=draft, spec=spec, max_num_batched_tokens=7, max_prefill_chunk=4, **KW)
    assert [o.token_ids for o in tight.generate(five, greedy)] == want


# ---- int8 draft-head weights ------------------------------------------------------------------

@pytest.mark.skipif(kernels.native() is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_draft_head_keeps_speculation_lossless(tiny_llama, head_dir, dtype):
    """A head with int8 weights (the CPU default) drafts through them, its native stack included,
    and greedy and seeded sampled outputs stay those of plain decoding (bf16 too: the target's
    trees run through the same row-independent kernels as its plain steps, as long as a round's
    rows stay within the native kernels' limit, 16 without AMX: so one request at a time there)."""
    kw = dict(KW, dtype=dtype)
    ps = prompts(5, seed=11)
    greedy = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 9, 30, 1, 17)]
    sampled = [SamplingParams(max_tokens=20, temperature=t, top_p=tp, seed=i, ignore_eos=True)
               for i, (t, tp) in enumerate([(0.8, 1.0), (1.2, 0.9), (0.5, 1.0), (1.0, 0.7), (0.9, 0.95)])]
    def run(llm, params):
        if dtype == "float32":
            return [o.token_ids for o in llm.generate(ps, params)]
        return [llm.generate(p, q)[0].token_ids for p, q in zip(ps, params)]
    plain_llm = LLM(tiny_llama[0], **kw)
    ref_g, ref_s = run(plain_llm, greedy), run(plain_llm, sampled)
    spec = SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2)
    llm = LLM(tiny_llama[0], draft=head_dir, spec=spec, **kw)  # draft_quantization auto
    head = llm.runner.drafter.head
    assert llm.runner.draft_int8
    assert llm.runner.draft_int8_inputs == kernels.native().int8_inputs_available()  # auto: w8a8 where VNNI
    assert all(m.int8_weight is not None for m in head.modules() if isinstance(m, Linear))
    assert run(llm, greedy) == ref_g
    assert llm.generate(ps[0], greedy[0])[0].spec.verify_steps > 0
    assert run(llm, sampled) == ref_s
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    off = LLM(tiny_llama[0], draft=head_dir, spec=spec, draft_quantization="none", **kw)
    assert not off.runner.draft_int8
    assert all(m.int8_weight is None for m in off.runner.drafter.head.modules() if isinstance(m, Linear))
    assert run(off, greedy) == ref_g
    # int8 weights with float inputs (the other of int8 / w8a8 where VNNI makes auto w8a8):
    # other drafts, the same output
    other = LLM(tiny_llama[0], draft=head_dir, spec=spec, draft_quantization="int8", **kw)
    assert other.runner.draft_int8 and not other.runner.draft_int8_inputs
    assert all(m.int8_weight is not None and m.int8_weight.shape[-1] == 64
               for m in other.runner.drafter.head.modules() if isinstance(m, Linear))
    if kernels.native().int8_inputs_available():
        assert all(m.int8_weight.shape[-1] == 256 for m in head.modules() if isinstance(m, Linear))
    assert run(other, greedy) == ref_g
    assert run(other, sampled) == ref_s
    assert other.allocator.num_free_blocks == other.allocator.num_blocks


def test_draft_quantization_is_checked(tiny_llama, head_dir):
    from eagle_serve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="draft_quantization must be one of"):
        EngineConfig(draft=head_dir, draft_quantization="fp8")
    with pytest.raises(ValueError, match="applies to an EAGLE draft head"):
        EngineConfig(spec="ngram", draft_quantization="int8")
    # float64 has no native kernels: int8 is refused, not ignored; auto then keeps the head as it is
    with pytest.raises(ValueError, match="int8 needs the native CPU kernels"):
        LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2"), draft_quantization="int8", **KW)
    with pytest.raises(ValueError, match="w8a8 needs the native CPU kernels"):
        LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2"), draft_quantization="w8a8", **KW)
    assert not LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2"), **KW).runner.draft_int8


@pytest.mark.skipif(kernels.native() is None, reason="no native kernels on this CPU or no compiler")
def test_w8a8_is_refused_where_the_kernels_have_no_vnni(tiny_llama, head_dir, monkeypatch):
    """A build without VNNI (AVX2) has no int8-input products: w8a8 is refused, not ignored."""
    class NoVnni:
        def __getattr__(self, name):
            return getattr(real, name)

        def int8_inputs_available(self):
            return False
    real = kernels.native()
    monkeypatch.setattr(kernels, "native", lambda: NoVnni())
    with pytest.raises(ValueError, match="w8a8 needs the AVX-512 build"):
        LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2"), draft_quantization="w8a8",
            **dict(KW, dtype="float32"))


# ---- the native draft tree --------------------------------------------------------------------

@pytest.mark.skipif(kernels.native() is None, reason="no native kernels on this CPU or no compiler")
@pytest.mark.parametrize("dtype, quant", [("float32", "none"), ("float32", "int8"), ("bfloat16", "int8")])
def test_native_draft_tree_equals_the_per_level_python_path(tiny_llama, tmp_path, dtype, quant):
    """DecodeStack.draft_tree (every level of a round's EAGLE-2 trees in one native call) drafts
    the trees the per-level Python path drafts, round by round, with the same confidences and
    the same draft KV, batched and with mixed depths in a batch; outputs stay plain decoding's."""
    import json
    import os
    from safetensors.torch import load_file, save_file
    head = write_eagle_head(str(tmp_path / "head"), tiny_llama[0], std=0.2)
    weights = load_file(os.path.join(head, "model.safetensors"))  # a reduced draft vocabulary (the native path's)
    save_file({**weights, "d2t": torch.arange(0, 256, 2)}, os.path.join(head, "model.safetensors"))
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump({**cfg, "draft_vocab_size": 128}, f)
    kw = dict(KW, dtype=dtype)
    spec = SpecConfig("eagle2", total_tokens=9, depth=4, top_k=3)
    ps = prompts(4, seed=21)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 13, 25, 7)]

    def run(native: bool):
        llm = LLM(tiny_llama[0], draft=head, spec=spec, draft_quantization=quant, **kw)
        dr = llm.runner.drafter
        dr.native_tree = native
        log, used = [], []
        propose, tree_fn = dr.propose, dr._native_tree

        def mixed(steps, depths):  # the tree budget's mixed depths within a batch
            trees = propose(steps, [max(1, d - (s.seq_id % 3)) for s, d in zip(steps, depths)])
            log.append([(t.tokens, t.parents, dr._confidence.get(s.seq_id)) for s, t in zip(steps, trees)])
            return trees

        def counted(*a):
            out = tree_fn(*a)
            used.append(out is not None)
            return out
        dr.propose, dr._native_tree = mixed, counted
        # one at a time, then batched (float32's native linears take 4 rows: its batches of
        # trees take the Python path, bf16's packed ones 16)
        outs = [llm.generate(p, q)[0].token_ids for p, q in zip(ps, params)]
        outs += [o.token_ids for o in llm.generate(ps, params)]
        return outs, log, used, dr.kv.data.clone(), llm

    outs_n, log_n, used_n, kv_n, llm = run(True)
    outs_p, log_p, used_p, kv_p, _ = run(False)
    assert any(used_n) and not any(used_p)
    if dtype == "bfloat16":
        assert all(used_n)  # every round, the batched ones too
    assert outs_n == outs_p
    assert log_n == log_p and any(len(t[0]) > 4 for r in log_n for t in r)
    assert torch.equal(kv_n, kv_p)
    if dtype == "float32":  # (bf16 batches may round a near-tie apart from plain decoding)
        assert outs_n[len(ps):] == [o.token_ids for o in LLM(tiny_llama[0], **kw).generate(ps, params)]
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


@pytest.mark.skipif(kernels.native() is None, reason="no native kernels on this CPU or no compiler")
def test_catch_ups_in_native_chunks_write_the_heads_kv_and_keep_outputs(tiny_llama, head_dir):
    """A short backlog of pending pairs (a prompt's, at its first draft) is consumed in forwards
    of the native head stack's rows, a long one in one forward: the head's KV at those pairs is
    the one-forward catch-up's (to float32 rounding: other kernels) and outputs stay plain
    decoding's."""
    from eagle_serve.engine.speculative.eagle_drafter import CATCHUP_CHUNKED_MAX
    kw = dict(KW, dtype="float32")
    spec = SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2)
    rng = random.Random(3)
    ps = [[rng.randrange(3, 300) for _ in range(n)] for n in (23, 41, 18, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(tiny_llama[0], **kw).generate(ps, params)]
    runs = {}
    for chunked in (True, False):
        # (the head's own weights: a float32 chunk of 4 rows would take its int8 ones, the one forward not)
        llm = LLM(tiny_llama[0], draft=head_dir, spec=spec, draft_quantization="none", **kw)
        dr = llm.runner.drafter
        dr.native_tree = chunked
        assert (dr._catchup_chunk() > 0) == chunked
        forwards, written = [], []
        head_forward, catch_up = dr._head_forward, dr._catch_up

        def counted(spans, feats, head_forward=head_forward, forwards=forwards):
            forwards.append(sum(len(s.token_ids) for s in spans))
            return head_forward(spans, feats)

        def kept(steps, keep, dr=dr, catch_up=catch_up, written=written):  # the KV each catch-up wrote
            slots = [x for s in steps for x in dr._slots(s.block_table, dr.states[s.seq_id].draft_len,
                                                         len(dr.states[s.seq_id].tokens) - keep)]
            catch_up(steps, keep)
            written.append(dr.kv.data[:, :, slots].clone())
        dr._head_forward, dr._catch_up = counted, kept
        outs = [llm.generate(p, params)[0].token_ids for p in ps]  # one at a time: their first drafts catch up
        assert outs == ref
        runs[chunked] = (written, forwards, dr._catchup_chunk())
    (kv_c, fw_c, chunk), (kv_1, fw_1, _) = runs[True], runs[False]
    assert len(kv_c) == len(kv_1) == len(ps)  # one catch-up per prompt, at its first draft
    # chunks of the stack's rows, but a backlog past CATCHUP_CHUNKED_MAX pairs in one forward
    assert all(f <= chunk or f > CATCHUP_CHUNKED_MAX for f in fw_c) and max(fw_c) == max(fw_1) == 89
    assert sum(chunk < f <= CATCHUP_CHUNKED_MAX for f in fw_1) == 3
    for a, b in zip(kv_c, kv_1):
        assert a.shape[2] > chunk and torch.allclose(a, b, atol=1e-5, rtol=1e-4)
