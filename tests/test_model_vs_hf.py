"""The engine's own forward equals Hugging Face's on the same random weights (float64)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from eagle_serve.engine.attention import TorchAttention
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.loader import load_model
from tests.conftest import write_tiny_model

BLOCK = 4
VARIANTS = {
    "llama-gqa-untied": dict(arch="llama"),
    "llama-tied-mha": dict(arch="llama", tie=True, kv_heads=4),
    "llama3-rope-scaling": dict(arch="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "llama-linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias-tied": dict(arch="qwen2", tie=True),
    "qwen2-untied-mqa": dict(arch="qwen2", kv_heads=1),
    "qwen3-qk-norm": dict(arch="qwen3"),
    "qwen3-tied-mqa": dict(arch="qwen3", tie=True, kv_heads=1),
    "qwen3-moe": dict(arch="qwen3_moe"),
    "gemma3-tied-windows": dict(arch="gemma3", tie=True, layers=3),
    "gemma3-untied-softcap-linear-rope": dict(arch="gemma3", kv_heads=1, softcap=4.0, layers=3,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def full_precision_norms(hf):
    """HF's RMSNorm computes in float32 whatever the model dtype; make the float64 reference
    really float64 so the comparison can be tight (RoPE tables are float32 in both)."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def gemma_forward(self, x):  # Gemma scales by (1 + weight)
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
    for m in hf.modules():
        name = type(m).__name__
        if name.startswith("Gemma") and name.endswith("RMSNorm"):
            m.forward = gemma_forward.__get__(m)
        elif name.endswith("RMSNorm"):
            m.forward = forward.__get__(m)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = full_precision_norms(write_tiny_model(path, tokenizer=False, **VARIANTS[request.param]))
    ours = load_model(path, torch.float64, torch.device("cpu"), skip_tokenizer=True)
    return hf, ours


class PagedRunner:
    """Drive our model through a paged cache whose blocks are handed out in shuffled order."""

    def __init__(self, loaded, num_blocks=96, seed=0):
        cfg = loaded.config
        self.model = loaded.model
        self.kv = KVCache(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
        self.backend = TorchAttention(cfg.head_dim ** -0.5)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, n_tokens: int, table: list[int]) -> list[int]:
        while len(table) * BLOCK < n_tokens:
            table.append(self.free.pop())
        return table

    def forward(self, spans: list[SeqSpan]) -> list[torch.Tensor]:
        batch = build_forward_batch(spans, BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(batch, self.kv, self.backend))
        return list(logits.split([len(s.token_ids) for s in spans]))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_and_decode_match_hf(pair):
    hf, ours = pair
    runner = PagedRunner(ours)
    rng = random.Random(1)
    ids = [rng.randrange(ours.config.vocab_size) for _ in range(23)]
    table = runner.table(len(ids), [])
    (logits,) = runner.forward([SeqSpan(ids, 0, table)])
    torch.testing.assert_close(logits, hf_logits(hf, ids), rtol=1e-9, atol=1e-9)
    for _ in range(6):  # token-by-token through the cache
        nxt = rng.randrange(ours.config.vocab_size)
        table = runner.table(len(ids) + 1, table)
        (step,) = runner.forward([SeqSpan([nxt], len(ids), table)])
        ids.append(nxt)
        torch.testing.assert_close(step[0], hf_logits(hf, ids)[-1], rtol=1e-9, atol=1e-9)


def test_packed_batch_of_mixed_sequences_matches_hf(pair):
    """Prefill of one sequence, decode of another and a chunk of a third in one forward."""
    hf, ours = pair
    runner = PagedRunner(ours, seed=3)
    rng = random.Random(2)
    seqs = [[rng.randrange(ours.config.vocab_size) for _ in range(n)] for n in (9, 17, 30)]
    cached = [0, 16, 21]  # tokens already in the cache before the joint forward
    tables = [[], [], []]
    for i in (1, 2):  # fill the cache for the decoding / chunked sequences first
        tables[i] = runner.table(cached[i], tables[i])
        runner.forward([SeqSpan(seqs[i][:cached[i]], 0, tables[i])])
    spans = []
    for i, ids in enumerate(seqs):
        tables[i] = runner.table(len(ids), tables[i])
        spans.append(SeqSpan(ids[cached[i]:], cached[i], tables[i]))
    outs = runner.forward(spans)
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(outs[i], hf_logits(hf, ids)[cached[i]:], rtol=1e-9, atol=1e-9)


def test_greedy_generation_matches_hf_generate(tiny_llama, tiny_llm):
    from eagle_serve.engine.sampling_params import SamplingParams
    _, hf = tiny_llama
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 26, 40)]
    outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_a_gguf_with_rope_freqs_applies_them_as_llama3_scaling(tmp_path):
    # llama.cpp writes Llama 3.1's RoPE scaling as a rope_freqs tensor of per-frequency factors,
    # with no rope.scaling.* keys; unscaled RoPE would put the logits far from HF's llama3-scaled
    # reference
    import math
    import numpy as np
    gguf = pytest.importorskip("gguf")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf = full_precision_norms(write_tiny_model(str(tmp_path / "hf"), tokenizer=False, rope_scaling=scaling,
                                               dtype=torch.float32)).float()
    cfg = hf.config
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    factors = []  # what llama.cpp's converter writes for llama3 scaling
    for f in (1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).tolist():
        wavelen, old = 2 * math.pi / f, scaling["original_max_position_embeddings"]
        if wavelen < old / scaling["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old / scaling["low_freq_factor"]:
            factors.append(scaling["factor"])
        else:
            s = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - s) / scaling["factor"] + s))
    path = str(tmp_path / "llama3.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    sub = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    def permute(t, n):  # llama.cpp's q/k row order
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
    for name, t in hf.state_dict().items():
        if name in top:
            w.add_tensor(top[name], t.numpy())
            continue
        parts = name.split(".")
        kind = ".".join(parts[3:-1])
        t = permute(t, heads) if kind == "self_attn.q_proj" else permute(t, kv_heads) if kind == "self_attn.k_proj" else t
        w.add_tensor(f"blk.{parts[2]}.{sub[kind]}.weight", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_model(path, torch.float32, torch.device("cpu"), skip_tokenizer=True)
    assert ours.config.rope_scaling["rope_type"] == "freq_factors"
    runner = PagedRunner(ours)
    runner.kv = KVCache(ours.config.num_layers, 96, BLOCK, ours.config.num_kv_heads, ours.config.head_dim,
                        torch.float32, torch.device("cpu"))
    ids = [random.Random(1).randrange(cfg.vocab_size) for _ in range(40)]
    (logits,) = runner.forward([SeqSpan(ids, 0, runner.table(len(ids), []))])
    assert (logits - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_gguf_metadata_is_checked_and_end_of_turn_ids_stop(tmp_path):
    # a GGUF's end-of-turn / end-of-message ids stop generation, as in llama.cpp; a Mixtral GGUF
    # (architecture llama), missing metadata and unknown tensors are named, not tracebacks
    import numpy as np
    gguf = pytest.importorskip("gguf")
    from eagle_serve.engine.gguf_loader import gguf_config
    from eagle_serve.engine.model_config import UnsupportedModel

    def write(name, heads=True, experts=0, extra_tensor=None):
        path = str(tmp_path / name)
        w = gguf.GGUFWriter(path, "llama")
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        if heads:
            w.add_head_count(2)
        if experts:
            w.add_expert_count(experts)
        w.add_vocab_size(10)
        w.add_eos_token_id(2)
        w.add_eot_token_id(0)
        w.add_eom_token_id(1)
        w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
        if extra_tensor:
            w.add_tensor(extra_tensor, np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    p = write("ok.gguf")
    assert gguf_config(gguf.GGUFReader(p), p)["eos_token_id"] == [2, 0, 1]
    for path, message in ((write("moe.gguf", experts=4), "mixture-of-experts"),
                          (write("noheads.gguf", heads=False), "lacks llama.attention.head_count"),
                          (write("gate.gguf", extra_tensor="blk.0.ffn_gate_inp.weight"), "not one a llama model has")):
        with pytest.raises(UnsupportedModel, match=message):
            gguf_config(gguf.GGUFReader(path), path)


def test_gemma3_windows_on_the_native_cpu_backend_match_hf(tmp_path):
    # float32 through the native CPU kernels (decode, a tree-free chunk) and their SDPA fallback
    # (a 70-token prompt) against HF at float64: a window left out is off by whole logits
    from eagle_serve.engine import kernels
    from eagle_serve.engine.attention import NativeCPUAttention
    mod = kernels.native()
    if mod is None:
        pytest.skip("the native CPU kernels do not build here")
    hf = full_precision_norms(write_tiny_model(str(tmp_path), arch="gemma3", tokenizer=False, layers=3))
    ours = load_model(str(tmp_path), torch.float32, torch.device("cpu"), skip_tokenizer=True)
    ours.model.prepack()
    runner = PagedRunner(ours)
    cfg = ours.config
    runner.kv = KVCache(cfg.num_layers, 96, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    runner.backend = NativeCPUAttention(cfg.head_dim ** -0.5, mod)
    rng = random.Random(7)
    ids = [rng.randrange(cfg.vocab_size) for _ in range(70)]
    table = runner.table(len(ids), [])
    (logits,) = runner.forward([SeqSpan(ids, 0, table)])
    assert (logits.double() - hf_logits(hf, ids)).abs().max().item() < 1e-4
    chunk = [rng.randrange(cfg.vocab_size) for _ in range(5)]
    table = runner.table(len(ids) + len(chunk), table)
    (step,) = runner.forward([SeqSpan(chunk, len(ids), table)])
    ids += chunk
    assert (step.double() - hf_logits(hf, ids)[-5:]).abs().max().item() < 1e-4
    for _ in range(3):
        nxt = rng.randrange(cfg.vocab_size)
        table = runner.table(len(ids) + 1, table)
        (step,) = runner.forward([SeqSpan([nxt], len(ids), table)])
        ids.append(nxt)
        assert (step[0].double() - hf_logits(hf, ids)[-1]).abs().max().item() < 1e-4


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
GGUF_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_qwen3_gguf(hf_dir: str, path: str, arch: str, tokenizer: bool = False) -> None:
    """A GGUF of a Qwen3 / Qwen3-MoE HF directory as llama.cpp's converter lays it out: qwen3 /
    qwen3moe metadata, q / k rows in HF's order (rotate-half RoPE: not permuted), each layer's
    experts stacked into one [experts, rows, columns] tensor per projection, float32; with
    `tokenizer`, the directory's byte-level BPE tokenizer as GGUF "gpt2" tokenizer metadata."""
    import json
    import os
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    p = arch + "."
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_uint32(p + "vocab_size", cfg["vocab_size"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if tokenizer:
        with open(os.path.join(hf_dir, "tokenizer.json")) as f:
            tok = json.load(f)
        vocab = tok["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        special = {t["content"] for t in tok["added_tokens"]}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_bos_token_id(vocab["<|im_start|>"])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).float().numpy()
            if name in top:
                if not (name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
                    w.add_tensor(top[name], t)
                continue
            parts = name.split(".")
            if parts[3:5] == ["mlp", "experts"]:
                experts.setdefault((parts[2], GGUF_EXPERT[parts[6]]), {})[int(parts[5])] = t
                continue
            w.add_tensor(f"blk.{parts[2]}.{GGUF_LAYER['.'.join(parts[3:-1])]}.weight", t)
    for (layer, kind), ts in sorted(experts.items()):
        w.add_tensor(f"blk.{layer}.{kind}.weight", np.stack([ts[e] for e in range(len(ts))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_qwen3_gguf_gives_the_logits_of_its_hf_directory(tmp_path, arch):
    hf_dir = str(tmp_path / "hf")
    hf = full_precision_norms(write_tiny_model(hf_dir, arch=arch, tokenizer=False, dtype=torch.float32, kv_heads=1))
    path = str(tmp_path / "model.gguf")
    write_qwen3_gguf(hf_dir, path, arch.replace("_", ""))
    from_gguf = load_model(path, torch.float32, torch.device("cpu"), skip_tokenizer=True)
    from_dir = load_model(hf_dir, torch.float32, torch.device("cpu"), skip_tokenizer=True)
    import dataclasses
    eps = from_gguf.config.rms_norm_eps  # (GGUF stores it as a float32)
    assert eps == pytest.approx(from_dir.config.rms_norm_eps, rel=1e-6)
    assert from_gguf.config == dataclasses.replace(from_dir.config, rms_norm_eps=eps)
    rng = random.Random(3)
    ids = [rng.randrange(from_dir.config.vocab_size) for _ in range(25)]
    logits = []
    for loaded in (from_gguf, from_dir):
        runner = PagedRunner(loaded)
        runner.kv = KVCache(loaded.config.num_layers, 96, BLOCK, loaded.config.num_kv_heads, loaded.config.head_dim,
                            torch.float32, torch.device("cpu"))
        logits.append(runner.forward([SeqSpan(ids, 0, runner.table(len(ids), []))])[0])
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5
    assert (logits[0] - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_a_qwen3_gguf_serves_as_its_hf_directory(tmp_path, monkeypatch):
    # the whole path: tokenizer converted from the GGUF's metadata, end-of-sequence ids, greedy
    # generation
    monkeypatch.setenv("EAGLE_SERVE_CACHE", str(tmp_path / "cache"))  # (the converted tokenizer's)
    from eagle_serve.engine.sampling_params import SamplingParams
    from eagle_serve.server.llm import LLM
    hf_dir, path = str(tmp_path / "hf"), str(tmp_path / "model.gguf")
    write_tiny_model(hf_dir, arch="qwen3", dtype=torch.float32)
    write_qwen3_gguf(hf_dir, path, "qwen3", tokenizer=True)
    kw = dict(dtype="float32", device="cpu", kv_cache_tokens=1024)
    from_gguf, from_dir = LLM(path, **kw), LLM(hf_dir, **kw)
    text = "the quick brown fox héllo 你好"
    assert from_gguf.tokenizer.encode(text) == from_dir.tokenizer.encode(text)
    assert from_gguf.runner.loaded.eos_token_ids == from_dir.runner.loaded.eos_token_ids
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert from_gguf.generate([text], params)[0].token_ids == from_dir.generate([text], params)[0].token_ids


def test_qwen3_gguf_metadata_is_checked(tmp_path):
    import numpy as np
    gguf = pytest.importorskip("gguf")
    from eagle_serve.engine.gguf_loader import gguf_config
    from eagle_serve.engine.model_config import UnsupportedModel

    def write(name, arch, experts=True, gating=None, tensor="blk.0.attn_q_norm.weight"):
        path = str(tmp_path / name)
        w = gguf.GGUFWriter(path, arch)
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_vocab_size(10)
        if arch == "qwen3moe" and experts:
            w.add_expert_count(4)
            w.add_expert_used_count(2)
            w.add_expert_feed_forward_length(4)
        if gating is not None:
            w.add_expert_gating_func(gating)
        w.add_tensor(tensor, np.zeros((4,), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    ok = write("ok.gguf", "qwen3")
    assert gguf_config(gguf.GGUFReader(ok), ok)["architectures"] == ["Qwen3ForCausalLM"]
    for path, message in ((write("moe.gguf", "qwen3moe", experts=False), "lacks qwen3moe.expert_count"),
                          (write("sigmoid.gguf", "qwen3moe", gating=gguf.ExpertGatingFuncType.SIGMOID),
                           "expert_gating_func 2"),
                          (write("llama-norm.gguf", "llama", tensor="blk.0.attn_q_norm.weight"), "not one a llama"),
                          (write("shexp.gguf", "qwen3moe", tensor="blk.0.ffn_gate_shexp.weight"), "not one a qwen3moe"),
                          (write("qwen2.gguf", "qwen2"), "GGUF architecture 'qwen2' is not supported")):
        with pytest.raises(UnsupportedModel, match=message):
            gguf_config(gguf.GGUFReader(path), path)


def test_gemma3_windows_in_the_padded_cuda_graph_layout(tmp_path):
    # the layout CUDA graphs replay (engine/cuda_graphs.py: padded [B * Q] rows, every row a
    # query, the attention of PaddedAttention), run eagerly on the CPU: a draft tree past the
    # window and a prompt chunk batched together equal the packed forward's logits
    from eagle_serve.engine.cuda_graphs import PaddedAttention, expand_batch, pad_spans
    write_tiny_model(str(tmp_path), arch="gemma3", tokenizer=False, layers=3)
    ours = load_model(str(tmp_path), torch.float64, torch.device("cpu"), skip_tokenizer=True)
    rng = random.Random(9)
    first = [rng.randrange(320) for _ in range(20)]
    tree = SeqSpan([rng.randrange(320) for _ in range(4)], 20, [], positions=[20, 21, 21, 22],
                   tree_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
    chunk = [rng.randrange(320) for _ in range(13)]
    outs = []
    for padded in (False, True):
        runner = PagedRunner(ours, seed=4)
        table_a = runner.table(20, [])
        runner.forward([SeqSpan(first, 0, table_a)])
        spans = [dataclasses.replace(tree, block_table=runner.table(24, table_a)),
                 SeqSpan(chunk, 0, runner.table(13, []))]
        if not padded:
            outs.append(torch.cat(runner.forward(spans)))
            continue
        p = pad_spans(spans, 2, 16, 24, BLOCK, scratch_block=95)
        batch = expand_batch(*p.tensors(), BLOCK)
        with torch.inference_mode():
            hidden = ours.model(batch, runner.kv, PaddedAttention(ours.config.head_dim ** -0.5))
            outs.append(ours.model.compute_logits(hidden[p.out_rows]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
