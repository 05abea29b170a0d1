"""bench/gpu_check.py: its oracle trees, and a CPU smoke run (`--device cpu --quick`) that writes
every section of the report (the real run needs a GPU; see docs/gpu.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from eagle_serve.engine.speculative.accept import walk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
SECTIONS = ("env", "correctness", "backends", "kv_sizing", "throughput", "verify_curve", "families")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("branchy", [False, True])
@pytest.mark.parametrize("accept", [1, 2, 4, None])
def test_oracle_tree_accepts_as_set(gpu_check, accept, branchy):
    reference = [11, 12, 13, 14, 15, 16, 17, 18]
    rng = random.Random(0) if branchy else None
    tree = gpu_check.oracle_tree(10, reference, accept, total=12, depth=5, vocab=100, rng=rng)
    assert len(tree) == (12 if branchy else 6) and tree.max_depth == 5
    assert sum(len(c) for c in tree.children()) == len(tree) - 1  # no two siblings share a token
    # the target picks the reference at every node of the reference path (and 99 elsewhere)
    on_path = {}
    node = 0
    for tok in reference[:6]:
        on_path[node] = tok
        node = tree.children()[node].get(tok)
        if node is None:
            break
    chosen = [on_path.get(i, 99) for i in range(len(tree))]
    verdict = walk(tree, chosen)
    assert len(verdict.tokens) == (accept if accept is not None else 6)
    assert verdict.tokens == reference[:len(verdict.tokens)]


def test_oracle_tree_edges(gpu_check):
    assert len(gpu_check.oracle_tree(3, [4, 5], 2, total=8, depth=0, vocab=50)) == 1  # no depth left: root only
    short = gpu_check.oracle_tree(3, [4], None, total=4, depth=3, vocab=50)  # the reference runs out
    assert len(short) == 4 and short.tokens[1] == 4


def test_cpu_quick_run_writes_every_section(tmp_path):
    env = {**os.environ, "EAGLE_SERVE_NATIVE_KERNELS": "0"}
    env.pop("OUT", None)
    # a generous time budget: on a loaded machine the steps' time limits must not cut the smoke run short
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--quick", "--time-budget", "900",
                             "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for section in SECTIONS:
        assert section in report, section
    for section in ("correctness", "backends", "throughput", "verify_curve"):
        assert report[section]["status"] == "ok", (section, report[section])
    assert report["kv_sizing"]["status"] == "skipped"  # CUDA only
    c = report["correctness"]
    assert c["all_equal_to_plain"] and c["oracle_acceptance_as_set"] and c["graph_vs_eager"]["ok"]
    assert {r["name"] for r in c["runs"]} >= {"plain", "eagle2", "eagle1", "oracle-tree-accept3"}
    assert {r["backend"] for r in report["backends"]["rows"]} >= {"torch", "padded (CUDA graphs)"}
    rows = report["throughput"]["models"]["tiny"]["rows"]
    assert {r["mode"] for r in rows} == {"plain", "accept1-t4", "accept2-t4"} and all(r["tok_s"] > 0 for r in rows)
    assert all(r["same_as_plain"] for r in rows)
    curve = report["verify_curve"]["models"]["tiny"]
    assert [r["tokens_per_seq"] for r in curve["rows"] if r["batch"] == 1] == [1, 2, 4, 8]
    assert "batch1_eager" in curve["free_until"]
    assert report["chart"].endswith(".png") or report["chart"].startswith("no chart")
