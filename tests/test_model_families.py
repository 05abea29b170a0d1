"""Qwen3 (dense and mixture of experts) targets through the whole engine: speculative greedy
equals plain greedy with an EAGLE-2 head, an EAGLE-3 head and an oracle drafter, batched, with
prefix-cache hits; the fast CPU paths (float32) agree with float64; config keys that are not
implemented are refused."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from eagle_serve.engine.loader import ModelLoadError, load_model
from eagle_serve.engine.model_config import ModelConfig, UnsupportedModel
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.server.llm import LLM
from tests.conftest import write_tiny_model
from tests.spec_helpers import KW, OracleDrafter, write_eagle3_head, write_eagle_head


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
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
