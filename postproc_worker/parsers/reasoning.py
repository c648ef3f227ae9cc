"""Reasoning parser: a chat choice's text split into reasoning (`<think>…</think>`) and content.

Where the output starts depends on the prompt (`thinking`, see common/thinking.py) and on the
format:

    thinking=True (prompt ended in <think>) ─────────────┐
    thinking=None, deepseek-r1 (assumes it starts inside)┴─▶ REASONING ──"</think>"──▶ CONTENT
    thinking=None, qwen3 ──▶ START ──"<think>" first─────────▲                          ▲
                               └──anything else─────────────────────────────────────────┤
    thinking=False (prompt closed thinking) ────────────────────────────────────────────┘

One reasoning block per output: after `</think>` every character is content (tags included), and
the whitespace right after `</think>` is dropped. A `<think>` inside the reasoning is dropped
(deepseek-r1 models repeat it when the prompt did not end with it). Text arrives already
detokenized; a marker split across deltas is held back until it is whole (markers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from common.parser_choice import ReasoningParserName
from common.thinking import THINK_END, THINK_START
from postproc_worker.parsers.markers import Markers


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str = THINK_START
    end: str = THINK_END
    reasoning_at_start: bool = False  # when the prompt did not say: the output starts inside
    # harmony: no tags, the analysis channel is the reasoning, split out with the calls by
    # parsers/harmony.py (pipeline.py runs that parser instead)
    channels: bool = False


REASONING_PARSERS: dict[ReasoningParserName, ReasoningFormat] = {
    "qwen3": ReasoningFormat(),
    "deepseek-r1": ReasoningFormat(reasoning_at_start=True),
    "harmony": ReasoningFormat(start="", end="", channels=True),
}


class _Phase(Enum):
    START = "start"  # content so far is whitespace; a <think> now opens the reasoning
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """Per-choice state; `feed` and `finish` return (reasoning, content) for the new text."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool | None) -> None:
        self._fmt = fmt
        self._markers = Markers((fmt.start, fmt.end))
        if thinking is None:
            self._phase = _Phase.REASONING if fmt.reasoning_at_start else _Phase.START
        else:
            self._phase = _Phase.REASONING if thinking else _Phase.CONTENT
        self._buf = ""
        self._strip_content = False  # drop whitespace until the first content after </think>

    @property
    def markers(self) -> tuple[str, ...]:
        return self._markers.texts

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: release what was held (an unclosed reasoning stays one)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content = ""
        while self._buf:
            if self._phase is _Phase.START:
                head = self._buf.lstrip()
                if head.startswith(self._fmt.start):
                    self._buf = head[len(self._fmt.start) :]
                    self._phase = _Phase.REASONING
                elif self._fmt.start.startswith(head) and not final:
                    break  # whitespace or part of <think>: wait for more
                else:
                    self._phase = _Phase.CONTENT
            elif self._phase is _Phase.REASONING:
                found = self._markers.find(self._buf)
                if found is None:
                    split = len(self._buf) - (0 if final else self._markers.held_len(self._buf))
                    reasoning.append(self._buf[:split])
                    self._buf = self._buf[split:]
                    break
                pos, marker = found
                reasoning.append(self._buf[:pos])
                self._buf = self._buf[pos + len(marker) :]
                if marker == self._fmt.end:
                    self._phase = _Phase.CONTENT
                    self._strip_content = True
            else:
                content, self._buf = self._buf, ""
                if self._strip_content:
                    content = content.lstrip()
                    self._strip_content = not content
        return "".join(reasoning), content
