"""Qwen3 (dense and mixture of experts) and Gemma 3 (sliding windows of 8 keys) targets through
the whole engine: speculative greedy equals plain greedy with an EAGLE-2 head, an EAGLE-3 head and
an oracle drafter, batched, with prefix-cache hits; the fast CPU paths (float32) agree with
float64; config keys that are not implemented are refused."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from eagle_serve.engine import kernels
from eagle_serve.engine.loader import ModelLoadError, load_model
from eagle_serve.engine.model_config import ModelConfig, UnsupportedModel
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.server.llm import LLM
from tests.conftest import write_tiny_model
from tests.spec_helpers import KW, OracleDrafter, write_eagle3_head, write_eagle_head


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "gemma3"])
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    write_tiny_model(path, arch=request.param, layers=4, seed=2)
    return request.param, path


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 25))] for _ in range(n)]


def test_speculative_greedy_equals_plain(family, tmp_path):
    name, path = family
    ps = _prompts(5, 1) + [_prompts(1, 1)[0] * 2]  # the last repeats the first's prompt: a prefix-cache hit
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(path, enable_prefix_caching=True, **KW)
    ref = [o.token_ids for o in plain.generate(ps, params)]
    heads = {"eagle2": write_eagle_head(str(tmp_path / "e2"), path),
             "eagle3": write_eagle3_head(str(tmp_path / "e3"), path, hidden_state_ids=(0, 1, 2))}
    for method, head in heads.items():
        llm = LLM(path, draft=head, spec=SpecConfig(method, total_tokens=8, depth=4, top_k=3),
                  enable_prefix_caching=True, **KW)
        assert [o.token_ids for o in llm.generate(ps, params)] == ref, method
        assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    oracle = LLM(path, spec=SpecConfig("ngram", total_tokens=6, depth=5), **KW)
    oracle.runner.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref)}, vocab=320,
                                          corrupt_at=lambda i: [2, None, 4][i % 3])
    outs = oracle.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.accepted_tokens for o in outs) > 20  # the oracle's drafts were verified and accepted


def test_float32_fast_paths_agree_with_float64(family):
    name, path = family
    ps = _prompts(3, 2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    exact = [o.token_ids for o in LLM(path, **KW).generate(ps, params)]
    fast = [o.token_ids for o in LLM(path, **{**KW, "dtype": "float32"}).generate(ps, params)]
    assert fast == exact


def test_unimplemented_config_keys_are_refused(tmp_path):
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    assert ModelConfig.from_hf(base).qk_norm
    with pytest.raises(UnsupportedModel, match="rope scaling type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModel, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                             "num_experts_per_tok": 6, "moe_intermediate_size": 16})
    moe = ModelConfig.from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 2,
                               "mlp_only_layers": []})
    assert moe.moe_layers == (1,)  # every second layer sparse, as decoder_sparse_step says
    # a window (use_sliding_window, or a sliding layer type) caps the context: windows are not applied
    assert ModelConfig.from_hf({**base, "sliding_window": 64, "max_position_embeddings": 4096}).max_model_len == 4096
    for extra in ({"use_sliding_window": True}, {"layer_types": ["full_attention", "sliding_attention"]}):
        assert ModelConfig.from_hf({**base, "sliding_window": 64, "max_position_embeddings": 4096,
                                    **extra}).max_model_len == 64


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 32, "sliding_window": 8, "sliding_window_pattern": 2, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 32, "max_position_embeddings": 4096}


def test_gemma3_config_and_refusals():
    cfg = ModelConfig.from_hf(GEMMA3)
    # sliding_window_pattern 2: every second layer global; the windows do not cap the context
    assert cfg.window_layers == (0, 2) and cfg.max_model_len == 4096 and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.hidden_act) == (1e6, 1e4, "gelu_pytorch_tanh")
    typed = ModelConfig.from_hf({**GEMMA3, "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert typed.window_layers == (3,) and typed.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # other families keep the cap: their windows are not applied
    assert ModelConfig.from_hf({**{k: v for k, v in GEMMA3.items() if k != "model_type"},
                                "architectures": ["MistralForCausalLM"]}).max_model_len == 8
    for extra, message in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                           ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                           ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
                           ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
                           ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
                           ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
                            "sliding-window layers"),
                           ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
                            "only the text model")):
        with pytest.raises(UnsupportedModel, match=message):
            ModelConfig.from_hf({**GEMMA3, **extra})


def test_gemma3_windows_apply_on_every_backend_path(tmp_path):
    # long prompts (past the native kernel's 64 queries: SDPA), decode steps and a batch mixing
    # them: float32 through the native CPU backend (or torch where it does not build) equals the
    # float64 torch run
    path = str(tmp_path / "gemma3")
    write_tiny_model(path, arch="gemma3", layers=4, seed=2)
    rng = random.Random(4)
    ps = [[rng.randrange(3, 300) for _ in range(n)] for n in (70, 5, 33)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    exact = [o.token_ids for o in LLM(path, **KW).generate(ps, params)]
    fast = LLM(path, **{**KW, "dtype": "float32"})
    assert fast.runner.backend.name == ("native" if kernels.native() is not None else "torch")
    assert [o.token_ids for o in fast.generate(ps, params)] == exact


def test_gemma3_through_the_flash_backend(tmp_path, monkeypatch):
    # flash-attn (a CPU stand-in) reads no window: the window layers run on the torch backend,
    # the global ones on flash; plain and oracle-drafted greedy equal the torch backend's
    from tests import flash_attn_standin as standin
    path = str(tmp_path / "gemma3")
    write_tiny_model(path, arch="gemma3", layers=4, seed=2)
    ps = _prompts(4, 5)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, **{**KW, "attention": "torch"}).generate(ps, params)]
    standin.install(monkeypatch)
    flash = LLM(path, **{**KW, "attention": "flash"})
    assert flash.runner.backend.name == "flash"
    assert [o.token_ids for o in flash.generate(ps, params)] == ref
    assert standin.calls["flash_attn_varlen_func"] > 0
    oracle = LLM(path, spec=SpecConfig("ngram", total_tokens=6, depth=5), **{**KW, "attention": "flash"})
    oracle.runner.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref)}, vocab=320,
                                          corrupt_at=lambda i: [3, None][i % 2])
    outs = oracle.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.accepted_tokens for o in outs) > 10


def test_grouped_experts_equal_the_per_expert_loop(tmp_path):
    """The GPU's grouped expert path (one padded batch, batched matmuls over stacked weights) sums
    what the CPU's per-expert loop sums, on a batch where some experts get no rows; stacking leaves
    each expert's weights as views (no copy)."""
    from eagle_serve.engine.models.llama import SparseMoE
    path = str(tmp_path / "moe")
    write_tiny_model(path, arch="qwen3_moe", layers=3, seed=4, tokenizer=False)
    loaded = load_model(path, torch.float64, torch.device("cpu"), skip_tokenizer=True)
    moe = next(m for m in loaded.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(5, loaded.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        weights, chosen = moe.route(x)
        assert len(chosen.unique()) < len(moe.experts)  # idle experts in the batch
        loop = moe(x)
        grouped = moe.grouped(x, weights, chosen)
        torch.testing.assert_close(grouped, loop, rtol=1e-12, atol=1e-12)
        gate_up, _ = moe.stacked()
        assert moe.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
        torch.testing.assert_close(moe(x), loop, rtol=0, atol=0)  # the loop on the views
        # a batch past the sync-free size pads to the busiest expert instead
        import eagle_serve.engine.models.llama as llama
        big = torch.randn(40, loaded.config.hidden_size, dtype=torch.float64)
        w, c = moe.route(big)
        saved = llama.GROUPED_SYNC_FREE_ROWS
        try:
            llama.GROUPED_SYNC_FREE_ROWS = 8
            torch.testing.assert_close(moe.grouped(big, w, c), moe(big), rtol=1e-12, atol=1e-12)
        finally:
            llama.GROUPED_SYNC_FREE_ROWS = saved
