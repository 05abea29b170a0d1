#!/usr/bin/env python
"""Write docs/benchmarks.md and README's Performance section from the files in bench/results.

Every figure comes from a results file, with the hardware it records, the command that wrote it
and a link to the file; a figure without a file does not appear. Rerun a benchmark, then this.

    .venv/bin/python bench/report.py            # rewrite both
    .venv/bin/python bench/report.py --check    # exit 1 when either differs from what it would write
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- performance:start -->", "<!-- performance:end -->"


@dataclass(frozen=True)
class Section:
    title: str
    source: str  # results file name in bench/results
    hardware: str
    command: str
    table: list[list[str]]  # header row first
    note: str = ""

    @property
    def plot(self) -> str | None:
        png = self.source.rsplit(".", 1)[0] + ".png"
        return png if os.path.exists(os.path.join(RESULTS, png)) else None


RESULTS = os.path.join(ROOT, "bench", "results")


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def with_out(command: str, name: str) -> str:
    """The recorded command, its --out pointing at the results file it wrote."""
    command = re.sub(r"\s--out\s+\S+", "", command)
    return f"{command} --out bench/results/{name}"


def cpu(env: dict, threads_key: str = "threads") -> str:
    model = env.get("cpu_model") or env.get("cpu")
    threads = env.get(threads_key)
    torch = env.get("torch")
    parts = [model or "CPU model not recorded", f"{threads} threads" if threads else "", f"torch {torch}" if torch else ""]
    return ", ".join(p for p in parts if p)


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


# ---------------------------------------------------------------- sections, one per results file

def decode_vs_peers() -> Section:
    name = "decode_vs_peers.json"
    d = load(name)
    rows = [["system", "median tok/s", "x ours, same dtype (paired)"]]
    labels = {"ours": "eagle-serve", "hf": "HF transformers", "llamacpp": "llama.cpp"}
    for dtype, gguf in (("bfloat16", "f16"), ("float32", "f32")):
        for system in (f"ours-{dtype}", f"hf-{dtype}", f"llamacpp-{gguf}"):
            s = d["summary"].get(system)
            if s:
                kind, variant = system.split("-", 1)
                rows.append([f"{labels[kind]} {variant}", f1(s["median_tok_s"]),
                             f2(s[f"paired_ratio_to_ours-{dtype}"])])
    c = d["config"]
    note = (f"Greedy, {c['prompts']} MT-bench first turns through the chat template, {c['max_new']} new "
            "tokens, every system in one run, alternating per prompt.")
    return Section("Single stream against the peers", name, cpu(d["env"]), with_out(d["env"]["command"], name),
                   rows, note)


def speculative(name: str = "speculative_single_stream.json", title: str = "Speculative decoding, one stream",
                extra_note: str = "") -> Section:
    d = load(name)
    sets = [s for s in ("mtbench", "humaneval") if s in d["summary"]]
    header = ["method"] + [h for s in sets for h in (f"{s} tok/s", "x none", "tokens a forward")]
    rows = [header]
    for method in d["summary"][sets[0]]:
        row = [method]
        for s in sets:
            m = d["summary"][s][method]
            row += [f1(m["median_tok_s"]), f2(m["speedup_vs_none"]), f2(m["pooled_tok_per_forward"])]
        rows.append(row)
    same = {m: sum(v is None for v in div.values()) for m, div in d.get("parity_vs_none", {}).items()}
    n = {m: len(div) for m, div in d.get("parity_vs_none", {}).items()}
    c = d["config"]
    note = (f"Greedy, {c['dtype']}, {c['prompts']} prompts a set, {c['max_new']} new tokens; x none is the median "
            "of per-prompt ratios in the same run. Greedy ids equal plain decoding: "
            + ", ".join(f"{m} {same[m]}/{n[m]}" for m in same) + "." + extra_note)
    return Section(title, name, cpu(d["env"]), with_out(d["env"]["command"], name), rows, note)


def speculative_bounds(name: str) -> Section:
    d = load(name)
    target = d["config"]["target"]
    rows = [["set", "method", "tokens a forward", "round x plain step", "speed-up modelled / measured",
             "with a free draft", f"tokens a forward for {target}x"]]
    for s, methods in d["sets"].items():
        for m, b in methods.items():
            rows.append([s, m, f2(b["tok_per_forward"]), f2(b["round_x_plain"]),
                         f"{f2(b['speedup_modelled'])} / {f2(b['speedup_measured_median'])}",
                         f2(b["speedup_free_draft"]), f2(b[f"tok_per_forward_for_{target}x"])])
    result = os.path.basename(d["config"]["result"])
    run = load(result)
    return Section(f"What bounds the speed-up (target {target}x)", name, cpu(run["env"]),
                   f"python bench/spec_bounds.py bench/results/{result} --target {target} "
                   f"--out bench/results/{name}", rows,
                   "From the cost profile of the single-stream run above.")


def round_cost() -> Section:
    name = "round_cost_mtbench.json"
    d = load(name)
    keys = ["execute", "propose", "target_stack", "target_lm_head"]
    rows = [["system", "tok/s", "x none"] + [f"{k} ms" for k in keys]]
    for system, s in d["systems"].items():
        rows.append([system, f1(s["tok_s"]), f2(s["x_none"])]
                    + [f2(s["median_ms"][k]) if k in s["median_ms"] else "-" for k in keys])
    c = d["config"]
    return Section("Where a round's time goes", name, "not recorded in the results file",
                   f"python bench/bench_draft_calls.py --trees {c['trees']} --prompts {c['prompts']} "
                   f"--out bench/results/{name}", rows, "Median ms a call over every round of the run.")


def serve_sweep() -> Section:
    name = "serve_sweep.json"
    d = load(name)
    c = d["config"]
    rows = [["clients", "on tok/s", "off tok/s", "on / off (median)", "on / off by repetition"]]
    for transport, points in d["summary"].items():
        for conc, p in points.items():
            rows.append([conc, f1(p["on"]["tok_s"]), f1(p["off"]["tok_s"]), f2(p["on_off_ratio_median"]),
                         " / ".join(f2(r) for r in p["ratios"])])
    command = (f"python bench/bench_serve.py --transports {c['transports']} --reps {c['reps']} "
               f"--passes {c['passes']} --min-requests {c['min_requests']} --out bench/results/{name}")
    note = ("'on': the shipped head with the tree budget; 'off': `--spec none`. "
            f"{c['dtype']}, {c['max_new']} new tokens a request, in process.")
    return Section("Serving throughput by concurrency", name,
                   f"CPU model not recorded, {d.get('torch_threads', '?')} torch threads", command, rows, note)


def serve_vs_vllm() -> Section:
    name = "serve_vs_vllm.json"
    d = load(name)
    c = d["config"]
    servers = [s for s in c["servers"].split(",") if s in d["servers"]]
    rows = [["clients"] + [f"{s} tok/s" for s in servers]
            + [f"{s} / vllm" for s in servers if f"{s}/vllm" in d["ratios_median_per_rep"]]]
    for conc in c["concurrency"].split(","):
        rows.append([conc] + [f1(d["servers"][s][conc]["tok_s_median"]) for s in servers]
                    + [f2(r[conc]) for k, r in d["ratios_median_per_rep"].items()])
    command = (f"python bench/bench_vs_vllm.py --reps {c['reps']} --min-requests {c['min_requests']} "
               f"--out bench/results/{name}")
    note = ("Over HTTP, each server alone on the machine; eagle-spec: `eagle-serve serve`, eagle-plain: "
            "`--draft none`, vllm: vLLM's CPU build on the same weights (bf16). Medians over repetitions.")
    return Section("Serving against vLLM's CPU build", name, "not recorded in the results file", command,
                   rows, note)


def head_eval() -> Section:
    name = "head_eval_mtbench.json"
    d = load(name)
    c = d["config"]
    rows = [["head", "top-1 step 1", "(full vocabulary)", "step 2", "step 3", "tokens scored"]]
    for head, h in d["heads"].items():
        rows.append([head, f"{h['heldout_top1_step1']:.3f}", f"{h['heldout_top1_full_vocab']:.3f}",
                     f"{h['heldout_top1_step2']:.3f}", f"{h['heldout_top1_step3']:.3f}", str(h["heldout_tokens"])])
    command = (f"python bench/eval_head.py --heads {c['heads']} --data {c['data']} --conversations "
               f"{c['conversations']} --regen-max-tokens {c['regen_max_tokens']} --out bench/results/{name}")
    return Section("Draft head: agreement with the target on MT-bench", name, "not recorded in the results file",
                   command, rows, "The shipped head is the last one listed.")


def head_curve(name: str, title: str) -> Section:
    d = load(name)
    c = d["config"]
    rows = [["stage", "head", "training tokens", "acceptance length"]]
    for p in d["points"]:
        rows.append([str(p["stage"]), p["head"], f"{p['train_tokens']:,}", f"{p['acceptance_length']:.3f}"])
    command = (f"python bench/bench_head_curve.py --run {c['run']} --prompts {c['prompts']} --max-new "
               f"{c['max_new']} --tree {c['tree']} --out bench/results/{name}")
    note = f"Acceptance length at the {c['tree']} tree (tokens x depth x top-k), {c['dtype']}, greedy."
    return Section(title, name, "not recorded in the results file", command, rows, note)


def head_speed() -> Section:
    name = "head_speed_by_stage.json"
    d = load(name)
    sets = [s for s in ("mtbench", "humaneval") if s in d["summary"]]
    rows = [["method"] + [h for s in sets for h in (f"{s} tok/s", "x none")] + ["tokens a forward (all)"]]
    for method in d["summary"][sets[0]]:
        row = [method]
        for s in sets:
            m = d["summary"][s][method]
            row += [f1(m["median_tok_s"]), f2(m["speedup_vs_none"])]
        rows.append(row + [f2(d["summary"]["all"][method]["pooled_tok_per_forward"])])
    return Section("Draft head: speed against the previous stage", name, cpu(d["env"]),
                   with_out(d["env"]["command"], name), rows,
                   "Methods marked `-compare` run the previous stage's head in the same run.")


def reliability() -> Section:
    name = "reliability.json"
    d = load(name)
    rows = [["scenario", "load or input", "requirement", "tests passed"]]
    for s in d["scenarios"]:
        rows.append([s["scenario"], s["load_or_input"], s["requirement"], f"{s['passed']}/{s['tests']}"])
    return Section("Reliability", name, "not recorded in the results file",
                   "python bench/reliability_report.py", rows)


def soak() -> Section:
    name = "soak.json"
    d = load(name)
    rows = [["check", "result"]]
    rows.append(["requests", f"{d['requests']} in {d['minutes']:g} min at {d['concurrency']} clients"])
    rows.append(["RSS slope after warm-up", f"{d['rss_slope_mb_per_min_after_warmup']} MB/min"])
    rows += [[k.replace("_", " "), "yes" if v else "no"] for k, v in d["verdict"].items()]
    return Section("Soak", name, "not recorded in the results file",
                   f"python bench/soak.py --minutes {d['minutes']:g} --concurrency {d['concurrency']}", rows)


def linear() -> Section:
    name = "linear.json"
    d = load(name)
    rows_n = sorted({r["rows"] for r in d["results"]})
    paths = list(dict.fromkeys(r["path"] for r in d["results"]))
    ms = {(r["path"], r["rows"]): r["ms"] for r in d["results"]}
    rows = [["path \\ rows (ms)"] + [str(n) for n in rows_n]]
    rows += [[p] + [f"{ms[(p, n)]:.2f}" if (p, n) in ms else "-" for n in rows_n] for p in paths]
    return Section("Linear layers: the whole model's products", name, cpu(d), with_out(d["command"], name), rows,
                   "Every linear of the 30 layers and the LM head, one pass, bfloat16.")


def attention() -> Section:
    name = "attention.json"
    d = load(name)
    rows = [["context", "sequences", "rows", "native ms", "reference ms", "speed-up", "max abs diff"]]
    for r in d["results"]:
        rows.append([str(r["context"]), str(r["seqs"]), str(r["rows"]), f"{r['new_ms']:.3f}", f"{r['base_ms']:.3f}",
                     f2(r["speedup"]), f"{r['max_abs_diff']:g}"])
    return Section("Attention kernel", name, f"CPU model not recorded, {d['threads']} threads, {d['torch']}",
                   f"python bench/bench_attention.py --out bench/results/{name}", rows)


def kernels_ab() -> Section:
    name = "kernels_ab_topk_log_softmax.json"
    d = load(name)
    rows = [["tree", "tok/s (base / this tree)", "ratio", "same outputs", "draft ms a round (base / this tree)"]]
    for tree, r in d["decode"].items():
        tok, draft = list(r["tok_s"].values()), [v["draft_ms"] for v in r["ms_per_round"].values()]
        rows.append([tree, " / ".join(f1(t) for t in tok), f"{r['ratio']:.3f}", r["same_outputs"],
                     " / ".join(f"{x:.3f}" for x in draft)])
    a = d["args"]
    return Section("Kernel A/B: a draft level's ranking in one pass", name, cpu(d),
                   f"python bench/bench_kernels_ab.py --rev {a['rev']} --skip-linear --trees {a['trees']} "
                   f"--prompts {a['prompts']} --out bench/results/{name}", rows)


def gpu_check() -> Section:
    name = "gpu_check.json"
    d = load(name)
    env = d["env"]
    rows = [["model", "batch", "CUDA graphs", "mode", "tok/s", "same as plain"]]
    for model, m in d["throughput"]["models"].items():
        for r in m["rows"]:
            rows.append([model, str(r["batch"]), "yes" if r["graphs"] else "no", r["mode"], f1(r["tok_s"]),
                         "yes" if r.get("same_as_plain") else "no"])
    hardware = f"{env.get('device_name', 'GPU not recorded')}, torch {env.get('torch', '?')}"
    return Section("GPU check (random weights)", name, hardware, "python bench/gpu_check.py --out $OUT", rows,
                   "Details in [gpu.md](gpu.md).")


def startup() -> Section:
    name = "startup.json"
    d = load(name)
    env = d["env"]
    rows = [["run", "seconds", "target"]]
    labels = {"first_start": "serve, fresh machine (kernels built, cost profile measured): /health 200",
              "second_start": "serve again (both cached): /health 200",
              "generate": "`eagle-serve generate`, 48 tokens, caches warm: answer printed"}
    for key, label in labels.items():
        r = d["runs"][key]
        rows.append([label, f1(r.get("seconds_to_health", r.get("seconds"))), f"<= {d['targets_s'][key]}"])
    hardware = f"{env['cpu_model'] or 'CPU model not recorded'}, {env['cpu_count']} cores"
    return Section("Start-up", name, hardware, f"python bench/bench_startup.py --out bench/results/{name}", rows,
                   "Wall-clock seconds of whole processes on an idle machine, the default model and head.")


def structured_output() -> Section:
    name = "structured_output.json"
    d = load(name)
    s = d["summary"]
    rows = [["system", "tok/s", "tokens a forward", "grammar ms a token"]]
    for n in ("plain", "plain+json", "spec", "spec+json"):
        rows.append([n, f1(s[n]["tok_s"]), f2(s[n]["tokens_per_forward"]), f"{s[n]['grammar_ms_per_token']:.3f}"])
    rows.append(["decode time a token, plain+json / plain", f"{s['mask_cost_per_token']:.3f}", "", ""])
    rows.append(["speed-up without / with the grammar", f"{s['speedup_free']:.2f} / {s['speedup_json']:.2f}", "", ""])
    note = (f"{s['prompts']} prompts (JSON extraction and tool-call arguments), greedy, {d['max_new']} new tokens at "
            f"most, single stream, draft head `{d['draft']}` with the tree budget; speculative greedy equal to plain: "
            f"{s['greedy_equal_json']}/{s['prompts']} with the grammar, {s['greedy_equal_free']}/{s['prompts']} "
            f"without; finished JSON outputs valid: {s['json_valid']}/{s['json_finished']}. Tokens the grammar alone "
            f"forces: {s['jump_forward']['forced_tokens']} of {s['jump_forward']['tokens']}.")
    return Section("Structured output: the masks' cost and speculation", name, cpu(d["env"]),
                   with_out(d["env"]["command"], name), rows, note)


def eagle3_interop() -> Section:
    name = "eagle3_interop.json"
    d = load(name)
    rows = [["case", "reference head in eagle-serve", "eagle-serve's head in the reference", "keys as the reference saves"]]
    for c in d["cases"]:
        fwd = c.get("reference_head_in_eagle_serve") or (c if "max_abs_logit_diff" in c else None)
        back = c.get("eagle_serve_head_in_reference")
        rows.append([c["case"], _diff(fwd), _diff(back),
                     "-" if back is None else "yes" if back.get("same_keys_as_reference_save") else "no"])
    refs = ", ".join(f"{k} {v}" for k, v in d["reference_packages"].items())
    note = (f"Max abs difference of the draft logits ({d['dtype']}, {d['sizes']['positions']} positions, the same "
            f"token ids and captured target states), and whether the top-1 ids agree. References: {refs}. "
            "safeailab: no EAGLE-3 reference on PyPI, SpecForge's head without its embedding and layer ids, "
            "through eagle-serve's loader.")
    return Section("EAGLE-3 heads against the reference implementations", name, "CPU",
                   "python bench/eagle3_interop.py --setup", rows, note)


def _diff(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['max_abs_logit_diff']:.1e} (top-1 {'equal' if r.get('top1_ids_equal') else 'differs'})"


def model_families() -> Section:
    name = "model_families.json"
    d = load(name)
    rows = [["model", "parameters", "sequences", "plain tok/s", "plain ms a step", "oracle tok/s", "oracle ms a round",
             "acceptance length", "outputs equal plain"]]
    for model, m in d["models"].items():
        for batch in sorted({r["batch"] for r in m["rows"]}):
            plain = next(r for r in m["rows"] if r["batch"] == batch and r["mode"] == "plain")
            oracle = next(r for r in m["rows"] if r["batch"] == batch and r["mode"] != "plain")
            rows.append([model, f"{m['parameters'] / 1e9:.2f} B", str(batch), f1(plain["tok_s"]), f1(plain["ms_per_step"]),
                         f1(oracle["tok_s"]), f1(oracle["ms_per_step"]), f2(oracle["accept_len"]),
                         "yes" if plain["same_as_plain"] and oracle["same_as_plain"] else "no"])
    note = (f"Random-weight models of each family's real shape (bench/bench_families.py's docstring: the MoE is "
            f"scaled down to fit), {d['dtype']}, prompts of {d['prompt_len']} tokens, {d['max_new']} new tokens; the "
            f"oracle drafts the target's own continuation as a chain of {d['tree_tokens'] - 1} tokens.")
    return Section("Model families: decode speed", name, f"{d['device']}, {d.get('threads', '?')} threads, torch {d['torch']}",
                   d.get("command", "python bench/bench_families.py"), rows, note)


def quantized() -> Section:
    """GGUF files decoded with their blocks kept (eagle-serve) and by llama.cpp, alternating."""
    name = "quantized.json"
    d = load(name)
    labels = {"ours": "eagle-serve", "ours-dense": "eagle-serve, dequantized to bf16 (`--quantization none`)",
              "ours-eagle": "eagle-serve + EAGLE head", "ours-dense-eagle": "eagle-serve bf16 + EAGLE head"}
    rows = [["file", "weights MB", "system", "tok/s, 1 sequence", "x llama.cpp", "tok/s, 8 sequences", "x llama.cpp",
             "bytes a step / file's", "memory MB (weights + KV)"]]
    for f in d["files"]:
        sm = f["summary"]
        ref1, ref8 = sm.get("llamacpp-bench x1", {}), sm.get("llamacpp-batched x8", {})
        mb = f"{f['weight_bytes'] / 1e6:.0f}"
        if ref1.get("n") or ref8.get("n"):
            rows.append([f["name"], mb, "llama.cpp", f1(ref1["median_tok_s"]) if ref1.get("n") else "-", "",
                         f1(ref8["median_tok_s"]) if ref8.get("n") else "-", "", "", ""])
        for key, label in labels.items():
            one, eight, w = sm.get(f"{key} x1", {}), sm.get(f"{key} x8", {}), f.get("workers", {}).get(key)
            if not (one.get("n") or eight.get("n")):
                continue
            streamed = f"{w['bytes_streamed_per_step'] / f['weight_bytes']:.2f}" if w and "bytes_streamed_per_step" in w else "-"
            m = f.get("memory") if key == "ours" and f.get("memory") else w
            mem = (f"{(m['rss_after_load_bytes'] - m['rss_before_load_bytes']) / 1e6:.0f} "
                   f"({m['weights_in_memory_bytes'] / 1e6:.0f} + {m['kv_cache_bytes'] / 1e6:.0f})"
                   if m and "rss_before_load_bytes" in m else "-")
            rows.append([f["name"], mb, label, f1(one["median_tok_s"]) if one.get("n") else "-",
                         f2(one["ratio_to_llamacpp-bench_x1"]) if "ratio_to_llamacpp-bench_x1" in one else "-",
                         f1(eight["median_tok_s"]) if eight.get("n") else "-",
                         f2(eight["ratio_to_llamacpp-batched_x8"]) if "ratio_to_llamacpp-batched_x8" in eight else "-",
                         streamed, mem])
    c = d["config"]
    note = (f"Decode tokens/s (medians of {c['repeats']} runs, systems alternating): llama.cpp's `llama-bench -n "
            f"{c['max_new']}` (one sequence) and `llama-batched-bench -npl 8` (eight), eagle-serve's offline `LLM` "
            f"on the same file, greedy, {c['max_new']} new tokens a sequence, prefill left out. Random-weight Llama "
            f"files at Llama-3.2-1B / 3B shapes (bench/make_random_gguf.py) and the default model requantized to "
            f"Q8_0. Memory: the worker's resident memory gained by loading (its weights in memory + its KV cache "
            f"in parentheses); for the `eagle-serve` rows from a later load of the same files "
            f"(`bench/bench_quantized.py --memory-only`, after the engine returns the load's freed staging copies "
            f"to the OS), the other rows from the timed run.")
    return Section("Quantized GGUF weights: eagle-serve and llama.cpp on the same files", name, cpu(d["env"], "threads")
                   if d["env"].get("threads") else f"{d['env']['cpu_model']}, {c['threads']} threads, torch {d['env'].get('torch', '?')}",
                   "; ".join(dict.fromkeys(f["run"]["command"] for f in d["files"] if "run" in f)) or d["env"]["command"],
                   rows, note)


def eagle3_vs_eagle2() -> Section:
    """The two recipes trained side by side on the same data, tokens and held-out split."""
    e3, e2 = load("head_curve_eagle3.json"), load("head_curve_eagle2_fused.json")
    rows = [["training tokens", "EAGLE-3 acceptance length", "EAGLE-2 (fused features) acceptance length"]]
    by_tokens = {p["train_tokens"]: p for p in e2["points"]}
    for p in e3["points"]:
        q = by_tokens.get(p["train_tokens"])
        rows.append([f"{p['train_tokens']:,}", f"{p['acceptance_length']:.3f}",
                     f"{q['acceptance_length']:.3f}" if q else "-"])
    for key, label in (("heldout_top1_step1", "held-out top-1, step 1"), ("heldout_top1_step2", "step 2"),
                       ("heldout_top1_step3", "step 3"), ("train_seconds", "training seconds")):
        rows.append([label, f"{e3['card'][key]:.3f}" if key != "train_seconds" else f1(e3["card"][key]),
                     f"{e2['card'][key]:.3f}" if key != "train_seconds" else f1(e2["card"][key])])
    c = e3["config"]
    note = (f"Acceptance length at the {c['tree']} tree (tokens x depth x top-k, fixed), {c['prompts']} MT-bench first "
            f"turns, {c['max_new']} new tokens, {c['dtype']}, greedy; held-out figures from the runs' cards. "
            f"Training: `{e3['train_command']}` and `{e2['train_command']}`; the curves: "
            f"`python bench/bench_head_curve.py --run RUN --prompts {c['prompts']} --max-new {c['max_new']}`.")
    return Section("Draft head: EAGLE-3 against EAGLE-2 at the same training tokens", "head_curve_eagle3.json",
                   "not recorded in the results file", "see the note", rows, note)


def sections() -> list[Section]:
    return [decode_vs_peers(), speculative(), speculative_bounds("speculative_bounds_1.5x.json"),
            speculative_bounds("speculative_bounds_1.8x.json"), round_cost(), serve_sweep(), serve_vs_vllm(),
            head_eval(), head_curve("head_acceptance_60x6x10.json", "Draft head: acceptance length"),
            head_curve("head_curve_stages.json", "Draft head: acceptance over its training stages"),
            head_speed(), eagle3_vs_eagle2(),
            speculative("eagle3_vs_shipped_speed.json", "Draft head: the EAGLE-3 run against the shipped head",
                        " Rows marked `@eagle3-smollm2` draft with the EAGLE-3 head of the comparison above "
                        "(322,599 training tokens), the others with the shipped head, in the same run."),
            eagle3_interop(), structured_output(), model_families(), quantized(), linear(),
            attention(), kernels_ab(), startup(), reliability(), soak(), gpu_check()]


# ---------------------------------------------------------------- rendering

def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def render(s: Section, results_link: str, level: str) -> str:
    link = f"[bench/results/{s.source}]({results_link}{s.source})"
    plot = f", plot [{s.plot}]({results_link}{s.plot})" if s.plot else ""
    parts = [f"{level} {s.title}", "", f"Hardware: {s.hardware}. Command: `{s.command}`. Results: {link}{plot}.", ""]
    if s.note:
        parts += [s.note, ""]
    return "\n".join(parts + [table(s.table), ""])


def benchmarks_page(all_sections: list[Section]) -> str:
    head = ["# Benchmarks", "",
            "Generated by `bench/report.py` from the files in `bench/results`; rerun a benchmark, then the "
            "script, to change this page.", ""]
    return "\n".join(head + [render(s, "../bench/results/", "##") for s in all_sections])


def performance_section(all_sections: list[Section]) -> str:
    by_source = {s.source: s for s in all_sections}
    chosen = [by_source[n] for n in ("decode_vs_peers.json", "speculative_single_stream.json",
                                     "serve_vs_vllm.json")]
    body = [render(s, "bench/results/", "###") for s in chosen]
    return "\n".join([START, ""] + body + [END])


def with_performance(readme: str, section: str) -> str:
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README has no {START} ... {END} lines to write between")
    return readme[:start] + section + readme[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = ap.parse_args(argv)
    all_sections = sections()
    with open(args.readme) as f:
        readme = f.read()
    wanted = {args.docs: benchmarks_page(all_sections),
              args.readme: with_performance(readme, performance_section(all_sections))}
    stale = []
    for path, text in wanted.items():
        current = open(path).read() if os.path.exists(path) else None
        if current != text:
            stale.append(path)
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        print("out of date (run bench/report.py): " + ", ".join(os.path.relpath(p, ROOT) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
