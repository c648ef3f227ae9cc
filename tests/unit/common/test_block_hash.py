"""Chained block hashes: only full blocks, chained through the parent, stable across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.block_hash import ExtraKey, block_hashes, hash_block

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes([], 4) == []
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(8)), 4)) == 2
    assert len(block_hashes(list(range(11)), 4)) == 2


def test_hashes_chain_through_the_parent() -> None:
    tokens = list(range(12))
    h0 = hash_block(None, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    h2 = hash_block(h1, tokens[8:12])
    assert block_hashes(tokens, 4) == [h0, h1, h2]


def test_same_block_with_different_prefix_hashes_differently() -> None:
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_shared_prefix_gives_shared_hashes_until_divergence() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14], 4)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_hash_is_unsigned_64_bit() -> None:
    for h in block_hashes(list(range(64)), 4):
        assert 0 <= h < 2**64


def test_hash_matches_documented_byte_layout() -> None:
    """Re-derive the hash from the layout in block_hash.py, so a router in any language can too."""

    def reference(parent: int | None, tokens: list[int], salt: str) -> int:
        data = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
        data += len(tokens).to_bytes(4, "little")
        data += b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
        data += b"t" + (1).to_bytes(4, "little")  # extra keys: a 1-tuple ...
        data += b"s" + len(salt).to_bytes(4, "little") + salt.encode()  # ... holding one str
        digest = hashlib.blake2b(data, digest_size=8, person=b"pdc-kvblock-v1").digest()
        return int.from_bytes(digest, "little")

    h0 = reference(None, [1, 2, 3, -1], "salt")
    h1 = reference(h0, [151643, 0, 7, 2**31 - 1], "salt")
    assert block_hashes([1, 2, 3, -1, 151643, 0, 7, 2**31 - 1], 4, ("salt",)) == [h0, h1]


def test_root_block_differs_from_block_with_parent_zero() -> None:
    assert hash_block(None, [1, 2]) != hash_block(0, [1, 2])


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((), ("salt",)),
        (("salt-a",), ("salt-b",)),
        ((1,), ("1",)),
        (("ab",), ("a", "b")),
        ((b"x",), ("x",)),
        ((None,), ()),
        ((True,), (1,)),
        ((("lora", 1),), ("lora", 1)),
    ],
)
def test_extra_keys_change_hashes(a: tuple[ExtraKey, ...], b: tuple[ExtraKey, ...]) -> None:
    tokens = list(range(8))
    ha = block_hashes(tokens, 4, a)
    hb = block_hashes(tokens, 4, b)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]


def test_unencodable_extra_key_is_rejected() -> None:
    with pytest.raises(TypeError):
        hash_block(None, [1], (1.5,))  # type: ignore[arg-type]


def test_incremental_hashing_matches_full_rehash() -> None:
    tokens: list[int] = []
    known: list[int] = []
    for t in range(50):  # decode: one token at a time
        tokens.append(t * 7 % 13)
        parent = known[-1] if known else None
        known += block_hashes(tokens, 4, ("s",), start=len(known), parent=parent)
        assert known == block_hashes(tokens, 4, ("s",))
    assert len(known) == 12


def test_start_and_parent_must_agree() -> None:
    with pytest.raises(ValueError):
        block_hashes(list(range(8)), 4, start=1)
    with pytest.raises(ValueError):
        block_hashes(list(range(8)), 4, start=0, parent=5)
    with pytest.raises(ValueError):
        block_hashes(list(range(8)), 0)


def test_token_ids_accept_any_int_sequence() -> None:
    assert block_hashes(tuple(range(8)), 4) == block_hashes(list(range(8)), 4)
    assert block_hashes(range(8), 4) == block_hashes(list(range(8)), 4)


def test_hash_is_stable_across_processes_and_hash_seeds() -> None:
    code = (
        "from common.block_hash import block_hashes;"
        "print(block_hashes(list(range(40)), 16, ('salt', 3, None)))"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(proc.stdout.strip())
    here = str(block_hashes(list(range(40)), 16, ("salt", 3, None)))
    assert outputs == [here, here]
