"""Literal markers in streamed text: where the next one is, and how much of the tail to hold back.

Text arrives in arbitrary pieces, so a marker such as `</think>` can be split anywhere. A parser
emits everything up to the tail that could still grow into a marker, and holds that tail:

    "...the answer is 42</th" ──▶ emit "...the answer is 42", hold "</th"
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class Markers:
    """A fixed set of marker strings, searched as one regex; immutable, so parsers can share one."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = tuple(sorted({t for t in texts if t}, key=len, reverse=True))
        self._prefixes = frozenset(t[:k] for t in self.texts for k in range(1, len(t)))
        self._max_prefix_len = max((len(t) - 1 for t in self.texts), default=0)
        # Longest first: at one position the longer marker wins ("<tool_call>" vs "<tool").
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in self.texts)) if self.texts else None
        )

    def find(self, text: str) -> tuple[int, str] | None:
        """The first marker in `text`: (its start, the marker), or None."""
        if self._pattern is None:
            return None
        match = self._pattern.search(text)
        return None if match is None else (match.start(), match.group())

    def held_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is the start of a marker (0: none)."""
        for k in range(min(len(text), self._max_prefix_len), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0

    def remove(self, text: str) -> str:
        return text if self._pattern is None else self._pattern.sub("", text)


class MarkerFilter:
    """Removes markers from a stream of text (special tokens the client must not see)."""

    def __init__(self, markers: Markers) -> None:
        self._markers = markers
        self._held = ""

    def feed(self, text: str) -> str:
        text = self._markers.remove(self._held + text)
        split = len(text) - self._markers.held_len(text)
        self._held = text[split:]
        return text[:split]

    def finish(self) -> str:
        text, self._held = self._held, ""
        return text
