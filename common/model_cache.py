"""Model directories built once per machine into ~/.cache/pdcluster, safely and verifiably.

A builtin model (`builtin:tiny`, `builtin:smollm2-135m`) is built by code, not downloaded. The
cache keeps one directory per model (and dtype) with a build record beside the weights:

    ~/.cache/pdcluster/
        .smollm2-135m-instruct-v1-float32.lock     flock: one builder at a time, others wait
        smollm2-135m-instruct-v1-float32/
            config.json, tokenizer.json, ..., model.safetensors
            pdcluster-build.json                   written last: its presence = complete
                                                   (sha256 of the weights, build seconds)

A directory is built in a staging sibling and renamed into place, so the cache holds either
nothing or a complete model. On reuse the weights' checksum is compared with the record; a
mismatch (a file damaged or edited) rebuilds. Torch-free: the CLI checks the cache without it.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

CACHE_ROOT = Path("~/.cache/pdcluster").expanduser()
BUILD_RECORD = "pdcluster-build.json"
_CHUNK_BYTES = 1 << 22


class BuildRecord(msgspec.Struct, frozen=True):
    model: str  # the builtin name, e.g. builtin:smollm2-135m
    dtype: str
    weights_sha256: str  # over every *.safetensors file, in name order
    build_seconds: float


def progress(message: str) -> None:
    """One line per build stage on stderr: a build takes up to a minute and must not look hung."""
    print(f"[model build] {message}", file=sys.stderr, flush=True)


def weights_sha256(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def read_record(model_dir: Path) -> BuildRecord | None:
    try:
        return msgspec.json.decode((model_dir / BUILD_RECORD).read_bytes(), type=BuildRecord)
    except (OSError, msgspec.DecodeError):
        return None


def is_complete(model_dir: Path) -> bool:
    """Cheap: the build finished (its record exists). Processes that only read the tokenizer
    use this; builders and `orchestrator up` also verify the checksum."""
    return read_record(model_dir) is not None


def is_verified(model_dir: Path) -> bool:
    record = read_record(model_dir)
    return record is not None and record.weights_sha256 == weights_sha256(model_dir)


@contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Exclusive while held; a second builder blocks here, then finds the model built."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def ensure_built(target: Path, model: str, dtype: str, build: Callable[[Path], None]) -> Path:
    """`target` verified, building it with `build(staging_dir)` first when missing or damaged."""
    with build_lock(target):
        if target.exists():
            if is_verified(target):
                return target
            progress(f"{model}: {target} is incomplete or its weights changed; rebuilding")
            shutil.rmtree(target)
        start = time.perf_counter()
        progress(f"{model} ({dtype}): building into {target} (once per machine)")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            record = BuildRecord(
                model=model,
                dtype=dtype,
                weights_sha256=weights_sha256(staging),
                build_seconds=round(time.perf_counter() - start, 1),
            )
            (staging / BUILD_RECORD).write_bytes(msgspec.json.format(msgspec.json.encode(record)))
            staging.chmod(0o755)  # mkdtemp makes it 0700; give it a plain directory's mode
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        progress(f"{model} ({dtype}): ready in {record.build_seconds:.0f} s")
        return target
