"""Hugging Face hub ids as `model:` values (`Qwen/Qwen3-0.6B`, `Qwen/Qwen3-0.6B@<revision>`),
resolved through the hub's own cache as `vllm serve` resolves them.

    $HF_HUB_CACHE (default $HF_HOME/hub, default ~/.cache/huggingface/hub)
        models--Qwen--Qwen3-0.6B/
            refs/main                   the commit `main` pointed at when last downloaded
            snapshots/<commit>/         config.json, tokenizer.json, *.safetensors ...
                                        (symlinks into blobs/): the model directory served
            blobs/, trees/<commit>.json the files, and the hub's listing of the commit

`orchestrator up` (and `LLM(...)`) download the files a server reads once, before any worker
starts, unless the cache holds them already; every other process (frontend, engine and postproc
workers) only looks the id up in the cache and never downloads, so all of them serve the same
snapshot. huggingface_hub reads HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_ENDPOINT itself,
when it is imported, and finds and writes every path in the cache: none is built here.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The files a server reads; all at the repo's top level (`original/` holds Meta's consolidated
# .pth checkpoints, other folders GGUF or ONNX exports, and Mistral's repos a second copy of the
# weights in their own names, consolidated.safetensors: none of them is read).
SERVER_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
NOT_SERVER_FILES = ["*/*", "consolidated*"]
REQUIRED_FILES = ("config.json", "tokenizer.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"

# org/name: the hub's characters (letters, digits, - _ .) on both sides of exactly one slash
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


class HubModelError(FileNotFoundError):
    """A hub id that cannot be served from here; the message is one line saying how to fix it."""


@dataclass(frozen=True, slots=True)
class HubId:
    repo_id: str  # org/name
    revision: str  # a branch, a tag or a commit; `main` unless `@revision` names one

    def __str__(self) -> str:
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


def parse_hub_id(model: str) -> HubId | None:
    """The hub id a `model:` value names, or None for a builtin or a path. A directory that
    exists wins over an id of the same spelling (as in vLLM); so does anything path-shaped."""
    if model.startswith(("builtin:", "/", ".", "~")) or Path(model).expanduser().exists():
        return None
    repo_id, at, revision = model.partition("@")
    if not _REPO_ID.fullmatch(repo_id):
        return None
    if at and not revision:
        raise ValueError(f"model {model!r}: nothing after '@' (want org/name@revision)")
    return HubId(repo_id, revision or "main")


def cache_dir() -> Path:
    """The hub cache this process looks in (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants  # on first use: most processes never resolve an id

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(hub: HubId) -> Path:
    """The snapshot directory of `hub` in the cache, without any network access: what the
    frontend and the workers serve once `orchestrator up` has downloaded it."""
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        path = _snapshot_download(hub, local_files_only=True)
    except IncompleteSnapshotError as exc:
        raise HubModelError(incomplete_message(hub, exc.snapshot_path)) from None
    except LocalEntryNotFoundError:
        raise HubModelError(
            f"model {str(hub)!r} is not in the Hugging Face cache {cache_dir()} "
            f"(`orchestrator up` downloads it before it starts the cluster, "
            f"`orchestrator download {hub}` ahead of time)"
        ) from None
    return checked_snapshot(hub, path)


def download_snapshot(hub: HubId) -> Path:
    """Ask the hub for `hub` and download what the cache lacks (with progress on stderr):
    `orchestrator download`. Offline (HF_HUB_OFFLINE, or no network) the cache alone answers."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    start = time.perf_counter()
    if not constants.HF_HUB_OFFLINE:
        _progress(f"{hub}: fetching config, tokenizer and safetensors weights into {cache_dir()}")
    try:
        path = _snapshot_download(hub, local_files_only=False)
    except IncompleteSnapshotError as exc:
        raise HubModelError(incomplete_message(hub, exc.snapshot_path)) from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE or isinstance(exc.__cause__, OfflineModeIsEnabled):
            reason = "HF_HUB_OFFLINE is set"
        else:
            reason = f"the hub at {constants.ENDPOINT} cannot be reached ({_cause(exc)})"
        raise HubModelError(not_cached_message(hub, reason)) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"model {str(hub)!r}: {hub.repo_id} has no revision {hub.revision!r} "
            f"on the hub at {constants.ENDPOINT}"
        ) from None
    except RepositoryNotFoundError:  # also gated and private repos without a token
        raise HubModelError(
            f"model {str(hub)!r}: no model {hub.repo_id} on the hub at {constants.ENDPOINT}, "
            "or it is gated or private (set HF_TOKEN to a token allowed to read it)"
        ) from None
    except Exception as exc:  # a transfer cut short, a full disk: one line, not a traceback
        raise HubModelError(f"model {str(hub)!r}: the download failed ({_cause(exc)})") from None
    checked_snapshot(hub, path)
    _progress(f"{hub}: ready in {path} ({time.perf_counter() - start:.0f} s)")
    return path


def prepare_snapshot(hub: HubId) -> Path:
    """The cached snapshot, downloading it first only when the cache lacks it or part of it:
    `orchestrator up` and `LLM(...)` start without asking the hub when they can."""
    try:
        return cached_snapshot(hub)
    except HubModelError:
        return download_snapshot(hub)


def _snapshot_download(hub: HubId, local_files_only: bool) -> Path:
    """huggingface_hub's own lookup (and download) of the serving files of `hub`."""
    import huggingface_hub

    return Path(
        huggingface_hub.snapshot_download(
            hub.repo_id,
            revision=hub.revision,
            allow_patterns=SERVER_FILES,
            ignore_patterns=NOT_SERVER_FILES,
            local_files_only=local_files_only,
        )
    )


def checked_snapshot(hub: HubId, path: Path) -> Path:
    """`path`, when it holds what serving needs: config.json, a fast tokenizer, and every
    safetensors file the weights index names (or at least one without an index)."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing += [shard for shard in shards if not (path / shard).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise HubModelError(
            f"model {str(hub)!r}: the snapshot {path} has no {', '.join(missing)} "
            "(served: config.json, tokenizer.json and safetensors weights; a repo without "
            "them cannot be served: set model: to a directory that has them)"
        )
    return path


def not_cached_message(hub: HubId, reason: str) -> str:
    return (
        f"model {str(hub)!r} is not in the Hugging Face cache {cache_dir()} and {reason}: "
        f"download it where the hub is reachable (`orchestrator download {hub}`) and copy that "
        "cache here, point HF_HOME or HF_HUB_CACHE at a cache that holds it, or set model: to "
        "a local model directory"
    )


def incomplete_message(hub: HubId, snapshot: str | Path) -> str:
    return (
        f"model {str(hub)!r}: the cached snapshot {snapshot} is incomplete (a download was cut "
        f"short?): `orchestrator download {hub}` completes it where the hub is reachable"
    )


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {cause}".splitlines()[0]


def _progress(message: str) -> None:
    """A download takes minutes: a line per stage beside huggingface_hub's progress bars."""
    print(f"[model download] {message}", file=sys.stderr, flush=True)
