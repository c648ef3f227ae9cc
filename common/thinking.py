"""Whether a rendered chat prompt leaves the model inside a `<think>` block.

Templates may prefill the reasoning markers: a forced-thinking template ends the prompt with
`<think>\\n` (the output starts inside the reasoning), and Qwen3's `enable_thinking=False`
renders an empty `<think>\\n\\n</think>\\n\\n` (the output is all content). Only the frontend
sees the rendered text; the postproc worker sees token ids, so the frontend resolves the state
here and sends it in `OutputOptions.parser_state.thinking`.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
PROMPT_TAIL_CHARS = 64  # only the end of the prompt can hold a prefilled marker


def resolve_prefilled_thinking(
    template_text: str, *, start: str = THINK_START, end: str = THINK_END
) -> bool | None:
    """True: the prompt ends inside thinking; False: it closed thinking; None: it did not say.

    `template_text` is the template's own output: a forced tool call's begin string, which the
    frontend appends after rendering, must not be part of it.
    """
    tail = template_text[-PROMPT_TAIL_CHARS:].rstrip()
    if tail.endswith(start):
        return True
    if tail.endswith(end):
        return False
    return None
