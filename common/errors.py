"""Errors that cross layers: what was wrong with a request, and which parameter it was.

The HTTP layer maps `InvalidRequest` to a 400 with `param` set; anything else is a server error.
Every error a client sees has the one body `error_body` makes, whichever process found it.
"""

from __future__ import annotations

import msgspec


class InvalidRequest(ValueError):
    """The request cannot be served as asked; `param` names the offending field, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """The one error body of every route: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a method the route does not have: the client's mistake
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """The JSON error body for `status_code`, typed the way OpenAI's clients expect."""
    detail = ErrorDetail(
        message=message,
        type=_ERROR_TYPES.get(status_code, "server_error"),
        param=param,
        code=code,
    )
    return msgspec.json.encode(ErrorResponse(error=detail))


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, kw_only=True, tag_field="type", tag="error"):
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""

    error: AnthropicErrorDetail


def anthropic_error_body(status_code: int, message: str) -> bytes:
    detail = AnthropicErrorDetail(
        type=_ANTHROPIC_ERROR_TYPES.get(status_code, "api_error"), message=message
    )
    return msgspec.json.encode(AnthropicErrorResponse(error=detail))


def as_anthropic_error(openai_body: bytes, status_code: int) -> bytes:
    """An error body made in the OpenAI shape (by a worker) in Anthropic's."""
    try:
        message = msgspec.json.decode(openai_body, type=ErrorResponse).error.message
    except msgspec.DecodeError:
        message = openai_body.decode(errors="replace")
    return anthropic_error_body(status_code, message)


def validation_location(message: str) -> tuple[str, str | None]:
    """Split msgspec's 'Expected `int` >= 1 - at `$.kv_cache.block_size`' into the reason and
    the path ('kv_cache.block_size'); None when the message names no place."""
    reason, sep, where = message.rpartition(" - at `$.")
    return (reason, where.rstrip("`")) if sep else (message, None)
