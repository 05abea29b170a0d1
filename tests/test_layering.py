"""Layers import one way: server -> scheduler -> engine. scheduler/ and the torch-free engine
modules load neither torch nor numpy; engine/ never imports the layers above it."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# engine modules the scheduler and the front doors use without a model
TORCH_FREE_ENGINE = ["engine", "engine.sampling_params", "engine.step_io", "engine.tokenizer", "engine.model_config",
                     "engine.config", "engine.speculative.config", "engine.default_model", "engine.model_files",
                     "engine.train.config"]


def _scheduler_modules() -> list[str]:
    """Every module under scheduler/, packages and their modules included."""
    out = []
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_scheduler_modules_are_all_found():
    found = _scheduler_modules()
    assert {"scheduler.async_engine", "scheduler.worker", "scheduler.budget", "scheduler.budget.policy"} <= set(found)


def test_scheduler_and_torch_free_engine_modules_load_no_torch_or_numpy():
    modules = [f"eagle_serve.{m}" for m in _scheduler_modules() + TORCH_FREE_ENGINE]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "bad = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_engine_never_imports_the_scheduler_or_the_server():
    upward = ("eagle_serve.scheduler", "eagle_serve.server", "scheduler", "server")
    bad = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        hits = sorted(m for m in _imported(ast.parse(path.read_text(), str(path)))
                      if any(m == u or m.startswith(u + ".") for u in upward))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, bad
