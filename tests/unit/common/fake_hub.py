"""A Hugging Face hub on loopback, serving the few routes huggingface_hub's snapshot_download
calls, so that tests download with the hub's own client into a cache it lays out itself
(refs/, snapshots/ symlinked to blobs/, trees/) without touching the network.

    GET       /api/models/{org}/{name}/revision/{revision}   {"id", "sha", "siblings"}
    GET       /api/models/{org}/{name}/tree/{commit}         [{"type", "path", "size", "oid",
                                                               "lfs"}]  (one page)
    HEAD/GET  /{org}/{name}/resolve/{commit}/{path}          the file, with X-Repo-Commit and
                                                             ETag as the hub sends them

Unknown repos and revisions get the hub's 404s (X-Error-Code RepoNotFound, RevisionNotFound).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from subprocess import CompletedProcess, run
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[3]


@dataclass(slots=True)
class FakeRepo:
    refs: dict[str, str]  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]]  # commit -> {path in repo: content}


@dataclass(slots=True)
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[str] = field(default_factory=list)  # "GET /path", in arrival order
    url: str = ""

    def add_repo(
        self, repo_id: str, refs: dict[str, str], commits: dict[str, dict[str, bytes]]
    ) -> None:
        self.repos[repo_id] = FakeRepo(refs, commits)


def commit_sha(label: str) -> str:
    """A 40-hex commit id (the cache names snapshots by commit)."""
    return hashlib.sha1(label.encode()).hexdigest()


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _is_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".bin", ".pth", ".gguf"))


def _git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _etag(path: str, content: bytes) -> str:
    """The hub's ETag: an LFS file's sha256, else the git blob id."""
    return hashlib.sha256(content).hexdigest() if _is_lfs(path) else _git_blob_oid(content)


def _tree_entry(path: str, content: bytes) -> dict[str, object]:
    entry: dict[str, object] = {
        "type": "file",
        "path": path,
        "size": len(content),
        "oid": _git_blob_oid(content),
    }
    if _is_lfs(path):
        entry["lfs"] = {"oid": _etag(path, content), "size": len(content), "pointerSize": 134}
    return entry


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self.answer(send_body=False)

        def do_GET(self) -> None:
            self.answer(send_body=True)

        def answer(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                self.api(f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:]))
            elif len(parts) >= 5 and parts[2] == "resolve":
                self.resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), send_body)
            else:
                self.send_error(404)

        def api(self, repo_id: str, route: str, revision: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self.hub_error("RepoNotFound")
            commit = repo.refs.get(revision, revision)
            if commit not in repo.commits:
                return self.hub_error("RevisionNotFound")
            files = repo.commits[commit]
            if route == "revision":
                body = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": p} for p in files]}
                return self.json(body, commit)
            if route == "tree":
                return self.json([_tree_entry(p, c) for p, c in sorted(files.items())], commit)
            self.send_error(404)

        def resolve(self, repo_id: str, revision: str, path: str, send_body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self.hub_error("RepoNotFound")
            commit = repo.refs.get(revision, revision)
            content = repo.commits.get(commit, {}).get(path)
            if content is None:
                return self.hub_error("EntryNotFound")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(content)))
            self.send_header("ETag", f'"{_etag(path, content)}"')
            self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if send_body:
                self.wfile.write(content)

        def json(self, body: object, commit: str) -> None:
            self.send_json(200, body, {"X-Repo-Commit": commit})

        def hub_error(self, code: str) -> None:
            self.send_json(404, {"error": code}, {"X-Error-Code": code})

        def send_json(self, status: int, body: object, headers: dict[str, str]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    """The hub on 127.0.0.1 (an ephemeral port) for the duration; `hub.url` is HF_ENDPOINT."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# --- the tests' hub and cache ---------------------------------------------------------------------

TINY_ID = "someorg/tiny-test"
MAIN = commit_sha("tiny-test main")
V1 = commit_sha("tiny-test v1")
NO_TOKENIZER = commit_sha("no-tokenizer main")
# on the hub beside the served files, never downloaded: another format's weights, Meta's
# original checkpoint folder, a GGUF export, the model card
NOT_SERVED = {
    "pytorch_model.bin": b"\0" * 64,
    "original/consolidated.00.pth": b"\1" * 64,
    "original/params.json": b"{}",
    "model-q4.gguf": b"GGUF",
    "README.md": b"# tiny",
}


def tiny_hub(tiny_model_path: Path) -> FakeHub:
    """someorg/tiny-test: the tiny model at `main`, with a tag v1 whose generation_config
    differs (to tell the snapshots apart); someorg/no-tokenizer: a repo without tokenizer.json."""
    served = files_of(tiny_model_path)
    served.pop("pdcluster-build.json", None)
    v1 = dict(served)
    generation = json.loads(served["generation_config.json"])
    v1["generation_config.json"] = json.dumps({**generation, "top_k": 7}).encode()
    no_tokenizer = {k: v for k, v in served.items() if k != "tokenizer.json"}
    hub = FakeHub({})
    commits = {MAIN: {**served, **NOT_SERVED}, V1: {**v1, **NOT_SERVED}}
    hub.add_repo(TINY_ID, {"main": MAIN, "v1": V1}, commits)
    hub.add_repo("someorg/no-tokenizer", {"main": NO_TOKENIZER}, {NO_TOKENIZER: no_tokenizer})
    return hub


def hub_env(hf_home: Path, endpoint: str | None = None, **more: str) -> dict[str, str]:
    """A child's environment: its own HF_HOME, and the fake hub or no hub at all (offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **more)
    if endpoint is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = endpoint
    return env


def run_cli(env: dict[str, str], *args: str, timeout_s: float = 60) -> CompletedProcess[str]:
    return run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
