"""The tracked tree reads like a product: present tense, no work history, no machine paths.

Every tracked text file is scanned, and every new one .gitignore lets in. Results under
bench/results/ are raw measurements, so only the machine-path rule applies to them. Each check
lists every offending file:line at once.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # holds the patterns as test data
RESULTS_DIR = "bench/results/"
README_MAX_LINES = 300
BINARY_SUFFIXES = {".safetensors", ".gguf", ".bin", ".pt", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".npy",
                   ".npz", ".so", ".whl", ".gz", ".zip", ".ico"}

# Work-history wording: numbered work periods, and prose that narrates what happened when.
# `--stages 21` is a command-line flag, not prose, hence the lookbehind.
CHRONOLOGY = re.compile(r"(?<![\w-])(?:sessions?|stages?)\s+#?\d+\b"
                        r"|\btried in\b|\bsince then\b", re.IGNORECASE)

# A commit hash in prose: one lowercase word of 7-40 hex digits with both a digit and a letter
# (pure digits are numbers, pure letters are words such as "defaced"). Neighbouring characters
# rule out hex literals (0x...), colors (#...), UUID and digest pieces (-, :, =) and paths.
COMMIT_HASH = re.compile(r"(?<![\w#:=/.@-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w:=/@-])")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
DIGEST = re.compile(r"\b(?:sha1|sha256|sha512|md5|blake2b?)\b\W{0,3}[0-9a-f]+", re.IGNORECASE)
HASH_SUFFIXES = {".md", ".py", ".txt", ".yaml", ".yml", ".cpp", ".h"}

# Paths that only exist on the machine that wrote them, forbidden prefix -> its pattern. Product
# paths (/proc/, /sys/, /dev/shm, /models/, /usr/, /opt/, /etc/) are deliberately not listed.
FORBIDDEN_PREFIXES = {
    "/work/": r"/work/",
    "/tmp/": r"/tmp/(?=[\w.-])",  # followed by a path: "the /tmp dir" names no file
    "/root/": r"/root/",
    "/home/<user>/": r"/home/(?!eagle/)[\w.-]+/",  # /home/eagle/: the image's own user (docker/Dockerfile)
    "/Users/": r"/Users/",
    "C:\\Users": r"(?i:C:(?:\\\\?|/)Users\b)",
}
# not inside a relative path, a URL, $HOME/... or ~/...
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])(?:" + "|".join(FORBIDDEN_PREFIXES.values()) + ")")


def _tracked_text_files() -> dict[str, list[str]]:
    """Path -> lines for every tracked file (and every new one .gitignore lets in) that exists
    and decodes as text."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True, text=True).stdout.split("\0")
    files = {}
    for name in filter(None, names):
        path = ROOT / name
        if name == THIS_FILE or path.suffix.lower() in BINARY_SUFFIXES or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files[name] = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            continue
    return files


@pytest.fixture(scope="module")
def tracked():
    return _tracked_text_files()


def _hashes_in(line: str) -> list[str]:
    return COMMIT_HASH.findall(DIGEST.sub(" ", URL.sub(" ", line)))


def _offenders(files: dict[str, list[str]], find) -> list[str]:
    return [f"{name}:{i}: {line.strip()[:120]}" for name, lines in files.items()
            for i, line in enumerate(lines, 1) if find(line)]


def _report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n" + "\n".join(offenders)


@pytest.mark.parametrize("text", ["## Session 48: caching", "found in session 12", "Stage 7 of the head",
                                  "after stage 21", "sessions 3 and 4", "tried in the budget run",
                                  "Since then the loop is faster"])
def test_chronology_pattern_matches_work_history(text):
    assert CHRONOLOGY.search(text)


@pytest.mark.parametrize("text", ["bench_head_curve.py --stages 21", "a multi-stage build", "session_id = 12",
                                  "the session cookie", "retried in a loop", "since the cache is warm"])
def test_chronology_pattern_ignores_product_text(text):
    assert not CHRONOLOGY.search(text)


@pytest.mark.parametrize("text", ["measured on d23edb0's code", "reverted in 3f9a2c1b", "(commit a1b2c3d)",
                                  "see 9fceb02d0ae598e95dc970b74767f19372d61af8 for details"])
def test_commit_hash_pattern_matches_hashes_in_prose(text):
    assert _hashes_in(text)


@pytest.mark.parametrize("text", ["https://github.com/org/repo/commit/d23edb0a", "mask = 0xdeadbeef1",
                                  "color: '#1f77b4ff'", "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
                                  "digest sha256 = 9f86d081884c7d65", "id 123e4567-e89b-12d3-a456-426614174000",
                                  "a defaced facade", "128000 tokens", "run bf16 at 1e-6",
                                  "image@sha256-ab12cd34ef", "weights/3f9a2c1b.bin"])
def test_commit_hash_pattern_ignores_other_hex(text):
    assert not _hashes_in(text)


@pytest.mark.parametrize("text", ["--out /work/main/x.json", "saved to /tmp/run/log.txt", "cd /root/models",
                                  "/home/alice/eagle", "/Users/bob/eagle", "C:\\Users\\bob", '"path": "/work/x"'])
def test_machine_path_pattern_matches_forbidden_prefixes(text):
    assert MACHINE_PATH.search(text)


@pytest.mark.parametrize("text", ["/sys/kernel/mm/transparent_hugepage/enabled", "/proc/cpuinfo", "/dev/shm",
                                  "--model /models/smollm2", "COPY . /opt/eagle-serve", "/usr/local/bin",
                                  "/etc/passwd", "bench/work/x", "https://example.com/home/a/b",
                                  "XDG_CACHE_HOME=/home/eagle/.cache", "the /tmp dir",
                                  "$HOME/tmp/x", "~/work/x", "GET /users/{id}"])
def test_machine_path_pattern_ignores_product_paths(text):
    assert not MACHINE_PATH.search(text)


def test_no_work_history_in_tracked_text(tracked):
    prose = {name: lines for name, lines in tracked.items() if not name.startswith(RESULTS_DIR)}
    offenders = _offenders(prose, CHRONOLOGY.search)
    assert not offenders, _report("lines narrate work history (sessions, stages, 'tried in', 'since then')",
                                  offenders)


def test_no_commit_hashes_in_prose(tracked):
    prose = {name: lines for name, lines in tracked.items()
             if not name.startswith(RESULTS_DIR) and Path(name).suffix in HASH_SUFFIXES}
    offenders = _offenders(prose, _hashes_in)
    assert not offenders, _report("lines cite commit hashes", offenders)


def test_no_machine_paths_in_tracked_files(tracked):
    offenders = _offenders(tracked, MACHINE_PATH.search)
    assert not offenders, _report("lines hold absolute machine paths", offenders)


def test_readmes_stay_short(tracked):
    offenders = [f"{name}:{len(lines)} lines" for name, lines in tracked.items()
                 if Path(name).name == "README.md" and len(lines) > README_MAX_LINES]
    assert not offenders, _report(f"README.md files run over {README_MAX_LINES} lines", offenders)


# a bench script or results file that tracked text names: it must exist (the text cites it as the
# measurement behind a figure or a choice)
BENCH_REFERENCE = re.compile(r"\bbench/(?:results/)?[A-Za-z0-9_.-]+\.(?:py|json|png|txt)\b")


def test_named_bench_scripts_and_results_files_exist(tracked):
    prose = {name: lines for name, lines in tracked.items() if not name.startswith(RESULTS_DIR)}
    offenders = [f"{name}:{i}: {ref}" for name, lines in prose.items() for i, line in enumerate(lines, 1)
                 for ref in BENCH_REFERENCE.findall(line) if not (ROOT / ref).exists()]
    assert not offenders, _report("references name a bench script or results file that does not exist", offenders)
