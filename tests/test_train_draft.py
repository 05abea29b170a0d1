"""`eagle-serve train-draft`: data rendering, training, the saved head, bad data."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time

import pytest
import torch

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.train.data import DataError, _json_array_items, load_conversations, render
from eagle_serve.engine.train.config import TrainConfig
from eagle_serve.engine.train.trainer import train_draft
from eagle_serve.server.cli import regeneration_llm
from eagle_serve.server.llm import LLM
from tests.spec_helpers import write_eagle_head

WORDS = "the quick brown fox jumps over the lazy dog speculative decoding verifies a draft tree".split()


def write_jsonl(path, n, seed=0, turns=1):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            msgs = []
            for _ in range(turns):
                msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 8)))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 12)))})
            f.write(json.dumps({"messages": msgs} if i % 2 else msgs) + "\n")
    return path


def test_only_assistant_tokens_are_counted(tiny_llm):
    tok = tiny_llm.tokenizer
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"},
            {"role": "assistant", "content": "jumps over"}, {"role": "user", "content": "the dog"},
            {"role": "assistant", "content": "is lazy"}]
    ex = render(tok, conv, max_len=1000)
    assert ex.ids == tok.encode(tok.apply_chat_template(conv, add_generation_prompt=False), add_special_tokens=False)
    spans, cur = [], []
    for i, m in zip(ex.ids, ex.mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur) if cur else None
    assert [tok.decode(s, skip_special_tokens=False) for s in spans] == ["jumps over<|im_end|>\n", "is lazy<|im_end|>\n"]
    # truncation cuts the tail; a conversation with no assistant token left is dropped
    short = render(tok, conv, max_len=len(ex.ids) - 3)
    assert short.ids == ex.ids[:len(ex.ids) - 3]
    assert render(tok, conv, max_len=5) is None


def test_bad_data_is_a_clear_error(tmp_path, tiny_llama):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty file"):
        load_conversations(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]\n{"messages": [\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_conversations(str(bad))
    useless = tmp_path / "useless.jsonl"
    useless.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n"a string"\n')
    with pytest.raises(DataError):
        load_conversations(str(useless))
    with pytest.raises(DataError, match="no such file"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    # bytes that are not UTF-8 name their line; a lone surrogate (valid JSON, no UTF-8) skips its
    # conversation, as other unusable ones are skipped (the tokenizer cannot take either)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]\n'
                      b'[{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "yo"}]\n')
    with pytest.raises(DataError, match=r"latin.jsonl:2: not UTF-8"):
        load_conversations(str(latin))
    lone = tmp_path / "lone.jsonl"
    lone.write_text('[{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "yo"}]\n'
                    '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]\n')
    assert [c[0]["content"] for c in load_conversations(str(lone))] == ["hi"]
    # an assistant turn's token_ids past the target's vocabulary: named before any feature is computed
    far = tmp_path / "far.jsonl"
    far.write_text("".join(json.dumps([{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "yo", "token_ids": ids}]) + "\n"
                           for ids in ([5, 6], [7, 10 ** 6])))
    with pytest.raises(DataError, match="conversation 2 .* past the target's vocabulary"):
        train_draft(TrainConfig(model=tiny_llama[0], out=str(tmp_path / "far"), data=str(far), max_len=16,
                                batch_tokens=64, dtype="float64", progress=False), log=lambda m: None)
    # every conversation longer than max_len with no assistant token inside: a clear error
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps([{"role": "user", "content": " ".join(WORDS * 20)}, {"role": "assistant", "content": "ok"}]) + "\n" * 2)
    with pytest.raises(DataError, match="max_len"):
        train_draft(TrainConfig(model=tiny_llama[0], out=str(tmp_path / "o"), data=str(long), max_len=16,
                                batch_tokens=64, dtype="float64", progress=False), log=lambda m: None)


@pytest.mark.parametrize("field,value", [("lr", float("inf")), ("noise", -1.0), ("noise", float("nan")),
                                         ("snapshots", -1)])
def test_nonsense_settings_are_refused(field, value):
    # --lr inf trained a head of NaNs and exited 0; negative or NaN noise trained without noise
    with pytest.raises(ValueError, match=field):
        TrainConfig(model=None, out="o", **{field: value})


def test_truncated_sharegpt_array_is_read_up_to_the_cut():
    text = '[{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "human", "value": "x"}]}, {"id": "c", "conv'
    assert [o["id"] for o in _json_array_items(text)] == ["a", "b"]


def test_training_lowers_loss_and_saved_head_reloads_identically(tiny_llama, tmp_path):
    from eagle_serve.engine.attention import TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    from eagle_serve.engine.train.head import TrainHead
    data = write_jsonl(tmp_path / "d.jsonl", 40)
    out = str(tmp_path / "head")
    card = train_draft(TrainConfig(model=tiny_llama[0], out=out, data=data, max_len=128, epochs=3, lr=3e-3,
                                   batch_tokens=512, warmup_steps=2, dtype="float64", progress=False,
                                   heldout_fraction=0.1, snapshots=2), log=lambda m: None)
    hist = card["history"]
    assert hist[-1]["heldout_loss"] < hist[0]["heldout_loss"]
    assert os.path.exists(os.path.join(out, "model.safetensors")) and os.path.exists(os.path.join(out, "card.json"))
    assert len(os.listdir(os.path.join(out, "snapshots"))) == 2
    # the serving loader accepts it and computes what the training module computes
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    target = llm.runner.model
    head = load_eagle_head(out, target, torch.float64)
    state = torch.load(os.path.join(out, "train_state.pt"), weights_only=False)["head"]
    th = TrainHead(llm.runner.loaded.config).double()
    th.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    th.load_eagle_state_dict({k: v.to(torch.bfloat16).double() for k, v in th.eagle_state_dict().items()})  # as saved
    ids = list(range(5, 25))
    feats = torch.randn(len(ids), 64, dtype=torch.float64)
    cfg = head.config
    kv = KVCache(1, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    batch = build_forward_batch([SeqSpan(ids, 0, list(range(8)))], 4, torch.device("cpu"))
    with torch.inference_mode():
        served = head(target.model.embed_tokens(batch.input_ids), feats, batch, kv, TorchAttention(cfg.head_dim ** -0.5),
                      target.model.rotary)
        trained = th(target.model.embed_tokens.weight[torch.tensor(ids)][None], feats[None])[0]
    assert torch.allclose(served, trained, atol=1e-9)
    # resuming a finished run changes nothing
    again = train_draft(TrainConfig(model=tiny_llama[0], out=out, data=data, max_len=128, epochs=3, lr=3e-3,
                                    batch_tokens=512, warmup_steps=2, dtype="float64", progress=False,
                                    heldout_fraction=0.1, snapshots=2), log=lambda m: None)
    assert again["heldout_loss"] == card["heldout_loss"]


def test_reduced_draft_vocab_is_saved_and_used(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", 30, seed=2)
    out = str(tmp_path / "head")
    card = train_draft(TrainConfig(model=tiny_llama[0], out=out, data=data, max_len=128, epochs=1, batch_tokens=512,
                                   dtype="float64", progress=False, draft_vocab=40, heldout_fraction=0.1, snapshots=0),
                       log=lambda m: None)
    assert card["draft_vocab"] == 40 and 0 < card["draft_vocab_coverage"] <= 1
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4, draft=out,
              spec=SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2), tree_budget=False)
    head = llm.runner.drafter.head
    assert head.d2t is not None and len(head.d2t) == 40
    plain = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    p = [5, 6, 7, 8, 9]
    assert llm.generate(p, params)[0].token_ids == plain.generate(p, params)[0].token_ids


@pytest.mark.slow
def test_trained_head_beats_a_random_head(tmp_path):
    """Learnable structure: a one-layer tiny target whose attention and MLP outputs are zeroed,
    so its next token is a function of the current one (a bigram chain a head can learn), and
    its own greedy answers as data (--regenerate). A briefly trained head must reach an
    acceptance length >= a random head's + 0.5 and at least halve the held-out loss."""
    from tests.conftest import write_tiny_model
    target = str(tmp_path / "target")
    model = write_tiny_model(target, layers=1, seed=3)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    model.save_pretrained(target)
    data = write_jsonl(tmp_path / "d.jsonl", 160, seed=5)
    out = str(tmp_path / "head")
    cfg = TrainConfig(model=target, out=out, data=data, max_len=160, epochs=30, lr=5e-3, batch_tokens=2048,
                      warmup_steps=5, dtype="float64", progress=False, regenerate=True, regen_max_tokens=48,
                      heldout_fraction=0.1, snapshots=0, noise=0.02)
    card = train_draft(cfg, log=lambda m: None, open_llm=lambda: regeneration_llm(cfg))
    hist = card["history"]
    assert hist[-1]["heldout_loss"] <= 0.5 * hist[0]["heldout_loss"]
    random_head = write_eagle_head(str(tmp_path / "random"), target)
    plain = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    rng = random.Random(7)
    prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(5))}])
               for _ in range(6)]  # held-out prompts shaped like the training data
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    spec = SpecConfig("eagle2", total_tokens=16, depth=5, top_k=3)

    def acceptance(head):
        llm = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4, draft=head,
                  spec=spec, tree_budget=False)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
        steps = sum(o.spec.verify_steps for o in outs)
        return (sum(o.spec.accepted_tokens for o in outs) + steps) / steps

    trained, rnd = acceptance(out), acceptance(random_head)
    assert trained >= rnd + 0.5, (trained, rnd)


def test_regeneration_keeps_ids_and_resumes(tiny_llama, tmp_path):
    from eagle_serve.engine.train.regenerate import regenerate
    convs = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", 3, seed=4, turns=2)))
    cfg = TrainConfig(model=tiny_llama[0], out=str(tmp_path / "o"), data="x", regenerate=True, regen_max_tokens=6,
                      dtype="float64", progress=False, max_len=64, batch_tokens=64)
    os.makedirs(cfg.out)
    first = regenerate(cfg, convs, log=lambda m: None, open_llm=lambda: regeneration_llm(cfg))
    answers = [m for c in first for m in c if m["role"] == "assistant"]
    assert len(answers) == 6 and all(1 <= len(m["token_ids"]) <= 6 for m in answers)
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4)
    ex = render(llm.tokenizer, first[0], max_len=1000)
    turn = first[0][1]["token_ids"]
    assert any(ex.ids[i:i + len(turn)] == turn for i in range(len(ex.ids)))  # the ids themselves, not re-encoded
    def no_llm():
        raise AssertionError("regenerated again")
    assert regenerate(cfg, convs, log=lambda m: None, open_llm=no_llm) == first  # resumed from regenerated.jsonl
    # a run stopped mid-write (Ctrl-C exits at once) leaves a partial last line: the line is
    # dropped and its conversation regenerated
    path = os.path.join(cfg.out, "regenerated.jsonl")
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[:whole.rfind(b"\n", 0, len(whole) - 1) + 1] + b'{"messages": [{"role": "us')
    said = []
    assert regenerate(cfg, convs, log=said.append, open_llm=lambda: llm) == first
    assert any("partly written" in m for m in said) and open(path, "rb").read() == whole
    # more conversations extend the file (it holds a prefix of them): the first ones are kept
    more = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", 4, seed=4, turns=2)))
    said = []
    extended = regenerate(dataclasses.replace(cfg, max_conversations=4), more, log=said.append, open_llm=lambda: llm)
    assert extended[:3] == first and len(extended) == 4 and not any("other settings" in m for m in said)
    # other answer settings regenerate (reusing the file would train a run on new data on the
    # previous answers), and every answer stops at the target's context
    said = []
    longer = dataclasses.replace(cfg, regen_max_tokens=600)
    again = regenerate(longer, convs, log=said.append, open_llm=lambda: llm)
    assert any("other settings" in m for m in said) and os.path.exists(os.path.join(cfg.out, "regenerated.jsonl.old"))
    assert len(again) == len(first) and all(c[-1]["role"] == "assistant" for c in again)
    assert all(len(llm.tokenizer.encode_chat(c[:-1])) + len(c[-1]["token_ids"]) <= llm.max_model_len for c in again)


def test_out_is_never_the_target_or_a_foreign_model(tiny_llama, tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", 4))
    target = tmp_path / "target"
    shutil.copytree(tiny_llama[0], target)
    before = (target / "config.json").read_bytes()
    for out in (target, tmp_path / "target" / ".." / "target"):
        with pytest.raises(DataError, match="own directory"):
            train_draft(TrainConfig(model=str(target), out=str(out), data=data, max_len=64, batch_tokens=64,
                                    dtype="float64", progress=False), log=lambda m: None)
    other = tmp_path / "other"
    shutil.copytree(tiny_llama[0], other)  # another model: a config.json no run wrote
    with pytest.raises(DataError, match="no train-draft run wrote"):
        train_draft(TrainConfig(model=str(target), out=str(other), data=data, max_len=64, batch_tokens=64,
                                dtype="float64", progress=False), log=lambda m: None)
    assert (target / "config.json").read_bytes() == before


def test_max_len_past_the_context_is_capped(tiny_llama, tmp_path):
    # the tiny target's context is 512: a 1024-token max_len would run past its rotary table
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps([{"role": "user", "content": " ".join(WORDS * 2)},
                                          {"role": "assistant", "content": " ".join(WORDS * 80)}]) for _ in range(3)))
    said = []
    card = train_draft(TrainConfig(model=tiny_llama[0], out=str(tmp_path / "o"), data=str(data), max_len=1024,
                                   batch_tokens=2048, epochs=1, dtype="float64", progress=False, snapshots=0),
                       log=said.append)
    assert any("using 512" in m for m in said) and card["tokens"] <= 3 * 512


def test_training_time_test_steps_are_the_drafting_computation(tiny_llm):
    """forward_steps' step s at position i equals drafting s levels deep from the true pairs up
    to i - s + 1: the head run causally over those pairs, then over its own chained predictions."""
    from eagle_serve.engine.train.head import TrainHead
    torch.manual_seed(0)
    cfg = tiny_llm.runner.loaded.config
    head = TrainHead(cfg).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)  # far from the small init, so a wrong key or position would show
    T, h = 9, cfg.hidden_size
    emb, feats = torch.randn(1, T, h, dtype=torch.float64), torch.randn(1, T, h, dtype=torch.float64)
    with torch.no_grad():
        preds = head.forward_steps(emb, feats, 4)
        assert torch.allclose(preds[0], head(emb, feats), atol=1e-12)
        for s in range(2, 5):
            for i in range(s - 1, T):
                t = i - s + 1
                chain = feats[:, :t + 1]
                pred = head(emb[:, :t + 1], chain)[:, t]
                for p in range(t + 1, i + 1):
                    chain = torch.cat([chain, pred[:, None]], dim=1)
                    pred = head(emb[:, :p + 1], chain)[:, p]
                assert torch.allclose(preds[s - 1][:, i], pred, atol=1e-10), (s, i)


def test_ttt_training_and_init_warm_start(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", 30, seed=3)
    first = str(tmp_path / "first")
    common = dict(model=tiny_llama[0], data=data, max_len=128, lr=3e-3, batch_tokens=512, warmup_steps=2,
                  dtype="float64", progress=False, heldout_fraction=0.1, snapshots=0, draft_vocab=40)
    card = train_draft(TrainConfig(out=first, epochs=2, ttt_steps=3, **common), log=lambda m: None)
    hist = card["history"]
    for s in (1, 2, 3):
        assert f"heldout_top1_step{s}" in hist[-1]
    assert hist[-1]["heldout_loss"] < hist[0]["heldout_loss"]
    # a run started from that head begins where it ended (same held-out loss before any step)
    logs = []
    again = train_draft(TrainConfig(out=str(tmp_path / "second"), epochs=1, init=first, **{**common, "draft_vocab": None}),
                        log=logs.append)
    assert abs(again["history"][0]["heldout_loss"] - hist[-1]["heldout_loss"]) < 1e-3
    assert any("draft vocabulary: 40 tokens from" in m for m in logs)
    with pytest.raises(DataError, match="--init .*config.json"):
        train_draft(TrainConfig(out=str(tmp_path / "third"), epochs=1, init=str(tmp_path), **common), log=lambda m: None)


def test_feature_shards_are_reused_when_the_data_grows(tiny_llm, tmp_path):
    from eagle_serve.engine.train.features import extract_features, load_shards
    convs = load_conversations(write_jsonl(tmp_path / "d.jsonl", 10, seed=4))
    examples = [render(tiny_llm.tokenizer, c, 128) for c in convs]
    logs = []
    first = extract_features(tiny_llm.runner.loaded, examples[:6], str(tmp_path / "cache"), "k", logs.append, False,
                             shard_size=4)
    assert len(first) == 2 and "0 of 2 shards cached" in logs[-1]
    both = extract_features(tiny_llm.runner.loaded, examples, str(tmp_path / "cache"), "k", logs.append, False,
                            shard_size=4)
    assert both[0] == first[0] and both[1] != first[1]  # the full first shard is reused as it is
    assert "1 of 3 shards cached" in logs[-1]
    ids, masks, feats, offsets, aux = load_shards(both)
    assert aux is None
    assert len(offsets) == 11 and feats.shape[0] == ids.shape[0] == int(offsets[-1])
    n = len(logs)
    assert extract_features(tiny_llm.runner.loaded, examples, str(tmp_path / "cache"), "k", logs.append, False,
                            shard_size=4) == both and len(logs) == n  # all cached: nothing computed
    other = extract_features(tiny_llm.runner.loaded, examples[:4], str(tmp_path / "cache"), "other-dtype", logs.append,
                             False, shard_size=4)
    assert other[0] != both[0]  # another target/dtype never reuses these features


def test_heldout_split_does_not_depend_on_the_rest_of_the_data(tiny_llm, tmp_path):
    from eagle_serve.engine.train.trainer import split_heldout
    convs = load_conversations(write_jsonl(tmp_path / "d.jsonl", 60, seed=5))
    examples = [render(tiny_llm.tokenizer, c, 128) for c in convs]
    held_all, train_all = split_heldout(examples, 0.2, seed=0)
    held_part, train_part = split_heldout(examples[:30], 0.2, seed=0)
    assert held_all and sorted(held_all + train_all) == list(range(60))
    assert held_part == [i for i in held_all if i < 30]  # growing the data never moves a conversation
    assert split_heldout(examples, 0.2, seed=1)[0] != held_all  # the seed picks another split


def test_fused_feature_head_trains_serves_and_stays_lossless(tiny_llama, tmp_path):
    """--aux-layers: the head also reads the target's residual stream after those layers (fused
    features). It starts as the plain head it is initialised from, trains, saves `aux_layers` and
    `fc_aux`, and the serving path computes what training computes; speculative greedy output
    stays the plain output. A config whose aux layers the target lacks is a clear load error."""
    from eagle_serve.engine.attention import TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.loader import ModelLoadError
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    from eagle_serve.engine.train.head import TrainHead
    data = write_jsonl(tmp_path / "d.jsonl", 30, seed=4)
    common = dict(model=tiny_llama[0], data=data, max_len=128, lr=3e-3, batch_tokens=512, warmup_steps=2,
                  dtype="float64", progress=False, heldout_fraction=0.1, snapshots=0, ttt_steps=2)
    plain_dir, fused_dir = str(tmp_path / "plain"), str(tmp_path / "fused")
    plain_card = train_draft(TrainConfig(out=plain_dir, epochs=2, **common), log=lambda m: None)
    card = train_draft(TrainConfig(out=fused_dir, epochs=2, init=plain_dir, aux_layers=(0,), **common),
                       log=lambda m: None)
    # fc_aux starts at zero: before its first step the fused head is exactly the plain one
    assert abs(card["history"][0]["heldout_loss"] - plain_card["heldout_loss"]) < 1e-3
    assert card["history"][-1]["heldout_loss"] < card["history"][0]["heldout_loss"]
    with open(os.path.join(fused_dir, "config.json")) as f:
        assert json.load(f)["aux_layers"] == [0]
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4, draft=fused_dir,
              spec=SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2), tree_budget=False)
    target = llm.runner.model
    assert llm.runner.drafter.head.aux_layers == (0,) and target.aux_layers == (0,)
    # served fusion == trained fusion, on the saved (bf16-rounded) weights
    head = load_eagle_head(fused_dir, target, torch.float64)
    assert float(head.fc_aux.weight.abs().sum()) > 0
    state = torch.load(os.path.join(fused_dir, "train_state.pt"), weights_only=False)["head"]
    th = TrainHead(llm.runner.loaded.config, aux_layers=(0,)).double()
    th.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    th.load_eagle_state_dict({k: v.to(torch.bfloat16).double() for k, v in th.eagle_state_dict().items()})
    ids = list(range(5, 25))
    feats, aux = torch.randn(len(ids), 64, dtype=torch.float64), 3 * torch.randn(len(ids), 64, dtype=torch.float64)
    cfg = head.config
    kv = KVCache(1, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    batch = build_forward_batch([SeqSpan(ids, 0, list(range(8)))], 4, torch.device("cpu"))
    with torch.inference_mode():
        served = head(target.model.embed_tokens(batch.input_ids), torch.cat([feats, aux], -1), batch, kv,
                      TorchAttention(cfg.head_dim ** -0.5), target.model.rotary)
        trained = th(target.model.embed_tokens.weight[torch.tensor(ids)][None], th.fuse(feats[None], aux[None]))[0]
    torch.testing.assert_close(served, trained, rtol=0, atol=1e-9)
    plain = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for p in ([5, 6, 7, 8, 9], [40, 41, 42]):
        assert llm.generate(p, params)[0].token_ids == plain.generate(p, params)[0].token_ids
    # the target has 2 layers: layer 1's output is the final feature already
    with open(os.path.join(fused_dir, "config.json")) as f:
        bad = {**json.load(f), "aux_layers": [1]}
    with open(os.path.join(fused_dir, "config.json"), "w") as f:
        json.dump(bad, f)
    with pytest.raises(ModelLoadError, match="aux_layers"):
        load_eagle_head(fused_dir, target, torch.float64)
    with pytest.raises(DataError, match="--aux-layers"):
        train_draft(TrainConfig(out=str(tmp_path / "x"), epochs=1, aux_layers=(1,), **common), log=lambda m: None)
    # a fused head fed plain-width features (or the wrong width) is a clear error, not a silent plain head
    with pytest.raises(ValueError, match="width"), torch.inference_mode():
        head(target.model.embed_tokens(batch.input_ids), feats[:, :32], batch, kv,
             TorchAttention(cfg.head_dim ** -0.5), target.model.rotary)
    # --init from a fused head needs its layers
    with open(os.path.join(fused_dir, "config.json"), "w") as f:
        json.dump({**bad, "aux_layers": [0]}, f)
    with pytest.raises(DataError, match="fuses target layers \\[0\\]"):
        train_draft(TrainConfig(out=str(tmp_path / "y"), epochs=1, init=fused_dir, **common), log=lambda m: None)


def test_starting_over_drops_the_previous_runs_snapshots_and_log(tiny_llama, tmp_path):
    # a rerun with other settings starts over; the previous run's snapshots and log would mix
    # into the new run's acceptance curve (epochs 1, 2, 1, 2, 3 in one train_log.jsonl)
    data = write_jsonl(tmp_path / "d.jsonl", 12, seed=3)
    common = dict(model=tiny_llama[0], out=str(tmp_path / "o"), data=data, max_len=128, batch_tokens=256,
                  dtype="float64", progress=False, heldout_fraction=0.1, snapshots=2)
    train_draft(TrainConfig(epochs=1, lr=1e-3, **common), log=lambda m: None)
    assert os.listdir(tmp_path / "o" / "snapshots")
    said, t0 = [], time.time()
    train_draft(TrainConfig(epochs=2, lr=2e-3, **common), log=said.append)
    assert any("starting over" in m for m in said)
    snaps = tmp_path / "o" / "snapshots"
    assert os.listdir(snaps) and all(os.path.getmtime(snaps / n / "model.safetensors") >= t0 for n in os.listdir(snaps))
    with open(tmp_path / "o" / "train_log.jsonl") as f:
        epochs = [json.loads(line)["epoch"] for line in f if line.strip()]
    assert epochs == sorted(epochs) and os.path.exists(tmp_path / "o" / "train_log.jsonl.old")


def test_ctrl_c_saves_the_training_state_and_the_same_command_resumes(tiny_llama, tmp_path):
    # Ctrl-C stops train-draft cleanly (not SIGABRT from an engine thread left mid-step at exit)
    # and saves the steps since the last checkpoint
    import signal
    import subprocess
    import sys
    data = write_jsonl(tmp_path / "d.jsonl", 40)
    cmd = [sys.executable, "-c", "import sys; from eagle_serve.server.cli import main; sys.exit(main())", "train-draft",
           "--model", tiny_llama[0], "--out", str(tmp_path / "o"), "--data", str(data), "--max-len", "64",
           "--batch-tokens", "64", "--epochs", "400", "--dtype", "float64", "--no-progress", "--snapshots", "0"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def interrupted_after(mark: str):
        # (SIGINT back to its default: a shell that runs the tests in the background ignores it,
        # and a child that inherits SIG_IGN gets no KeyboardInterrupt)
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        seen = []
        for line in proc.stderr:  # training is under way once this line is out
            seen.append(line)
            if line.startswith(mark):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 130, "".join(seen) + rest
        assert "interrupted at epoch" in rest and "the same command resumes" in rest, rest
        return "".join(seen), torch.load(tmp_path / "o" / "train_state.pt", weights_only=False)["state"]

    _, first = interrupted_after("before training")
    assert first["step"] > 0
    log, second = interrupted_after("resuming at")
    assert f"resuming at epoch {first['epoch']}, step {first['step']}" in log and second["step"] > first["step"]


def test_init_head_keeps_its_own_shapes(tiny_llama, tmp_path):
    # --init with a head of other shapes (MLP width, heads): training builds the head's shapes,
    # not the target's, and saves the head's config
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    data = write_jsonl(tmp_path / "d.jsonl", 12, seed=5)
    init = write_eagle_head(str(tmp_path / "init"), tiny_llama[0], seed=2, inter=48, heads=2, kv=1, head_dim=16,
                            rope_theta=5000.0)
    out = str(tmp_path / "o")
    card = train_draft(TrainConfig(model=tiny_llama[0], out=out, data=data, max_len=64, batch_tokens=128, epochs=1,
                                   dtype="float64", progress=False, snapshots=0, init=init), log=lambda m: None)
    with open(os.path.join(out, "config.json")) as f:
        ocfg = json.load(f)
    assert (ocfg["intermediate_size"], ocfg["num_attention_heads"], ocfg["num_key_value_heads"], ocfg["rope_theta"]) \
        == (48, 2, 1, 5000.0)
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=256, block_size=4)
    load_eagle_head(out, llm.runner.loaded.model, torch.float64)  # the serving loader takes it
    assert card["history"][-1]["heldout_loss"] < card["history"][0]["heldout_loss"]


def test_training_rotates_positions_as_serving_does(tmp_path):
    # serving rotates a head with the target's rope_theta and head_dim by the target's rotary
    # (its scaling included, which published heads' configs leave out); training an --init head
    # must use the same one, and a head of another head_dim its own (the target's table has
    # the wrong width for it)
    from tests.conftest import write_tiny_model
    from eagle_serve.engine.train.head import TrainHead
    from eagle_serve.engine.train.fit import read_head
    target = str(tmp_path / "scaled")
    write_tiny_model(target, rope_scaling={"rope_type": "linear", "factor": 2.0})
    plain = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=512, block_size=4)
    loaded = plain.runner.loaded
    pos = torch.arange(300)
    shared = read_head(write_eagle_head(str(tmp_path / "h1"), target), loaded)[2]
    for got, want in zip(TrainHead(shared).rotary.lookup(pos, torch.float64),
                         loaded.model.model.rotary.lookup(pos, torch.float64)):
        assert torch.equal(got, want)
    wide = write_eagle_head(str(tmp_path / "h2"), target, heads=2, kv=1, head_dim=32)
    assert read_head(wide, loaded)[2].head_dim == 32
    spec = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=512, block_size=4, draft=wide,
               spec=SpecConfig(method="eagle2", total_tokens=8, depth=3, top_k=2))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert spec.generate([[5, 9, 17]], sp)[0].token_ids == plain.generate([[5, 9, 17]], sp)[0].token_ids


def test_a_head_trained_for_a_qwen2_target_loads_and_drafts_losslessly(tmp_path):
    # the head's config names the target's family (Qwen2 has q/k/v biases, Llama none), so the
    # serving loader takes the trained head's biases ("unexpected weight ... qkv_proj.bias")
    from tests.conftest import write_tiny_model
    target = str(tmp_path / "qwen")
    write_tiny_model(target, "qwen2")
    out = str(tmp_path / "o")
    train_draft(TrainConfig(model=target, out=out, data=write_jsonl(tmp_path / "d.jsonl", 10), max_len=64,
                            batch_tokens=128, epochs=1, dtype="float64", progress=False, snapshots=0),
                log=lambda m: None)
    plain = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=512, block_size=4)
    spec = LLM(target, dtype="float64", device="cpu", kv_cache_tokens=512, block_size=4, draft=out,
               spec=SpecConfig(method="eagle2", total_tokens=8, depth=3, top_k=2))
    prompts = [[5, 9, 17, 33], [40, 41, 42]]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


@pytest.mark.parametrize("field,value", [("p_weight", float("inf")), ("weight_decay", -0.1),
                                         ("weight_decay", float("nan")), ("regen_max_tokens", 0),
                                         ("warmup_steps", -1)])
def test_more_nonsense_settings_are_refused(field, value):
    # refused at once: --p-weight inf would save a head of NaNs with exit 0, --regen-max-tokens 0
    # would fail only after the engine is built
    with pytest.raises(ValueError, match=field):
        TrainConfig(model=None, out="o", **{field: value})


def test_a_diverging_run_stops_and_writes_no_head(tiny_llama, tmp_path):
    # --lr 1e4 trained weights to NaN and saved them with exit 0
    from eagle_serve.engine.train.fit import Diverged
    out = tmp_path / "o"
    with pytest.raises(Diverged, match="diverged"):
        train_draft(TrainConfig(model=tiny_llama[0], out=str(out), data=write_jsonl(tmp_path / "d.jsonl", 12),
                                max_len=64, batch_tokens=64, epochs=2, lr=1e12, warmup_steps=0, dtype="float64",
                                progress=False, snapshots=4), log=lambda m: None)
    assert not (out / "model.safetensors").exists() and not (out / "snapshots").exists()


def test_resume_keys_on_the_files_not_their_names(tiny_llama, tmp_path):
    # new data written over the same path starts a new run, not the previous run's state
    data = write_jsonl(tmp_path / "d.jsonl", 12, seed=6)
    common = dict(model=tiny_llama[0], out=str(tmp_path / "o"), data=data, max_len=64, batch_tokens=128,
                  epochs=1, dtype="float64", progress=False, snapshots=0)
    train_draft(TrainConfig(**common), log=lambda m: None)
    said = []
    train_draft(TrainConfig(**common), log=said.append)
    assert any("resuming at epoch 1" in m for m in said)
    lines = open(data).read().splitlines()
    with open(data, "w") as f:  # the same conversations in another order: same steps, other data
        f.write("\n".join(lines[::-1]) + "\n")
    st = os.stat(data)
    os.utime(data, (st.st_atime, st.st_mtime + 10))
    said = []
    train_draft(TrainConfig(**common), log=said.append)
    assert any("starting over" in m for m in said) and not any("resuming" in m for m in said)
    # what does not change the inputs keeps the state: an --init head copied afresh (same bytes),
    # a file the loader does not read added to the model's directory
    model = tmp_path / "model"
    shutil.copytree(tiny_llama[0], model)
    src, head = tmp_path / "head_src", tmp_path / "head"
    shutil.copytree(tmp_path / "o", src, ignore=shutil.ignore_patterns("cache", "train_*", "snapshots"))
    shutil.copytree(src, head)
    again = {**common, "model": str(model), "init": str(head)}
    train_draft(TrainConfig(**again), log=lambda m: None)
    shutil.rmtree(head)
    time.sleep(0.01)
    shutil.copytree(src, head)
    (model / "README.md").write_text("notes")
    said = []
    train_draft(TrainConfig(**again), log=said.append)
    assert any("resuming at epoch 1" in m for m in said) and not any("computing" in m for m in said), said


def test_out_is_never_the_init_head(tiny_llama, tmp_path):
    # an --init head that a train-draft run wrote (card.json and all) is never trained over in place
    data = write_jsonl(tmp_path / "d.jsonl", 8)
    common = dict(model=tiny_llama[0], data=data, max_len=64, batch_tokens=64, epochs=1, dtype="float64",
                  progress=False, snapshots=0)
    init = str(tmp_path / "init")
    train_draft(TrainConfig(out=init, **common), log=lambda m: None)
    before = open(os.path.join(init, "model.safetensors"), "rb").read()
    with pytest.raises(DataError, match="--init head's own directory"):
        train_draft(TrainConfig(out=str(tmp_path / "x" / ".." / "init"), init=init, **{**common, "lr": 1e-2}),
                    log=lambda m: None)
    assert open(os.path.join(init, "model.safetensors"), "rb").read() == before


def test_draft_vocab_with_init_is_re_picked_and_the_full_vocabulary_is_refused(tiny_llama, tmp_path):
    # with --init, --draft-vocab K re-picks the head's vocabulary (full or reduced); K at or over
    # the vocabulary is refused, not silently the full vocabulary
    data = write_jsonl(tmp_path / "d.jsonl", 12, seed=7)
    common = dict(model=tiny_llama[0], data=data, max_len=64, batch_tokens=128, epochs=1, dtype="float64",
                  progress=False, snapshots=0)
    init = write_eagle_head(str(tmp_path / "init"), tiny_llama[0])
    said = []
    card = train_draft(TrainConfig(out=str(tmp_path / "o"), init=init, draft_vocab=30, **common), log=said.append)
    assert card["draft_vocab"] == 30 and any("re-picked" in m for m in said)
    with open(tmp_path / "o" / "config.json") as f:
        assert json.load(f)["draft_vocab_size"] == 30
    with pytest.raises(DataError, match="not below the target's vocabulary"):
        train_draft(TrainConfig(out=str(tmp_path / "full"), draft_vocab=320, **common), log=lambda m: None)


def test_a_short_run_still_reaches_its_learning_rate(tiny_llama, tmp_path, monkeypatch):
    # warmup fits the run's length: a fixed 50 steps would leave a run of 6 steps at 6/50 of --lr
    seen = []
    step = torch.optim.AdamW.step

    def record(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    said = []
    train_draft(TrainConfig(model=tiny_llama[0], out=str(tmp_path / "o"), data=write_jsonl(tmp_path / "d.jsonl", 12),
                            max_len=64, batch_tokens=64, epochs=1, lr=1e-3, dtype="float64", progress=False,
                            snapshots=0), log=said.append)
    assert 2 <= len(seen) < 50 and max(seen) == pytest.approx(1e-3) and any("warmup" in m for m in said)


def test_regeneration_stops_a_conversation_at_a_turn_it_cannot_answer(tiny_llm, tmp_path):
    # a first user turn over regen_max_prompt ends the conversation: answering the second would
    # treat it as if the conversation began there
    from eagle_serve.engine.train.regenerate import regenerate
    conv = [{"role": "user", "content": " ".join(WORDS * 4)}, {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}]
    short = [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "sleeps"}]
    cfg = TrainConfig(model=None, out=str(tmp_path / "o"), data="x", regenerate=True, regen_max_tokens=4,
                      regen_max_prompt=24, dtype="float64", progress=False, max_len=64, batch_tokens=64)
    os.makedirs(cfg.out)
    done = regenerate(cfg, [conv, short], log=lambda m: None, open_llm=lambda: tiny_llm)
    assert done[0] == [] and [m["role"] for m in done[1]] == ["user", "assistant"]


def test_data_formats_and_skipped_conversations_are_reported(tmp_path):
    # content parts and the developer role are read, and every unusable conversation is reported
    path = tmp_path / "d.jsonl"
    rows = [[{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                         {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "c"}],
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}, {"role": "assistant", "content": "z"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
             {"role": "assistant", "content": "z"}],
            [{"role": "user", "content": "only a question"}]]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())  # a byte-order mark first
    said = []
    convs = load_conversations(str(path), log=said.append)
    assert convs == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                      {"role": "assistant", "content": "c"}]]
    assert len(said) == 1 and "skipped 3" in said[0] and "'tool'" in said[0] and "not text" in said[0] \
        and "no non-empty assistant turn" in said[0]


def test_cli_errors_are_one_line_and_leave_nothing_behind(tiny_llama, tmp_path, capsys):
    from eagle_serve.server.cli import main
    data = write_jsonl(tmp_path / "d.jsonl", 4)
    base = ["train-draft", "--model", tiny_llama[0], "--no-progress", "--dtype", "float64", "--max-len", "64",
            "--batch-tokens", "64"]
    cases = [(["--out", str(tmp_path / "a"), "--data", str(tmp_path)], "directory"),
             (["--out", str(tmp_path / "d.jsonl" / "sub"), "--data", str(data)], ""),
             (["--out", str(tmp_path / "b"), "--data", str(data), "--regen-max-tokens", "0", "--regenerate"],
              "regen_max_tokens")]
    for args, word in cases:
        assert main(base + args) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and last.startswith("eagle-serve: error:") and word in last, err
    assert main(["train-draft", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "c"), "--data", str(data),
                 "--no-progress"]) == 2
    assert not (tmp_path / "c").exists()
