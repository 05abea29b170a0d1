"""GGUF block-quantized weights kept quantized (engine/quant.py, engine/kernels/cpu_gguf.cpp):
the kernels against the gguf package's dequantization and a float64 product, a quantized GGUF
model through the loader and the engine (speculative greedy == plain greedy on it), the int8
load option, and what the loader refuses."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from eagle_serve.engine import kernels, quant
from eagle_serve.engine.loader import ModelLoadError, load_model
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.speculative.config import SpecConfig
from tests.spec_helpers import OracleDrafter, write_eagle_head

gguf = pytest.importorskip("gguf")
native = kernels.native()
needs_native = pytest.mark.skipif(native is None, reason="the native CPU kernels do not build here")

# magnitudes of the fp16 fields that keep random blocks' weights near N(0, 0.05)
SCALES = {quant.Q8_0: (0.0007,), quant.Q4_0: (0.012,), quant.Q4_1: (0.012, -0.09), quant.Q4_K: (0.0004, 0.0004),
          quant.Q6_K: (0.00004,)}
FP16_AT = {quant.Q8_0: (0,), quant.Q4_0: (0,), quant.Q4_1: (0, 2), quant.Q4_K: (0, 2), quant.Q6_K: (208,)}


def random_blocks(ggml_type: int, rows: int, K: int, seed: int = 0) -> quant.QuantTensor:
    """Random blocks of a type: random bytes, with the fp16 scale fields set to finite values."""
    rng = np.random.default_rng(seed)
    _, per, nbytes = quant.BLOCK_TYPES[ggml_type]
    b = rng.integers(0, 256, size=(rows, K // per, nbytes), dtype=np.uint8)
    for off, scale in zip(FP16_AT[ggml_type], SCALES[ggml_type]):
        v = (scale * (0.5 + rng.random((rows, K // per)))).astype(np.float16)
        b[:, :, off:off + 2] = v.view(np.uint8).reshape(rows, K // per, 2)
    return quant.QuantTensor(ggml_type, torch.from_numpy(b.reshape(rows, -1).copy()), (rows, K))


@needs_native
@pytest.mark.parametrize("ggml_type", sorted(quant.BLOCK_TYPES))
@pytest.mark.parametrize("K", [512, 96])
def test_kernels_match_the_dequantized_weights(ggml_type, K):
    if K % quant.BLOCK_TYPES[ggml_type][1]:
        pytest.skip("K is not a multiple of the block")
    q = random_blocks(ggml_type, 96, K, seed=ggml_type)
    ref = q.dequantize().double()  # the gguf package's dequantization
    p = quant.pack([q])
    assert torch.equal(native.gguf_dequantize(p), ref.float())  # bit-exact, as llama.cpp's dequantize_row_*
    ids = torch.tensor([5, 0, 95, 5])
    assert torch.equal(native.gguf_rows(p, ids), ref.float()[ids])
    x = torch.randn(7, K, dtype=torch.float64)
    bias = torch.randn(96)
    y64 = x @ ref.T + bias.double()
    scale = y64.abs().max().item()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        exact = xd.double() @ ref.T + bias.double()
        y = native.skinny_linear(xd, p, bias.to(dtype) if dtype == torch.float32 else bias.bfloat16(), True)
        # float32 accumulation of the exact products: only the summation order differs
        bias_err = 0 if dtype == torch.float32 else (bias.bfloat16().double() - bias.double()).abs().max().item()
        assert (y.double() - exact).abs().max().item() <= 1e-5 * scale + bias_err
        mm = native.gguf_mm(xd, p, bias.to(dtype), True)
        assert (mm.double() - exact).abs().max().item() <= 1e-5 * scale + bias_err
    # a row's result does not depend on how many rows share the call (speculative == plain)
    x32 = x.float()
    many = native.skinny_linear(x32, p, None, True)
    for i in range(x32.shape[0]):
        assert torch.equal(native.skinny_linear(x32[i:i + 1], p, None, True)[0], many[i])
    # bf16 output is the float32 result rounded
    assert torch.equal(native.skinny_linear(x32, p, None, False), many)
    assert torch.equal(native.skinny_linear(x.bfloat16(), p, None, False),
                       native.skinny_linear(x.bfloat16(), p, None, True).bfloat16())


@needs_native
def test_segments_of_different_types_stack_along_the_outputs():
    parts = [random_blocks(quant.Q4_K, 64, 256, 1), random_blocks(quant.Q6_K, 32, 256, 2),
             random_blocks(quant.Q4_K, 32, 256, 3)]
    p = quant.pack(parts)
    assert quant.packed_shape(p) == (128, 256) and quant.packed_types(p) == ["Q4_K", "Q6_K", "Q4_K"]
    ref = torch.cat([q.dequantize() for q in parts])
    assert torch.equal(native.gguf_dequantize(p), ref)
    assert torch.equal(quant.dequantize(p), ref)
    two = quant.pack([random_blocks(quant.Q8_0, 32, 256, 4), random_blocks(quant.Q8_0, 32, 256, 5)])
    assert quant.packed_types(two) == ["Q8_0"]  # neighbours of one type share a segment
    with pytest.raises(ValueError, match="same number of columns"):
        quant.pack([random_blocks(quant.Q8_0, 32, 256), random_blocks(quant.Q8_0, 32, 512)])
    with pytest.raises(RuntimeError, match="packed GGUF weight"):
        native.gguf_dequantize(torch.zeros(256, dtype=torch.uint8))


def test_q8_0_quantization_matches_the_gguf_package():
    w = torch.randn(64, 256) * 0.1
    ours = quant.quantize_q8_0(w)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.blocks.numpy(), np.asarray(theirs).reshape(64, -1))
    assert (ours.dequantize() - w).abs().max().item() <= w.abs().max().item() / 127


# a tiny Llama whose linears are all multiples of 256 wide (the K-quants' super-blocks)
H, HEADS, KV, INTER, VOCAB, LAYERS = 256, 4, 2, 512, 320, 2
TYPES = {"attn_q": quant.Q4_K, "attn_k": quant.Q4_K, "attn_v": quant.Q6_K, "attn_output": quant.Q4_0,
         "ffn_gate": quant.Q4_1, "ffn_up": quant.Q4_1, "ffn_down": quant.Q6_K}


def write_quantized_gguf(path: str, types: dict | None = None, embed=quant.Q8_0, output=quant.Q6_K) -> str:
    """A random-weight Llama GGUF whose linears are block-quantized (types per tensor kind, as a
    Q4_K_M file mixes them: the value rows Q6_K beside Q4_K query and key rows); output None
    ties the LM head to the embedding."""
    types = types or TYPES
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    seed = iter(range(1000))

    def add(name, ggml_type, rows, K):
        q = random_blocks(ggml_type, rows, K, next(seed))
        w.add_tensor(name, q.blocks.numpy(), raw_shape=q.blocks.shape, raw_dtype=gguf.GGMLQuantizationType(ggml_type))

    add("token_embd.weight", embed, VOCAB, H)
    if output is not None:
        add("output.weight", output, VOCAB, H)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    d = H // HEADS
    shapes = {"attn_q": (HEADS * d, H), "attn_k": (KV * d, H), "attn_v": (KV * d, H), "attn_output": (H, HEADS * d),
              "ffn_gate": (INTER, H), "ffn_up": (INTER, H), "ffn_down": (H, INTER)}
    for layer in range(LAYERS):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(H, dtype=np.float32))
        for kind, (rows, K) in shapes.items():
            t = types[kind]
            if t in quant.BLOCK_TYPES:
                add(f"blk.{layer}.{kind}.weight", t, rows, K)
            else:  # a float tensor, or a quantized type without a native kernel
                dense = np.random.default_rng(next(seed)).standard_normal((rows, K)).astype(np.float32) * 0.05
                w.add_tensor(f"blk.{layer}.{kind}.weight", gguf.quants.quantize(dense, t) if t != 0 else dense,
                             raw_dtype=None if t == 0 else gguf.GGMLQuantizationType(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    return write_quantized_gguf(str(tmp_path_factory.mktemp("q") / "tiny-q.gguf"))


def _logits(loaded, ids, dtype):
    from eagle_serve.engine.forward_batch import SeqSpan
    from eagle_serve.engine.kv_cache import KVCache
    from tests.test_model_vs_hf import BLOCK, PagedRunner
    cfg = loaded.config
    runner = PagedRunner(loaded)
    runner.kv = KVCache(cfg.num_layers, 96, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    (logits,) = runner.forward([SeqSpan(ids, 0, runner.table(len(ids), []))])
    return logits


@needs_native
def test_quantized_gguf_loads_in_blocks_and_matches_the_dequantized_model(quantized_gguf):
    cpu = torch.device("cpu")
    q = load_model(quantized_gguf, torch.float32, cpu, skip_tokenizer=True)
    ref = load_model(quantized_gguf, torch.float64, cpu, skip_tokenizer=True, quantization="none")
    layer = q.model.model.layers[0]
    assert quant.packed_types(layer.self_attn.qkv_proj.gguf_weight) == ["Q4_K", "Q6_K"]  # one fused weight
    assert quant.packed_types(layer.mlp.gate_up_proj.gguf_weight) == ["Q4_1"]
    assert quant.is_quantized(q.model.model.embed_tokens) and quant.is_quantized(q.model.lm_head)
    assert not quant.is_quantized(ref.model.lm_head)
    # the kept blocks are the file's bytes: the model holds no dense copy of them
    held = quant.quantized_bytes(q.model)
    reader = gguf.GGUFReader(quantized_gguf)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name not in ("F32", "F16"))
    assert file_bytes <= held <= file_bytes * 1.01
    dense = sum(p.numel() for p in q.model.parameters() if p.is_contiguous())
    assert dense < 10 * H * LAYERS  # norms only
    # the dequantized float64 model (the llama Q/K row permutation applied to the blocks too)
    assert torch.equal(quant.dense_weight(q.model.lm_head).double(), ref.model.lm_head.weight.data)
    q.model.prepack()
    ids = [random.Random(3).randrange(VOCAB) for _ in range(12)]
    lq, lr = _logits(q, ids, torch.float32), _logits(ref, ids, torch.float64)
    assert (lq.double() - lr).abs().max().item() < 1e-4 * max(1.0, lr.abs().max().item())


@needs_native
def test_tied_embedding_and_unsupported_types_in_a_gguf(tmp_path, caplog):
    types = dict(TYPES, ffn_down=int(gguf.GGMLQuantizationType.Q5_0), attn_output=0)
    path = write_quantized_gguf(str(tmp_path / "mixed.gguf"), types, embed=quant.Q4_K, output=None)
    with caplog.at_level("INFO"):
        m = load_model(path, torch.float32, torch.device("cpu"), skip_tokenizer=True)
    assert "dequantized at load: 2 Q5_0 tensors" in caplog.text
    assert m.model.lm_head.gguf_weight is m.model.model.embed_tokens.gguf_weight  # tied: one copy
    m.model.prepack()  # (moves the blocks into the huge-page arena where there is one: still one copy)
    assert m.model.lm_head.gguf_weight is m.model.model.embed_tokens.gguf_weight
    assert m.model.lm_head.native_weight is m.model.lm_head.gguf_weight
    down = m.model.model.layers[0].mlp.down_proj
    assert not quant.is_quantized(down) and down.weight.is_contiguous()
    ids = torch.tensor([1, 7, 319])
    emb = m.model.model.embed_tokens(ids)
    assert emb.shape == (3, H) and torch.equal(emb, quant.dense_weight(m.model.model.embed_tokens)[ids])


@needs_native
def test_speculative_greedy_equals_plain_greedy_on_a_quantized_model(quantized_gguf, tmp_path):
    from eagle_serve.server.llm import LLM
    kw = dict(dtype="float32", device="cpu", kv_cache_tokens=4096, block_size=4, tree_budget=False,
              skip_tokenizer=True)
    rng = random.Random(5)
    ps = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(quantized_gguf, **kw)
    assert quant.is_quantized(plain.runner.model.lm_head)
    ref = [o.token_ids for o in plain.generate(ps, params)]
    cfg_dir = tmp_path / "target"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "vocab_size": VOCAB}))
    head = write_eagle_head(str(tmp_path / "head"), str(cfg_dir), stray_embed=False, std=0.05)
    llm = LLM(quantized_gguf, draft=head, spec=SpecConfig("eagle2", total_tokens=8, depth=4, top_k=3), **kw)
    assert not quant.is_quantized(llm.runner.drafter.embed)  # the draft paths read a dense table
    assert [o.token_ids for o in llm.generate(ps, params)] == ref
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    oracle = LLM(quantized_gguf, spec=SpecConfig("ngram", total_tokens=6, depth=5), **kw)
    oracle.runner.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref)}, vocab=VOCAB,
                                          corrupt_at=lambda i: [2, None, 4][i % 3])
    outs = oracle.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.accepted_tokens for o in outs) > 10


@needs_native
def test_int8_quantization_of_a_hf_checkpoint(tmp_path):
    from tests.conftest import write_tiny_model
    path = str(tmp_path / "hf")
    write_tiny_model(path, tokenizer=False, intermediate=128)
    cpu = torch.device("cpu")
    q = load_model(path, torch.float32, cpu, skip_tokenizer=True, quantization="int8")
    dense = load_model(path, torch.float32, cpu, skip_tokenizer=True)
    lin_q, lin_d = q.model.model.layers[0].mlp.down_proj, dense.model.model.layers[0].mlp.down_proj
    assert quant.packed_types(lin_q.gguf_weight) == ["Q8_0"]
    w = lin_d.weight.data
    err = (quant.dense_weight(lin_q).float() - w).abs().max().item()
    assert 0 < err <= w.abs().max().item() / 127  # rounded to int8 steps, no further
    with pytest.raises(ModelLoadError, match="quantizes a Hugging Face checkpoint"):
        load_model(write_quantized_gguf(str(tmp_path / "t.gguf")), torch.float32, cpu, skip_tokenizer=True,
                   quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(path, torch.float32, cpu, skip_tokenizer=True, quantization="int4")


def test_without_native_kernels_gguf_blocks_are_dequantized(tmp_path, monkeypatch, quantized_gguf):
    monkeypatch.setattr(kernels, "native", lambda: None)
    m = load_model(quantized_gguf, torch.float32, torch.device("cpu"), skip_tokenizer=True)
    assert not any(quant.is_quantized(mod) for mod in m.model.modules())
    with pytest.raises(ModelLoadError, match="native kernels"):
        load_model(quantized_gguf, torch.float32, torch.device("cpu"), skip_tokenizer=True, quantization="int8")


def test_quantization_flag_reaches_the_engine_config():
    from eagle_serve.engine.config import EngineConfig
    from eagle_serve.server.cli import build_parser, engine_kwargs
    assert engine_kwargs(build_parser().parse_args(["serve"]))["quantization"] == "auto"
    for value in ("none", "int8"):
        kw = engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x", "--quantization", value]))
        assert EngineConfig(**{k: v for k, v in kw.items() if v is not None}).quantization == value
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "q4"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")
