"""frontend/chat.py's thinking switches: `enable_thinking` and `thinking` equal after resolution."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from frontend.chat import thinking_kwargs


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
