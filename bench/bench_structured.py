#!/usr/bin/env python
"""What grammar masks cost, and what they do to speculation: the embedded default model, single
stream, greedy, on JSON-extraction prompts (a JSON Schema) and tool-call prompts (a function's
parameter schema, as a named tool_choice constrains them).

Four systems, one run, the order rotated per prompt (drift of the machine's speed hits each alike):
  plain        spec none, free text
  plain+json   spec none, the prompt's schema
  spec         EAGLE-2 with the default head and the load-aware tree budget, free text
  spec+json    the same, the prompt's schema

Per system: new tokens, tok/s, tokens per target forward. Ratios (medians of per-prompt paired
ratios): decode time a token (after the first) of plain+json over plain (what the masks cost a
token: the two texts differ in length, a decode step's cost at these contexts does not; whole-
request times would charge the shorter JSON answers more prefill a token), speculative speed-up
without and with the grammar (whole requests, the same prompt on both sides), and the engine's own seconds in grammar work per token (matcher sync, draft candidate
checks, tree masks, applying them), timed around those calls. Greedy outputs of spec+json
equal plain+json's (checked per prompt), and every finished JSON output validates.

    .venv/bin/python bench/bench_structured.py                 # 8 + 8 prompts, 96 new tokens
    .venv/bin/python bench/bench_structured.py --prompts 2 --max-new 32

Writes --out (default bench/results/structured_output.json) and a chart next to it (.png).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from eagle_serve.engine import sampler, structured  # noqa: E402
from eagle_serve.engine.default_model import default_draft_path  # noqa: E402
from eagle_serve.engine.model_runner import ModelRunner  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "occupation"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "occupation": {"type": "string"}}}
EXTRACTION = [
    "Maria Lopez is a 34-year-old engineer who lives in Madrid.",
    "At 61, retired teacher John Smith still lives in Leeds.",
    "Aiko Tanaka, 27, works as a nurse in Osaka.",
    "The chef Pierre Martin (45) runs a bistro in Lyon.",
    "Lena Fischer is a 52-year-old architect based in Hamburg.",
    "Carlos Silva, a 39-year-old pilot, is from Lisbon.",
    "Priya Sharma, 30, is a software developer in Bangalore.",
    "Tom Baker, aged 71, is a retired actor living in Brighton.",
]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer"}}}
TOOL_REQUESTS = [
    "What's the weather in Paris today, in celsius?", "Will it rain in Seattle over the next 3 days?",
    "How hot is it in Phoenix in fahrenheit?", "Give me the 5-day forecast for Tokyo.",
    "Is it cold in Oslo right now?", "Temperature in Cairo please, celsius.",
    "What will the weather be like in Sydney for 2 days?", "Weather for Chicago in fahrenheit.",
]
TOOL_SYSTEM = ("You can call the function get_weather(city: string, unit: 'celsius' | 'fahrenheit', days: integer). "
               "Answer with the function's arguments as a JSON object.")


def prompts(tokenizer, n: int) -> list[dict]:
    out = []
    for i in range(n):
        text = EXTRACTION[i % len(EXTRACTION)]
        out.append({"kind": "extraction", "schema": PERSON, "ids": tokenizer.encode_chat([
            {"role": "user", "content": f"Extract the person's name, age, city and occupation as JSON.\n\n{text}"}])})
        out.append({"kind": "tool", "schema": WEATHER, "ids": tokenizer.encode_chat([
            {"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": TOOL_REQUESTS[i % len(TOOL_REQUESTS)]}])})
    return out


class GrammarClock:
    """Seconds spent in the engine's grammar work (wrapping the calls that do it)."""

    def __init__(self):
        self.seconds = 0.0
        for owner, name in ((ModelRunner, "_grammar_states"), (ModelRunner, "_masks"),
                            (sampler.GrammarMasks, "apply"), (structured.GrammarState, "valid_candidates")):
            self._wrap(owner, name)

    def _wrap(self, owner, name):
        fn = getattr(owner, name)
        clock = self

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock.seconds += time.perf_counter() - t0
        setattr(owner, name, timed)


def run(llm: LLM, p: dict, grammar: bool, max_new: int, clock: GrammarClock) -> dict:
    spec = StructuredOutputs(json=json.dumps(p["schema"])) if grammar else None
    params = SamplingParams(max_tokens=max_new, temperature=0, structured=spec)
    steps0, g0 = llm.loop.num_steps, clock.seconds
    t0 = time.perf_counter()
    out = llm.generate(p["ids"], params)[0]
    seconds = time.perf_counter() - t0
    decode = (out.finish_time - out.first_token_time) if out.finish_time and out.first_token_time else None
    return {"tokens": len(out.token_ids), "seconds": seconds, "decode_seconds": decode, "steps": llm.loop.num_steps - steps0,
            "grammar_seconds": clock.seconds - g0, "ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason,
            "spec": {"verify_steps": out.spec.verify_steps, "accepted": out.spec.accepted_tokens}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="of each kind (extraction, tool call)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft", default=None, help="EAGLE head directory (default: the shipped head)")
    ap.add_argument("--gap", type=float, default=0.1, help="pause (s) before each request")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "structured_output.json"))
    args = ap.parse_args(argv)
    clock = GrammarClock()
    draft = args.draft or default_draft_path()
    systems = {"plain": LLM(spec="none", dtype=args.dtype), "spec": LLM(draft=draft, dtype=args.dtype)}
    ps = prompts(systems["plain"].tokenizer, args.prompts)
    names = ["plain", "plain+json", "spec", "spec+json"]
    for name in names:  # warm-up: kernels, grammar compiler, tree budget profile
        run(systems[name.split("+")[0]], ps[0], name.endswith("+json"), 16, clock)
    rows = []
    for i, p in enumerate(ps):
        order = names[i % 4:] + names[:i % 4]
        row = {"kind": p["kind"], "schema": p["schema"]}
        for name in order:
            time.sleep(args.gap)
            row[name] = run(systems[name.split("+")[0]], p, name.endswith("+json"), args.max_new, clock)
        rows.append(row)
        print(f"prompt {i:2d} {p['kind']:10s} " + "  ".join(
            f"{n} {row[n]['tokens'] / row[n]['seconds']:6.1f} tok/s" for n in names), flush=True)
    summary = summarize(rows, names)
    summary["jump_forward"] = forced_positions(systems["plain"], rows)
    import platform

    import torch
    sys.path.insert(0, HERE)
    from bench_decode import cpu_model
    env = {"cpu_model": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), "command": " ".join(["python"] + sys.argv)}
    result = {"benchmark": "structured_output", "env": env, "model": "embedded default (SmolLM2-135M-Instruct)",
              "draft": os.path.basename(os.path.normpath(draft)), "dtype": args.dtype, "max_new": args.max_new,
              "prompts_per_kind": args.prompts, "threads": os.cpu_count(), "summary": summary,
              "rows": [{k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v)
                        for k, v in r.items()} for r in rows]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    plot(summary, os.path.splitext(args.out)[0] + ".png")


def forced_positions(llm: LLM, rows: list[dict]) -> dict:
    """Of the tokens plain+json emitted, how many were the only token its grammar allowed there
    (what token-level jump-forward would emit without a forward), and the text the grammar alone
    decided at each position (xgrammar's jump-forward string: emitting it skips forwards but
    tokenizes it the grammar's way, not necessarily the model's)."""
    grammars, vocab = llm.runner.grammars, llm.runner.loaded.config.vocab_size
    forced = total = jump_positions = jump_chars = 0
    for r in rows:
        out = r["plain+json"]
        state = grammars.state(StructuredOutputs(json=json.dumps(r["schema"])))
        mask = structured.allocate(1, vocab)
        for t in out["ids"]:
            state._fill(mask, 0)
            bits = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in mask[0].tolist()))
            forced += bits == 1
            total += 1
            jump = state.matcher.find_jump_forward_string()  # text the grammar alone decides from here
            jump_positions += bool(jump)
            jump_chars += len(jump)
            state.accept([t])
    return {"forced_tokens": forced, "tokens": total, "forced_fraction": round(forced / max(total, 1), 4),
            "positions_with_forced_text": jump_positions, "forced_chars": jump_chars,
            "output_chars": sum(len(r["plain+json"]["text"]) for r in rows)}


def summarize(rows: list[dict], names: list[str]) -> dict:
    def per_token(r):
        return r["seconds"] / max(r["tokens"], 1)

    def paired(a, b, subset=rows):
        return statistics.median(per_token(r[a]) / per_token(r[b]) for r in subset)
    out = {}
    for n in names:
        toks = sum(r[n]["tokens"] for r in rows)
        out[n] = {"tokens": toks, "tok_s": round(toks / sum(r[n]["seconds"] for r in rows), 2),
                  "tokens_per_forward": round(toks / max(sum(r[n]["steps"] for r in rows), 1), 3),
                  "grammar_ms_per_token": round(1e3 * sum(r[n]["grammar_seconds"] for r in rows) / max(toks, 1), 4)}
    def decode_per_token(r):  # after the first token: the prompt's prefill is not a token's cost
        return r["decode_seconds"] / max(r["tokens"] - 1, 1)
    # > 1: what the masks add to a decoded token (the texts differ in length, a decode step's cost
    # at these contexts does not)
    out["mask_cost_per_token"] = round(statistics.median(
        decode_per_token(r["plain+json"]) / decode_per_token(r["plain"]) for r in rows), 4)
    out["speedup_free"] = round(paired("plain", "spec"), 3)
    out["speedup_json"] = round(paired("plain+json", "spec+json"), 3)
    for kind in ("extraction", "tool"):
        sub = [r for r in rows if r["kind"] == kind]
        out[f"speedup_json_{kind}"] = round(paired("plain+json", "spec+json", sub), 3)
        out[f"speedup_free_{kind}"] = round(paired("plain", "spec", sub), 3)
    out["grammar_share_of_plain_json"] = round(
        sum(r["plain+json"]["grammar_seconds"] for r in rows) / sum(r["plain+json"]["seconds"] for r in rows), 4)
    out["greedy_equal_json"] = sum(r["spec+json"]["ids"] == r["plain+json"]["ids"] for r in rows)
    out["greedy_equal_free"] = sum(r["spec"]["ids"] == r["plain"]["ids"] for r in rows)
    out["prompts"] = len(rows)
    valid = 0
    finished = [r["plain+json"] for r in rows if r["plain+json"]["finish_reason"] == "stop"]
    import jsonschema
    for r, p in ((r["plain+json"], r) for r in rows if r["plain+json"]["finish_reason"] == "stop"):
        try:
            jsonschema.validate(json.loads(r["text"]), PERSON if p["kind"] == "extraction" else WEATHER)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    out["json_finished"], out["json_valid"] = len(finished), valid
    return out


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["plain", "plain+json", "spec", "spec+json"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, [summary[n]["tok_s"] for n in names], color=["#888", "#bbb", "#2a6", "#7c9"])
    for i, n in enumerate(names):
        ax.text(i, summary[n]["tok_s"], f"{summary[n]['tok_s']:.0f}\n{summary[n]['tokens_per_forward']:.2f}/fwd",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tok/s (single stream, greedy)")
    ax.set_title("Grammar masks and speculation, default model", fontsize=9)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
