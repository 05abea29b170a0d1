"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own
GGUF loader and its LlamaForCausalLM: same weights, same greedy tokens in float32."""
from __future__ import annotations

import os

import pytest
import torch

from eagle_serve.engine.default_model import default_model_path
from eagle_serve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for staying healthy.", "Explain what a hash table is in two sentences."]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    from eagle_serve.server.llm import LLM
    return LLM(None, dtype="float32", device="cpu", kv_cache_tokens=8192)


def test_gguf_weights_match_transformers_loader(hf_model, llm):
    ref = hf_model.state_dict()
    cfg = llm.runner.loaded.config
    ours = dict(llm.runner.model.named_parameters())
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = ours[p + "self_attn.qkv_proj.weight"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = ours[p + "mlp.gate_up_proj.weight"].split(cfg.intermediate_size)
        for name, w in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                        ("mlp.gate_proj", gate), ("mlp.up_proj", up), ("self_attn.o_proj", ours[p + "self_attn.o_proj.weight"]),
                        ("mlp.down_proj", ours[p + "mlp.down_proj.weight"])):
            assert torch.equal(w, ref[p + name + ".weight"]), p + name
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(ours[p + norm + ".weight"], ref[p + norm + ".weight"])
    assert torch.equal(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert torch.equal(ours["model.norm.weight"], ref["model.norm.weight"])
    assert llm.runner.model.lm_head.weight is llm.runner.model.model.embed_tokens.weight  # tied


def test_tokenizer_and_eos_match_transformers(llm):
    from transformers import AutoTokenizer
    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    assert llm.tokenizer.encode_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ref.convert_tokens_to_ids("<|im_end|>") in llm.runner.loaded.eos_token_ids


def test_greedy_matches_hf_in_float32(hf_model, llm):
    """Token-identical up to the end, or a divergence only where HF's top-2 logits nearly tie."""
    params = SamplingParams(max_tokens=48, temperature=0)
    report = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        ours = llm.generate(ids, params)[0].token_ids
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                    eos_token_id=2, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(ids):].tolist()
        n = min(len(ours), len(ref))
        first = next((i for i in range(n) if ours[i] != ref[i]), None)
        if first is None:
            assert ours == ref
            report.append(f"{prompt[:30]!r}: identical ({len(ours)} tokens)")
            continue
        top2 = torch.topk(out.logits[first][0], 2).values
        gap = float(top2[0] - top2[1])
        report.append(f"{prompt[:30]!r}: first divergence at token {first}, HF top-2 gap {gap:.4f}")
        assert gap < 0.05, report[-1]
    print("\n".join(report))


@pytest.mark.parametrize("tree", [(4, 3, 2), (8, 4, 3), (16, 5, 4)], ids=["4-token", "8-token", "16-token"])
def test_bfloat16_speculative_greedy_is_bit_identical_to_plain(tree):
    """The default model in bfloat16 with its shipped head: verifying trees of up to
    SKINNY_MAX_ROWS tokens runs the native kernels, whose per-row sums do not depend on how many
    rows share a call, so EAGLE-2 greedy output equals plain greedy output token for token even
    at bfloat16 near-ties."""
    from eagle_serve.engine.default_model import default_draft_path
    from eagle_serve.engine.layers import SKINNY_MAX_ROWS
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.llm import LLM
    from eagle_serve.engine import kernels
    if kernels.native() is None:
        pytest.skip("no native kernels on this CPU")
    total, depth, top_k = tree
    assert total <= SKINNY_MAX_ROWS
    kw = dict(dtype="bfloat16", device="cpu", kv_cache_tokens=4096)
    plain = LLM(None, **kw)
    spec = LLM(None, **kw, draft=default_draft_path(),
               spec=SpecConfig("eagle2", total_tokens=total, depth=depth, top_k=top_k), tree_budget=False)
    params = SamplingParams(max_tokens=48, temperature=0)
    prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    # one prompt at a time: a batch of several trees would pass SKINNY_MAX_ROWS rows
    want = [plain.generate(p, params)[0].token_ids for p in prompts]
    outs = [spec.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec.accepted_tokens for o in outs) > 0  # drafts were accepted, not only roots
