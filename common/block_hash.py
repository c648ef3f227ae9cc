"""Chained KV block hashes, shared by the engine's prefix cache and the KV-aware router.

`h_i = blake2b-64(h_{i-1}, tokens of block i, extra keys)`: block i's hash covers the whole prefix
up to and including block i, so two sequences share block i's KV exactly when they share h_i. Only
full blocks are hashed. The byte encoding is canonical (little-endian, length-prefixed, type-tagged
extra keys), so the value is the same in every process, after restarts and on every machine;
Python's `hash()` is never used. Extra keys (LoRA id, cache_salt, ...) are mixed into every block so
differently-keyed sequences never share a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TypeAlias

# Versions the encoding: changing the byte layout must change this, so old hashes never match.
_PERSON = b"pdc-kvblock-v1"
HASH_ALGORITHM = f"blake2b-64 chained, person {_PERSON.decode()}"  # /server_info says it

_NO_PARENT = b"\x00"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

ExtraKey: TypeAlias = int | str | bytes | None | tuple["ExtraKey", ...]


def hash_block(
    parent: int | None, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
) -> int:
    """Hash of one block given its parent's hash (None for the first block); unsigned 64-bit."""
    return _hash(parent, token_ids, _encode_extra(extra_keys))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[ExtraKey, ...] = (),
    *,
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks `start, start + 1, ...` of `token_ids`.

    `parent` is the hash of block `start - 1` (None when `start == 0`), so a growing sequence can
    hash its new blocks without rehashing the old ones: `start=len(known), parent=known[-1]`.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if (start == 0) != (parent is None):
        raise ValueError("parent must be given exactly when start > 0")
    extra = _encode_extra(extra_keys)
    hashes: list[int] = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = _hash(parent, token_ids[begin : begin + block_size], extra)
        hashes.append(parent)
    return hashes


def _hash(parent: int | None, token_ids: Sequence[int], extra: bytes) -> int:
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(_NO_PARENT if parent is None else b"\x01" + _U64.pack(parent))
    h.update(_U32.pack(len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def _encode_extra(extra_keys: tuple[ExtraKey, ...]) -> bytes:
    """Type-tagged, length-prefixed bytes: ("1",) and (1,), ("ab",) and ("a", "b") all differ."""
    out = bytearray()
    _encode_key(tuple(extra_keys), out)
    return bytes(out)


def _encode_key(key: ExtraKey, out: bytearray) -> None:
    if key is None:
        out += b"n"
    elif isinstance(key, bool):  # before int: bool is an int subclass but a distinct key
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        out += b"i" + _U32.pack(len(raw)) + raw
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out += b"s" + _U32.pack(len(raw)) + raw
    elif isinstance(key, bytes):
        out += b"b" + _U32.pack(len(key)) + key
    elif isinstance(key, tuple):
        out += b"t" + _U32.pack(len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(f"extra key of type {type(key).__name__} has no canonical encoding")
