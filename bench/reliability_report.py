#!/usr/bin/env python
"""The reliability table: runs tests/test_reliability.py (fuzzing, bad inputs, disconnect storm,
KV pressure, injected faults, timeouts, CORS, SIGTERM, short soak, per-request leaks), reads
each scenario's outcome from pytest's JUnit XML, adds the last 10-minute soak
(bench/results/soak.json, from bench/soak.py) and writes bench/results/reliability.json plus a
markdown table for the README.

    .venv/bin/python bench/reliability_report.py          # ~2 min
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tests.test_reliability import _bad_inputs  # noqa: E402  (the hand-written cases, counted)

# test name prefix -> (scenario, load held, faults injected / bad input tried, what must be lost: nothing)
SCENARIOS = [
    ("test_fuzzed_requests", "schema fuzzing (schemathesis)",
     "40 generated requests per POST route and mode (valid / invalid bodies), 5 per GET route",
     "every status documented, no 5xx, documented shapes"),
    ("test_fuzzing_leaves", "after fuzzing", "-", "all KV blocks free, /health 200"),
    ("test_hand_written_bad_inputs", "hand-written bad inputs",
     f"{len(_bad_inputs(320, 128)) + 1} cases (invalid JSON / UTF-8, NaN, 100k-deep nesting, huge n, 10k stop strings, ids outside the "
     "vocabulary, 10 MB body with and without Content-Length, ...)", "clear 4xx in OpenAI's shape, no leak"),
    ("test_disconnect_storm", "disconnect storm",
     "200 streams, 64 at a time; ~30% of clients leave at a random chunk", "blocks back to start, /health 200, "
     "completed outputs == undisturbed outputs"),
    ("test_kv_pressure", "KV pressure", "16 concurrent requests in a cache for 2 (preemption)",
     "all complete, outputs == unpressured run, blocks back"),
    ("test_injected_fault", "fault isolation", "an exception inside one request's step (fault hook), batched",
     "that request fails (500 / error event, counted); the others exact; no leak"),
    ("test_request_timeout", "request timeout", "500-token requests with a 0.5 s timeout",
     "408 / error event, aborted, blocks back"),
    ("test_cors", "CORS", "cross-origin preflight and GET", "no CORS headers unless configured"),
    ("test_sigterm_drains", "graceful shutdown", "SIGTERM mid-stream (real process)",
     "the stream finishes with [DONE], new connections refused, exit 0"),
    ("test_sigterm_deadline", "shutdown deadline", "SIGTERM with 128 long streams, --shutdown-timeout 1",
     "cut at the deadline, exit 0 within 15 s"),
    ("test_short_soak", "short soak (20 s)", "6 clients of mixed load (bench/soak.py's mix), eagle2",
     "no unexpected outcome, no engine error, blocks back, /health 200, exit 0"),
    ("test_requests_leave_no_python", "per-request leaks", "150 mixed requests after a warm-up",
     "engine maps empty, no object of the project's own types left behind"),
]


def main() -> int:
    out_dir = os.path.join(HERE, "results")
    xml = os.path.join(out_dir, "reliability_junit.xml")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_reliability.py",
                    f"--junitxml={xml}"], cwd=ROOT)
    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        failed = tc.find("failure") is not None or tc.find("error") is not None
        skipped = tc.find("skipped") is not None
        cases.append({"name": tc.get("name"), "seconds": float(tc.get("time", 0)),
                      "outcome": "failed" if failed else "skipped" if skipped else "passed"})
    rows = []
    for prefix, scenario, load, requirement in SCENARIOS:
        mine = [c for c in cases if c["name"].startswith(prefix)]
        rows.append({"scenario": scenario, "load_or_input": load, "requirement": requirement, "tests": len(mine),
                     "passed": sum(c["outcome"] == "passed" for c in mine),
                     "seconds": round(sum(c["seconds"] for c in mine), 1)})
    soak_path = os.path.join(out_dir, "soak.json")
    soak = None
    if os.path.exists(soak_path):
        with open(soak_path) as f:
            s = json.load(f)
        soak = {k: s[k] for k in ("minutes", "concurrency", "requests", "counts", "unexpected", "finished_by_reason",
                                  "generation_tokens", "rss_start_mb", "rss_end_mb",
                                  "rss_slope_mb_per_min_after_warmup", "final_kv_usage", "final_health", "verdict",
                                  "server_exit_code_after_sigterm", "serve_args")}
    result = {"scenarios": rows, "cases": cases, "soak_10min": soak}
    with open(os.path.join(out_dir, "reliability.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| scenario | load / input | must hold | tests passed |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['load_or_input']} | {r['requirement']} | {r['passed']}/{r['tests']} |")
    return 0 if all(r["passed"] == r["tests"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
