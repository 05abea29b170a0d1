"""EAGLE-3 heads: layouts and their errors, the head's math, the target states it reads, and
lossless speculation with it."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eagle_serve.engine.attention import make_backend
from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.loader import ModelLoadError
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.eagle3_config import parse_eagle3
from eagle_serve.engine.speculative.eagle3_head import Eagle3Head, load_eagle3_head
from eagle_serve.server.llm import LLM
from tests.conftest import write_tiny_model
from tests.spec_helpers import KW, prompts, write_eagle3_head, write_eagle_head
from tests.test_model_vs_hf import full_precision_norms

LAYERS = 8  # the target: HF hidden_states 2, L // 2 and L - 3 are 2, 4 and 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(path, HF model) of a tiny float64 8-layer Llama."""
    path = str(tmp_path_factory.mktemp("target8"))
    return path, full_precision_norms(write_tiny_model(path, layers=LAYERS))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target[0], **KW)


# ---- layouts -------------------------------------------------------------------------------

def test_captured_states_follow_each_layouts_numbering():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 320,
            "draft_vocab_size": 64, "architectures": ["LlamaForCausalLMEagle3"]}
    spec = {"speculators_model_type": "eagle3", "transformer_layer_config": {k: base[k] for k in base if k not in (
        "draft_vocab_size", "architectures")}, "draft_vocab_size": 64, "norm_before_residual": False}
    # no ids: 2, L // 2, L - 3; eagle_config ids name the layers whose outputs are read (index
    # id + 1), top-level ids (speculators, or a flattened config) the layers the states enter
    cases = [(base, (2, 4, 5)), ({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, (2, 4, 5)),
             ({**base, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, (2, 4, 5)),
             ({**spec, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, (2, 4, 5)),
             ({**spec, "eagle_aux_hidden_state_layer_ids": [6, 1, 3]}, (1, 3, 6)), (spec, (2, 4, 5))]
    for raw, want in cases:
        assert parse_eagle3(raw, "config.json").hf_indices(LAYERS) == want, raw


@pytest.mark.parametrize("layout, nbr", [("eagle", False), ("speculators", False), ("speculators", True)])
def test_each_layout_loads(target, plain, tmp_path, layout, nbr):
    d = write_eagle3_head(str(tmp_path / "h"), target[0], layout, norm_before_residual=nbr,
                          hidden_state_ids=[0, 3, 5] if layout == "eagle" else [1, 4, 6])
    head = load_eagle3_head(d, plain.runner.model, torch.float64)
    assert isinstance(head, Eagle3Head) and head.aux_layers == (0, 3, 5)  # HF 1, 4, 6 = outputs of layers 0, 3, 5
    assert head.midlayer.norm_before_residual is nbr and head.embed_tokens is None and head.rotary is None
    w = load_file(os.path.join(d, "model.safetensors"))
    assert head.d2t.tolist() == (torch.arange(64) + w["d2t"]).tolist() == w["t2d"].nonzero().flatten().tolist()
    full = load_eagle3_head(write_eagle3_head(str(tmp_path / "full"), target[0], layout, draft_vocab=None),
                            plain.runner.model, torch.float64)
    assert full.d2t is None and full.lm_head.weight.shape == (320, 64)


def _rewrite(d, drop=(), add=None, cfg=None, cfg_drop=(), layer_cfg=None):
    w = load_file(os.path.join(d, "model.safetensors"))
    w = {k: v for k, v in w.items() if k not in drop}
    save_file({**w, **(add or {})}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    raw = {k: v for k, v in raw.items() if k not in cfg_drop}
    raw.update(cfg or {})
    if layer_cfg:
        raw["transformer_layer_config"].update(layer_cfg)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(raw, f)
    return d


BROKEN = [
    ("eagle", dict(drop=("lm_head.weight",)), "weights missing: lm_head.weight"),
    ("eagle", dict(drop=("midlayer.hidden_norm.weight", "fc.weight")), "fc.weight, midlayer.hidden_norm.weight"),
    ("eagle", dict(drop=("d2t",)), "weights missing: d2t"),
    ("eagle", dict(cfg_drop=("draft_vocab_size", "intermediate_size")), "missing intermediate_size, draft_vocab_size"),
    ("speculators", dict(cfg_drop=("norm_before_residual",)), "missing norm_before_residual"),
    ("speculators", dict(cfg_drop=("transformer_layer_config",)), "missing transformer_layer_config"),
    ("eagle", dict(cfg={"fc_norm": True}), "fc_norm"),
    ("speculators", dict(cfg={"norm_before_fc": True}), "norm_before_fc"),
    ("speculators", dict(cfg={"norm_output": True}), "norm_output"),
    ("speculators", dict(layer_cfg={"model_type": "qwen3"}), "'qwen3' is not supported"),
    ("speculators", dict(layer_cfg={"num_hidden_layers": 2}), "only one-layer"),
    ("speculators", dict(add={"layers.1.hidden_norm.weight": torch.ones(64)}), "more than one draft layer"),
    ("speculators", dict(cfg={"speculators_model_type": "eagle"}), "only eagle3"),
    ("eagle", dict(cfg={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}}), "within 1..7"),
    ("eagle", dict(cfg={"vocab_size": 256}), "does not fit the target"),
    ("eagle", dict(add={"d2t": -torch.arange(64)}), "distinct target ids"),
]


@pytest.mark.parametrize("layout, change, message", BROKEN, ids=[b[2] for b in BROKEN])
def test_broken_heads_name_what_is_wrong(target, plain, tmp_path, layout, change, message):
    d = _rewrite(write_eagle3_head(str(tmp_path / "h"), target[0], layout), **change)
    with pytest.raises(ModelLoadError, match=message):
        load_eagle3_head(d, plain.runner.model, torch.float64)


def test_method_follows_the_head(target, tmp_path):
    e3 = write_eagle3_head(str(tmp_path / "e3"), target[0])
    e2 = write_eagle_head(str(tmp_path / "e2"), target[0])
    assert EngineConfig(target[0], draft=e3).spec.method == "eagle3"
    assert EngineConfig(target[0], draft=e3, spec=SpecConfig("eagle2", total_tokens=7)).spec == SpecConfig(
        "eagle3", total_tokens=7)
    assert EngineConfig(target[0], draft=e3, spec="eagle1").spec.method == "eagle1"  # a static tree, EAGLE-3 head
    assert EngineConfig(target[0], draft=e2).spec.method == "eagle2"
    with pytest.raises(ModelLoadError, match="needs an EAGLE-3 draft head"):
        LLM(target[0], draft=e2, spec="eagle3", **KW)


# ---- the head's math ------------------------------------------------------------------------

def reference_z(w, embed, ids, x, eps, theta, heads, kv_heads, nbr):
    """The EAGLE-3 layer over one causal sequence from position 0: x [T, h] fused hidden."""
    T, hd = len(ids), w["midlayer.self_attn.q_proj.weight"].shape[0] // heads
    rms = lambda t, g: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g  # noqa: E731
    m = lambda k: w["midlayer." + k + ".weight"]  # noqa: E731
    hx = rms(x, m("hidden_norm"))
    u = torch.cat([rms(embed[ids], m("input_layernorm")), hx], -1)
    # angles in float32, as Hugging Face computes them (and the checkpoints were trained with)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().double()[:, None], ang.sin().double()[:, None]
    rope = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    g = heads // kv_heads
    q = rope((u @ m("self_attn.q_proj").T).view(T, heads, hd)).transpose(0, 1)
    k = rope((u @ m("self_attn.k_proj").T).view(T, kv_heads, hd)).repeat_interleave(g, 1).transpose(0, 1)
    v = (u @ m("self_attn.v_proj").T).view(T, kv_heads, hd).repeat_interleave(g, 1).transpose(0, 1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, heads * hd)
    y = (hx if nbr else x) + att @ m("self_attn.o_proj").T
    p = rms(y, m("post_attention_layernorm"))
    return y + (F.silu(p @ m("mlp.gate_proj").T) * (p @ m("mlp.up_proj").T)) @ m("mlp.down_proj").T


@pytest.mark.parametrize("layout, nbr", [("eagle", False), ("speculators", True), ("speculators", False)])
def test_head_forward_equals_the_reference_math(target, plain, tmp_path, layout, nbr):
    d = write_eagle3_head(str(tmp_path / "h"), target[0], layout, norm_before_residual=nbr, std=0.2)
    model = plain.runner.model
    head = load_eagle3_head(d, model, torch.float64)
    w = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(os.path.join(d, "model.safetensors")).items()}
    embed = model.model.embed_tokens.weight.data
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (9,), generator=gen)
    feats = torch.randn(8, 4 * 64, generator=gen, dtype=torch.float64)  # [f ; a_1 ; a_2 ; a_3] of 8 positions
    kv = KVCache(1, 8, 4, 2, 16, torch.float64, CPU)
    backend = make_backend(16 ** -0.5, CPU, torch.float64, "torch")
    batch = build_forward_batch([SeqSpan(ids[:8].tolist(), 0, [3, 1, 5])], 4, CPU)
    z = head(embed[batch.input_ids], feats, batch, kv, backend, model.model.rotary)
    x = feats[:, 64:] @ w["fc.weight"].T
    ref = reference_z(w, embed, ids[:8], x, 1e-5, 10000.0, 4, 2, nbr)
    torch.testing.assert_close(z, ref, rtol=1e-10, atol=1e-10)
    # the next level: the last z as its hidden, the KV of the first 8 positions reused
    batch = build_forward_batch([SeqSpan([int(ids[8])], 8, [3, 1, 5])], 4, CPU)
    z2 = head(embed[batch.input_ids], z[-1:], batch, kv, backend, model.model.rotary)
    ref2 = reference_z(w, embed, ids, torch.cat([x, z[-1:]]), 1e-5, 10000.0, 4, 2, nbr)
    torch.testing.assert_close(z2, ref2[-1:], rtol=1e-10, atol=1e-10)
    # logits over the draft vocabulary, mapped to target ids by d2t offsets
    logp, tok = head.draft_topk(z, model, 3)
    zn = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w["norm.weight"]
    top = (zn @ w["lm_head.weight"].T).log_softmax(-1).topk(3)
    torch.testing.assert_close(logp, top.values, rtol=1e-10, atol=1e-10)
    assert torch.equal(tok, top.indices + w["d2t"][top.indices])


# ---- the target states the head reads ----------------------------------------------------

CAPTURES = [({}, [2, 4, 5]), ({"hidden_state_ids": [0, 3, 5]}, [1, 4, 6]),
            ({"layout": "speculators", "hidden_state_ids": [1, 3, 6]}, [1, 3, 6])]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kwargs, hf_indices", CAPTURES, ids=["default", "eagle_config", "speculators"])
def test_captured_states_are_hugging_faces_hidden_states(target, tmp_path, kwargs, hf_indices, dtype):
    """The target hands the drafter [f ; hidden_states[i] for the head's i] per token, whether a
    prompt (Python forward) or a few rows (the native stack, float32)."""
    d = write_eagle3_head(str(tmp_path / "h"), target[0], **kwargs)
    llm = LLM(target[0], draft=d, spec=SpecConfig("eagle3", total_tokens=4, depth=3, top_k=2), **{**KW, "dtype": dtype})
    ids = [5, 9, 33, 41, 2, 17, 8, 100, 7, 250]
    with torch.no_grad():
        hs = target[1](torch.tensor([ids]), output_hidden_states=True).hidden_states
    tol = 1e-10 if dtype == "float64" else 1e-4
    runner = llm.runner
    for n_prefix in (0, 7):  # the whole prompt, then the last 3 tokens after a cached prefix
        with torch.inference_mode():
            got = runner.forward([SeqSpan(ids[n_prefix:], n_prefix, [0, 1, 2])]).double()
        assert got.shape == (len(ids) - n_prefix, 4 * 64)
        for j, i in enumerate(hf_indices):
            torch.testing.assert_close(got[:, 64 * (j + 1):64 * (j + 2)], hs[i][0, n_prefix:], rtol=tol, atol=tol)


# ---- lossless speculation -------------------------------------------------------------------

HEADS = {"eagle": {}, "speculators-nbr": {"layout": "speculators", "norm_before_residual": True},
         # a narrower head: its own embedding, RoPE theta and a RoPE table shorter than the context
         "narrow": {"hidden": 32, "heads": 2, "kv": 1, "rope_theta": 20000.0, "max_positions": 16}}
SPECS = [("small", SpecConfig("eagle3", total_tokens=6, depth=3, top_k=2)),
         ("wide", SpecConfig("eagle3", total_tokens=20, depth=5, top_k=4)),
         ("static", SpecConfig("eagle1"))]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-heads")
    return {name: write_eagle3_head(str(root / name), target[0], std=0.2, **kw) for name, kw in HEADS.items()}


@pytest.mark.parametrize("head_name", list(HEADS))
@pytest.mark.parametrize("name, spec", SPECS, ids=[s[0] for s in SPECS])
def test_greedy_speculative_equals_plain(target, plain, heads, head_name, name, spec):
    ps = prompts(6, seed=2)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 7, 1, 22, 40, 13)]
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(target[0], draft=heads[head_name], spec=spec, **KW)
    assert isinstance(llm.runner.drafter.head, Eagle3Head) and llm.engine_config.spec.method == spec.method
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == ref  # batched
    assert sum(o.spec.draft_tokens for o in outs) > 0
    assert llm.generate(ps[0], params[0])[0].token_ids == ref[0]  # alone
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


def sequential_score(head, drafter, tokens, feats, path):
    """Pairs (x_{j+1}, target features of j) for the true prefix, then the path's pairs on the
    head's own z: the path's cumulative draft log-probability."""
    cfg = head.config
    kv = KVCache(1, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float64, CPU)
    ids, fs, n_done, total = list(tokens[1:]), [feats[j] for j in range(len(tokens) - 1)], 0, 0.0
    draft_ids = head.d2t.tolist()
    for step in range(len(path) + 1):
        batch = build_forward_batch([SeqSpan(ids[n_done:], n_done, list(range(64)))], 4, CPU)
        out = head(drafter.embed(batch.input_ids), torch.stack(fs[n_done:]), batch, kv, drafter.backend,
                   drafter.rotary)
        n_done = len(ids)
        if step == len(path):
            return total
        logp = head.lm_head(head.norm(out[-1:])).log_softmax(-1)[0]
        total += float(logp[draft_ids.index(path[step])])
        ids.append(path[step])
        fs.append(out[-1])


@pytest.mark.parametrize("head_name", ["eagle", "narrow"])
def test_draft_tree_scores_equal_each_path_drafted_alone(target, heads, head_name):
    """Every candidate's cumulative score in the drafter's tree equals the head run sequentially
    along that candidate's path: tree masks, pairing, d2t and the head's own embedding and RoPE."""
    llm = LLM(target[0], draft=heads[head_name], spec=SpecConfig("eagle3", total_tokens=12, depth=4, top_k=3),
              **KW)
    drafter = llm.runner.drafter
    grown = []
    original = drafter._tree
    drafter._tree = lambda root, g, *rest: (grown.append(g), original(root, g, *rest))[1]
    prompt = prompts(1, seed=4)[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids[0]
    g, tokens = grown[0], prompt + [first]
    with torch.inference_mode():
        feats = llm.runner.forward([SeqSpan(tokens[:-1], 0, list(range(200, 230)))])
        assert feats.shape[1] == 4 * 64
        for c in range(len(g.cands)):
            path, node = [], c
            while node >= 0:
                path.append(g.cands.tokens[node])
                node = g.cands.parents[node]
            assert abs(sequential_score(drafter.head, drafter, tokens, feats, path[::-1]) - g.cands.scores[c]) < 1e-9


@pytest.mark.parametrize("head_name", ["eagle", "narrow"])
def test_seeded_sampling_speculative_equals_plain(target, plain, heads, head_name):
    ps = prompts(5, seed=3)
    params = [SamplingParams(max_tokens=25, temperature=t, top_p=tp, top_k=k, seed=i, ignore_eos=True)
              for i, (t, tp, k) in enumerate([(0.8, 1.0, -1), (1.2, 0.9, -1), (0.5, 1.0, 20), (1.0, 0.7, 5),
                                              (0.0, 1.0, -1)])]
    ref = [o.token_ids for o in plain.generate(ps, params)]
    llm = LLM(target[0], draft=heads[head_name], spec=SpecConfig("eagle3", total_tokens=12, depth=4, top_k=3), **KW)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref


def test_tree_budget_drafts_with_an_eagle3_head_and_stays_lossless(target, plain, heads):
    ps = prompts(6, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(ps, params)]
    # a random head never pays: the budget is told to run its modelled tree every round whatever
    # the model predicts (and no guard), so what it drafts does not hang on this machine's timings
    llm = LLM(target[0], draft=heads["eagle"], budget_overrides={"model_probe_every": 1, "model_probe_far": 1,
                                                                 "model_probe_max_seqs": 8,
                                                                 "guard_min": 0}, **{**KW, "tree_budget": True})
    assert llm.engine_config.spec.method == "eagle3" and llm.budget is not None
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.draft_tokens for o in outs) > 0


def test_feature_cache_is_as_wide_as_the_states_the_head_reads(target, heads):
    from eagle_serve.engine.gpu_memory import draft_feature_width
    llm = LLM(target[0], draft=heads["narrow"], **KW)
    assert draft_feature_width(llm.engine_config, 64) == 4 * 64 == llm.runner.drafter.features.shape[1]
