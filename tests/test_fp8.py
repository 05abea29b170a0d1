"""FP8 (e4m3) checkpoints (engine/fp8.py): the compressed-tensors and the plain `weight_scale`
layouts load as their dequantized weights, generate as the Hugging Face model holding those
weights does, and anything else is a clear ModelLoadError; the FP8 product's reference and
_scaled_mm paths against float64. The CUDA path itself runs in bench/gpu_check.py's fp8 step."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_serve.engine import fp8, kernels
from eagle_serve.engine.loader import ModelLoadError, load_model
from eagle_serve.engine.sampling_params import SamplingParams
from tests.conftest import write_tiny_model

E4M3 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate")  # gate: a MoE router
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                               "strategy": "channel", "group_size": None, "block_structure": None},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}
# layout -> (quantization_config, weight scale strategy, block)
LAYOUTS = {
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": CT_GROUP}, "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None},
        "channel", None),
    "ct-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "tensor"}, "input_activations": None}},
        "ignore": ["lm_head"]}, "tensor", None),
    "ct-block": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "block", "block_structure": [32, 48]}}},
        "ignore": ["lm_head"]}, "block", (32, 48)),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor", None),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [48, 40]}, "block", (48, 40)),
}


@pytest.fixture(autouse=True, scope="module")
def _no_native_kernels():
    """These models are float32 / float64 on the CPU: no native kernel build for them."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EAGLE_SERVE_NATIVE_KERNELS", "0")
    kernels.native.cache_clear()
    yield
    mp.undo()
    kernels.native.cache_clear()


def quantize(w: torch.Tensor, strategy: str, block=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) as llm-compressor / AutoFP8 store them."""
    w = w.float()
    n, k = w.shape
    if strategy == "tensor":
        scale = w.abs().max() / 448
        full = scale
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448  # [N, 1]
        full = scale
    else:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.stack([torch.stack([w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
                                          for j in range(cols)]) for i in range(rows)])
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(E4M3), scale


def reference(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """The dequantized weight computed in float64 and rounded once to float32 (e4m3 has 4
    significant bits and the scale 24: the float64 product is exact)."""
    s = scale.double()
    if block is not None and s.dim() == 2 and s.numel() > 1:
        s = s.repeat_interleave(block[0], 0)[:q.shape[0]].repeat_interleave(block[1], 1)[:, :q.shape[1]]
    return (q.double() * s).float()


def write_fp8(src: str, dst: str, layout: str, *, scale_shape=None, extra=None, drop=None, quant=None) -> dict:
    """An FP8 copy of the HF checkpoint in `src` (LM head, embeddings and norms unquantized) ->
    {weight name: dequantized float32 reference}. scale_shape: reshape every scale to it;
    extra: more tensors; drop: a tensor name to leave out; quant: another quantization_config."""
    config, strategy, block = LAYOUTS[layout]
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = quant if quant is not None else config
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    out, refs = {}, {}
    suffix = "weight_scale_inv" if layout == "fp8-block" else "weight_scale"
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if name.split(".")[-2] in LINEARS:
            q, scale = quantize(w, strategy, block)
            if layout == "fp8" and strategy == "tensor":
                scale = scale.reshape(())  # AutoFP8: a scalar; compressed-tensors: [1]
            elif strategy == "tensor":
                scale = scale.reshape(1)
            refs[name] = reference(q, scale, block)
            out[name] = q
            out[name[:-len("weight")] + suffix] = scale.reshape(scale_shape) if scale_shape else scale
        else:
            out[name] = w.float()
            refs[name] = w.float()
    out.update(extra or {})
    out.pop(drop, None)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"))
    return refs


def write_dequantized(src: str, dst: str, refs: dict) -> None:
    """The same model as a plain HF checkpoint holding the dequantized weights."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    save_file({k: v.contiguous() for k, v in refs.items()}, os.path.join(dst, "model.safetensors"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp8-base"))
    write_tiny_model(path)  # Llama, GQA, untied, 2 layers, float64
    return path


def load(path, dtype=torch.float32):
    return load_model(path, dtype, torch.device("cpu"), skip_tokenizer=True).model


def fused_reference(refs: dict, layer: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}."
    r = lambda n: refs[p + n + ".weight"]  # noqa: E731
    return {"self_attn.qkv_proj": torch.cat([r("self_attn.q_proj"), r("self_attn.k_proj"), r("self_attn.v_proj")]),
            "self_attn.o_proj": r("self_attn.o_proj"),
            "mlp.gate_up_proj": torch.cat([r("mlp.gate_proj"), r("mlp.up_proj")]), "mlp.down_proj": r("mlp.down_proj")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaded_weights_are_the_dequantized_reference(base, tmp_path, layout):
    refs = write_fp8(base, str(tmp_path / layout), layout)
    net = load(str(tmp_path / layout))
    modules = dict(net.named_modules())
    for layer in range(2):
        for name, want in fused_reference(refs, layer).items():
            m = modules[f"model.layers.{layer}.{name}"]
            assert m.fp8_weight is None
            assert m.weight.dtype == torch.float32 and torch.equal(m.weight, want), (layout, layer, name)
    assert torch.equal(net.lm_head.weight, refs["lm_head.weight"])  # ignored: unquantized
    assert torch.equal(net.model.embed_tokens.weight, refs["model.embed_tokens.weight"])


def greedy(llm, prompts, n=16):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("layout", ["ct-channel", "fp8", "fp8-block"])
def test_greedy_generation_equals_the_dequantized_checkpoint(base, tmp_path, layout):
    from transformers import AutoModelForCausalLM
    from eagle_serve.server.llm import LLM
    refs = write_fp8(base, str(tmp_path / "fp8"), layout)
    write_dequantized(base, str(tmp_path / "deq"), refs)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (4, 13, 30)]
    kw = dict(dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    got = greedy(LLM(str(tmp_path / "fp8"), **kw), prompts)
    assert got == greedy(LLM(str(tmp_path / "deq"), **kw), prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float64).eval()
    for prompt, out in zip(prompts, got):  # (greedy by hand: generate's min_new_tokens would mask the EOS id)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out == ids[len(prompt):]


def test_the_kept_fp8_path_attaches_weights_and_generates(base, tmp_path, monkeypatch):
    """The GPU path's loading, on the CPU: FP8 weights attached to the decoder's linears, a NaN
    placeholder of no memory as `weight`, the LM head float; forwards through fp8.linear's
    reference product (no _scaled_mm probe off CUDA) generate as the dequantized checkpoint."""
    from eagle_serve.server.llm import LLM
    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: True)
    refs = write_fp8(base, str(tmp_path / "fp8"), "ct-channel")
    write_dequantized(base, str(tmp_path / "deq"), refs)
    net = load(str(tmp_path / "fp8"), torch.bfloat16)
    modules = dict(net.named_modules())
    for name, want in fused_reference(refs, 1).items():
        m = modules[f"model.layers.1.{name}"]
        assert m.fp8_weight.dtype == E4M3 and m.fp8_weight.shape == want.shape
        assert m.fp8_scale.dtype == torch.float32 and m.fp8_scale.shape == (want.shape[0],)
        assert torch.equal(m.fp8_weight.float() * m.fp8_scale[:, None], want)
        assert m.weight.shape == want.shape and m.weight.dtype == torch.bfloat16
        assert m.weight.stride() == (0, 0) and torch.isnan(m.weight).all()
    assert net.lm_head.fp8_weight is None and torch.equal(net.lm_head.weight, refs["lm_head.weight"].bfloat16())
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 21)]
    kw = dict(dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    assert greedy(LLM(str(tmp_path / "fp8"), **kw), prompts) == greedy(LLM(str(tmp_path / "deq"), **kw), prompts)


def test_a_qwen3_moe_keeps_attention_and_dense_mlps_fp8_and_dequantizes_the_experts(tmp_path, monkeypatch):
    """Qwen3-MoE (per-head q / k norms, routed experts) on the kept path: the experts and the
    router are dequantized (the grouped GPU path stacks the experts' float weights; the
    router's 8 outputs are no multiple of 16), the rest stays FP8; greedy equals the
    dequantized checkpoint's."""
    from eagle_serve.server.llm import LLM
    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: True)
    write_tiny_model(str(tmp_path / "base"), arch="qwen3_moe")
    refs = write_fp8(str(tmp_path / "base"), str(tmp_path / "fp8"), "ct-channel")
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in refs and "model.layers.0.mlp.gate.weight" in refs
    write_dequantized(str(tmp_path / "base"), str(tmp_path / "deq"), refs)
    net = load(str(tmp_path / "fp8"))
    layers = net.model.layers
    assert layers[0].self_attn.qkv_proj.fp8_weight is not None and layers[1].mlp.gate_up_proj.fp8_weight is not None
    expert = layers[0].mlp.experts[5].gate_up_proj
    assert expert.fp8_weight is None and torch.equal(expert.weight, torch.cat(
        [refs["model.layers.0.mlp.experts.5.gate_proj.weight"], refs["model.layers.0.mlp.experts.5.up_proj.weight"]]))
    assert layers[0].mlp.gate.fp8_weight is None
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (6, 17)]
    kw = dict(dtype="float64", device="cpu", kv_cache_tokens=2048, block_size=4)
    assert greedy(LLM(str(tmp_path / "fp8"), **kw), prompts) == greedy(LLM(str(tmp_path / "deq"), **kw), prompts)


def test_a_fused_linear_with_fp8_and_float_parts_is_refused_on_the_kept_path(base, tmp_path, monkeypatch):
    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: True)
    write_fp8(base, str(tmp_path / "m"), "ct-channel")
    f = str(tmp_path / "m" / "model.safetensors")
    t = load_file(f)
    name = "model.layers.0.self_attn.k_proj."
    t[name + "weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    del t[name + "weight_scale"]
    save_file(t, f)
    with pytest.raises(ModelLoadError, match="parts of the fused model.layers.0.self_attn.qkv_proj are not all FP8"):
        load(str(tmp_path / "m"))


# ---------------------------------------------------------------- refusals

def ct(weights=None, acts="same", **top) -> dict:
    group = {**CT_GROUP, "weights": {**CT_GROUP["weights"], **(weights or {})}}
    if acts != "same":
        group["input_activations"] = acts
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **top}


@pytest.mark.parametrize("quant, message", [
    (ct({"num_bits": 4, "type": "int", "group_size": 128, "strategy": "group"}, format="pack-quantized"),
     "format 'pack-quantized'"),
    (ct({"num_bits": 4, "type": "int", "strategy": "group"}), "weights are 4-bit int"),
    (ct({"num_bits": 8, "type": "int"}, format="int-quantized"), "format 'int-quantized'"),
    (ct({"num_bits": 8, "type": "int"}), "weights are 8-bit int"),
    (ct(acts={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}), "static input activation"),
    (ct(acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "input activations"),
    (ct({"strategy": "group", "group_size": 128}), "weight strategy 'group'"),
    (ct({"strategy": "block", "block_structure": None}), "block_structure None"),
    (ct({"symmetric": False}), "asymmetric"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors"}, "without config_groups"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"quant_method": "gptq", "bits": 4}, r"quantized checkpoints \(quant_method 'gptq'\) are not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ("fp8", "not an object"),
])
def test_unsupported_configs_are_refused(base, tmp_path, quant, message):
    write_fp8(base, str(tmp_path), "ct-channel", quant=quant)
    with pytest.raises(ModelLoadError, match=message) as e:
        load(str(tmp_path))
    assert "config.json" in str(e.value)


def test_published_configs_are_accepted():
    fp8_dynamic = ct()  # llm-compressor's FP8_DYNAMIC: channel weights, dynamic per-token activations
    assert fp8.scheme(fp8_dynamic, "c").strategies == {"channel"}
    assert fp8.scheme(fp8_dynamic, "c").activations == "dynamic"
    w8a16 = ct({"strategy": "tensor"}, acts=None)
    assert fp8.scheme(w8a16, "c").activations == "none"
    block = fp8.scheme(ct({"strategy": "block", "block_structure": [128, 128]}), "c")
    assert block.block == (128, 128) and block.strategies == {"block"}
    qwen3 = fp8.scheme({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128]}, "c")  # Qwen3-*-FP8
    assert qwen3.scale_suffix == "weight_scale_inv" and qwen3.block == (128, 128)


@pytest.mark.parametrize("change, message", [
    (dict(drop="model.layers.1.mlp.down_proj.weight_scale"),
     r"FP8 weights without their weight_scale: \['model.layers.1.mlp.down_proj.weight'\]"),
    (dict(drop="model.layers.0.self_attn.o_proj.weight"),
     r"weight_scale tensors without an FP8 weight: \['model.layers.0.self_attn.o_proj.weight_scale'\]"),
    (dict(scale_shape=(1, -1)), r"weight_scale has shape \(1, \d+\); weight .* needs \[\d+, 1\]"),
    (dict(extra={"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.1)}),
     "q_proj.input_scale' is a static activation scale"),
    (dict(extra={"model.layers.0.mlp.up_proj.weight_zero_point": torch.ones(128, 1, dtype=torch.int8)}),
     "nonzero zero points"),
    (dict(extra={"model.norm.weight_scale": torch.tensor([1.0])}), "scales a weight that is not float8_e4m3fn"),
    (dict(extra={"model.layers.0.mlp.up_proj.weight_scale_inv": torch.tensor([1.0])}),
     "stores scales as 'weight_scale'"),
])
def test_bad_fp8_tensors_are_refused(base, tmp_path, change, message):
    write_fp8(base, str(tmp_path), "ct-channel", **change)
    with pytest.raises(ModelLoadError, match=message):
        load(str(tmp_path))


def test_zero_points_of_zero_are_consumed_and_fp8_configs_need_fp8_weights(base, tmp_path):
    zp = {f"model.layers.{i}.mlp.up_proj.weight_zero_point": torch.zeros(128, 1, dtype=torch.int8) for i in range(2)}
    refs = write_fp8(base, str(tmp_path / "zp"), "ct-channel", extra=zp)
    assert torch.equal(load(str(tmp_path / "zp")).model.layers[1].mlp.gate_up_proj.weight,
                       fused_reference(refs, 1)["mlp.gate_up_proj"])
    # an FP8 config over unquantized weights (the config was pasted onto the wrong checkpoint)
    (tmp_path / "plain").mkdir()
    for f in os.listdir(base):
        shutil.copy(os.path.join(base, f), tmp_path / "plain")
    cfg = json.load(open(os.path.join(base, "config.json")))
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ModelLoadError, match="declares FP8 .* but no weight is float8_e4m3fn"):
        load(str(tmp_path / "plain"))
    # e5m2 weights
    t = load_file(str(tmp_path / "zp" / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].float().to(torch.float8_e5m2)
    save_file(t, str(tmp_path / "zp" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.weight' is torch.float8_e5m2; only float8_e4m3fn"):
        load(str(tmp_path / "zp"))


def test_weight_and_scale_in_different_shards(base, tmp_path):
    refs = write_fp8(base, str(tmp_path), "fp8")
    t = load_file(str(tmp_path / "model.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    scales = {k: v for k, v in t.items() if k.endswith("weight_scale")}
    rest = {k: v for k, v in t.items() if k not in scales}
    save_file(scales, str(tmp_path / "model-00001-of-00002.safetensors"))  # every scale before its weight
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    wmap = {**{k: "model-00001-of-00002.safetensors" for k in scales},
            **{k: "model-00002-of-00002.safetensors" for k in rest}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    net = load(str(tmp_path))
    assert torch.equal(net.model.layers[0].self_attn.qkv_proj.weight, fused_reference(refs, 0)["self_attn.qkv_proj"])


# ---------------------------------------------------------------- the product

def operands(m, k, n, dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen, dtype=torch.float64) * 3).to(dtype)
    x[0] = 0  # an all-zero row: a zero scale must not make NaNs
    w = (torch.randn(n, k, generator=gen) * 2).to(E4M3)
    scale = torch.rand(n, generator=gen) * 0.01 + 0.001
    b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    return x, w, scale, b


def exact(x, w, scale, b):
    y = x.double() @ (w.double() * scale.double()[:, None]).t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_product_against_float64(dtype):
    x, w, scale, b = operands(7, 48, 32, dtype)
    want = exact(x, w, scale, b)
    got = fp8.reference(x, w, scale, b)
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    out = fp8.reference(x, w, scale, b, float_out=True)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    if dtype != torch.float64:  # float32 out, not rounded through bf16
        torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
    scalar = fp8.reference(x, w, scale[3], None)  # a per-tensor scale
    torch.testing.assert_close(scalar.double(), x.double() @ (w.double() * scale[3].double()).t(),
                               rtol=tol, atol=tol * want.abs().max().item())


def test_linear_module_dispatches_to_the_fp8_product():
    from eagle_serve.engine.layers import Linear
    x, w, scale, b = operands(5, 32, 48, torch.float32, seed=3)
    m = Linear(32, 48, bias=True)
    m.bias.data = b
    fp8.set_fp8(m, w, scale, torch.float32)
    assert m.weight.shape == (48, 32) and m.weight.untyped_storage().nbytes() == 4
    y = m(x)
    torch.testing.assert_close(y.double(), exact(x, w, scale, b), rtol=2e-6, atol=1e-5)
    assert m(x, float_out=True).dtype == torch.float32
    assert m(x.reshape(1, 5, 32)).shape == (1, 5, 48)


def test_quantize_rows_scales_each_row_to_448():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [1e-30, 0, 0]])
    q, s = fp8.quantize_rows(x)
    assert torch.equal(q[0].float(), torch.zeros(3)) and torch.isfinite(s).all()
    assert q[1].float().abs().max() == 448 and torch.isclose(s[1, 0], torch.tensor(2 / 448))
    assert q[2, 0].float() == 448


CPU_SCALED_MM = hasattr(torch, "_scaled_mm")


@pytest.mark.skipif(not CPU_SCALED_MM, reason="this torch has no torch._scaled_mm")
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("mode, dtype", [("tensorwise", torch.float32), ("tensorwise", torch.bfloat16),
                                         ("rowwise", torch.bfloat16)])
def test_scaled_product_on_the_cpu(rows, mode, dtype):
    """The _scaled_mm call the CUDA path makes (torch runs it on the CPU too): the same as its
    float64 emulation from the same FP8 operands, and within FP8 activation rounding of the
    exact product."""
    x, w, scale, b = operands(rows, 64, 48, dtype, seed=rows)
    got = fp8.scaled(x, w, scale, b, mode)
    assert got.dtype == dtype and got.shape == (rows, 48)
    emu = fp8.emulate(x, w, scale, b)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # rounding of the output (bf16) or float32 accumulation
    torch.testing.assert_close(got.double(), emu, rtol=tol, atol=tol * emu.abs().max().item())
    full = fp8.scaled(x, w, scale, b, mode, float_out=True)
    assert full.dtype == torch.float32
    torch.testing.assert_close(full.double(), emu, rtol=1e-5, atol=1e-5 * emu.abs().max().item())
    # e4m3 rounds activations to 4 significant bits: within 2^-4 of each row's magnitude
    want = exact(x, w, scale, b)
    err = (emu - want).abs().amax(1)
    bound = 2 ** -4 * (x.double().abs() @ (w.double() * scale.double()[:, None]).abs().t()).amax(1)
    assert (err <= bound + 1e-12).all()
    assert torch.equal(got[0].double(), (b.double() if mode == "tensorwise" and dtype == torch.float32
                                          else b.to(got.dtype).double()))  # the zero row: bias only
