"""The command line: every flag's help and default, the examples, the bare command, start-up logging."""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys

import pytest

from eagle_serve.server.cli import build_parser, main

COMMANDS = ("generate", "serve", "train-draft")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help `--help` prints for one flag, its default filled in."""
    return parser._get_formatter()._expand_help(action)


def _flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help is not argparse.SUPPRESS]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_says_what_it_does_and_its_default(command):
    parser = _subparsers()[command]
    for action in _flags(parser):
        shown = _shown_help(parser, action)
        assert action.help and action.help.strip(), action.option_strings
        if action.required:
            continue
        if action.nargs == 0:  # a switch: off unless given
            assert "(default: " not in shown, action.option_strings
            continue
        assert "(default: " in shown, (action.option_strings, shown)
        if action.default is not None and "(default: " not in action.help:  # not described in words
            assert shown.endswith(f"(default: {action.default})"), (action.option_strings, shown)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_ends_its_help_with_examples(command):
    text = _subparsers()[command].format_help()
    examples = text.split("\nexamples:\n", 1)[1].splitlines()
    assert 2 <= len(examples) <= 4
    assert all(f"eagle-serve {command}" in line for line in examples), examples


def test_serve_help_shows_the_environment_default_it_uses(monkeypatch):
    monkeypatch.setenv("EAGLE_SERVE_PORT", "9000")
    monkeypatch.setenv("EAGLE_SERVE_FIXED_TREE", "1")
    monkeypatch.setenv("EAGLE_SERVE_API_KEY", "sk-secret")
    monkeypatch.setenv("EAGLE_SERVE_MAX_WAITING", "not-a-number")
    serve = _subparsers()["serve"]
    shown = {a.dest: _shown_help(serve, a) for a in _flags(serve)}
    assert shown["port"].endswith("(default: 9000, from EAGLE_SERVE_PORT)")
    assert shown["fixed_tree"].endswith("(default: on, from EAGLE_SERVE_FIXED_TREE)")
    assert shown["api_key"].endswith("(default: set, from EAGLE_SERVE_API_KEY)") and "sk-secret" not in shown["api_key"]
    assert "EAGLE_SERVE_MAX_WAITING does not parse" in shown["max_waiting"]
    args = serve.parse_args(["--max-waiting", "3"])
    assert (args.port, args.fixed_tree, args.api_key) == (9000, True, "sk-secret")  # the defaults shown


def test_bare_command_lists_the_subcommands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(command in err for command in COMMANDS) and "usage: eagle-serve" in err


def test_help_and_bare_command_in_a_subprocess():
    cli = [sys.executable, "-m", "eagle_serve.server.cli"]
    out = subprocess.run([*cli, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-num-seqs" in out.stdout and "examples:" in out.stdout
    bare = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "Traceback" not in bare.stderr
    assert all(command in bare.stderr for command in COMMANDS)


def _generate_args(model: str) -> list[str]:
    return ["generate", "--model", model, "--dtype", "float64", "--device", "cpu", "--kv-cache-tokens", "1024",
            "--prompt", "the quick brown fox the quick", "--max-tokens", "4", "--ignore-eos", "--spec", "ngram"]


def test_generate_logs_each_start_up_phase_with_its_time(tiny_llama, caplog, monkeypatch):
    import eagle_serve.engine.profile
    real = eagle_serve.engine.profile.profile_costs
    monkeypatch.setattr(eagle_serve.engine.profile, "profile_costs",  # each point timed once: the lines are the point
                        lambda *args, **kw: real(*args, **kw, repeats=1, small_repeats=1))
    caplog.set_level(logging.INFO, logger="eagle_serve")
    assert main(_generate_args(tiny_llama[0])) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert any(line.startswith(f"start-up: loading {tiny_llama[0]}: weights and KV cache") for line in lines), lines
    assert any(re.fullmatch(r"start-up: model loaded in \d+\.\d s", line) for line in lines), lines
    assert any(line.startswith("start-up: tree budget cost profile (") for line in lines), lines
    assert any(re.fullmatch(r"start-up: tree budget cost profile done in \d+\.\d s", line) for line in lines), lines


def test_generate_shows_start_up_lines_by_default(tiny_llama, tmp_path):
    """INFO reaches stderr without any flag; stdout carries only the completion."""
    cmd = [sys.executable, "-m", "eagle_serve.server.cli", *_generate_args(tiny_llama[0]), "--fixed-tree"]
    env = {**os.environ, "EAGLE_SERVE_CACHE": str(tmp_path)}  # nothing written to the user's cache
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "INFO eagle_serve: start-up: model loaded in" in out.stderr
    assert "start-up" not in out.stdout
