"""bench/report.py keeps docs/benchmarks.md and README's Performance section in step with bench/results."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_report(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(root, "bench", "report.py"), *args],
                          capture_output=True, text=True)


def test_committed_pages_match_the_results_files():
    out = run_report(ROOT, "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_fails_when_a_figure_is_edited(tmp_path):
    shutil.copytree(os.path.join(ROOT, "bench"), tmp_path / "bench")
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    assert run_report(str(tmp_path), "--check").returncode == 0
    page = tmp_path / "docs" / "benchmarks.md"
    text = page.read_text()
    assert "| 90.5 |" in text  # eagle-serve bfloat16's median tok/s in decode_vs_peers.json
    page.write_text(text.replace("| 90.5 |", "| 95.0 |", 1))
    out = run_report(str(tmp_path), "--check")
    assert out.returncode == 1 and "docs/benchmarks.md" in out.stdout
