"""Tokenizer and chat template (torch-free): the `tokenizers` library plus a jinja2 template.

Chat templates are rendered the way Hugging Face renders them (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`), then encoded without adding special tokens because the
template already writes them.
"""
from __future__ import annotations

import codecs
import datetime
import functools
import json
import os
from dataclasses import dataclass, field

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


class TemplateError(ValueError):
    """The chat template refused the messages (e.g. a role it does not support)."""


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    _byte_level: bool | None = None
    # the other special tokens a template may name (pad_token, unk_token, ...), as HF passes them
    special_tokens: dict[str, str] = field(default_factory=dict)
    # a tokenizer_config.json's named chat templates, where it has a list of them
    template_names: tuple[str, ...] = ()

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"{path}: no tokenizer.json (a fast tokenizer file is required)")
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        # special_tokens_map.json, as transformers reads it: only for a tokenizer_config.json
        # without added_tokens_decoder (older checkpoints), and then over the config's values
        if "added_tokens_decoder" not in cfg:
            cfg = {**cfg, **_read_json(os.path.join(path, "special_tokens_map.json"))}
        special = {}
        for key in _SPECIAL_KEYS:
            value = _token_str(cfg.get(key))
            if isinstance(value, str) and value:
                special[key] = value
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        named = ()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = tuple(t["name"] for t in template if isinstance(t, dict) and isinstance(t.get("name"), str))
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        try:
            backend = HFTokenizer.from_file(tj)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions for a broken file
            raise ValueError(f"{tj}: not a readable tokenizer file ({e})") from None
        tok = cls(backend, template, special.get("bos_token"), special.get("eos_token"),
                  special_tokens={k: v for k, v in special.items() if k not in ("bos_token", "eos_token")},
                  template_names=named)
        tok.byte_level  # decided now, not on a request's first logprobs (it reads the whole tokenizer)
        return tok

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (byte-level BPE or SentencePiece byte fallback);
        a token that is part of a multi-byte character gives just its own bytes. Which kind of
        tokenizer it is comes from its decoder, once: GPT-2's byte alphabet holds printable ASCII
        and Latin-1, so reading a SentencePiece piece through it turned "é" into one byte 0xE9
        and "<0x0A>" into six characters."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to decoded text: its own, or none for a special token (decode
        with skip_special_tokens leaves those out)."""
        return b"" if token_id in self.special_ids else self.token_bytes(token_id)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens, which decode(skip_special_tokens=True) leaves out of
        the text."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def byte_level(self) -> bool:
        """Whether pieces are written in GPT-2's byte alphabet (a ByteLevel decoder)."""
        if self._byte_level is None:
            try:
                decoder = json.loads(self.backend.to_str()).get("decoder") or {}
            except (ValueError, AttributeError):
                decoder = {}
            self._byte_level = "ByteLevel" in json.dumps(decoder)
        return self._byte_level

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The template rendered as Hugging Face renders it; `tools` (OpenAI's
        [{"type": "function", "function": {...}}, ...]) are passed as the template's `tools`."""
        if not self.chat_template:
            if self.template_names:  # as transformers: a list of templates needs one named "default"
                raise TemplateError(f"this model has several chat templates ({', '.join(self.template_names)}) and "
                                    "none is named 'default'; send a plain prompt instead")
            raise TemplateError("this model has no chat template; send a plain prompt instead")
        try:
            template = _compile(self.chat_template)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        try:
            # as HF renders: tools as given (none without), documents none, the special tokens
            # the tokenizer has
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   documents=None, **self.special_tokens,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's own failure (jinja's, or a TypeError inside it) is the request's 400
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, reversed (char -> byte)."""
    if not _BYTE_DECODER:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
            list(range(ord("\xae"), ord("\xff") + 1))
        chars, extra = {}, 0
        for b in range(256):
            if b in keep:
                chars[b] = chr(b)
            else:
                chars[b] = chr(256 + extra)
                extra += 1
        _BYTE_DECODER.update({c: b for b, c in chars.items()})
    return _BYTE_DECODER


def _raise(message: str):
    raise TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def template_environment() -> jinja2.Environment:
    """The sandboxed environment chat templates render in, as Hugging Face's."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        _TEMPLATES[source] = template_environment().from_string(source)
    return _TEMPLATES[source]


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's tojson filter, its options passed through."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks in HF's
    templates; rendering keeps its body, so templates using it compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    """A tokenizer side file's JSON object ({} when absent); malformed is an error naming it."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _token_str(token) -> str | None:
    if isinstance(token, dict):  # AddedToken serialisation
        return token.get("content")
    return token


def _incomplete_tail(data: bytes) -> bool:
    """Whether the bytes end inside a UTF-8 character."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return bool(decoder.getstate()[0])


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas that never split a UTF-8 character.

    It decodes a short window (`prefix_offset:`) and emits what the window adds past the text
    already emitted; a trailing U+FFFD means an incomplete byte sequence, so it waits. A few
    prompt tokens seed the window so SentencePiece's leading-space rule sees real context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 5):
        self.tokenizer = tokenizer
        seed = list(prompt_ids[-context:])
        # a seed that ends inside a character (a token-id prompt cut mid-character) would hide
        # the output token that completes it: the completed character is no longer than its
        # U+FFFD, so the first delta would be held back and then sliced past, its bytes lost. The
        # seed stops at the last whole character: the completing bytes then come out as U+FFFD,
        # as decoding the output alone gives. Judged by the bytes, not the text (a prompt may
        # end in a real U+FFFD, and emptying the seed would cost SentencePiece its leading space).
        while seed and _incomplete_tail(b"".join(tokenizer.token_bytes(t) for t in seed)):
            seed.pop()
        # nor may it start inside one: a byte-fallback decoder (Llama-2, Mistral) turns a whole
        # run of byte tokens into U+FFFD when one byte in it is stray, and the run goes on into
        # the output (CJK or emoji after CJK or emoji in the prompt came out as U+FFFD only)
        # (kept whole if every token is one: SentencePiece's leading space needs some context)
        start = next((i for i, t in enumerate(seed) if not 0x80 <= (tokenizer.token_bytes(t) or b"\0")[0] < 0xC0), 0)
        seed = seed[start:]
        self.ids = seed
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character becomes U+FFFD)."""
        decode = self.tokenizer.decode
        rest = decode(self.ids[self.prefix_offset:])[len(decode(self.ids[self.prefix_offset:self.read_offset])):]
        self.prefix_offset = self.read_offset = len(self.ids)
        return rest
