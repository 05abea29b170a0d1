"""Reading tool calls out of a chat answer, as it streams or at once.

A `ToolCallReader` takes one choice's text piece by piece and gives OpenAI chat deltas: content
pieces ({"content": ...}) and tool calls ({"tool_calls": [...]}, a call's first delta with its
index, id, type, function name and empty arguments, then its arguments). A non-streamed answer
is the same reader fed the whole text, so both give the same content and calls.

Readers (the `reader` of a request's plan, server/structured.py):
  named     tool_choice naming a function: the output (a grammar's JSON) is that call's arguments.
  required  tool_choice "required": the output is a JSON array [{"name", "parameters"}, ...].
  hermes    --tool-call-parser hermes (Hermes, Qwen): <tool_call>{"name": ..., "arguments": {...}}
            </tool_call> blocks anywhere in the text; the text outside them is content.
  llama3_json  --tool-call-parser llama3_json (Llama 3.x JSON tool calling): the whole output is
            {"name": ..., "parameters": {...}}, or several such objects separated by ";".
A block or output that does not parse as calls to the request's functions (or, for a function
with strict: true, whose arguments do not validate against its schema) stays content and is
counted as a parse failure.
"""
from __future__ import annotations

import json
import secrets
import string

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # --tool-call-parser
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class _Content:
    """Content pieces with whitespace held back until text follows: an answer whose text outside
    its calls is only whitespace has null content, streamed or not."""

    def __init__(self):
        self.held = ""
        self.any = False

    def add(self, text: str) -> list[dict]:
        if not text:
            return []
        if not text.strip():
            self.held += text
            return []
        out, self.held, self.any = self.held + text, "", True
        return [{"content": out}]

    def finish(self) -> list[dict]:
        out = [{"content": self.held}] if self.any and self.held else []
        self.held = ""
        return out


class ToolCallReader:
    def __init__(self, reader: str, functions: dict[str, dict | None] | None = None, function: str | None = None,
                 on_call=None, on_failure=None, max_calls: int | None = None):
        """reader: named / required / hermes / llama3_json. functions: name -> its parameters'
        JSON Schema where the function is strict (its calls' arguments are validated), None
        otherwise; a call to a name not in it stays content. on_call / on_failure: called once
        per call read / per block or output that did not parse. max_calls: hermes and
        llama3_json read at most this many calls (parallel_tool_calls false); blocks past it,
        or an llama3_json answer with more, stay content."""
        self.max_calls = max_calls
        if reader not in ("named", "required", "hermes", "llama3_json"):
            raise ValueError(f"unknown tool-call reader {reader!r}")
        self.reader, self.functions, self.function = reader, functions or {}, function
        self.on_call, self.on_failure = on_call or (lambda: None), on_failure or (lambda: None)
        self.buffer = ""
        self.calls = 0
        self.content = _Content()
        self.in_call = False  # hermes: inside a <tool_call> block
        self.decided = None  # llama3_json: "json" (held to the end) or "text" (streamed)
        self.array_open = self.array_closed = False  # required
        self.arguments = ""  # named: the arguments so far

    # ------------------------------------------------------------------ deltas
    def _call(self, name: str, arguments: str | None) -> list[dict]:
        index = self.calls
        self.calls += 1
        self.on_call()
        head = {"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
        if not arguments:
            return [head]
        return [head, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]

    def feed(self, text: str) -> list[dict]:
        """Deltas for the next piece of the answer."""
        if not text:
            return []
        return getattr(self, "_feed_" + self.reader)(text)

    def finish(self) -> list[dict]:
        """Deltas for what is still held at the end of the answer."""
        return getattr(self, "_finish_" + self.reader)() + self.content.finish()

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer: (content or None, tool calls in the response's shape)."""
        return assemble(self.feed(text) + self.finish())

    # ------------------------------------------------------------------ named
    def _feed_named(self, text: str) -> list[dict]:
        out = self._call(self.function, None) if not self.calls else []
        self.arguments += text
        return out + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def _finish_named(self) -> list[dict]:
        out = self._call(self.function, None) if not self.calls else []
        if not _json_object(self.arguments):  # cut short (max_tokens): the arguments are sent as written
            self.on_failure()
        return out

    # ------------------------------------------------------------------ required
    def _feed_required(self, text: str) -> list[dict]:
        self.buffer += text
        out = []
        decoder = json.JSONDecoder()
        while not self.array_closed:
            rest = self.buffer.lstrip()
            if not rest:
                break
            if not self.array_open:
                if rest[0] != "[":
                    break
                self.array_open, self.buffer = True, rest[1:]
                continue
            if rest[0] in ",":
                self.buffer = rest[1:]
                continue
            if rest[0] == "]":
                self.array_closed, self.buffer = True, rest[1:]
                break
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:  # the element is not complete yet
                self.buffer = rest
                break
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                    and isinstance(obj.get("parameters"), dict)):
                self.buffer = rest
                break
            self.buffer = rest[end:]
            out += self._call(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))
        return out

    def _finish_required(self) -> list[dict]:
        rest, self.buffer = self.buffer, ""
        if rest.strip() or not self.array_closed:
            self.on_failure()
        return self.content.add(rest.strip()) if rest.strip() else []

    # ------------------------------------------------------------------ hermes
    def _feed_hermes(self, text: str) -> list[dict]:
        self.buffer += text
        out = []
        while True:
            if not self.in_call:
                at = self.buffer.find(HERMES_OPEN)
                if at < 0:
                    keep = _partial_tail(self.buffer, HERMES_OPEN)
                    out += self.content.add(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out += self.content.add(self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at + len(HERMES_OPEN):], True
            at = self.buffer.find(HERMES_CLOSE)
            if at < 0:
                return out
            body = self.buffer[:at]
            self.buffer, self.in_call = self.buffer[at + len(HERMES_CLOSE):], False
            out += self._hermes_block(body, HERMES_OPEN + body + HERMES_CLOSE)

    def _hermes_block(self, body: str, whole: str) -> list[dict]:
        call = self._valid(_decode(body), "arguments")
        if call is not None and self.max_calls is not None and self.calls >= self.max_calls:
            return self.content.add(whole)
        if call is None:
            self.on_failure()
            return self.content.add(whole)
        return self._call(*call)

    def _finish_hermes(self) -> list[dict]:
        rest, self.buffer = self.buffer, ""
        if self.in_call:  # a block the answer did not close (cut short, or a stop string)
            self.in_call = False
            return self._hermes_block(rest, HERMES_OPEN + rest)
        return self.content.add(rest)

    def _valid(self, obj, key: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a call object to one of the request's functions, or None."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(key, obj.get("arguments" if key == "parameters" else "parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _json_object(args)
        if not isinstance(args, dict) or obj["name"] not in self.functions:
            return None
        schema = self.functions[obj["name"]]
        if schema is not None:
            import jsonschema
            try:
                jsonschema.validate(args, schema)
            except Exception:  # noqa: BLE001 - invalid arguments, or a schema the validator cannot use
                return None
        return obj["name"], json.dumps(args, ensure_ascii=False)

    # ------------------------------------------------------------------ llama3_json
    def _feed_llama3_json(self, text: str) -> list[dict]:
        if self.decided == "text":
            return self.content.add(text)
        self.buffer += text
        head = self.buffer.lstrip()
        if not head:
            return []
        if head.startswith("{"):
            self.decided = "json"
            return []
        self.decided = "text"
        rest, self.buffer = self.buffer, ""
        return self.content.add(rest)

    def _finish_llama3_json(self) -> list[dict]:
        rest, self.buffer = self.buffer, ""
        if self.decided != "json":
            return self.content.add(rest)
        calls = []
        decoder, text, i = json.JSONDecoder(), rest.strip(), 0
        while i < len(text):
            try:
                obj, end = decoder.raw_decode(text, i)
            except ValueError:
                calls = None
                break
            call = self._valid(obj, "parameters")
            if call is None:
                calls = None
                break
            calls.append(call)
            i = end
            while i < len(text) and text[i].isspace():
                i += 1
            if i < len(text):
                if text[i] != ";":
                    calls = None
                    break
                i += 1
                while i < len(text) and text[i].isspace():
                    i += 1
        if calls and self.max_calls is not None and len(calls) > self.max_calls:
            return self.content.add(rest)
        if not calls:
            self.on_failure()
            return self.content.add(rest)
        return [d for call in calls for d in self._call(*call)]


def _decode(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_object(text: str):
    value = _decode(text)
    return value if isinstance(value, dict) else None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may be
    arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def assemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """Deltas back into (content or None, tool calls as a response's message carries them)."""
    content, calls = [], {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    text = "".join(content)
    return (text if text else None), [calls[i] for i in sorted(calls)]


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" for an answer that ended by itself with calls."""
    return "tool_calls" if calls and reason == "stop" else reason
