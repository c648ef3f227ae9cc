"""Which blocks a generation worker reads: only those past its own prefix-cache hits."""

from __future__ import annotations

import pytest

from generation_worker.pulls import plan_read


def test_reads_only_blocks_past_the_local_prefix_hit() -> None:
    plan = plan_read([7, 3, 9, 12], [0, 1, 2, 5], num_valid_tokens=32, block_size=16)
    assert plan.remote_block_ids == [9, 12]
    assert plan.local_block_ids == [2, 5]


def test_a_fully_cached_prompt_reads_nothing() -> None:
    plan = plan_read([7, 3], [0, 1], num_valid_tokens=32, block_size=16)
    assert plan.remote_block_ids == [] and plan.local_block_ids == []


def test_mismatched_block_counts_name_the_likely_cause() -> None:
    with pytest.raises(ValueError, match="block_size differs"):
        plan_read([7, 3, 9], [0, 1], num_valid_tokens=0, block_size=16)
