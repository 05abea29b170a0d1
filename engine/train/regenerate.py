"""Regeneration: the target answers the data's user turns itself, so the head learns the
target's own distribution rather than another model's answers.

The engine comes from the caller (`open_llm`, a zero-argument callable returning an engine with
`tokenizer`, `max_model_len`, `generate(prompts, params)` and `runner.loaded.eos_token_ids`, as
the server's `LLM` has): the training package never builds a server-side object itself.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.train.config import TrainConfig, source_key

OpenLLM = Callable[[], Any]


def regenerate(cfg: TrainConfig, convs: list[list[dict]], log, open_llm: OpenLLM) -> list[list[dict]]:
    """Replace every assistant turn with the target's own greedy answer (batched through the
    engine), turn by turn so later turns see the regenerated history. Done conversations are
    appended to OUT/regenerated.jsonl; a restart continues after the last one. `open_llm` is
    called only when some conversation is left to answer."""
    path = os.path.join(cfg.out, "regenerated.jsonl")
    done = read_regenerated(cfg, path, log)
    if len(done) >= len(convs):
        return done[:len(convs)]
    llm = open_llm()
    tok = llm.tokenizer
    context = llm.max_model_len
    chunk = 512  # conversations per round of turns: large, so the batch stays full while answers finish
    t0, n_tokens = time.time(), 0
    with open(path, "a", encoding="utf-8") as f:
        for start in range(len(done), len(convs), chunk):
            batch = convs[start:start + chunk]
            new = [[m for m in c[:1] if m["role"] == "system"] for c in batch]
            turns = min(cfg.regen_max_turns, max(sum(m["role"] == "user" for m in c) for c in batch))
            user_turns = [[m for m in c if m["role"] == "user"] for c in batch]
            stopped = [False] * len(batch)
            for t in range(turns):
                todo, prompts = [], []
                for i, c in enumerate(new):
                    if t < len(user_turns[i]) and not stopped[i]:
                        hist = c + [user_turns[i][t]]
                        ids = tok.encode_chat(hist)
                        # an answer never runs past the target's context
                        if len(ids) <= cfg.regen_max_prompt and len(ids) < context:
                            todo.append(i)
                            prompts.append(ids)
                            new[i] = hist
                        else:  # a later turn would be answered without this one in its history
                            stopped[i] = True
                if not todo:
                    break
                params = [SamplingParams(max_tokens=min(cfg.regen_max_tokens, context - len(p)), temperature=0.0)
                          for p in prompts]
                outs = llm.generate(prompts, params)
                for i, o in zip(todo, outs):
                    ids = list(o.token_ids)
                    if ids and ids[-1] in llm.runner.loaded.eos_token_ids:
                        ids.pop()  # the template writes the end of turn
                    # the ids themselves: re-encoding the text need not give back what the target said
                    new[i] = new[i] + [{"role": "assistant", "content": o.text, "token_ids": ids}]
                    n_tokens += len(o.token_ids)
            for c in new:
                c = drop_unanswered(c)
                f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
                done.append(c)
            f.flush()
            rate = n_tokens / max(time.time() - t0, 1e-9)
            log(f"regenerate: {len(done)}/{len(convs)} conversations, {n_tokens} new tokens, {rate:.0f} tok/s")
    del llm
    return done


def read_regenerated(cfg: TrainConfig, path: str, log) -> list[list[dict]]:
    """The conversations `path` already holds, when it was written with cfg's settings (else it
    is moved to `path`.old and nothing is reused)."""
    # what the file's answers depend on: another source, model or answer length starts it over
    # (not the count: the file holds a prefix of the conversations, and a larger count extends it)
    key_path = path + ".key"
    key = repr((source_key(cfg.model or "default"), source_key(cfg.data), cfg.dtype, cfg.regen_max_tokens,
                cfg.regen_max_prompt, cfg.regen_max_turns))
    if os.path.exists(path):
        old_key = None
        if os.path.exists(key_path):
            with open(key_path, encoding="utf-8") as f:
                old_key = f.read()
        if old_key is not None and old_key != key:
            log(f"{path} was regenerated with other settings: regenerating")
            os.replace(path, path + ".old")
        elif old_key is None:
            log(f"{path} has no record of its settings ({key_path}): reusing it; delete it to regenerate")
    if not os.path.exists(key_path) or not os.path.exists(path):
        with open(key_path, "w", encoding="utf-8") as f:
            f.write(key)
    done = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            raw = f.read()
        whole = raw[:raw.rfind(b"\n") + 1]  # a run stopped mid-write (Ctrl-C exits at once) leaves a partial last line
        if len(whole) < len(raw):
            log(f"{path}: dropping a partly written last line ({len(raw) - len(whole)} bytes)")
            with open(path, "wb") as f:
                f.write(whole)
        done = [json.loads(line)["messages"] for line in whole.decode("utf-8").splitlines() if line.strip()]
    return done


def drop_unanswered(conv: list[dict]) -> list[dict]:
    while conv and conv[-1]["role"] != "assistant":
        conv = conv[:-1]
    return conv
