#!/usr/bin/env python
"""Why every model computation runs on one engine thread (scheduler/worker.py): single-stream
greedy decoding of the default model (bf16, no draft, 128 new tokens) with the model built and
stepped on the same thread, against built on one thread and stepped on another (what the async
engine did before: the model loaded on the main thread, steps in a worker thread), and after
a second thread has run torch work. Each setup runs in its own fresh process, setups
alternate, `--reps` repetitions.

  same      LLM built on the engine thread, generate() on it (as the server runs now)
  split     LLM built on the engine thread, the loop stepped from the main thread
  touched   as `same`, after the main thread has run a few matmuls (a second thread that
            has used torch, idle while the engine decodes)

    .venv/bin/python bench/bench_threads.py [--reps 3]
Writes --out (bench/results/threads.json): tok/s per setup and the ratios to `same`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETUPS = ("same", "split", "touched")


def child(setup: str) -> float:
    sys.path.insert(0, ROOT)
    import torch
    from engine.sampling_params import SamplingParams
    from server.llm import LLM
    llm = LLM(None, dtype="bfloat16", draft=None, kv_cache_tokens=8192)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Write a long story about a dragon and a knight."}])
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    if setup == "touched":
        a = torch.randn(256, 256)
        for _ in range(20):
            a = torch.tanh(a @ a)
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        if setup == "split":  # step the loop from this (main) thread
            llm.loop.add_request(prompt, sp)
            out = next(iter(llm.loop.run_to_completion().values()))
        else:
            out = llm.generate([prompt], sp)[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - t))
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "threads.json"))
    ap.add_argument("--child", choices=SETUPS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"tok_s": child(args.child)}))
        return
    rows = {s: [] for s in SETUPS}
    for rep in range(args.reps):
        for setup in (SETUPS if rep % 2 == 0 else SETUPS[::-1]):
            r = subprocess.run([sys.executable, __file__, "--child", setup], capture_output=True, text=True, check=True)
            tok_s = json.loads(r.stdout.strip().splitlines()[-1])["tok_s"]
            rows[setup].append(tok_s)
            print(f"rep {rep} {setup:8s} {tok_s:6.1f} tok/s", flush=True)
    med = {s: statistics.median(v) for s, v in rows.items()}
    summary = {s: {"tok_s_median": med[s], "tok_s": rows[s], "vs_same": med[s] / med["same"]} for s in SETUPS}
    for s in SETUPS:
        print(f"{s:8s} median {med[s]:6.1f} tok/s  x{med[s] / med['same']:.2f} of same")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"reps": args.reps, "model": "default", "dtype": "bfloat16", "max_tokens": 128},
                   "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
