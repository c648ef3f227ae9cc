"""Stop strings over streamed text, OpenAI semantics: the output ends just before the first match.

Text that could still grow into a stop string is held back, so a streaming client never sees part of
a stop string that is then retracted:

    stop = ["###"], text so far "ab#"  ->  emit "ab", hold "#"
    next "#x"                          ->  "##x" cannot start "###": emit "##x"
    next "#" then "##"                 ->  match: emit nothing more, finish with "stop"

Held text is released by `flush` when the choice ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Per-choice matcher; each `feed` costs O(new text + longest stop string) per stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in dict.fromkeys(stop) if s)  # "" would match everywhere
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Take new text, return what is safe to show; after a match, `matched` is set."""
        if self.matched is not None:
            return ""
        if not self._stop:
            return text
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            position, self.matched = match
            self._held = ""
            return buffer[:position]
        num_held = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held]

    def flush(self) -> str:
        """The choice ended without a match: release the held text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """The earliest stop string in `buffer` (the held part never contains a whole one)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            position = buffer.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
