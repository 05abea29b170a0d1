"""`eagle-serve train-draft --arch eagle3`: the EAGLE-3 training head computes what the served
head computes, trains, is written in SpecForge's layout and drafts losslessly."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.train.config import TrainConfig
from eagle_serve.engine.train.data import DataError
from eagle_serve.engine.train.eagle3 import Eagle3TrainHead, default_aux_layers
from eagle_serve.engine.train.trainer import train_draft
from eagle_serve.server.llm import LLM
from tests.conftest import write_tiny_model
from tests.test_train_draft import write_jsonl


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A tiny float64 Llama with 8 layers: room for EAGLE-3's low, middle and high streams."""
    path = str(tmp_path_factory.mktemp("tiny-llama-8"))
    write_tiny_model(path, layers=8, seed=1)
    return path


def test_default_layers_are_eagle3s_low_middle_high():
    assert default_aux_layers(30) == (1, 14, 26)  # Hugging Face hidden_states 2, 15, 27
    assert default_aux_layers(8) == (1, 3, 4)
    assert default_aux_layers(6) == (1, 2)  # 6 // 2 - 1 and 6 - 3 - 1 coincide


def test_training_time_test_steps_are_the_drafting_computation(deep_llama):
    """Step s at position i equals drafting s levels deep: the head over the true pairs up to
    i - s + 1, then over its own chained outputs z (which EAGLE-3 feeds back as x)."""
    from eagle_serve.engine.loader import load_model
    cfg = load_model(deep_llama, torch.float64, torch.device("cpu")).config
    torch.manual_seed(0)
    head = Eagle3TrainHead(cfg, (1, 2, 3), torch.randn(40, cfg.hidden_size)).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    T, h = 8, cfg.hidden_size
    emb, x = torch.randn(1, T, h, dtype=torch.float64), torch.randn(1, T, h, dtype=torch.float64)
    with torch.no_grad():
        preds = head.forward_steps(emb, x, 3)
        for s in range(2, 4):
            for i in range(s - 1, T):
                t = i - s + 1
                chain = x[:, :t + 1]
                z = head(emb[:, :t + 1], chain)[:, t]
                for p in range(t + 1, i + 1):
                    chain = torch.cat([chain, z[:, None]], dim=1)
                    z = head(emb[:, :p + 1], chain)[:, p]
                assert torch.allclose(preds[s - 1][:, i], z, atol=1e-10), (s, i)


def test_eagle3_head_trains_is_written_for_specforge_and_serves_losslessly(deep_llama, tmp_path):
    from eagle_serve.engine.attention import TorchAttention
    from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
    from eagle_serve.engine.kv_cache import KVCache
    from eagle_serve.engine.speculative.eagle3_head import Eagle3Head
    data = write_jsonl(tmp_path / "d.jsonl", 30, seed=6)
    out = str(tmp_path / "head3")
    card = train_draft(TrainConfig(model=deep_llama, data=data, out=out, max_len=128, lr=3e-3, batch_tokens=512,
                                   warmup_steps=2, dtype="float64", progress=False, heldout_fraction=0.1, snapshots=2,
                                   epochs=3, ttt_steps=3, draft_vocab=60, arch="eagle3"), log=lambda m: None)
    hist = card["history"]
    assert card["arch"] == "eagle3" and card["aux_layers"] == [1, 3, 4]
    assert hist[-1]["heldout_ploss"] < hist[0]["heldout_ploss"] and hist[-1]["heldout_vloss"] == 0
    assert hist[-1]["heldout_top1"] > hist[0]["heldout_top1"]
    assert all(f"heldout_top1_step{s}" in hist[-1] for s in (1, 2, 3))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 60
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    from safetensors.torch import load_file
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "embed_tokens.weight"} <= set(weights)
    assert weights["fc.weight"].shape == (64, 3 * 64) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    assert len(os.listdir(os.path.join(out, "snapshots"))) == 2
    # served: the engine loads the written head as EAGLE-3, and its forward is the trained one's
    llm = LLM(deep_llama, dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4, draft=out,
              spec=SpecConfig("eagle3", total_tokens=6, depth=3, top_k=2), tree_budget=False)
    served = llm.runner.drafter.head
    assert isinstance(served, Eagle3Head) and served.aux_layers == (1, 3, 4)
    state = torch.load(os.path.join(out, "train_state.pt"), weights_only=False)["head"]
    trained = Eagle3TrainHead(llm.runner.loaded.config, (1, 3, 4), torch.zeros(60, 64)).double()
    trained.load_state_dict({k: v.double() for k, v in state.items()})
    with torch.no_grad():  # the written weights are bf16
        for p in trained.parameters():
            p.copy_(p.to(torch.bfloat16).double())
    ids = list(range(5, 21))
    feats = torch.randn(len(ids), 4 * 64, dtype=torch.float64)  # [f ; a_1 ; a_3 ; a_4]
    cfg = served.config
    kv = KVCache(1, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    batch = build_forward_batch([SeqSpan(ids, 0, list(range(8)))], 4, torch.device("cpu"))
    target = llm.runner.model
    with torch.inference_mode():
        z_served = served(target.model.embed_tokens(batch.input_ids), feats, batch, kv,
                          TorchAttention(cfg.head_dim ** -0.5), target.model.rotary)
        emb = target.model.embed_tokens.weight[torch.tensor(ids)][None]
        z_trained = trained(emb, trained.fuse(None, feats[None, :, 64:]))[0]
        torch.testing.assert_close(z_served, z_trained, rtol=0, atol=1e-9)
        logits = served.lm_head(served.norm(z_served))
        torch.testing.assert_close(logits, trained.draft_logits(z_trained, None), rtol=0, atol=1e-9)
    plain = LLM(deep_llama, dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for p in ([5, 6, 7, 8, 9], [40, 41, 42]):
        out_ids = llm.generate(p, params)[0]
        assert out_ids.token_ids == plain.generate(p, params)[0].token_ids
    assert llm.runner.drafter.spec.method == "eagle3"


def test_eagle3_settings_are_checked(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="--init takes EAGLE-1/2 heads"):
        TrainConfig(model=None, out=str(tmp_path / "o"), arch="eagle3", init=str(tmp_path))
    with pytest.raises(ValueError, match="arch must be"):
        TrainConfig(model=None, out=str(tmp_path / "o"), arch="eagle4")
    data = write_jsonl(tmp_path / "d.jsonl", 6)
    with pytest.raises(DataError, match="three target layers"):  # the shared tiny target has 2 layers
        train_draft(TrainConfig(model=tiny_llama[0], data=data, out=str(tmp_path / "x"), arch="eagle3",
                                progress=False, dtype="float64"), log=lambda m: None)
