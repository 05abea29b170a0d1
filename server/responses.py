"""Engine outputs as OpenAI objects: chat and completion responses, their usage and logprobs.
The streams (`server.streaming`) build their chunks from the same pieces."""
from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from eagle_serve.server.tool_parsers import ToolCallReader, finish_reason

if TYPE_CHECKING:
    from eagle_serve.server.app import ServerState
    from eagle_serve.server.requests import Handle


def usage(state: ServerState, handle: Handle, outs) -> dict:
    prompt = handle.prompt_tokens
    completion = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec.verify_steps for o in outs)
    accepted = sum(o.spec.accepted_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "spec": {"method": state.spec_method, "verify_steps": steps,
                     "draft_tokens": sum(o.spec.draft_tokens for o in outs), "accepted_tokens": accepted,
                     "acceptance_length": round((accepted + steps) / steps, 4) if steps else None}}


# ---------------------------------------------------------------------------- chat

def _token_str(state: ServerState, token_id: int) -> str:
    return state.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace") if state.tokenizer else str(token_id)


def chat_logprobs(state: ServerState, token_ids, logprobs) -> dict:
    content = []
    for t, lp in zip(token_ids, logprobs):
        b = state.tokenizer.token_bytes(t) if state.tokenizer else b""
        content.append({"token": _token_str(state, t), "logprob": lp.logprob, "bytes": list(b),
                        "top_logprobs": [{"token": _token_str(state, i), "logprob": v,
                                          "bytes": list(state.tokenizer.token_bytes(i)) if state.tokenizer else []}
                                         for i, v in lp.top]})
    return {"content": content}


def tool_reader(state: ServerState, handle: Handle) -> ToolCallReader | None:
    """A choice's tool-call reader, for a request whose answer is read as tool calls."""
    p = handle.plan
    if p is None or p.reader is None:
        return None
    m = state.metrics
    return ToolCallReader(p.reader, p.functions, p.function, on_call=m.tool_calls.labels(p.reader).inc,
                          on_failure=m.tool_call_failures.labels(p.reader).inc, max_calls=p.max_calls)


def chat_response(state: ServerState, handle: Handle, outs) -> dict:
    choices = []
    for i, o in enumerate(outs):
        message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
        reader = tool_reader(state, handle)
        if reader is not None:
            message["content"], calls = reader.read(o.text)
            if calls:
                message["tool_calls"] = calls
            finish = finish_reason(finish, len(calls))
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(state, o.token_ids, o.logprobs) if o.logprobs is not None else None,
                        "finish_reason": finish})
    return {"id": f"chatcmpl-{handle.id}", "object": "chat.completion", "created": handle.created,
            "model": state.model_name, "choices": choices, "usage": usage(state, handle, outs)}


# ---------------------------------------------------------------------------- completions

def _token_key(state: ServerState, token_id: int) -> str:
    """A completions top_logprobs key: the token's text, or "bytes:\\xNN..." where its bytes are
    not whole UTF-8 (part of a character)."""
    if not state.tokenizer:
        return str(token_id)
    b = state.tokenizer.token_bytes(token_id)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class TextOffsets:
    """A choice's text_offset so far: characters of its output's bytes decoded, so a character
    split over tokens counts once, when complete, and a stream's offsets do not depend on how
    much text it has sent (a possible stop string is held back)."""

    def __init__(self, start: int = 0):
        self.chars = start
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes (then past it)."""
        at = self.chars
        self.chars += len(self.decoder.decode(token_bytes))
        return at


def completion_logprobs(state: ServerState, token_ids, logprobs, offsets: TextOffsets) -> dict:
    """The completions API's logprobs of `token_ids`; `offsets` carries the choice's text_offset
    from one call to the next (a stream's chunks)."""
    tokens, token_lps, tops, text_offset = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = _token_key(state, t)
        tokens.append(s)
        token_lps.append(lp.logprob)
        # keyed as OpenAI keys them, the sampled token always among them (OpenAI: "up to
        # logprobs + 1 elements"; vLLM adds it too); a token that is not whole UTF-8 on its own
        # is keyed by its bytes, or every such token would be one "\ufffd" key
        top = {_token_key(state, i): v for i, v in lp.top}
        top.setdefault(_token_key(state, t), lp.logprob)
        tops.append(top)
        text_offset.append(offsets.next(state.tokenizer.text_bytes(t) if state.tokenizer else s.encode()))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": text_offset}


def completion_response(state: ServerState, handle: Handle, outs) -> dict:
    choices = []
    for i, o in enumerate(outs):
        prefix = handle.echo[i] if handle.echo else ""
        choices.append({"index": i, "text": prefix + o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(state, o.token_ids, o.logprobs, TextOffsets(len(prefix)))
                        if o.logprobs is not None else None})
    return {"id": f"cmpl-{handle.id}", "object": "text_completion", "created": handle.created,
            "model": state.model_name, "choices": choices, "usage": usage(state, handle, outs)}
