"""What every message shares: the tagged msgspec base (the `type` field names the message)
and the encoding of token ids, which travel as base64 of little-endian int32, never as JSON
lists."""

from __future__ import annotations

import base64

import msgspec
import numpy as np


class _Message(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True):
    pass


def encode_token_ids(token_ids: list[int]) -> str:
    """Prompt token ids as base64 of little-endian int32: compact, and never a JSON list."""
    return base64.b64encode(np.asarray(token_ids, dtype="<i4").tobytes()).decode("ascii")


def decode_token_ids(b64: str) -> list[int]:
    raw = base64.b64decode(b64, validate=True)
    if len(raw) % 4:
        raise ValueError("prompt_token_ids_b64 must hold a whole number of int32 values")
    return [int(i) for i in np.frombuffer(raw, dtype="<i4")]


def count_token_ids(b64: str) -> int:
    """How many token ids `b64` holds, read from its length (nothing decoded)."""
    padding = len(b64) - len(b64.rstrip("="))
    return (len(b64) * 3 // 4 - padding) // 4


def tail_token_ids(b64: str, num_tokens: int) -> str:
    """The last `num_tokens` token ids of `b64` (up to two more), still encoded, cut without
    decoding: three int32 are 12 bytes, 16 base64 characters, so a cut at a multiple of three
    tokens keeps whole base64 groups.

        ids     | t0 t1 t2 | t3 t4 t5 | t6 t7 ... |
        base64  | 16 chars | 16 chars | 16 ...    |   cut here ─▶ a valid encoding of t3...
    """
    start = max(0, count_token_ids(b64) - num_tokens) // 3
    return b64[start * 16 :]
