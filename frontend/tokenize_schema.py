"""Request bodies of /v1/tokenize and /v1/detokenize (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.chat import Message


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None  # either a prompt, or messages rendered with the chat template
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]
