"""Following JSON as it streams in: where a value ends, and a tool call object's name and arguments.

Tool-call arguments are streamed to the client as the model writes them: the fragments are the
model's own text of the arguments value, cut wherever the deltas fall, so their concatenation is
exactly that text (valid JSON once the value is complete, and `json.loads` of it equals the
arguments). The text is scanned once, however small the deltas.
"""

from __future__ import annotations

import json
from enum import Enum

_WHITESPACE = " \t\r\n"
_SCALAR_END = ",}]" + _WHITESPACE


class JsonValue:
    """Finds the end of one JSON value (string, number, literal, object, array), char by char.

    It checks only the nesting, not the grammar: a malformed value still ends at its closing
    bracket, and `json.loads` is left to whoever needs the value itself.
    """

    __slots__ = ("depth", "done", "first", "_in_string", "_escape", "_scalar")

    def __init__(self) -> None:
        self.depth = 0
        self.done = False
        self.first = ""  # the value's first character: its kind
        self._in_string = False
        self._escape = False
        self._scalar = False

    def feed(self, text: str, start: int = 0) -> int:
        """Consume `text[start:]` up to the end of the value; return the index just after it.

        The value must start at `start` (no leading whitespace). A number or literal ends at
        the first delimiter, which is not consumed.
        """
        for i in range(start, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif not self.first:
                self.first = ch
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self.depth = 1
                else:
                    self._scalar = True
            elif self._scalar:
                if ch in _SCALAR_END:
                    self.done = True
                    return i
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _Phase(Enum):
    OPEN = "open"  # before "{"
    KEY = "key"  # before a key or "}"
    COLON = "colon"
    VALUE = "value"  # before a value
    IN_KEY = "in key"
    IN_VALUE = "in value"
    NEXT = "next"  # after a value: "," or "}"


class CallObject:
    """One `{"name": ..., "arguments": {...}}` object of a tool call, followed as it streams in.

    `name` is set once its string is whole; `arguments_started` once the arguments value begins;
    `take_arguments()` hands out the arguments text not yet taken (an arguments value written as
    a JSON string, `"{\\"a\\": 1}"`, is handed out decoded, in one piece, when whole). `done`:
    the closing brace was read; `failed`: the text is not such an object.
    """

    def __init__(
        self,
        arguments_keys: frozenset[str],
        allowed_keys: frozenset[str] | None = None,  # None: any other key is skipped
    ) -> None:
        self.arguments_keys = arguments_keys
        self.allowed_keys = allowed_keys
        self.name: str | None = None
        self.arguments_started = False
        self.arguments_done = False
        self.done = False
        self.failed = False
        self.raw = ""  # everything consumed, for the caller to show as content if this fails
        self._phase = _Phase.OPEN
        self._key = ""
        self._value = JsonValue()
        self._value_text: list[str] = []  # the key, or a value other than streamed arguments
        self._streaming_arguments = False
        self._arguments: list[str] = []

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def feed(self, text: str) -> int:
        """Consume text up to the closing brace (or the failure); return how much was consumed."""
        i, n = 0, len(text)
        while i < n and not (self.done or self.failed):
            if self._phase in (_Phase.IN_KEY, _Phase.IN_VALUE):
                end = self._value.feed(text, i)
                streamed = self._streaming_arguments and self._value.first != '"'
                (self._arguments if streamed else self._value_text).append(text[i:end])
                i = end
                if self._value.done:
                    self._end_value()
                continue
            ch = text[i]
            if ch in _WHITESPACE:
                i += 1
                continue
            if self._phase is _Phase.VALUE:
                self._start_value()
                continue  # the tracker reads this character
            self._structural(ch)
            i += 1
        self.raw += text[:i]
        return i

    def _structural(self, ch: str) -> None:
        phase = self._phase
        if phase is _Phase.OPEN and ch == "{":
            self._phase = _Phase.KEY
        elif phase is _Phase.KEY and ch == '"':
            self._phase = _Phase.IN_KEY
            self._value = JsonValue()
            self._value.feed('"')
            self._value_text = ['"']
        elif phase in (_Phase.KEY, _Phase.NEXT) and ch == "}":
            self.done = True
        elif phase is _Phase.NEXT and ch == ",":
            self._phase = _Phase.KEY
        elif phase is _Phase.COLON and ch == ":":
            self._phase = _Phase.VALUE
        else:
            self.failed = True

    def _start_value(self) -> None:
        self._phase = _Phase.IN_VALUE
        self._value = JsonValue()
        self._value_text = []
        is_arguments = self._key in self.arguments_keys and not self.arguments_started
        self._streaming_arguments = is_arguments
        if is_arguments:
            self.arguments_started = True

    def _end_value(self) -> None:
        text = "".join(self._value_text)
        if self._phase is _Phase.IN_KEY:
            key = _loads(text)
            allowed = self.allowed_keys is None or key in self.allowed_keys
            if isinstance(key, str) and allowed:
                self._key = key
                self._phase = _Phase.COLON
            else:
                self.failed = True
            return
        self._phase = _Phase.NEXT
        if self._streaming_arguments:
            self._streaming_arguments = False
            self.arguments_done = True
            if self._value.first == '"':  # arguments written as a JSON string holding JSON
                decoded = _loads(text)
                self._arguments.append(decoded if isinstance(decoded, str) else "")
        elif self._key == "name":
            name = _loads(text)
            if isinstance(name, str) and self.name is None:
                self.name = name
            else:
                self.failed = True


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
