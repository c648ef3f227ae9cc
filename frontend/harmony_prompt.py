"""A chat request as a harmony prompt, for models that take harmony (gpt-oss) rather than a chat
template: what the request says mapped onto what the harmony system and developer messages say
(common/harmony.py renders them).

    reasoning_effort (Chat), reasoning.effort (Responses),   → `Reasoning: low|medium|high`
    chat_template_kwargs.reasoning_effort                      (default medium; "minimal" is
                                                               low; "none" is refused: gpt-oss
                                                               always writes its analysis)
    chat_template_kwargs.enable_thinking false               → low, when no effort is named
      (Anthropic's thinking disabled): the least analysis; it still comes back as reasoning
    chat_template_kwargs.model_identity                      → the system message's first line
    response_format json_schema                              → `# Response Formats` (the grammar
                                                               holds the final answer to it)
    thinking_token_budget                                    → the budget on the analysis
                                                               channel (its header to <|end|>)

Every request also stops at <|return|> and <|call|>, whatever generation_config.json lists (as
vLLM adds them): a harmony answer or call ends there.
"""

from __future__ import annotations

import time
from typing import Any, get_args

from common import harmony
from common.errors import InvalidRequest
from common.harmony import ReasoningEffort, SystemSettings
from common.sampling_params import ThinkingBudget
from common.tokenizer import Tokenizer
from frontend.chat_template import RenderedPrompt
from frontend.structured import ResponseFormat

EFFORTS: tuple[ReasoningEffort, ...] = get_args(ReasoningEffort)


def reasoning_effort(effort: str | None, template_kwargs: dict[str, Any]) -> ReasoningEffort:
    least = template_kwargs.get("enable_thinking") is False
    default = "low" if least else "medium"
    chosen = effort if effort is not None else template_kwargs.get("reasoning_effort", default)
    if chosen == "minimal":
        return "low"
    for level in EFFORTS:
        if chosen == level:
            return level
    raise InvalidRequest(
        f"reasoning_effort {chosen!r}: this model always reasons; use low, medium or high",
        "reasoning_effort",
    )


def declared_format(response_format: ResponseFormat | None) -> harmony.ResponseFormat | None:
    """The json_schema format as the developer message declares it (json_object has no
    schema to declare: the grammar alone holds the answer to an object)."""
    if response_format is None or response_format.type != "json_schema":
        return None
    spec = response_format.json_schema or {}
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        return None  # structured.py refuses it with its own message
    description = spec.get("description")
    return harmony.ResponseFormat(
        name=str(spec.get("name") or "response"),
        schema=schema,
        description=description if isinstance(description, str) else None,
    )


def render_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    *,
    effort: str | None,
    template_kwargs: dict[str, Any],
    response_format: ResponseFormat | None,
    add_generation_prompt: bool,
) -> RenderedPrompt:
    """`messages`: chat.template_messages' dicts; `tools`: {"type": "function", "function": ...}."""
    identity = template_kwargs.get("model_identity")
    settings = SystemSettings(
        date=time.strftime("%Y-%m-%d"),
        effort=reasoning_effort(effort, template_kwargs),
        model_identity=identity if isinstance(identity, str) else harmony.MODEL_IDENTITY,
    )
    text = harmony.render(
        messages,
        [t["function"] for t in tools],
        settings,
        response_format=declared_format(response_format),
        add_generation_prompt=add_generation_prompt,
    )
    return RenderedPrompt(text, text)


def thinking_budget(tokens: int, tokenizer: Tokenizer) -> ThinkingBudget:
    """The engine's budget on the analysis channel: it opens with `<|channel|>analysis
    <|message|>` and ends at `<|end|>` (forced once the budget is spent; the model then writes
    its next message, the final answer or a call)."""
    return ThinkingBudget(
        tokens=tokens,
        start=tokenizer.encode(f"{harmony.CHANNEL}analysis{harmony.MESSAGE}"),
        end=tokenizer.encode(harmony.END),
        open_at_start=False,
    )


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of <|return|> and <|call|>, where a harmony output ends."""
    ids = (tokenizer.token_to_id(marker) for marker in (harmony.RETURN, harmony.CALL))
    return [i for i in ids if i is not None]
