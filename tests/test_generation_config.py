"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config): what
a request leaves out takes them, what it sets wins, max_new_tokens caps every output."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import httpx2 as httpx
import pytest

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.server.app import BackgroundServer, ServerState
from eagle_serve.server.generation_config import DEFAULT_MODEL, GenerationDefaults, load_defaults
from eagle_serve.server.llm import LLM
from eagle_serve.server.protocol import ChatRequest, sampling_params

KW = dict(dtype="float64", device="cpu", kv_cache_tokens=4096, block_size=4)


def _model_with(tiny_llama, tmp_path, config: dict | None) -> str:
    path = tmp_path / "model"
    shutil.copytree(tiny_llama[0], path)
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def test_settings_resolve_as_vllm_does(tmp_path, caplog):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "max_new_tokens": 100, "do_sample": True,
         "repetition_penalty": 1.1, "bos_token_id": 1}))
    with caplog.at_level(logging.WARNING, "eagle_serve"):
        auto = load_defaults("auto", str(tmp_path / "m"), False)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.max_new_tokens) == (0.6, 0.9, -1, 100)
    assert "repetition_penalty=1.1" in caplog.text  # named, not silently dropped
    by_path = load_defaults(str(tmp_path / "m"), "ignored", False)  # a folder given as the setting
    assert dataclasses.replace(by_path, source=auto.source) == auto
    assert load_defaults("vllm", str(tmp_path / "m"), False) == GenerationDefaults()
    assert load_defaults("auto", str(tmp_path), False).temperature is None  # no file: neutral
    assert load_defaults("auto", str(tmp_path / "x.gguf"), False).temperature is None
    default = load_defaults("auto", "", True)
    assert (default.temperature, default.top_p, default.max_new_tokens) == (
        DEFAULT_MODEL["temperature"], DEFAULT_MODEL["top_p"], DEFAULT_MODEL["max_new_tokens"])
    with pytest.raises(ValueError, match="does not exist"):
        load_defaults(str(tmp_path / "nowhere"), "", False)
    (tmp_path / "bad.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_defaults(str(tmp_path / "bad.json"), "", False)
    (tmp_path / "neg.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="top_p"):
        load_defaults(str(tmp_path / "neg.json"), "", False)


def test_request_fields_win_over_the_defaults_and_max_new_tokens_caps():
    d = GenerationDefaults(temperature=0.3, top_p=0.8, top_k=5, max_new_tokens=20, source="test")
    unset = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = sampling_params(unset, 1000, None, 0, d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.8, 5, 20)
    set_ = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0, top_p=1.0, top_k=-1)
    p = sampling_params(set_, 7, None, 0, d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0, 1.0, -1, 7)
    p = sampling_params(unset, 1000, None, 0)  # no generation config: OpenAI's neutral values
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, -1, 1000)


def test_served_model_answers_with_its_generation_config(tiny_llama, tmp_path):
    path = _model_with(tiny_llama, tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(path, **KW)
    assert llm.get_default_sampling_params().max_tokens == 3
    greedy3 = SamplingParams(temperature=0, max_tokens=3)
    assert llm.generate([5, 6, 7])[0].token_ids == llm.generate([5, 6, 7], greedy3)[0].token_ids
    srv = BackgroundServer(ServerState(llm, served_model_name="tiny"))
    try:
        msg = [{"role": "user", "content": "the quick brown fox"}]
        plain = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "messages": msg}, timeout=60).json()
        assert plain["usage"]["completion_tokens"] <= 3
        greedy = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": msg, "temperature": 0, "max_tokens": 3}).json()
        assert plain["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        capped = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}).json()
        assert capped["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()
    neutral = LLM(path, generation_config="vllm", **KW)
    assert neutral.get_default_sampling_params().temperature == 1.0
