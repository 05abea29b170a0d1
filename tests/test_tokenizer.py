"""The tokenizer's own pieces: token bytes, incremental detokenization, the chat template
environment (tiny tokenizers built here; no model)."""
from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from eagle_serve.engine.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer
from tests.conftest import build_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding verifies a draft tree",
          "hello world and everyone in it", "a tokenizer learns merges from text like this"] * 20


def sentencepiece_like(style: str) -> HFTokenizer:
    """A Llama-2 / Mistral-style tokenizer: "▁" for spaces, byte fallback pieces <0xNN>."""
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False))
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    vocab.update({f"<0x{b:02X}>": n + b for b in range(256)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    if style == "replace":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return tok


@pytest.mark.parametrize("style", ["replace", "metaspace"])
def test_token_bytes_of_a_sentencepiece_tokenizer(style):
    # GPT-2's byte alphabet holds printable ASCII and Latin-1: read through it, "é" would be one
    # byte 0xE9 and a byte-fallback piece "<0x0A>" the six characters of its name
    tok = Tokenizer(sentencepiece_like(style))
    text = "wörld\n你 é"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text).encode()


def test_token_bytes_of_a_byte_level_tokenizer():
    tok = Tokenizer(build_tokenizer(320))
    text = "héllo 🔥 wörld"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_a_prompt_that_ends_inside_a_character_loses_nothing_when_streamed():
    # the seed window ends in U+FFFD; the output token completing the character decodes to a
    # text no longer than that, and is held back, not sliced past: its bytes reach the stream
    tok = Tokenizer(build_tokenizer(320))
    ids = tok.encode("hi 🔥🔥 ok then", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # (the emoji spans tokens in this tokenizer)
    for k in cuts:
        d = IncrementalDetokenizer(tok, ids[:k])
        streamed = "".join(d.add([t]) for t in ids[k:]) + d.flush()
        assert streamed == tok.decode(ids[k:]), (k, streamed)


def test_the_template_environment_matches_hf():
    tok = Tokenizer(build_tokenizer(320))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # {% generation %} (HF's training-mask tag) renders its body, so such templates compile
    tok.chat_template = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}" \
                        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "hiyo"
    # tojson's options as HF passes them
    tok.chat_template = "{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}|{{ {'b': 1} | tojson(separators=(',', ':')) }}"
    assert tok.apply_chat_template(msgs) == '{"a": 2, "b": 1}|{"b":1}'
    # a template's own error (not jinja's) is the request's error, not a crash (a 500)
    tok.chat_template = "{{ messages[0].content + 1 }}"
    with pytest.raises(TemplateError, match="TypeError"):
        tok.apply_chat_template(msgs)


def test_a_prompt_ending_in_a_real_replacement_character_keeps_its_context():
    # a seed of real U+FFFD characters is not trimmed away as a partial character, so a
    # SentencePiece decoder that strips a leading space keeps the output's first space
    tok = Tokenizer(sentencepiece_like("replace"))
    for prompt in ("the dog \ufffd", "the dog \ufffd\ufffd"):
        p = tok.encode(prompt, add_special_tokens=False)
        full = tok.encode(prompt + " the lazy dog", add_special_tokens=False)
        assert full[:len(p)] == p
        d = IncrementalDetokenizer(tok, p)
        streamed = "".join(d.add([t]) for t in full[len(p):]) + d.flush()
        assert streamed == tok.decode(full)[len(tok.decode(p)):] == " the lazy dog", (prompt, streamed)


@pytest.mark.parametrize("prompt,rest", [("你好 世界", "你好世界"), ("fire 🔥🔥", "🔥 ok"), ("a 🔥", "é 你 done")])
def test_byte_fallback_output_after_multibyte_prompt_text_is_streamed_whole(prompt, rest):
    # the seed window began inside the prompt's last character (its continuation-byte tokens):
    # a byte-fallback decoder turned the whole byte run, the output's bytes included, into U+FFFD
    tok = Tokenizer(sentencepiece_like("replace"))
    p = tok.encode(prompt, add_special_tokens=False)
    full = tok.encode(prompt + rest, add_special_tokens=False)
    assert full[:len(p)] == p
    d = IncrementalDetokenizer(tok, p)
    streamed = "".join(d.add([t]) for t in full[len(p):]) + d.flush()
    assert streamed == tok.decode(full)[len(tok.decode(p)):] and "\ufffd" not in streamed, streamed


def test_a_seed_of_only_continuation_bytes_keeps_its_context():
    # (an emptied seed would let SentencePiece's decoder drop the output's leading space: a
    # token-id prompt cut inside a run of multi-byte characters)
    tok = Tokenizer(sentencepiece_like("replace"))
    p = tok.encode("🔥🔥🔥", add_special_tokens=False)[:-2]
    out = tok.encode(" the dog", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, p)
    streamed = "".join(d.add([t]) for t in out) + d.flush()
    assert streamed == tok.decode(p + out)[len(tok.decode(p)):], streamed


def test_template_variables_and_special_token_files_match_hf(tmp_path):
    # tools / documents are defined (none, so `tools is not none` is false), pad / unk tokens
    # and special_tokens_map.json are read (bos / eos, eos a stop id), and a broken tokenizer.json
    # or a malformed tokenizer_config.json is named, not a bare "Exception" traceback
    from transformers import AutoTokenizer
    build_tokenizer(320).save(str(tmp_path / "tokenizer.json"))
    msgs = [{"role": "user", "content": "hi"}]

    def both(config, special_map=None):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        side = tmp_path / "special_tokens_map.json"
        side.unlink(missing_ok=True)
        if special_map:
            side.write_text(json.dumps(special_map))
        ours = Tokenizer.from_dir(str(tmp_path)).apply_chat_template(msgs)
        hf = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(msgs, tokenize=False,
                                                                             add_generation_prompt=True)
        return ours, hf

    ours, hf = both({"eos_token": "<|im_end|>", "chat_template": "{% if tools is not none %}[TOOLS]{% endif %}"
                     "{% if documents is not none %}[DOCS]{% endif %}{{ messages[0].content }}"})
    assert ours == hf == "hi"
    ours, hf = both({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                     "chat_template": "{{ pad_token }}|{{ unk_token }}|{{ messages[0].content }}"})
    assert ours == hf == "<|endoftext|>|<|endoftext|>|hi"
    ours, hf = both({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
                    {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    assert ours == hf == "<|im_start|>hi<|im_end|>"
    # the map wins over the config where both name a token, and a config with
    # added_tokens_decoder (a modern one) is read alone, as transformers reads them
    ours, hf = both({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0].content }}{{ eos_token }}"},
                    {"eos_token": "<|endoftext|>"})
    assert ours == hf == "hi<|endoftext|>"
    ours, hf = both({"added_tokens_decoder": {}, "chat_template": "[{{ bos_token }}]{{ messages[0].content }}"},
                    {"bos_token": "<|im_start|>"})
    assert ours == hf == "[]hi"
    # a list of named templates: the one named "default" (none such: an error naming them, as HF refuses)
    ours, hf = both({"chat_template": [{"name": "tool_use", "template": "T{{ messages[0].content }}"},
                                       {"name": "default", "template": "D{{ messages[0].content }}"}]})
    assert ours == hf == "Dhi"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]}))
    with pytest.raises(TemplateError, match=r"several chat templates \(tool_use, rag\) and none is named 'default'"):
        Tokenizer.from_dir(str(tmp_path)).apply_chat_template(msgs)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer file"):
        Tokenizer.from_dir(str(tmp_path))
