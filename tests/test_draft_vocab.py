"""scripts/draft_vocab.py: a head's reduced draft vocabulary re-picked from conversations."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.sampling_params import SamplingParams
from scripts.draft_vocab import main
from eagle_serve.server.llm import LLM
from tests.spec_helpers import write_eagle_head


def test_revocabulised_head_keeps_its_weights_covers_the_data_and_serves(tiny_llama, tiny_llm, tmp_path):
    head = str(tmp_path / "head")
    write_eagle_head(head, tiny_llama[0], seed=1)
    tok = tiny_llm.tokenizer
    # assistant answers made of a few tokens only: a 12-token vocabulary covers them all
    words = [tok.encode(w) for w in ("fox", "dog", "tree", "draft")]
    rows = []
    for i in range(12):
        ids = [t for w in words[i % 4:] + words[:i % 4] for t in w]
        rows.append({"messages": [{"role": "user", "content": "say it"},
                                  {"role": "assistant", "content": tok.decode(ids), "token_ids": ids}]})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    assert main(["--head", head, "--data", str(data), "--k", "12", "--out", out, "--model", tiny_llama[0]]) == 0
    before, after = load_file(os.path.join(head, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert set(before) - {"d2t"} == set(after) - {"d2t"}
    for k in before:
        if k != "d2t":
            assert torch.equal(before[k], after[k])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == 12
    d2t = after["d2t"]
    answer_ids = {t for w in words for t in w}
    assert len(d2t) == 12 and answer_ids <= set(d2t.tolist()) and set(tiny_llm.runner.loaded.eos_token_ids) <= set(d2t.tolist())
    # the serving loader takes it; greedy speculation stays lossless
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4, draft=out,
              spec=SpecConfig("eagle2", total_tokens=6, depth=3, top_k=2), tree_budget=False)
    assert llm.runner.drafter.head.d2t.tolist() == d2t.tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert llm.generate([5, 6, 7, 8], params)[0].token_ids == tiny_llm.generate([5, 6, 7, 8], params)[0].token_ids


def test_bad_inputs_are_named_without_a_traceback(tiny_llama, tmp_path):
    """Each bad input is named in one line: token ids past the vocabulary, a missing data file, a
    head of another model (nothing is written for it); a head re-picked in place keeps working."""
    import pytest
    from tests.conftest import write_tiny_model
    head = write_eagle_head(str(tmp_path / "head"), tiny_llama[0], seed=1)
    (tmp_path / "head" / "README.md").write_text("card")
    model = ["--model", tiny_llama[0], "--k", "8"]
    row = lambda ids: json.dumps({"messages": [{"role": "user", "content": "hi"},  # noqa: E731
                                               {"role": "assistant", "content": "x", "token_ids": ids}]}) + "\n"
    oob = tmp_path / "oob.jsonl"
    oob.write_text(row([5, 6, 5000]))
    with pytest.raises(SystemExit, match="past the target's vocabulary"):
        main(["--head", head, "--data", str(oob), "--out", str(tmp_path / "o1"), *model])
    with pytest.raises(SystemExit, match="no such data file"):
        main(["--head", head, "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o2"), *model])
    good = tmp_path / "good.jsonl"
    good.write_text(row([5, 6, 7, 8, 9, 10]) * 3)
    other = str(tmp_path / "other")
    write_tiny_model(other, vocab=400)
    with pytest.raises(SystemExit, match="does not fit the target"):
        main(["--head", head, "--data", str(good), "--out", str(tmp_path / "o3"), "--model", other, "--k", "8"])
    assert not os.path.exists(tmp_path / "o3")
    before = load_file(os.path.join(head, "model.safetensors"))
    (tmp_path / "head" / "card.json").write_text("{}")
    assert main(["--head", head, "--data", str(good), "--out", head, *model]) == 0  # re-picked in place
    with open(os.path.join(head, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == 8
    assert (tmp_path / "head" / "README.md").read_text() == "card"
    assert not (tmp_path / "head" / "card.json").exists()  # a card describes the vocabulary it came with
    after = load_file(os.path.join(head, "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before if k != "d2t") and len(after["d2t"]) == 8
