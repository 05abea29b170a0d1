#!/usr/bin/env python
"""llama.cpp worker for bench_decode.py (started by it; not meant to be run by hand).

Runs in llama-cpp-python's own venv, so the benchmark can alternate prompts between systems:

    $LLAMACPP_PYTHON bench/_llamacpp_worker.py MODEL.gguf [--threads 2]

Protocol, one JSON object per line. The worker first writes
    {"ready": true, "version": ..., "system_info": ...}
then, for every request line {"ids": [...], "max_new": 128, "eos": [2], "text": "..."}, answers
    {"tokens": [...], "stopped_on_eos": bool, "seconds": s, "tokenize_match": bool | null}
`tokens` are the sampled ids without the final EOS. `seconds` is the wall time of the request:
prefill + greedy decode + detokenizing the output (as create_completion would do).
`tokenize_match` says whether llama.cpp's own tokenizer gives `ids` for `text` (special=True, no BOS).
An empty line or EOF ends the worker.
"""
import argparse
import json
import os
import sys
import time


def open_protocol_stream():
    """Keep the real stdout for JSON lines; send anything the C library prints to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def load(path: str, threads: int, n_ctx: int):
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                 verbose=False, seed=0)


def complete(llm, ids: list[int], max_new: int, eos: set[int]) -> dict:
    llm.reset()  # no KV prefix reuse from the previous request
    tokens, stopped = [], False
    t0 = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        if tok in eos:
            stopped = True
            break
        tokens.append(tok)
        if len(tokens) >= max_new:
            break
    llm.detokenize(tokens)
    return {"tokens": tokens, "stopped_on_eos": stopped, "seconds": time.perf_counter() - t0}


def tokenize_match(llm, text: str | None, ids: list[int]) -> bool | None:
    if text is None:
        return None
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    args = ap.parse_args()
    out = open_protocol_stream()
    import llama_cpp
    llm = load(args.gguf, args.threads, args.n_ctx)
    out.write(json.dumps({"ready": True, "version": llama_cpp.__version__,
                          "system_info": llama_cpp.llama_print_system_info().decode()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        res = complete(llm, req["ids"], req["max_new"], set(req["eos"]))
        res["tokenize_match"] = tokenize_match(llm, req.get("text"), req["ids"])
        out.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
