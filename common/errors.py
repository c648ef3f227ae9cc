"""Errors that cross layers: what was wrong with a request, and which parameter it was.

The HTTP layer maps `InvalidRequest` to a 400 with `param` set; anything else is a server error.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request cannot be served as asked; `param` names the offending field, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
