"""Shared fixtures: tiny random Hugging Face models written to disk, built inside the tests."""
from __future__ import annotations

import json
import os

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "héllo wörld ünïcode ✓ 你好 世界",
          "def f(x): return x + 1", "speculative decoding verifies a draft tree"] * 20


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with <|im_start|>/<|im_end|> specials, ids < vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    return tok


def write_tiny_model(path: str, arch: str = "llama", *, tie: bool = False, kv_heads: int = 2,
                     rope_scaling: dict | None = None, vocab: int = 320, layers: int = 2,
                     dtype=torch.float64, seed: int = 0, std: float = 0.15, tokenizer: bool = True,
                     intermediate: int = 128, softcap: float | None = None):
    """Save a random HF model (LlamaForCausalLM, Qwen2ForCausalLM, or Qwen3ForCausalLM /
    Qwen3MoeForCausalLM, whose heads are 32 wide: q and k projections wider than the hidden size;
    or Gemma3ForCausalLM, arch "gemma3": 32-wide heads, windows of 8 keys on every layer but
    each third from the second, other RoPE bases on those and the global layers, linear RoPE
    scaling on the global ones with `rope_scaling`, final logits soft-capped at `softcap`)
    + tokenizer to `path`."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512,
                  tie_word_embeddings=tie, initializer_range=std, eos_token_id=2, bos_token_id=1,
                  rms_norm_eps=1e-6)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        kinds = ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(layers)]
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
        cfg, cls = Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                    layer_types=kinds, rope_parameters=rope, final_logit_softcapping=softcap,
                                    pad_token_id=0), Gemma3ForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(**common, rope_theta=10000.0), Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = Qwen3Config(**common, rope_theta=10000.0, head_dim=32), Qwen3ForCausalLM
    elif arch == "qwen3_moe":  # 8 experts, 2 a token; layer 1 of 3 dense (mlp_only_layers)
        cfg, cls = Qwen3MoeConfig(**{**common, "num_hidden_layers": max(layers, 3)}, rope_theta=10000.0, head_dim=32,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                  norm_topk_prob=True, mlp_only_layers=[1]), Qwen3MoeForCausalLM
    else:
        extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
        cfg, cls = LlamaConfig(**common, **extra), LlamaForCausalLM
    if arch == "qwen3_moe":
        cfg._experts_implementation = "eager"  # (the grouped kernel takes no float64)
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so a norm bug shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer:
        build_tokenizer(vocab).save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHAT_TEMPLATE}, f)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, HF model) of a tiny float64 untied GQA Llama with a tokenizer."""
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    return path, write_tiny_model(path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama):
    from eagle_serve.server.llm import LLM
    return LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4)


@pytest.fixture(autouse=True)
def _profiles_ignore_machine_load(monkeypatch):
    """Tests build engines whose start-up cost profile would be taken again (and later retaken
    when idle) whenever the test machine happens to be busy; the behaviour under contention has
    its own tests (tests/test_scheduler.py, test_contended_*), which set the threshold they need."""
    import eagle_serve.engine.profile
    monkeypatch.setattr(eagle_serve.engine.profile, "MIN_CPU_SHARE", 0.0)
    # every test measures its own engines: a profile cached by an earlier test (or run) would
    # skip what the profiling tests check; the cache has its own tests, which turn it on
    monkeypatch.setenv("EAGLE_SERVE_PROFILE_CACHE", "off")


@pytest.fixture(scope="session")
def tools_llm():
    """The embedded default model (float32, plain decoding) with the shipped chatml_tools chat
    template: structured output and tool calls on a model that writes sensible JSON."""
    from eagle_serve.server.llm import LLM
    return LLM(None, dtype="float32", device="cpu", kv_cache_tokens=4096, chat_template="chatml_tools")


@pytest.fixture(scope="session")
def tools_server(tools_llm):
    """A live server over `tools_llm` with --tool-call-parser hermes; `.state` is its ServerState."""
    from eagle_serve.server.app import BackgroundServer, ServerState
    state = ServerState(tools_llm, tool_call_parser="hermes")
    srv = BackgroundServer(state)
    srv.state = state
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tools_server):
    """The openai SDK against `tools_server`."""
    import openai
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
