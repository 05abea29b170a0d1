"""Compare two builds of eagle-serve side by side: plain and speculative single-stream decoding
(bench_spec.py) and the in-process serving sweep (bench_serve.py), each build's own scripts, the
builds alternating repetition by repetition in one run so that machine drift hits both alike.

    python bench/bench_builds.py --base REF [--head REF2] [--reps 2] [--out bench/out/builds_ab.json]

REF is any git revision; it is checked out in a temporary worktree. The other build is this
working tree, or `--head REF2` checked out the same way. A build whose packages install as
eagle_serve.{engine,scheduler,server} is put on the path through a shim package; an older build
with top-level packages, through its root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIR = "engine/heads/smollm2-135m-instruct"


def _pythonpath(tree: Path, shim_root: Path) -> str:
    """The path entry that makes `tree`'s packages importable under the names its code uses."""
    if 'package-dir' not in (tree / "pyproject.toml").read_text():
        return str(tree)  # top-level engine/, scheduler/, server/
    shim = shim_root / "eagle_serve"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("")
    for name in ("engine", "scheduler", "server"):
        link = shim / name
        if not link.exists():
            link.symlink_to(tree / name)
    return str(shim_root)


def _run(tree: Path, pythonpath: str, script: str, args: list[str], out: Path) -> dict:
    # every run profiles its own engine: a profile cached by an earlier run would make the runs unalike
    env = dict(os.environ, PYTHONPATH=pythonpath, EAGLE_SERVE_PROFILE_CACHE="off")
    cmd = [sys.executable, f"bench/{script}", *args, "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed in {tree.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(f"  {script} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())


def _spec_figures(res: dict) -> dict:
    """tok/s (median over prompts) per method, pooled over both prompt sets."""
    return {m: s["median_tok_s"] for m, s in res["summary"]["all"].items()}


def _serve_figures(res: dict) -> dict:
    """tok/s per engine (on: speculation, off: plain) per client count."""
    return {f"c{c}_{eng}": row[eng]["tok_s"] for c, row in res["summary"]["inproc"].items() for eng in ("on", "off")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the build to compare against")
    ap.add_argument("--head", default=None, help="git revision of the other build (default: this working tree)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="bench_spec.py prompts per set")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "builds_ab.json"), help="(bench/out/ is not tracked)")
    a = ap.parse_args()

    spec_args = ["--methods", "none,eagle2", "--draft", HEAD_DIR, "--eagle2", "4x2x2",
                 "--prompts", str(a.prompts), "--max-new", str(a.max_new)]
    serve_args = ["--transports", "inproc", "--concurrency", a.concurrency, "--reps", "1",
                  "--min-requests", "8", "--max-new", str(a.max_new), "--prompts", "8"]
    base_rev = subprocess.run(["git", "rev-parse", a.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", a.head or "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="eagle-builds-") as tmp:
        tmp = Path(tmp)
        trees = {"base": tmp / "base", "head": tmp / "head" if a.head else ROOT}
        for name, rev in (("base", base_rev), ("head", head_rev)):
            if trees[name] != ROOT:
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[name]), rev], cwd=ROOT, check=True)
        try:
            builds = {name: (tree, _pythonpath(tree, tmp / f"shim-{name}")) for name, tree in trees.items()}
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            for rep in range(a.reps):
                order = ["base", "head"] if rep % 2 == 0 else ["head", "base"]
                for name in order:
                    tree, pp = builds[name]
                    print(f"rep {rep} {name}", flush=True)
                    spec = _run(tree, pp, "bench_spec.py", spec_args, tmp / f"spec_{name}_{rep}.json")
                    serve = _run(tree, pp, "bench_serve.py", serve_args, tmp / f"serve_{name}_{rep}.json")
                    runs[name].append({**_spec_figures(spec), **_serve_figures(serve)})
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    keys = sorted(set(runs["base"][0]) & set(runs["head"][0]))
    table = {}
    for k in keys:
        b = statistics.median(r[k] for r in runs["base"])
        h = statistics.median(r[k] for r in runs["head"])
        table[k] = {"base_tok_s": b, "head_tok_s": h, "head_over_base": h / b}
    result = {"base": base_rev, "head": head_rev, "reps": a.reps, "spec_args": spec_args,
              "serve_args": serve_args, "cpu_count": os.cpu_count(), "runs": runs, "summary": table}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("| figure | base tok/s | head tok/s | head / base |\n|---|---|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v['base_tok_s']:.1f} | {v['head_tok_s']:.1f} | {v['head_over_base']:.3f} |")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
