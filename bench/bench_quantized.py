#!/usr/bin/env python
"""Decode speed on GGUF-quantized weights: eagle-serve vs llama.cpp, 1 and 8 sequences.

    .venv/bin/python bench/bench_quantized.py --llamacpp-bin DIR            # everything
    .venv/bin/python bench/bench_quantized.py --systems llamacpp --shapes 1b --types q8_0,q4_0
    .venv/bin/python bench/bench_quantized.py --shapes tiny --types q8_0 --quick   # a check of the script

Files: random-weight Llama GGUFs at Llama-3.2-1B / 3B shapes (bench/make_random_gguf.py, made in
--gguf-dir when missing: q8_0 / q4_0 written directly, q4_k through llama-quantize --pure) and the
embedded default model requantized to Q8_0 (shape `default`, the only one with an EAGLE head).
Systems, run alternately (per repeat: llama.cpp then eagle-serve, A B A B) --repeats times:
  llamacpp  llama-bench -p 0 -n N -t T -r 1 -o json (1 sequence, decode from an empty context)
            and llama-batched-bench -npp 40 -ntg N -npl 1,8 -c 2048 -t T --output-format jsonl
            (random prompt tokens, then N decode steps of every sequence at once; S_TG t/s)
  ours      eagle-serve's offline LLM (server.llm.LLM) on the same file in a worker process of its
            own (this script with --worker), torch threads = T, prefix caching off; greedy,
            ignore_eos, N new tokens for each of B short chat prompts at once (B = 1, 8), plain
            decoding with the blocks kept (`ours`); for the default model also dequantized to bf16
            (`ours-dense`, --quantization none) and each of the two with its EAGLE head (eagle2).
            decode tok/s = B * (N - 1) / (t(N) - t(1)): the time of a call for N new tokens minus
            that of a call for 1 (prefill and the first token), as llama.cpp's TG figures leave
            prefill out; end-to-end tok/s = B * N / t(N) is kept too.
Recorded per file: weight bytes (sum of the tensors' stored bytes, gguf.GGUFReader), the worker's
resident memory after load (VmRSS) and its weights' bytes in memory, min / median tok/s per
system and batch, and the ratio of medians eagle-serve / llama.cpp. A run during which other
processes took > 10% of its wall time in CPU is flagged contended and measured again (--retries;
the replaced rows are kept as discarded_contended_rows); each measurement first waits (up to
--quiet-wait s) for the other processes to be idle: on 2 cores a busy neighbour stalls every
thread barrier of a 2-thread decode, for both systems. --append adds a partial run's files to an
existing --out.
Writes --out (default bench/results/quantized.json) and a bar chart next to it (.png, matplotlib).
`--memory-only` loads each file once more and records the worker's memory under the file's `memory`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DEFAULT_TYPES = {"default": ["q8_0"]}  # the default model is only benchmarked at Q8_0
CONTENDED = 0.1
TICK = os.sysconf("SC_CLK_TCK")
PROMPTS = [  # eight short chat turns; one per sequence (distinct, so nothing is shared)
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "What are three tips for learning a new language?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue during the day and red at sunset?",
    "Compare trains and planes for a 500 km trip.",
    "Summarize the rules of chess for a beginner.",
]


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="llamacpp,ours", help="llamacpp and / or ours")
    ap.add_argument("--shapes", default="1b,3b,default", help="1b, 3b, default, tiny")
    ap.add_argument("--types", default="q8_0,q4_0,q4_k",
                    help="GGUF types of the random shapes (the default model: q8_0 only)")
    ap.add_argument("--batches", default="1,8", help="sequences decoded at once")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=40,
                    help="llama-batched-bench -npp (about the length of the chat prompts eagle-serve gets)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-spec", action="store_true", help="skip the default model's EAGLE runs")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 32 new tokens (a check, not figures)")
    ap.add_argument("--llamacpp-bin", default=env("LLAMACPP_BIN"),
                    help="folder of llama-bench, llama-batched-bench, llama-quantize (default $LLAMACPP_BIN, else PATH)")
    ap.add_argument("--gguf-dir", default=os.path.join(HERE, "out"), help="where the GGUF files are (made when missing)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quantized.json"))
    ap.add_argument("--retries", type=int, default=2, help="re-runs of a contended measurement")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each measurement, wait up to this many seconds for the other processes to be idle")
    ap.add_argument("--append", action="store_true",
                    help="keep the files of an existing --out that this run does not measure (partial runs add up)")
    ap.add_argument("--memory-only", action="store_true",
                    help="load each file in an eagle-serve worker and record its memory (no timings) into the "
                         "files of an existing --out, under `memory`")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.types = [t for t in args.types.split(",") if t]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.quick:
        args.repeats, args.max_new = 1, min(args.max_new, 32)
    return args


# ---------------------------------------------------------------- CPU accounting

def machine_busy() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(v) - v[3] - v[4]) / TICK  # steal included: the hypervisor's share is not ours either


def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return 0.0


def own_cpu(pids: list[int]) -> float:
    """CPU s of this process, its finished children and the live `pids`."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime + sum(proc_cpu(p) for p in pids)


class Meter:
    """Wall time and the CPU that other processes took meanwhile."""

    def __init__(self, pids: list[int] | None = None):
        self.pids = pids or []

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy(), own_cpu(self.pids)
        self.load = os.getloadavg()[0]
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.other = max(0.0, (machine_busy() - self.busy0) - (own_cpu(self.pids) - self.own0))

    def info(self) -> dict:
        return {"wall_s": round(self.wall, 3), "other_cpu_s": round(self.other, 2),
                "loadavg_1m_before": round(self.load, 2), "contended": self.other > CONTENDED * self.wall}


def wait_quiet(max_wait: float, window: float = 2.0, limit: float = 0.1) -> float:
    """Wait (at most max_wait s) until other processes use < `limit` of one core over `window` s;
    returns the seconds waited. On 2 cores a busy neighbour stalls every thread barrier of a
    2-thread decode, so measurements start when the machine is idle."""
    t0 = time.perf_counter()
    while True:
        b0, o0 = machine_busy(), own_cpu([])
        time.sleep(window)
        other = (machine_busy() - b0) - (own_cpu([]) - o0)
        if other < limit * window or time.perf_counter() - t0 > max_wait:
            return time.perf_counter() - t0


def measured(args, fn, label: str, discarded: list) -> list[dict]:
    """fn() -> rows, re-run (up to --retries) while any row is contended; the replaced rows are
    kept in `discarded`."""
    for attempt in range(args.retries + 1):
        waited = wait_quiet(args.quiet_wait)
        rows = fn()
        for r in rows:
            r["waited_for_quiet_s"] = round(waited, 1)
            r["attempt"] = attempt
        if not any(r.get("contended") for r in rows) or attempt == args.retries:
            return rows
        print(f"{label}: contended, measuring again", flush=True)
        discarded += rows
    return rows


# ---------------------------------------------------------------- files

def file_path(args, shape: str, qtype: str) -> str:
    import make_random_gguf as mk
    path = mk.out_path(args.gguf_dir, shape, qtype)
    if not os.path.exists(path):
        argv = ["--shape", shape, "--type", qtype, "--out-dir", args.gguf_dir]
        if qtype in mk.VIA_QUANTIZE:
            argv += ["--llama-quantize", tool(args, "llama-quantize")]
        print(f"making {os.path.basename(path)}", flush=True)
        mk.main(argv)
    return path


def weight_bytes(path: str) -> dict:
    import gguf
    r = gguf.GGUFReader(path)
    by_type: dict[str, int] = {}
    for t in r.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {"weight_bytes": sum(by_type.values()), "weight_bytes_by_type": by_type,
            "file_bytes": os.path.getsize(path)}


def plan(args) -> list[dict]:
    out = []
    for shape in args.shapes:
        types = DEFAULT_TYPES.get(shape, args.types)
        for t in types:
            out.append({"shape": shape, "type": t, "name": f"{shape}-{t}"})
    return out


# ---------------------------------------------------------------- llama.cpp

def tool(args, name: str) -> str:
    path = os.path.join(args.llamacpp_bin, name) if args.llamacpp_bin else shutil.which(name)
    if not path or not os.path.exists(path):
        raise SystemExit(f"{name} not found: --llamacpp-bin DIR or $LLAMACPP_BIN")
    return path


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def run_tool(cmd: list[str]) -> tuple[str, dict]:
    with Meter() as m:
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({r.returncode}): {r.stderr[-1500:]}")
    return r.stdout + "\n" + r.stderr, m.info()


def llamacpp_run(args, path: str) -> list[dict]:
    """One llama-bench (1 sequence) and one llama-batched-bench (every batch) run -> rows."""
    rows = []
    if 1 in args.batches:
        cmd = [tool(args, "llama-bench"), "-m", path, "-p", "0", "-n", str(args.max_new), "-t", str(args.threads),
               "-r", "1", "-o", "json"]
        out, info = run_tool(cmd)
        start = out.find("[")
        data = json.loads(out[start:out.rindex("]") + 1])
        d = next(x for x in data if x.get("n_gen") == args.max_new)
        rows.append({"system": "llamacpp", "tool": "llama-bench", "batch": 1, "decode_tok_s": d["avg_ts"],
                     "n_gen": d["n_gen"], "n_prompt": d["n_prompt"], "flash_attn": d.get("flash_attn"),
                     "build": f"{d.get('build_commit')} ({d.get('build_number')})", "cpu_info": d.get("cpu_info"),
                     **info})
    n_kv = max(2048, max(args.batches) * (args.prompt_tokens + args.max_new))
    cmd = [tool(args, "llama-batched-bench"), "-m", path, "-c", str(n_kv), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt_tokens), "-ntg", str(args.max_new),
           "-npl", ",".join(str(b) for b in args.batches), "-t", str(args.threads), "-tb", str(args.threads),
           "--output-format", "jsonl"]
    out, info = run_tool(cmd)
    found = {d["pl"]: d for d in json_lines(out) if "speed_tg" in d}
    if not found:  # markdown table (older builds)
        for m in re.finditer(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6,
                             out, re.MULTILINE):
            pp, tg, pl = (int(m.group(i)) for i in (1, 2, 3))
            found[pl] = {"pp": pp, "tg": tg, "pl": pl, "t_tg": float(m.group(7)), "speed_tg": float(m.group(8)),
                         "speed_pp": float(m.group(6))}
    for b in args.batches:
        d = found.get(b)
        if d is None:
            raise RuntimeError(f"llama-batched-bench gave no row for {b} sequences:\n{out[-1500:]}")
        rows.append({"system": "llamacpp", "tool": "llama-batched-bench", "batch": b, "decode_tok_s": d["speed_tg"],
                     "prefill_tok_s": d.get("speed_pp"), "n_gen": d["tg"], "n_prompt": d["pp"],
                     "flash_attn": d.get("flash_attn"), **info})
    return rows


# ---------------------------------------------------------------- eagle-serve (worker process)

def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main() -> None:
    """stdin: one json config line, then requests; stdout: one json line each (others: stderr)."""
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    cfg = json.loads(sys.stdin.readline())
    import torch
    torch.set_num_threads(cfg["threads"])
    from eagle_serve.engine.sampling_params import SamplingParams
    from eagle_serve.server.llm import LLM
    t0 = time.perf_counter()
    kwargs = {"kv_cache_tokens": cfg["kv_cache_tokens"], "enable_prefix_caching": False,
              "quantization": cfg.get("quantization", "auto")}
    if cfg.get("draft"):
        kwargs["draft"] = cfg["draft"]
    rss_before = rss_bytes()  # torch and the engine imported, nothing loaded
    llm = LLM(cfg["gguf"], **kwargs)
    load_s = time.perf_counter() - t0
    tok = llm.tokenizer
    prompts = []
    for text in PROMPTS:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tok.encode(rendered, add_special_tokens=False) if not isinstance(rendered, list) else rendered)
    from eagle_serve.engine import quant
    from eagle_serve.engine.layers import Linear
    net = llm.runner.model
    params = [p for _, p in net.named_parameters() if p.is_contiguous()]  # (not quant.placeholder's views)
    dense = sum(p.numel() * p.element_size() for p in params)
    # what a decode step reads: every linear's weight once (a tied LM head reads the embedding's
    # blocks), the norms; the embedding table only at the looked-up rows
    streamed, seen = 0, set()
    for m in net.modules():
        w = m.gguf_weight if isinstance(m, Linear) and m.gguf_weight is not None else (
            m.weight if isinstance(m, Linear) else None)
        if w is not None and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            streamed += w.numel() * w.element_size()
    streamed += sum(p.numel() * p.element_size() for n, p in net.named_parameters() if "norm" in n)
    kv = llm.runner.kv
    kv_bytes = sum(t.numel() * t.element_size() for t in (kv.data if isinstance(kv.data, (list, tuple)) else [kv.data]))
    info = {"ready": True, "load_s": round(load_s, 2), "rss_before_load_bytes": rss_before,
            "rss_after_load_bytes": rss_bytes(), "quantization": kwargs["quantization"],
            "weights_in_memory_bytes": dense + quant.quantized_bytes(net),
            "quantized_block_bytes": quant.quantized_bytes(net), "bytes_streamed_per_step": streamed,
            "kv_cache_bytes": kv_bytes,
            "weight_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "prompt_tokens": [len(p) for p in prompts], "spec": llm.engine_config.spec.method,
            "pid": os.getpid()}

    def send(obj):
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    send(info)
    for line in sys.stdin:
        req = json.loads(line)
        ids = [prompts[i % len(prompts)] for i in range(req["batch"])]
        sp = SamplingParams(max_tokens=req["max_new"], temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(ids, sp)
        dt = time.perf_counter() - t
        send({"seconds": dt, "new_tokens": [len(o.token_ids) for o in outs]})


class Ours:
    """An eagle-serve worker process for one file (and head)."""

    def __init__(self, args, path: str, draft: str | None, quantization: str = "auto"):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        kv = max(4096, 2 * max(args.batches) * (64 + args.max_new + 64))
        self.proc.stdin.write(json.dumps({"gguf": path, "draft": draft, "threads": args.threads,
                                          "kv_cache_tokens": kv, "quantization": quantization}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("eagle-serve worker exited before it was ready (its log is above)")
        self.info = json.loads(line)
        self.info["kv_cache_tokens"] = kv

    def call(self, batch: int, max_new: int) -> tuple[dict, dict]:
        with Meter([self.proc.pid]) as m:
            self.proc.stdin.write(json.dumps({"batch": batch, "max_new": max_new}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("eagle-serve worker died")
        return json.loads(line), m.info()

    def run(self, args, name: str) -> list[dict]:
        rows = []
        for b in args.batches:
            first, _ = self.call(b, 1)
            full, info = self.call(b, args.max_new)
            n = sum(full["new_tokens"])
            dt = full["seconds"] - first["seconds"]
            rows.append({"system": name, "batch": b, "decode_tok_s": (n - b) / dt if dt > 0 else None,
                         "end_to_end_tok_s": n / full["seconds"], "seconds": round(full["seconds"], 3),
                         "seconds_first_token": round(first["seconds"], 3), "new_tokens": n, **info})
        return rows

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def warm(ours: Ours, args) -> None:
    for b in args.batches:
        ours.call(b, min(8, args.max_new))


# ---------------------------------------------------------------- run, summarize, save

def bench_file(args, item: dict) -> dict:
    path = file_path(args, item["shape"], item["type"])
    rec = {"file": os.path.basename(path), **item, **weight_bytes(path), "rows": [], "workers": {},
           "discarded_contended_rows": []}
    workers: dict[str, Ours] = {}
    try:
        if "ours" in args.systems:
            # ours: the blocks kept (quantization auto); ours-dense: dequantized to bf16 at load
            # (quantization none), for the default model, whose embedded copy runs that way
            variants = [("ours", None, "auto")]
            if item["shape"] == "default":
                variants.append(("ours-dense", None, "none"))
            if item["shape"] == "default" and not args.no_spec:
                from eagle_serve.engine.default_model import default_draft_path
                if default_draft_path():
                    variants.append(("ours-eagle", default_draft_path(), "auto"))
                    variants.append(("ours-dense-eagle", default_draft_path(), "none"))
            for name, draft, quantization in variants:
                print(f"{item['name']}: loading eagle-serve ({name})", flush=True)
                workers[name] = Ours(args, path, draft, quantization)
                warm(workers[name], args)
                rec["workers"][name] = {k: v for k, v in workers[name].info.items() if k not in ("ready", "pid")}
        for rep in range(args.repeats):
            if "llamacpp" in args.systems:
                for r in measured(args, lambda: llamacpp_run(args, path), f"{item['name']} llama.cpp",
                                  rec["discarded_contended_rows"]):
                    rec["rows"].append({"repeat": rep, **r})
                    print(f"{item['name']} rep {rep} llama.cpp ({r['tool']}) x{r['batch']}: "
                          f"{r['decode_tok_s']:.1f} tok/s{' CONTENDED' if r['contended'] else ''}", flush=True)
            for name, w in workers.items():
                for r in measured(args, lambda: w.run(args, name), f"{item['name']} {name}",
                                  rec["discarded_contended_rows"]):
                    rec["rows"].append({"repeat": rep, **r})
                    print(f"{item['name']} rep {rep} {name} x{r['batch']}: {fmt(r['decode_tok_s'])} tok/s "
                          f"(end-to-end {r['end_to_end_tok_s']:.1f}){' CONTENDED' if r['contended'] else ''}",
                          flush=True)
    finally:
        for w in workers.values():
            w.close()
    rec["summary"] = summarize(rec["rows"])
    return rec


def series_key(r: dict) -> str:
    tool = {"llama-bench": "llamacpp-bench", "llama-batched-bench": "llamacpp-batched"}.get(r.get("tool"), r["system"])
    return f"{tool} x{r['batch']}"


def summarize(rows: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(series_key(r), []).append(r)
    out = {}
    for key, rs in groups.items():
        v = [r["decode_tok_s"] for r in rs if r["decode_tok_s"] is not None]
        if not v:  # t(N) - t(1) not positive: a model too small to time this way
            out[key] = {"n": 0, "contended": sum(bool(r.get("contended")) for r in rs)}
            continue
        out[key] = {"n": len(v), "min_tok_s": round(min(v), 2), "median_tok_s": round(statistics.median(v), 2),
                    "max_tok_s": round(max(v), 2), "contended": sum(bool(r.get("contended")) for r in rs)}
        e2e = [r["end_to_end_tok_s"] for r in rs if "end_to_end_tok_s" in r]
        if e2e:
            out[key]["median_end_to_end_tok_s"] = round(statistics.median(e2e), 2)
    # eagle-serve / llama.cpp, medians; 1 sequence against llama-bench, B against batched-bench
    for key in list(out):
        name, b = key.rsplit(" x", 1)
        if name.startswith("ours"):
            for ref in (f"llamacpp-bench x{b}", f"llamacpp-batched x{b}"):
                if ref in out and out[ref].get("median_tok_s") and out[key].get("median_tok_s"):
                    out[key][f"ratio_to_{ref.replace(' ', '_')}"] = round(out[key]["median_tok_s"] / out[ref]["median_tok_s"], 3)
    return out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())


def environment(args) -> dict:
    from importlib.metadata import version
    env = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
           "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join(["bench/bench_quantized.py"] + ["DIR" if a.startswith("/") else a for a in sys.argv[1:]]),
           "gguf": version("gguf")}
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    env["git_head"] = head or None
    if "ours" in args.systems:  # bench_decode imports torch and the engine; the llama.cpp side needs neither
        import torch
        from bench_decode import source_digest
        env["torch"], env["source_digest"] = torch.__version__, source_digest()
    return env


def scrub(obj):
    """No machine paths in the results: file names only."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str) and re.search(r"(^|[\s=])/(tmp|work|root|home)/", obj):
        return re.sub(r"/(?:tmp|work|root|home)/\S*/", "", obj)
    return obj


def print_table(files: list[dict]) -> None:
    print(f"\n{'file':<14}{'MB':>8}{'series':>22}{'min':>8}{'median':>8}{'ratio':>8}")
    for f in files:
        for key, s in f["summary"].items():
            if not s["n"]:
                continue
            ratio = next((v for k, v in s.items() if k.startswith("ratio_to_")), None)
            print(f"{f['name']:<14}{f['weight_bytes'] / 1e6:8.0f}{key:>22}{s['min_tok_s']:8.1f}{s['median_tok_s']:8.1f}"
                  + (f"{ratio:8.2f}" if ratio is not None else ""))


def plot(path: str, files: list[dict]) -> bool:
    """One panel per batch size: eagle-serve's median decode tok/s over llama.cpp's (llama-bench for
    one sequence, llama-batched-bench for more) per file, one bar per eagle-serve variant."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = {k for f in files for k, v in f["summary"].items() if v.get("n") and k.startswith("ours")}
    batches = sorted({int(k.rsplit(" x", 1)[1]) for k in keys})
    variants = sorted({k.rsplit(" x", 1)[0] for k in keys}, key=lambda v: (len(v), v))
    if not batches:
        return False
    colors = dict(zip(variants, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.5), squeeze=False)
    width = 0.8 / len(variants)
    for ax, b in zip(axes[0], batches):
        ref = "llamacpp-bench x1" if b == 1 else f"llamacpp-batched x{b}"
        for i, name in enumerate(variants):
            xs, ys = [], []
            for j, f in enumerate(files):
                s, r = f["summary"].get(f"{name} x{b}", {}), f["summary"].get(ref, {})
                if s.get("n") and r.get("n"):
                    xs.append(j + i * width)
                    ys.append(s["median_tok_s"] / r["median_tok_s"])
            ax.bar(xs, ys, width, label=name, color=colors[name])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(files))])
        ax.set_xticklabels([f["name"] for f in files], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{b} sequence{'s' if b > 1 else ''} (against {ref.rsplit(' x', 1)[0]})")
        ax.set_ylabel("decode tok/s, eagle-serve / llama.cpp (medians)")
        ax.legend(fontsize=7)
    fig.suptitle(f"GGUF decode on {files[0].get('threads', '')} threads: eagle-serve over llama.cpp, same files")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


MEMORY_KEYS = ("quantization", "rss_before_load_bytes", "rss_after_load_bytes", "weights_in_memory_bytes",
               "quantized_block_bytes", "bytes_streamed_per_step", "kv_cache_bytes")


def memory_only(args) -> None:
    """Each planned file's eagle-serve worker (blocks kept), loaded and closed: its memory figures
    go into the existing --out's record of that file, with this run's time and command."""
    with open(args.out) as f:
        result = json.load(f)
    by_name = {rec["name"]: rec for rec in result["files"]}
    env = environment(args)
    for item in plan(args):
        rec = by_name.get(item["name"])
        if rec is None:
            continue
        w = Ours(args, file_path(args, item["shape"], item["type"]), None)
        w.close()
        rec["memory"] = {"run": {"time": env["time"], "command": env["command"]},
                         **{k: w.info[k] for k in MEMORY_KEYS if k in w.info}}
        m = rec["memory"]
        print(f"{item['name']}: resident +{(m['rss_after_load_bytes'] - m['rss_before_load_bytes']) / 1e6:.0f} MB, "
              f"weights {m['weights_in_memory_bytes'] / 1e6:.0f} MB, KV {m['kv_cache_bytes'] / 1e6:.0f} MB", flush=True)
    with open(args.out, "w") as f:
        json.dump(scrub(result), f, indent=1)


def main(argv=None) -> None:
    if "--worker" in (argv if argv is not None else sys.argv[1:]):
        worker_main()
        return
    args = parse_args(argv)
    if args.memory_only:
        memory_only(args)
        return
    files = []
    for item in plan(args):
        rec = bench_file(args, item)
        rec["threads"] = args.threads
        files.append(rec)
    config = {k: v for k, v in vars(args).items() if k not in ("llamacpp_bin", "gguf_dir", "out", "worker", "append")}
    env = environment(args)
    for rec in files:  # each file's record says which run measured it
        rec["run"] = {"time": env["time"], "command": env["command"], "systems": args.systems}
    print_table(files)
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        names = {rec["name"] for rec in files}
        files = [rec for rec in old.get("files", []) if rec["name"] not in names] + files
    result = scrub({"config": config, "env": env, "files": files})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    print("wrote", os.path.basename(args.out), *( [os.path.basename(png)] if plot(png, files) else []))


if __name__ == "__main__":
    main()
