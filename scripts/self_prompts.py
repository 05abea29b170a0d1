"""Training data for a draft head written by the target itself: prompts and answers.

When a dataset's prompts run out (or a model has none that fit), the target can write them: the
user turn is opened in the chat template, started with one of a few generic openers ("Write",
"Explain", "How", ...) and sampled to its end of turn; the prompts kept (finished within
--prompt-max-tokens, --min-chars..--max-chars long, mostly ASCII, no repeats) are then answered
greedily by the same engine through `train-draft --regenerate`'s own code and written with the
answer's token ids, so `train-draft --data OUT.jsonl` trains on them without regenerating. Usage:

    python scripts/self_prompts.py --count 2000 --out self.jsonl
    eagle-serve train-draft --data self.jsonl --max-conversations 2000 --init HEAD ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle_serve.engine.config import DTYPES  # noqa: E402
from scripts.sharegpt_instructions import check_args, keep  # noqa: E402  (the same length and ASCII filter)

OPENERS = ("Write", "Explain", "How", "What", "Describe", "Imagine", "Can you", "Give me", "Why", "Compose",
           "List", "Solve", "Create", "Suggest", "Compare", "Summarize", "Help me", "Is it", "Which", "Tell me")


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where a single user turn's content starts."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], False)
    if text.count(marker) != 1:
        raise ValueError("the chat template does not render a user turn's content verbatim")
    return text.split(marker)[0]


def write_prompts(llm, count: int, openers=OPENERS, max_tokens: int = 96, temperature: float = 1.0,
                  top_p: float = 0.95, seed: int = 0, min_chars: int = 20, max_chars: int = 400,
                  ascii_share: float = 0.98, batch: int = 256, max_tries: int | None = None, log=print) -> list[str]:
    """Up to `count` distinct prompts the target wrote; sample i uses seed + i and opener i mod len."""
    from eagle_serve.engine.sampling_params import SamplingParams
    tok = llm.tokenizer
    prefix = user_prefix(tok)
    out, seen, tried = [], set(), 0
    max_tries = max_tries if max_tries is not None else 20 * count
    while len(out) < count and tried < max_tries:
        n = min(batch, max_tries - tried, max(16, 2 * (count - len(out))))
        starts = [openers[(tried + j) % len(openers)] for j in range(n)]
        ids = [tok.encode(prefix + s, add_special_tokens=False) for s in starts]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + tried + j)
                  for j in range(n)]
        for s, o in zip(starts, llm.generate(ids, params)):
            text = (s + o.text).strip()
            if o.finish_reason == "stop" and keep(text, min_chars, max_chars, ascii_share) and text not in seen:
                seen.add(text)
                out.append(text)
        tried += n
        log(f"prompts: {min(len(out), count)}/{count} kept of {tried} sampled")
    return out[:count]


def answer(llm, prompts: list[str], max_tokens: int = 256, log=print) -> list[dict]:
    """Greedy answers as training conversations (the assistant turn keeps the target's ids):
    `engine.train.regenerate.regenerate` on one-turn conversations; empty answers are left out."""
    from eagle_serve.engine.train.config import TrainConfig
    from eagle_serve.engine.train.regenerate import regenerate
    with tempfile.TemporaryDirectory() as work:  # regenerate's resumable file, not kept
        cfg = TrainConfig(model=None, out=work, regen_max_tokens=max_tokens)
        convs = regenerate(cfg, [[{"role": "user", "content": p}] for p in prompts], log, open_llm=lambda: llm)
    return [{"messages": c} for c in convs if len(c) == 2 and c[1].get("token_ids")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target (default: the embedded default model)")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--openers", default=",".join(OPENERS), help="comma-separated starts of the user turn")
    p.add_argument("--prompt-max-tokens", type=int, default=96)
    p.add_argument("--answer-max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="sample i uses seed + i (a later file: a seed past the last one's)")
    p.add_argument("--min-chars", type=int, default=20)
    p.add_argument("--max-chars", type=int, default=400)
    p.add_argument("--ascii-share", type=float, default=0.98)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    check_args(p, a, (a.prompt_max_tokens < 1, "--prompt-max-tokens must be >= 1"),
               (a.answer_max_tokens < 1, "--answer-max-tokens must be >= 1"),
               (not 0 <= a.temperature < float("inf"), "--temperature must be a finite number >= 0"),
               (not 0 < a.top_p <= 1, "--top-p must be in (0, 1]"))  # before the model loads
    openers = tuple(s.strip() for s in a.openers.split(",") if s.strip())
    if not openers:
        p.error("--openers is empty")
    from eagle_serve.server.llm import LLM
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=64, kv_cache_tokens=64 * (512 + a.answer_max_tokens + 32))
    t0 = time.time()
    prompts = write_prompts(llm, a.count, openers, a.prompt_max_tokens, a.temperature, a.top_p, a.seed,
                            a.min_chars, a.max_chars, a.ascii_share)
    t1 = time.time()
    rows = answer(llm, prompts, a.answer_max_tokens)
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    lengths = [len(r["messages"][1]["token_ids"]) for r in rows]
    print(f"{len(rows)} conversations ({sum(lengths)} answer tokens, {sum(n >= a.answer_max_tokens for n in lengths)} "
          f"answers at --answer-max-tokens) -> {a.out}; prompts {t1 - t0:.0f} s, answers {time.time() - t1:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
