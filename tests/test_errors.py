"""Bad input gets a clear error naming the problem."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagle_serve.engine.loader import ModelLoadError, load_model
from eagle_serve.engine.model_config import UnsupportedModel
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.scheduler.loop import PromptTooLong
from eagle_serve.server.cli import main
from tests.conftest import write_tiny_model


def _load(path):
    import torch
    return load_model(path, torch.float32, torch.device("cpu"))


def test_missing_model_path():
    with pytest.raises(ModelLoadError, match="/no/such/model"):
        _load("/no/such/model")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        _load(str(tmp_path))
    write_tiny_model(str(tmp_path))
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        _load(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        _load(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        _load(str(tmp_path))


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    # a v5 config (default rope_parameters) with a user's rope_scaling: transformers applies the
    # scaling, and so does this engine
    from transformers import AutoConfig
    write_tiny_model(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(str(tmp_path)).rope_parameters
    ours = _load(str(tmp_path)).config
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 2.0} and hf["factor"] == 2.0
    assert ours.rope_theta == hf["rope_theta"]


def test_unsupported_rope_scaling_is_named(tmp_path):
    write_tiny_model(str(tmp_path), tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="yarn"):
        _load(str(tmp_path))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("hidden_size"), "missing field 'hidden_size'"),
    (lambda c: c.update(max_position_embeddings=-5), "max_position_embeddings must be a positive integer"),
    (lambda c: c.update(hidden_size="64"), "hidden_size must be a positive integer"),
    (lambda c: c.update(rms_norm_eps="x"), "rms_norm_eps"),
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    # rope scaling fields each type reads: missing, a string or 0, each is named before the
    # rotary table is built (a factor of 0 would make a table of NaNs)
    (lambda c: c.update(rope_scaling={"rope_type": "linear"}), "factor must be a positive number"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": "2"}), "factor must be a positive number"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 0}), "factor must be a positive number"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor must be"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                      "high_freq_factor": 1.0, "original_max_position_embeddings": 64}),
     "low_freq_factor must be below"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta must be a positive"),
    (lambda c: c.update(sliding_window="4096"), "sliding_window must be a positive integer"),
    (lambda c: c.update(num_key_value_heads=3), "not a multiple of")])
def test_a_malformed_config_names_its_file_and_field(tmp_path, edit, message):
    # each names the file and the field, and quotes a string value as a string
    write_tiny_model(str(tmp_path), tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=message) as e:
        _load(str(tmp_path))
    assert "config.json" in str(e.value)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UnsupportedModel, match="not a JSON object"):
        _load(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        _load(str(tmp_path))


def test_a_truncated_weight_file_is_named(tmp_path):
    write_tiny_model(str(tmp_path), tokenizer=False)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        _load(str(tmp_path))


def test_a_broken_draft_head_is_named(tmp_path, tiny_llama):
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.llm import LLM
    from tests.spec_helpers import write_eagle_head
    head = write_eagle_head(str(tmp_path / "head"), tiny_llama[0])
    st = tmp_path / "head" / "model.safetensors"
    st.write_bytes(b"garbage, not a safetensors file")
    kw = dict(dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4, spec=SpecConfig("eagle2"))
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        LLM(tiny_llama[0], draft=head, **kw)
    (tmp_path / "head" / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        LLM(tiny_llama[0], draft=head, **kw)


def test_weight_shape_mismatch_is_named(tmp_path):
    write_tiny_model(str(tmp_path), tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\..*has shape .* the config implies"):
        _load(str(tmp_path))


def test_prompt_longer_than_context(tiny_llm):
    n = tiny_llm.max_model_len
    with pytest.raises(PromptTooLong, match=f"maximum context length is {n}"):
        tiny_llm.generate([5] * n, SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLong):
        tiny_llm.generate([5] * (n - 4), SamplingParams(max_tokens=8))
    assert not tiny_llm.loop.has_unfinished  # nothing half-admitted


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={3: 500.0}), "logit_bias"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[5, 99999]], SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate([[5]], SamplingParams(logit_bias={99999: 1.0}))


def test_cli_reports_errors_cleanly(capsys):
    assert main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 2
    assert "/no/such/dir" in capsys.readouterr().err


def test_cli_refuses_what_it_would_fail_on_later(capsys, monkeypatch, tmp_path, tiny_llama):
    # each of these is refused with exit 2 and one line, before anything loads
    model = ["--model", tiny_llama[0], "--dtype", "float64", "--device", "cpu"]
    assert main(["generate", *model, "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    for tree, said in (('[[0], ["a"]]', "list of integers"), ("[0, 1]", "list of integers"),
                       ("[[0], [1.5]]", "list of integers"), ("nope", "not valid JSON")):
        f = tmp_path / "tree.json"
        f.write_text(tree)
        assert main(["generate", *model, "--prompt", "x", "--spec", "eagle1", "--draft", "none",
                     "--static-tree", str(f)]) == 2
        err = capsys.readouterr().err
        assert said in err and "tree.json" in err, err
    assert main(["generate", *model, "--prompt", "x", "--spec", "ngram", "--static-tree", str(f)]) == 2
    assert "for --spec eagle1" in capsys.readouterr().err
    # tree-shape flags the method does not read are refused, not ignored
    for method, flags, said in (("eagle1", ["--depth", "3", "--top-k", "2"], "--depth, --top-k do not apply"),
                                ("ngram", ["--top-k", "3"], "--top-k does not apply"),
                                ("none", ["--total-tokens", "8"], "--total-tokens does not apply")):
        draft = ["--draft", "none"] if method != "eagle1" else []
        assert main(["generate", *model, "--prompt", "x", "--spec", method, *draft, *flags]) == 2
        assert said in capsys.readouterr().err
    assert main(["generate", *model, "--prompt", "x", "--kv-cache-tokens", str(10 ** 12)]) == 2
    assert "cannot allocate the KV cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "99999"])
    assert "0-65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-request-bytes", "0"])
    capsys.readouterr()
    assert main(["serve", *model, "--api-key="]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    # a bad EAGLE_SERVE_* value fails serve, naming the variable, and nothing else
    monkeypatch.setenv("EAGLE_SERVE_PORT", "abc")
    monkeypatch.setenv("EAGLE_SERVE_FIXED_TREE", "maybe")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "EAGLE_SERVE_PORT='abc'" in err and "EAGLE_SERVE_FIXED_TREE='maybe'" in err
    # ... unless its flag is on the command line (the flag wins): a Kubernetes Service named
    # eagle-serve injects EAGLE_SERVE_PORT=tcp://IP:PORT into its namespace's pods (service links),
    # and a pod started with --port must not crash-loop on it
    monkeypatch.delenv("EAGLE_SERVE_FIXED_TREE")
    monkeypatch.setenv("EAGLE_SERVE_PORT", "tcp://10.96.0.12:8000")
    assert main(["serve", *model, "--port", "8000", "--api-key="]) == 2  # the variables pass, the flag is refused
    assert "--api-key is empty" in capsys.readouterr().err
    assert main(["serve", *model, "--api-key="]) == 2
    err = capsys.readouterr().err
    assert "EAGLE_SERVE_PORT='tcp://10.96.0.12:8000'" in err and "service link" in err
    monkeypatch.setenv("EAGLE_SERVE_SPEC", "nope")  # a choice outside the flag's choices, likewise
    assert main(["serve", *model, "--port", "8000", "--spec", "none", "--api-key="]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.delenv("EAGLE_SERVE_SPEC")
    assert main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 2  # other commands unaffected
    assert "/no/such/dir" in capsys.readouterr().err


def test_a_draft_top_k_beyond_the_heads_vocabulary_is_refused(tiny_llama, tmp_path):
    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.llm import LLM
    from tests.spec_helpers import write_eagle_head
    head = write_eagle_head(str(tmp_path / "head"), tiny_llama[0])  # the tiny vocabulary: 320
    kw = dict(dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4, draft=head, tree_budget=False)
    with pytest.raises(ValueError, match="top_k 321 is beyond the draft head's vocabulary of 320"):
        LLM(tiny_llama[0], spec=SpecConfig("eagle2", total_tokens=10, depth=2, top_k=321), **kw)
    with pytest.raises(ValueError, match="static tree rank 400"):
        LLM(tiny_llama[0], spec=SpecConfig("eagle1", static_tree=[[0], [400]]), **kw)
    LLM(tiny_llama[0], spec=SpecConfig("eagle2", total_tokens=10, depth=2, top_k=320), **kw)


@pytest.mark.real_model
def test_a_truncated_gguf_is_named(tmp_path):
    from eagle_serve.engine.default_model import default_model_path
    with open(default_model_path(), "rb") as f:
        head = f.read(5000)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(ModelLoadError, match="cut.gguf: not a readable GGUF file"):
        _load(str(cut))


def test_stop_strings_without_a_tokenizer_are_refused(tiny_llama):
    from eagle_serve.server.llm import LLM
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=256, skip_tokenizer=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].text == ""


def test_the_published_schema_states_every_limit_as_json_schema():
    # limits set after a validator must not come out as unknown "ge" / "le" keys: clients (and the
    # fuzz tests) would read no minimum at all
    import json as _json
    from eagle_serve.server.protocol import ChatRequest, CompletionRequest
    for model in (ChatRequest, CompletionRequest):
        text = _json.dumps(model.model_json_schema())
        assert '"ge"' not in text and '"le"' not in text and '"minimum": 1' in text


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    from eagle_serve.server.protocol import ChatRequest, chat_inputs
    req = ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "First part."},
                                                                         {"type": "text", "text": "Second part."}]}])
    assert chat_inputs(req)[0][0]["content"] == "First part.\nSecond part."


def test_sharded_checkpoints_load_the_files_transformers_loads(tmp_path):
    # only the files the index names are read (a Mistral repo keeps consolidated.safetensors
    # beside the shards, some an adapter file), and a missing shard is named as a missing file
    from safetensors.torch import load_file, save_file
    base = tmp_path / "base"
    write_tiny_model(str(base))
    src = load_file(str(base / "model.safetensors"))
    names = sorted(src)
    (base / "model.safetensors").unlink()
    wmap = {}
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{k}-of-00002.safetensors"
        save_file({n: src[n].contiguous() for n in part}, str(base / shard), metadata={"format": "pt"})
        wmap.update({n: shard for n in part})
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    save_file({"layers.0.attention.wq.weight": src[names[0]]}, str(base / "consolidated.safetensors"))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}, str(base / "adapter_model.safetensors"))
    _load(str(base))
    (base / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="names shard files that are not there: model-00002-of-00002"):
        _load(str(base))
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ModelLoadError, match="quantized checkpoints .*'gptq'"):  # (int weights were cast; FP8: test_fp8)
        _load(str(base))
    (base / "config.json").write_text(json.dumps(cfg))
    (base / "generation_config.json").write_text("[1]")  # not an object: named, not a traceback
    save_file(src, str(base / "model.safetensors"))  # a whole file beside the index: it is the one read
    with pytest.raises(ModelLoadError, match="generation_config.json: not a JSON object"):
        _load(str(base))
