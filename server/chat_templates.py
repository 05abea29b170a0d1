"""Chat templates the operator picks (`--chat-template`): a file, or a template shipped in
server/templates by name, and whether a template renders tools at all."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jinja2
import jinja2.meta

from eagle_serve.engine.tokenizer import template_environment

TEMPLATES_DIR = Path(__file__).parent / "templates"


def shipped_templates() -> list[str]:
    """Names of the templates shipped with the server (`--chat-template NAME`)."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def shipped_path(name: str) -> Path:
    return TEMPLATES_DIR / f"{name}.jinja"


def load_chat_template(value: str) -> str:
    """The template text for `--chat-template VALUE`: a shipped template's name, or a file's
    path (a .jinja file, or a JSON tokenizer_config.json-style file is not taken: give the
    template itself). ValueError naming the shipped names when it is neither."""
    if value in shipped_templates():
        return shipped_path(value).read_text(encoding="utf-8")
    if os.path.isfile(value):
        try:
            return Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot be read ({e})") from None
    raise ValueError(f"--chat-template {value!r} is neither a file nor a shipped template "
                     f"({', '.join(shipped_templates())})")


@functools.lru_cache(maxsize=16)
def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (a template that never does would drop
    a request's tools from the prompt)."""
    if not template:
        return False
    try:
        ast = template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return True  # (it fails when rendered, with its own error)
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def check_template_tools(template: str | None, tools: list | None, messages: list[dict]) -> None:
    """A request with tools, or with assistant tool calls in its history, needs a template that
    renders them: one that ignores `tools` would drop them from the prompt unseen (a tool result
    is a message with its own role, which any template renders or refuses). 400 telling the
    operator what to start the server with."""
    from eagle_serve.server.protocol import ApiError
    history = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if (not tools and history is None) or renders_tools(template):
        return
    raise ApiError(400, "this model's chat template does not render tools or tool calls; start the server with "
                        "--chat-template chatml_tools (ChatML with Hermes-style tool calls, shipped with eagle-serve, "
                        "for ChatML models such as SmolLM2 and Qwen) or --chat-template FILE with a template for "
                        "this model family", "tools" if tools else f"messages.{history}")
