"""Chat templates rendered the way transformers renders them (sandboxed Jinja, same filters), but
without importing transformers, so the frontend starts fast and never loads torch.

Rendering keeps two views of its result (see the reference seed on "template views"):
`template_text` is exactly what the template produced, which the thinking-state resolution reads;
`prompt_text` is what the model is given, which may carry a prefix injected after the template
(a forced tool call's begin string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    template_text: str  # the template's own output
    prompt_text: str  # what is tokenized: template_text plus any injected prefix


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct source (the model's template, or an allowed per-request one)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(f"the chat template does not compile: {e}", "chat_template") from None


@lru_cache(maxsize=16)
def takes_tools(source: str) -> bool:
    """Whether the template reads the `tools` variable at all (many plain ChatML ones do not)."""
    env = jinja2.Environment(extensions=[loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(f"the chat template does not compile: {e}", "chat_template") from None


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    template_kwargs: dict[str, Any],
) -> RenderedPrompt:
    """Render a conversation; a template error (raise_exception included) is the client's 400."""
    reserved = {"messages", "tools", "add_generation_prompt"} & template_kwargs.keys()
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs"
        )
    variables = {**special_tokens, **template_kwargs}
    try:
        text = compile_template(source).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except Exception as e:  # the template is code run on the client's data: any failure is a 400
        raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from None
    return RenderedPrompt(template_text=text, prompt_text=text)
