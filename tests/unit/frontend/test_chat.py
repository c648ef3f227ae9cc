"""frontend/chat.py's thinking switches (`enable_thinking` and `thinking` equal after resolution)
and the thinking a forced call's grammar allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ClusterConfig
from common.errors import InvalidRequest
from frontend.chat import thinking_kwargs, thinking_mode
from frontend.model_info import load_model_info


@pytest.mark.parametrize(
    ("kwargs", "effort", "expected"),
    [
        ({}, None, {}),
        ({"enable_thinking": False}, None, {"enable_thinking": False, "thinking": False}),
        ({"thinking": True}, None, {"thinking": True, "enable_thinking": True}),
        ({}, "high", {"enable_thinking": True, "thinking": True}),
        ({}, "minimal", {"enable_thinking": False, "thinking": False}),
        # the kwargs the request set explicitly win over reasoning_effort
        ({"enable_thinking": False}, "high", {"enable_thinking": False, "thinking": False}),
        (
            {"thinking": True, "enable_thinking": True},
            "none",
            {"thinking": True, "enable_thinking": True},
        ),
    ],
)
def test_the_two_switches_always_agree(kwargs: dict, effort: str | None, expected: dict) -> None:
    assert thinking_kwargs(kwargs, effort) == expected


def test_the_two_set_to_different_values_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        thinking_kwargs({"enable_thinking": True, "thinking": False})
    assert refused.value.param == "chat_template_kwargs"


def test_the_thinking_mode_of_a_forced_call_follows_the_rendered_prompt(
    tiny_model_path: Path, smollm2_path: Path
) -> None:
    tiny = load_model_info(ClusterConfig(model="builtin:tiny"))  # qwen3-like: <think> tokens
    assert thinking_mode(tiny, "<|im_start|>assistant\n") == "optional"
    assert thinking_mode(tiny, "<|im_start|>assistant\n<think>\n") == "open"
    assert thinking_mode(tiny, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "off"
    smollm2 = load_model_info(ClusterConfig(model="builtin:smollm2-135m"))  # does not think
    assert thinking_mode(smollm2, "<|im_start|>assistant\n<think>\n") == "off"
