"""Which of a prefilled request's blocks to read, and the READs in flight.

The context worker leased the prompt's blocks `source_block_ids` (one per block_size tokens, the
last maybe partial). The engine gave this worker a block table for the prompt whose head is its
own prefix-cache hit, so only the tail is read:

    source (context)   [ s0 ][ s1 ][ s2 ][ s3 ]      s3 partial
    local  (this)      [ l0 ][ l1 ][ l2 ][ l3 ]
                        hit   hit  └─ one READ ─┘    l0, l1 already hold this prompt's KV

An empty tail (the whole prompt was cached here) needs no READ, only a notification so that the
source frees its lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import DecodeRequest
from engine.kv_transfer import TransferHandle


@dataclass(slots=True, frozen=True)
class ReadPlan:
    remote_block_ids: list[int]
    local_block_ids: list[int]


def plan_read(
    source_block_ids: list[int], local_table: list[int], num_valid_tokens: int, block_size: int
) -> ReadPlan:
    """The blocks to read: the source's prompt blocks past this worker's own prefix-cache hits."""
    if len(source_block_ids) != len(local_table):
        raise ValueError(
            f"the context worker leased {len(source_block_ids)} blocks for a prompt of "
            f"{len(local_table)} blocks: block_size differs between workers"
        )
    start = num_valid_tokens // block_size
    return ReadPlan(list(source_block_ids[start:]), list(local_table[start:]))


@dataclass(slots=True)
class Pull:
    """A request whose KV is on its way; `handle` is None when no READ was needed."""

    decode: DecodeRequest
    handle: TransferHandle | None
