"""scheduler/ and the torch-free engine modules must not import torch."""
import subprocess
import sys


def test_scheduler_imports_no_torch():
    code = ("import sys, eagle_serve.scheduler.loop, scheduler.scheduler, scheduler.block_allocator, "
            "scheduler.output_processor, engine, engine.sampling_params, engine.step_io, "
            "engine.tokenizer, engine.model_config, engine.config\n"
            "bad = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
