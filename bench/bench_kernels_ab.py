#!/usr/bin/env python
"""The native CPU kernels of the working tree against those of a git revision, side by side in
one process (the machine's memory bandwidth drifts between runs, so only alternated pairs are
compared).

The revision's engine/kernels/*.cpp are compiled under another module name; each engine is built
with one of the two modules (its packed weights, decode stacks and attention backend keep it),
and every timed call switches `engine.kernels.native` to its module, so nothing of one runs in
the other. Two parts, alternating the builds within every repetition, both on the engine's thread (torch
ops on a second thread leave that thread's OpenMP team behind: after the linear part ran on the
main thread, decoding on the engine thread ran at half speed, both builds alike):

  linear   skinny_linear over the default model's layer shapes (30 x qkv / o / gate_up / down,
           cold: each weight read once a pass) at 1..16 input rows: ms per pass
  decode   greedy generation on MT-bench first turns with plain decoding, EAGLE-2 trees or the
           tree budget ('budget'; the shipped head), one sequence at a time or --batch at once:
           tokens/s of each build, and their ratio

    .venv/bin/python bench/bench_kernels_ab.py --rev HEAD [--trees none,3x1x2,budget] [--prompts 8] [--batch 16]
        [--nta default,off] [--amx off,on]

--nta REV,WORKTREE sets each build's non-temporal weight streams (on, off, or the build's default:
on AMD CPUs only; a revision before set_nta_streams has its own fixed behaviour): with --rev HEAD,
`--nta off,on` measures the streams alone, the same code on both sides (they apply to the
AVX-512 loop only: with AMX on, most products do not stream that way). --amx REV,WORKTREE likewise
sets each build's AMX tiles for packed bf16 products (default: where the CPU has them); set
after the builds' models are prepacked, it does not change the 16 / 32-row native limit.
Writes --out (bench/results/kernels_ab_topk_log_softmax.json).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode as bd  # noqa: E402  (puts the project root on sys.path)
import torch  # noqa: E402
from bench_linear import SHAPES  # noqa: E402  (the default model's qkv / o / gate_up / down)
from bench_spec import spec_from_shape  # noqa: E402

from eagle_serve.engine import kernels  # noqa: E402
from eagle_serve.engine.default_model import default_draft_path  # noqa: E402
from eagle_serve.engine.sampling_params import SamplingParams  # noqa: E402
from eagle_serve.engine.speculative.config import SpecConfig  # noqa: E402
from eagle_serve.scheduler.worker import on_engine_thread  # noqa: E402
from eagle_serve.server.llm import LLM  # noqa: E402

ROOT = os.path.dirname(HERE)
SOURCES = ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_decode.cpp")
DRAFT = default_draft_path()


def build_rev(rev: str):
    """The kernels as they were at `rev`, compiled as their own module."""
    from torch.utils.cpp_extension import load
    sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", rev], text=True).strip()
    tmp = tempfile.mkdtemp(prefix=f"kernels_{sha}_")
    files = subprocess.check_output(["git", "-C", ROOT, "ls-tree", "--name-only", sha, "engine/kernels/"],
                                    text=True).split()
    for f in (os.path.basename(p) for p in files if p.endswith((".cpp", ".h"))):  # sources and headers
        src = subprocess.check_output(["git", "-C", ROOT, "show", f"{sha}:engine/kernels/{f}"])
        # pybind11 registers classes process-wide: the revision's DecodeStack stays its module's own
        src = src.replace(b'class_<DecodeStack>(m, "DecodeStack")',
                          b'class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())')
        with open(os.path.join(tmp, f), "wb") as out:
            out.write(src)
    kernels.native()  # puts ninja on PATH as the engine's own build does
    mod = load(f"eagle_serve_cpu_kernels_{sha}", [os.path.join(tmp, f) for f in SOURCES],
               extra_cflags=kernels.isa()[2], build_directory=tmp, verbose=False)
    return sha, mod, tmp


def native_or_exit():
    """This machine's native kernel module (the process's thread count pinned first), or exit."""
    torch.set_num_threads(torch.get_num_threads())
    mod = kernels.native()
    if mod is None:
        sys.exit("the native kernels are unavailable on this machine")
    return mod


@contextlib.contextmanager
def using(mod):
    """eagle_serve.engine.kernels.native() answers `mod` inside the block."""
    saved = kernels.native
    kernels.native = lambda: mod
    try:
        yield
    finally:
        kernels.native = saved


def linear_part(mods: dict, rows: list[int], reps: int) -> dict:
    torch.manual_seed(0)
    raw = [(torch.randn(o, i) * 0.02).to(torch.bfloat16) for _ in range(30) for o, i in SHAPES]
    packed = {name: [m.pack_bf16(w) for w in raw] for name, m in mods.items()}
    nbytes = sum(w.numel() * 2 for w in raw)
    amx = {m.amx() if hasattr(m, "amx") else False for m in mods.values()}
    same = torch.equal if len(amx) == 1 else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-4)
    out = {}
    for M in rows:
        xs = [torch.randn(M, w.shape[1]).to(torch.bfloat16) for w in raw[:len(SHAPES)]]
        ref = None
        for name, m in mods.items():  # same numbers from both builds (AMX and AVX-512 round apart)
            y = m.skinny_linear(xs[0], packed[name][0], None, True)
            assert ref is None or same(y, ref), "the two builds disagree"
            ref = y
        times = {name: [] for name in mods}
        for rep in range(reps):  # the order alternates: the second build of a pass read ~8% faster
            for name, m in (list(mods.items()) if rep % 2 == 0 else list(mods.items())[::-1]):
                ws = packed[name]
                t0 = time.perf_counter()
                for i, w in enumerate(ws):
                    m.skinny_linear(xs[i % len(SHAPES)], w, None, False)
                times[name].append(time.perf_counter() - t0)
        out[M] = {name: {"ms": 1e3 * statistics.median(t), "gb_s": nbytes / statistics.median(t) / 1e9}
                  for name, t in times.items()}
        print(f"linear rows={M}: " + "  ".join(f"{n} {v['ms']:.2f} ms ({v['gb_s']:.0f} GB/s)" for n, v in out[M].items()),
              flush=True)
    return out


def spec_of(tree: str) -> SpecConfig:
    if tree == "none":
        return SpecConfig("none")
    if tree == "budget":  # the serving default: EAGLE-2's default shape under the tree budget
        return SpecConfig("eagle2")
    return spec_from_shape("eagle2", tree)


def decode_part(mods: dict, trees: list[str], prompts: list[list[int]], max_new: int, batch: int = 1,
                dtypes: dict | None = None) -> dict:
    """batch > 1: `batch` prompts at a time through one generate call (the scheduler batches
    them), alternating the builds per group. `mods` may name more than two builds (a module, or
    None: the native kernels off), each engine in dtypes[name] (default bfloat16); ratios and
    same outputs are against the last one's, per build."""
    params = SamplingParams(max_tokens=max_new, temperature=0)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    out = {}
    for tree in trees:
        spec = spec_of(tree)
        engines = {}
        for name, m in mods.items():
            with using(m):
                engines[name] = LLM(None, dtype=(dtypes or {}).get(name, "bfloat16"), spec=spec,
                                    draft=DRAFT if spec.uses_head else None,
                                    kv_cache_tokens=16384 * max(1, batch // 2), tree_budget=tree == "budget")
                engines[name].generate(groups[0], params)  # warm-up
        toks = {name: 0 for name in mods}
        secs = {name: 0.0 for name in mods}
        outputs = {name: [] for name in mods}
        # tokens a verify step gives (accepted drafts + 1): the builds' drafts may differ where a
        # kernel change reaches the head (int8 products), their outputs not
        verified = {name: [0, 0] for name in mods}
        # the engine's own round phases (ModelRunner.timings) over the timed calls only
        t_start = {name: _phases(engines[name]) for name in mods}
        for i, group in enumerate(groups):
            order = list(mods) if i % 2 == 0 else list(mods)[::-1]
            for name in order:
                with using(mods[name]):
                    t0 = time.perf_counter()
                    outs = engines[name].generate(group, params)
                    secs[name] += time.perf_counter() - t0
                for o in outs:
                    toks[name] += len(o.token_ids)
                    outputs[name].append(list(o.token_ids))
                    verified[name][0] += o.spec.verify_steps
                    verified[name][1] += o.spec.accepted_tokens
        names = list(mods)
        rates = {name: toks[name] / secs[name] for name in mods}
        phases = {}
        for name in mods:
            (d0, v0, a0, n0), (d1, v1, a1, n1) = t_start[name], _phases(engines[name])
            n = max(1, n1 - n0)
            phases[name] = {"rounds": n1 - n0, "draft_ms": 1e3 * (d1 - d0) / n, "verify_ms": 1e3 * (v1 - v0) / n,
                            "accept_ms": 1e3 * (a1 - a0) / n}
        acceptance = {name: (1 + a / v if v else None) for name, (v, a) in verified.items()}
        if len(names) == 2:
            same = sum(a == b for a, b in zip(outputs[names[0]], outputs[names[1]]))
            out[tree] = {"tok_s": rates, "ratio": rates[names[1]] / rates[names[0]], "tokens": toks,
                         "same_outputs": f"{same}/{len(prompts)}", "acceptance": acceptance,
                         "ms_per_round": phases}
            tail = f"  ratio {out[tree]['ratio']:.3f}  same outputs {same}/{len(prompts)}"
            if all(acceptance.values()):
                tail += "  acceptance " + " / ".join(f"{acceptance[n]:.3f}" for n in names)
        else:
            last = names[-1]
            same = {n: f"{sum(a == b for a, b in zip(outputs[n], outputs[last]))}/{len(prompts)}" for n in names}
            out[tree] = {"tok_s": rates, "ratio_to_" + last: {n: rates[n] / rates[last] for n in names},
                         "tokens": toks, "same_outputs_as_" + last: same, "acceptance": acceptance,
                         "ms_per_round": phases}
            tail = "  x " + last + ": " + " ".join(f"{rates[n] / rates[last]:.3f}" for n in names)
        print(f"decode {tree}: " + "  ".join(f"{n} {r:.1f} tok/s" for n, r in rates.items())
              + tail + f"  (batch {batch})", flush=True)
        print("    ms a round, draft / verify: " + "  ".join(
            f"{n} {p['draft_ms']:.3f} / {p['verify_ms']:.3f}" for n, p in phases.items()), flush=True)
        del engines
    return out


def _phases(llm) -> tuple[float, float, float, int]:
    """An engine's cumulative round phases: (draft, verify, accept seconds, rounds)."""
    t = llm.runner.timings
    return t.draft, t.verify, t.accept, t.steps


def with_history(prompts: list[list[int]], context: int) -> list[list[int]]:
    """Each prompt after `context` tokens of the others (cycled), so that every step of its
    generation attends over a long history of real text."""
    out = []
    for i, p in enumerate(prompts):
        history = []
        j = i + 1
        while len(history) < context:
            history.extend(prompts[j % len(prompts)])
            j += 1
        out.append(history[:context] + p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the baseline revision's kernels")
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--trees", default="none,3x1x2,4x2x2", help="'none' and/or TOTALxDEPTHxTOPK")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call (concurrent sequences)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--context", type=int, default=0,
                    help="put a history of about this many tokens before every prompt: the other prompts' "
                         "chat-rendered ids, in turn (attention's share of a step grows with it)")
    ap.add_argument("--nta", default="default,default",
                    help="REV,WORKTREE: each build's non-temporal weight streams, on / off / default")
    ap.add_argument("--amx", default="default,default",
                    help="REV,WORKTREE: each build's AMX tiles for packed bf16 products, on / off / default")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-linear", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kernels_ab_topk_log_softmax.json"))
    args = ap.parse_args()
    new = native_or_exit()
    sha, old, tmp = build_rev(args.rev)
    mods = {f"rev-{sha}": old, "worktree": new}
    for flag, setter in (("nta", "set_nta_streams"), ("amx", "set_amx")):
        modes = getattr(args, flag).split(",")
        if len(modes) != 2 or not set(modes) <= {"on", "off", "default"}:
            sys.exit(f"--{flag} {getattr(args, flag)!r}: two of on / off / default, comma-separated")
        for (name, m), mode in zip(mods.items(), modes):
            if mode != "default":
                if not hasattr(m, setter):
                    sys.exit(f"--{flag}: the {name} build has no {setter}")
                getattr(m, setter)(mode == "on")
    streams = {name: m.nta_streams() if hasattr(m, "nta_streams") else None for name, m in mods.items()}
    amx = {name: m.amx() if hasattr(m, "amx") else None for name, m in mods.items()}
    print("non-temporal streams:", streams, "AMX:", amx, "on", bd.cpu_model(), flush=True)
    try:
        result = {"rev": sha, "git_head": bd.git_head(), "source_digest": bd.source_digest(), "args": vars(args),
                  "cpu": bd.cpu_model(), "nta_streams": streams, "amx": amx, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "linear": None if args.skip_linear else
                  on_engine_thread(lambda: linear_part(mods, [int(r) for r in args.rows.split(",")], args.reps))}
        if not args.skip_decode:
            prompts = bd.mtbench_ids(args.prompts)
            if args.context:
                prompts = with_history(prompts, args.context)
            result["decode"] = decode_part(mods, args.trees.split(","), prompts, args.max_new, args.batch)
            result["decode_config"] = {"prompts": args.prompts, "max_new": args.max_new, "draft": DRAFT,
                                       "batch": args.batch, "order": "alternating per group of batch prompts"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bd.write_result(args.out, result)


if __name__ == "__main__":
    main()
