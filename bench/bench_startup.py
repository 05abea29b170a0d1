"""How long a newcomer waits: `eagle-serve serve` until /health answers 200, first with no
native-kernel build and no cached cost profile (a fresh machine), then again with both cached;
and one `eagle-serve generate` answer, wall-clock, with warm caches. Each run's start-up log
lines (the phases and their seconds) are kept in the results.

    python bench/bench_startup.py [--out bench/results/startup.json]

Run it on an idle machine: the figures are wall-clock seconds of whole processes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle_serve.engine.kernels import cpu_model
from eagle_serve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

PHASE = re.compile(r"start-up|cost profile|kernels", re.I)


def _phases(text: str, tmp: Path) -> list[str]:
    """The start-up lines of a log, the run's temporary folder written as <cache>."""
    return [line.replace(str(tmp), "<cache>") for line in text.splitlines() if PHASE.search(line)]


def serve_once(env: dict, log_path: Path) -> dict:
    t0 = time.perf_counter()
    server = ServerProcess([], str(log_path), startup_timeout=900, env=env)
    seconds = time.perf_counter() - t0
    server.terminate()
    return {"seconds_to_health": round(seconds, 2), "log": _phases(log_path.read_text(errors="replace"), log_path.parent)}


def generate_once(env: dict, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "eagle_serve.server.cli", "generate", "--chat", "--prompt",
           "What is the capital of France? Answer in one sentence.", "--max-tokens", "48", "--temperature", "0",
           "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"generate failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": round(seconds, 2), "text": out["text"], "tokens": out["num_generated_tokens"],
            "log": _phases(proc.stderr, tmp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagle-startup-") as tmp:
        tmp = Path(tmp)
        # empty caches of their own: the kernels are built and the profile measured, as on a fresh machine
        env = {"TORCH_EXTENSIONS_DIR": str(tmp / "kernels"), "EAGLE_SERVE_PROFILE_CACHE": str(tmp / "profiles")}
        runs = {}
        print("first start (kernels built, cost profile measured) ...", flush=True)
        runs["first_start"] = serve_once(env, tmp / "first.log")
        print(f"  /health 200 after {runs['first_start']['seconds_to_health']} s", flush=True)
        print("second start (both cached) ...", flush=True)
        runs["second_start"] = serve_once(env, tmp / "second.log")
        print(f"  /health 200 after {runs['second_start']['seconds_to_health']} s", flush=True)
        print("generate (caches warm) ...", flush=True)
        runs["generate"] = generate_once(env, tmp)
        print(f"  answered in {runs['generate']['seconds']} s: {runs['generate']['text']!r}", flush=True)
    result = {"env": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
              "targets_s": {"first_start": 120, "second_start": 15, "generate": 20}, "runs": runs}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, target in result["targets_s"].items():
        r = runs[name]
        print(f"{name}: {r.get('seconds_to_health', r.get('seconds'))} s (target <= {target} s)")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
