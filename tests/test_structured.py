"""Structured output in the engine: grammar masks in plain decoding, draft trees and tree
verification, lossless against plain decoding under the same grammar (float64 tiny models with a
real byte-level tokenizer), and the checks that refuse what cannot be served."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from eagle_serve.engine.sampling_params import SamplingParams, StructuredOutputs
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.drafters import Drafter
from eagle_serve.engine.speculative.tree import DraftTree, chain, from_paths, prune, root_only
from eagle_serve.engine.structured import GrammarError, GrammarState, allocate
from eagle_serve.server.llm import LLM
from tests.spec_helpers import KW, OracleDrafter
from tests.test_spec import SPECS, head_dir, plain  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}
GRAMMARS = {
    "json_schema": StructuredOutputs(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{1,3}"),
    "choice": StructuredOutputs(choice=("alpha", "beta", "gamma delta")),
    "ebnf": StructuredOutputs(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [a-z] | [a-z] [a-z]'),
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def _requests(seed: int = 0, temperature: float = 0.0, max_tokens: int = 24):
    """One request a grammar plus one free-text request, batched together."""
    ps = _prompts(len(GRAMMARS) + 1, seed)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured=g)
              for i, g in enumerate(GRAMMARS.values())]
    params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=99, ignore_eos=True))
    return ps, params


def _obeys(name: str, text: str, finished: bool) -> bool:
    """The text follows its grammar: whole (finished by the grammar's end) or a prefix of it."""
    if name == "regex":
        return bool(re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text)) if finished else \
            bool(re.fullmatch(r"[a-z]{0,5}(-[0-9]{0,3})?", text))
    if name == "choice":
        return text in GRAMMARS["choice"].choice if finished else any(c.startswith(text) for c in GRAMMARS["choice"].choice)
    if name == "ebnf":
        return bool(re.fullmatch(r"\([a-z]{1,2}(,[a-z]{1,2})?\)", text)) if finished else \
            bool(re.fullmatch(r"(\([a-z,]*)?", text))
    if name in ("json_schema", "json_object") and finished:
        value = json.loads(text)
        if name == "json_schema":
            import jsonschema
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    return True


def test_plain_outputs_follow_every_grammar(plain):
    ps, params = _requests(seed=1, max_tokens=40)
    outs = plain.generate(ps, params)
    for name, out in zip(GRAMMARS, outs):
        finished = out.finish_reason == "stop"
        assert _obeys(name, out.text, finished), (name, out.text)
    # the short grammars end within the budget, with the model's EOS as the only choice left
    assert all(o.finish_reason == "stop" for o in outs[2:5]), [o.text for o in outs[2:5]]
    assert outs[-1].finish_reason == "length"  # the free request next to them is untouched


@pytest.mark.parametrize("name, spec", SPECS, ids=[s[0] for s in SPECS])
def test_greedy_speculative_equals_plain_under_a_grammar(tiny_llama, plain, head_dir, name, spec):
    ps, params = _requests(seed=2)
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(tiny_llama[0], draft=head_dir if spec.uses_head else None, spec=spec, **KW)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref  # batched
    assert llm.generate(ps[0], params[0])[0].token_ids == ref[0]  # alone
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    assert not llm.runner.grammar_states  # every finished sequence's matcher is released


@pytest.mark.parametrize("name, spec", SPECS[:2] + SPECS[3:], ids=[s[0] for s in SPECS[:2] + SPECS[3:]])
def test_seeded_sampling_speculative_equals_plain_under_a_grammar(tiny_llama, plain, head_dir, name, spec):
    ps, params = _requests(seed=3, temperature=0.9)
    params = [p if i % 2 else SamplingParams(**{**p.__dict__, "top_p": 0.8, "top_k": 20})
              for i, p in enumerate(params)]
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(tiny_llama[0], draft=head_dir if spec.uses_head else None, spec=spec, **KW)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref


def _oracle_llm(tiny_llama, refs, depth, corrupt_at):
    llm = LLM(tiny_llama[0], spec=SpecConfig("ngram", total_tokens=depth + 1, depth=depth), **KW)
    llm.runner.drafter = OracleDrafter(refs, vocab=320, corrupt_at=corrupt_at)
    return llm


def test_oracle_drafts_under_a_grammar_are_accepted_deep_and_equal_plain(tiny_llama, plain):
    """Drafts of the grammar-constrained greedy continuation, some corrupted: deep acceptance
    (the masks at every node follow that node's path), outputs exactly plain's."""
    ps = _prompts(6, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0, structured=GRAMMARS["json_schema"])
    refs = {tuple(p): o.token_ids for p, o in zip(ps, plain.generate(ps, params))}
    rng = random.Random(0)
    llm = _oracle_llm(tiny_llama, refs, 5, corrupt_at=lambda _: rng.choice([1, 2, 3, 4, 5, None, None]))
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in ps]
    per_depth = [0] * 5
    for o in outs:
        for d, n in enumerate(o.spec.accepted_per_depth):
            per_depth[d] += n
    assert min(per_depth) >= 10, per_depth


class _PickThenFree(Drafter):
    """Drafts the grammar-constrained greedy token (from plain decoding's outputs) at depth 1,
    then the unconstrained model's greedy continuation: below the root, the target's unmasked pick
    is always a child in the tree."""

    def __init__(self, refs, model):
        self.refs, self.model = refs, model

    def propose(self, steps, max_depths):
        trees = []
        for s, d in zip(steps, max_depths):
            ref, n = self.refs.get(tuple(s.prompt_token_ids)), len(s.output_token_ids)
            if ref is None or ref[:n] != s.output_token_ids or n >= len(ref) or d < 2:
                trees.append(root_only(s.token_ids[-1]))
                continue
            history = s.history + [ref[n]]
            with torch.no_grad():
                out = self.model.generate(torch.tensor([history]), max_new_tokens=d - 1, do_sample=False,
                                          pad_token_id=0, eos_token_id=None)
            trees.append(chain(s.token_ids[-1], [ref[n]] + out[0, len(history):].tolist()))
        return trees


@pytest.mark.parametrize("wrong", [False, True], ids=["masked-nodes", "root-only-mask"])
def test_unmasked_tree_nodes_break_the_guarantee(tiny_llama, plain, monkeypatch, wrong):
    """Drafts whose nodes below the root hold the model's unconstrained picks: with every node
    masked along its own path the outputs equal plain decoding's; the rule that masks only the
    root's row is caught (the outputs leave plain decoding's, or the matcher refuses an accepted
    token)."""
    ps = _prompts(6, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, structured=GRAMMARS["regex"])
    refs = {tuple(p): o.token_ids for p, o in zip(ps, plain.generate(ps, params))}
    llm = LLM(tiny_llama[0], spec=SpecConfig("ngram", total_tokens=5, depth=4), **KW)
    llm.runner.drafter = _PickThenFree(refs, tiny_llama[1])
    if wrong:
        def root_only_masks(self, tokens, parents, out):
            out.fill_(-1)
            self._fill(out, 0)
        monkeypatch.setattr(GrammarState, "tree_masks", root_only_masks)
        monkeypatch.setattr(GrammarState, "valid_candidates", lambda self, tokens, parents: [True] * len(tokens))
    try:
        outs = llm.generate(ps, params)
        equal = [o.token_ids for o in outs] == [refs[tuple(p)] for p in ps]
        accepted = sum(o.spec.accepted_tokens for o in outs)
    except RuntimeError as e:  # the matcher refused an accepted token
        assert "not allowed" in str(e) or "follows the end" in str(e)
        equal, accepted = False, None
    assert equal != wrong
    if not wrong:
        assert accepted >= len(ps)  # the depth-1 drafts were accepted


def test_draft_trees_hold_only_tokens_the_grammar_allows(tiny_llama, head_dir):
    llm = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=20, depth=5, top_k=4), **KW)
    seen = []
    draft = llm.runner._draft

    def spy(steps, grammar=None):
        trees, depths = draft(steps, grammar)
        seen.extend((s, t) for s, t in zip(steps, trees) if s.params.structured is not None and len(t) > 1)
        return trees, depths
    llm.runner._draft = spy
    ps, params = _requests(seed=6, max_tokens=30)
    llm.generate(ps, params)
    assert seen
    compiled = {spec: llm.runner.grammars.get(spec) for spec in GRAMMARS.values()}
    for step, tree in seen:
        for node in range(1, len(tree)):
            state = GrammarState(compiled[step.params.structured], llm.runner.loaded.config.vocab_size)
            state.accept(step.output_token_ids + [tree.tokens[n] for n in tree.path(node)[1:]])


def test_preemption_and_retries_keep_the_matchers_consistent(tiny_llama, plain, head_dir):
    ps, params = _requests(seed=7, max_tokens=30)
    ref = [o.token_ids for o in plain.generate(ps, params)]
    tight = LLM(tiny_llama[0], draft=head_dir, spec=SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2),
                **{**KW, "kv_cache_tokens": 96})
    assert [o.token_ids for o in tight.generate(ps, params)] == ref
    assert tight.loop.scheduler.num_preemptions > 0
    # a failed batch is retried sequence by sequence with fresh engine state
    calls = {"n": 0}

    def flaky(steps):
        calls["n"] += 1
        if len(steps) > 1 and calls["n"] % 3 == 0:
            raise RuntimeError("injected")
    tight.runner.fault_hook = flaky
    assert [o.token_ids for o in tight.generate(ps, params)] == ref
    assert tight.allocator.num_free_blocks == tight.allocator.num_blocks


def test_a_prefix_cache_hit_leaves_the_grammar_at_the_output_start(tiny_llama, plain):
    llm = LLM(tiny_llama[0], enable_prefix_caching=True, **KW)
    p = _prompts(1, seed=8)[0] * 3
    params = SamplingParams(max_tokens=20, temperature=0, structured=GRAMMARS["ebnf"])
    first = llm.generate(p, params)[0].token_ids
    assert llm.generate(p, params)[0].token_ids == first == plain.generate(p, params)[0].token_ids


# ---- the matcher's tree walks against one matcher per path ---------------------------------


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist())


def test_tree_masks_and_candidate_checks_equal_a_matcher_per_path(tiny_llm):
    grammars = tiny_llm.runner.grammars
    vocab = tiny_llm.runner.loaded.config.vocab_size
    tok = tiny_llm.tokenizer
    compiled = grammars.get(GRAMMARS["regex"])
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    paths = [ids("ab"), ids("ab-1"), ids("xyz"), ids("9"), ids("a-"), ids("abcdef")]
    tree = from_paths(0, [p for p in paths if p])
    state = GrammarState(compiled, vocab)
    masks = allocate(len(tree), vocab)
    state.tree_masks(tree.tokens, tree.parents, masks)
    ok = state.valid_candidates(tree.tokens[1:], [p - 1 for p in tree.parents[1:]])
    assert state.num_accepted == 0 and _allowed(masks[0], vocab) == _allowed(_fresh_mask(compiled, vocab, []), vocab)
    for node in range(1, len(tree)):
        path = [tree.tokens[n] for n in tree.path(node)[1:]]
        fresh = GrammarState(compiled, vocab)
        try:
            fresh.accept(path)
            valid = True
        except RuntimeError:
            valid = False
        assert ok[node - 1] == valid, (node, path)
        expect = _allowed(_fresh_mask(compiled, vocab, path), vocab) if valid else set()
        assert _allowed(masks[node], vocab) == expect, node
    pruned = prune(tree, ok)
    assert all(ok[i - 1] for i in range(1, len(tree))) or len(pruned) < len(tree)
    assert isinstance(pruned, DraftTree) and pruned.parents[0] == -1


def _fresh_mask(compiled, vocab, path):
    state = GrammarState(compiled, vocab)
    state.accept(path)
    out = allocate(1, vocab)
    state._fill(out, 0)
    return out[0]


# ---- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec, field, words", [
    (StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": 5}}}'), "json_schema", "not a valid JSON Schema"),
    (StructuredOutputs(json='{"type": "object"'), "json_schema", "not valid JSON"),
    (StructuredOutputs(json='{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'), "json_schema",
     "uniqueItems"),
    (StructuredOutputs(json='{"not": {"type": "string"}}'), "json_schema", "not"),
    (StructuredOutputs(json='{"a":' * 40 + '1' + '}' * 40), "json_schema", "levels deep"),
    (StructuredOutputs(regex="(ab"), "regex", "does not compile"),
    (StructuredOutputs(regex="(?=a)b"), "regex", "Lookahead"),
    (StructuredOutputs(grammar='root ::= "a" | foo'), "grammar", "foo"),
    (StructuredOutputs(choice=("x" * 70000,)), "choice", "characters long"),
], ids=["bad-type", "bad-json", "unique-items", "not", "too-deep", "regex", "lookahead", "ebnf", "too-long"])
def test_unservable_grammars_are_refused_by_name(tiny_llm, spec, field, words):
    with pytest.raises(GrammarError) as e:
        tiny_llm.runner.grammars.get(spec)
    assert e.value.field == field and words in str(e.value)
    with pytest.raises(ValueError, match=re.escape(words)):  # the offline LLM refuses before running
        tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=4, structured=spec))


def test_property_names_are_not_taken_for_keywords(tiny_llm):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}}
    tiny_llm.runner.grammars.get(StructuredOutputs(json=json.dumps(schema)))


def test_structured_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs(choice=())
    with pytest.raises(ValueError, match="min_tokens and ignore_eos"):
        SamplingParams(min_tokens=3, structured=StructuredOutputs(regex="a+"))
    with pytest.raises(ValueError, match="min_tokens and ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutputs(regex="a+"))


def test_compiled_grammars_are_cached_and_bounded(tiny_llama):
    llm = LLM(tiny_llama[0], **KW)
    g = llm.runner.grammars
    g.cache_size = 3
    specs = [StructuredOutputs(regex=f"[a-z]{{{i}}}") for i in range(1, 6)]
    for s in specs + specs[-1:]:
        g.get(s)
    assert g.stats.misses == 5 and g.stats.hits == 1 and len(g.cache) == 3
    assert list(g.cache) == specs[2:]
    assert len(g.stats.compile_seconds) == 5


def test_mask_application_equals_xgrammars_kernel():
    """Both ways of applying masks (numpy on float32 CPU logits, torch elsewhere) give xgrammar's
    own result: -inf exactly where a listed row's bit is 0, other rows untouched."""
    import xgrammar
    from eagle_serve.engine.sampler import GrammarMasks
    gen = torch.Generator().manual_seed(0)
    vocab, n = 1000, 4
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(n, vocab, generator=gen)
    ref = logits.clone()
    xgrammar.apply_token_bitmask_inplace(ref, bitmask, indices=[0, 2], vocab_size=vocab)
    fast = logits.clone()
    GrammarMasks(bitmask, [0, 2], vocab).apply(fast)
    generic = logits.double()
    GrammarMasks(bitmask, [0, 2], vocab).apply(generic)
    assert torch.equal(fast, ref) and torch.equal(generic.float(), ref)
    assert torch.isinf(ref[0]).any() and torch.equal(ref[1], logits[1])
