"""tool_choice and parallel_tool_calls → the constraint, prompt prefix and stop strings."""

from __future__ import annotations

from common import guided
from frontend.structured import plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_parallel_tool_calls_false_allows_one_call_in_every_mode() -> None:
    auto = plan_tools(TOOLS, "auto", parallel=False)
    assert auto.guided is None and auto.stop == (guided.TOOL_CALL_END,)  # stop after the first
    assert plan_tools(TOOLS, "auto").stop == ()
    single = plan_tools(TOOLS, "required", parallel=False).guided
    several = plan_tools(TOOLS, "required", parallel=True).guided
    assert single is not None and several is not None and single.grammar != several.grammar
    # required without parallel_tool_calls: one call (the model repeats a call it may repeat)
    unset = plan_tools(TOOLS, "required").guided
    assert unset is not None and unset.grammar == single.grammar
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, parallel=False)
    assert named.prompt_prefix == guided.TOOL_CALL_BEGIN and named.stop == ()
