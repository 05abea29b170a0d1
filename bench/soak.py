#!/usr/bin/env python
"""Soak: a bounded mixed load against a live `eagle-serve serve` child process on 127.0.0.1,
sampling the server's RSS and KV cache use over time.

Load: --concurrency clients send requests back to back for --minutes. Each request is one of
  chat_stream      chat, streaming, include_usage                       (35%)
  completion       completions, not streaming                           (20%)
  chat_n2          chat, not streaming, n=2, seeded sampling            (10%)
  logprobs         completions, streaming, logprobs=3                   (10%)
  dropped_stream   chat, streaming, the client leaves after a few chunks (10%)
  bad_request      invalid JSON / unknown field / over the context       (15%)
with 16-96 new tokens. Every --sample-every seconds: the server's RSS (/proc/PID/status) and
its /metrics gauges (KV usage, running, waiting). After the load: wait until the server is idle
and read the final KV usage (0.0 = free blocks back to the start count).

Verdict (in the json): no 5xx, no failed request other than the intended ones, RSS slope after
--warmup-minutes < 1 MB/min (least squares), KV usage 0 after drain, /health 200.

    .venv/bin/python bench/soak.py                       # 10 minutes, default model + shipped head
    .venv/bin/python bench/soak.py --minutes 1 --concurrency 4
Writes --out (bench/results/soak.json) and a .png next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import httpx2 as httpx  # noqa: E402

from eagle_serve.server.metrics import parse_metrics  # noqa: E402

KINDS = (("chat_stream", 35), ("completion", 20), ("chat_n2", 10), ("logprobs", 10), ("dropped_stream", 10),
         ("bad_request", 15))
TOPICS = ["Explain how a hash map works.", "Write a haiku about the sea.", "What is speculative decoding?",
          "List three uses of Python decorators.", "Summarise the water cycle.", "Give a recipe for pancakes.",
          "Why is the sky blue?", "Describe a binary search in plain words."]


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


async def _one(client: httpx.AsyncClient, model: str, kind: str, rng: random.Random, max_context: int) -> str:
    """Run one request of `kind`; returns an outcome label ('ok', 'dropped', 'rejected_4xx', ...)."""
    max_tokens = rng.randint(16, 96)
    msg = [{"role": "user", "content": rng.choice(TOPICS)}]
    if kind == "bad_request":
        choice = rng.randrange(3)
        if choice == 0:
            r = await client.post("/v1/chat/completions", content=b'{"model": "' + model.encode() + b'", "messages": [',
                                  headers={"content-type": "application/json"})
        elif choice == 1:
            r = await client.post("/v1/chat/completions", json={"model": model, "messages": msg, "bogus_field": 1})
        else:
            r = await client.post("/v1/completions", json={"model": model, "prompt": [5] * (max_context + 1)})
        return "rejected_4xx" if 400 <= r.status_code < 500 else f"unexpected_{r.status_code}"
    if kind in ("chat_stream", "dropped_stream", "logprobs"):
        if kind == "logprobs":
            path, body = "/v1/completions", {"model": model, "prompt": rng.choice(TOPICS), "max_tokens": max_tokens,
                                              "logprobs": 3, "stream": True}
        else:
            path, body = "/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": max_tokens,
                                                   "stream": True, "stream_options": {"include_usage": True}}
        drop_after = rng.randint(1, 8) if kind == "dropped_stream" else None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"unexpected_{r.status_code}"
            n, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if '"error"' in line[:20]:
                    return "stream_error"
                if line.strip() == "data: [DONE]":
                    done = True
                    break
                n += 1
                if drop_after is not None and n >= drop_after:
                    return "dropped"
            return "ok" if done else "stream_cut"
    if kind == "completion":
        r = await client.post("/v1/completions", json={"model": model, "prompt": rng.choice(TOPICS),
                                                       "max_tokens": max_tokens, "temperature": 0})
    else:  # chat_n2
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": msg, "max_tokens": max_tokens,
                                                            "n": 2, "temperature": 0.8, "seed": rng.randrange(1000)})
    if r.status_code != 200:
        return f"unexpected_{r.status_code}"
    return "ok"


async def load(url: str, seconds: float, concurrency: int, seed: int, sample, sample_every: float) -> dict:
    """Run the mixed load for `seconds`; call sample() every sample_every seconds."""
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    model, max_context = models["id"], models["max_model_len"]
    counts: dict[str, dict[str, int]] = {}
    deadline = time.monotonic() + seconds
    names, weights = zip(*KINDS)

    async def client_task(i: int):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(names, weights)[0]
                try:
                    outcome = await _one(client, model, kind, rng, max_context)
                except httpx.HTTPError as e:
                    outcome = f"client_error_{type(e).__name__}"
                counts.setdefault(kind, {}).setdefault(outcome, 0)
                counts[kind][outcome] += 1

    async def sampler():
        while time.monotonic() < deadline:
            await asyncio.to_thread(sample)
            await asyncio.sleep(sample_every)

    await asyncio.gather(sampler(), *(client_task(i) for i in range(concurrency)))
    return counts


def soak(url: str, rss, minutes: float, concurrency: int = 8, seed: int = 0, sample_every: float = 2.0,
         warmup_minutes: float = 2.0, drain_timeout: float = 120.0) -> dict:
    """The load plus samples and a verdict. rss(): the server's resident bytes."""
    t0 = time.monotonic()
    samples = []

    def sample():
        m = metrics(url)
        samples.append({"t_s": round(time.monotonic() - t0, 2), "rss_mb": round(rss() / 2**20, 2),
                        "kv_usage": m["eagle_serve_kv_cache_usage_ratio"],
                        "running": m["eagle_serve_requests_running"], "waiting": m["eagle_serve_requests_waiting"]})

    counts = asyncio.run(load(url, minutes * 60, concurrency, seed, sample, sample_every))
    load_s = time.monotonic() - t0
    deadline = time.monotonic() + drain_timeout
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["eagle_serve_requests_running"] == 0 and m["eagle_serve_requests_waiting"] == 0 \
                and m["eagle_serve_kv_cache_usage_ratio"] == 0:
            break
        time.sleep(0.2)
    sample()
    final = metrics(url)
    health = httpx.get(url + "/health", timeout=10).status_code
    steady = [s for s in samples if s["t_s"] >= warmup_minutes * 60]
    slope = _slope([s["t_s"] / 60 for s in steady], [s["rss_mb"] for s in steady]) if len(steady) >= 3 else None
    intended = {"ok", "dropped", "rejected_4xx"}
    unexpected = {f"{k}:{o}": n for k, d in counts.items() for o, n in d.items() if o not in intended}
    requests = sum(n for d in counts.values() for n in d.values())
    by_reason = {r: final.get(f'eagle_serve_requests_total{{finish_reason="{r}"}}', 0)
                 for r in ("stop", "length", "abort", "error")}
    result = {
        "minutes": minutes, "concurrency": concurrency, "load_seconds": round(load_s, 1), "requests": requests,
        "counts": counts, "unexpected": unexpected, "finished_by_reason": by_reason,
        "generation_tokens": final.get("eagle_serve_generation_tokens_total"),
        "rss_start_mb": samples[0]["rss_mb"], "rss_end_mb": samples[-1]["rss_mb"],
        "rss_slope_mb_per_min_after_warmup": None if slope is None else round(slope, 3),
        "final_kv_usage": final["eagle_serve_kv_cache_usage_ratio"], "final_health": health, "samples": samples,
    }
    result["verdict"] = {
        "no_unexpected_outcomes": not unexpected,
        "no_engine_errors": by_reason["error"] == 0,
        "kv_blocks_all_free_after_drain": result["final_kv_usage"] == 0,
        "healthy_after": health == 200,
        "rss_slope_below_1_mb_per_min": None if slope is None else slope < 1.0,
    }
    return result


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(t, [x["rss_mb"] for x in s], marker=".")
    a.set_ylabel("server RSS (MB)")
    a.set_title(f"soak: {result['requests']} requests, concurrency {result['concurrency']}, "
                f"RSS slope {result['rss_slope_mb_per_min_after_warmup']} MB/min after warm-up")
    b.plot(t, [100 * x["kv_usage"] for x in s], marker=".", label="KV blocks in use (% of the cache)")
    b.plot(t, [x["running"] for x in s], alpha=0.5, label="sequences running")
    b.set_ylabel("% / count")
    b.set_xlabel("minutes")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    ap.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="flags for `eagle-serve serve` after --, e.g. -- --model DIR --spec none")
    args = ap.parse_args(argv)
    from eagle_serve.server.process import ServerProcess
    serve_args = [a for a in args.serve_args if a != "--"] or ["--log-level", "warning"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    server = ServerProcess(serve_args, args.out.replace(".json", ".server.log"))
    try:
        result = soak(server.url, server.rss_bytes, args.minutes, args.concurrency, args.seed, args.sample_every,
                      args.warmup_minutes)
    finally:
        rc = server.terminate()
    result["serve_args"] = serve_args
    result["server_exit_code_after_sigterm"] = rc
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out.replace(".json", ".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return 0 if all(v is not False for v in result["verdict"].values()) and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
