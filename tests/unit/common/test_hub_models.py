"""Hub ids (`model: org/name[@revision]`) through the Hugging Face cache: downloaded once by the
hub's own client (from a fake hub on loopback), then resolved offline by every process.

Nothing here reaches the network: downloads go to tests/unit/common/fake_hub.py on 127.0.0.1,
and the in-process tests run with HF_HUB_OFFLINE and HF_HOME under tmp_path.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import pytest

from common.builtin_models import resolve_model_dir
from common.config import ClusterConfig
from common.hub_models import HubId, HubModelError, cached_snapshot, parse_hub_id, prepare_snapshot
from tests.unit.common.fake_hub import (
    MAIN,
    NO_TOKENIZER,
    NOT_SERVED,
    ROOT,
    TINY_ID,
    V1,
    FakeHub,
    hub_env,
    run_cli,
    serve,
    tiny_hub,
)

REPO_DIR = "models--someorg--tiny-test"


@dataclass(slots=True)
class Downloaded:
    home: Path  # HF_HOME the downloads went to
    hub: FakeHub  # still serving, for tests that go online
    results: dict[str, subprocess.CompletedProcess[str]]  # `orchestrator download ID`, per ID

    @property
    def cache(self) -> Path:
        return (self.home / "hub").resolve()


@pytest.fixture(scope="module")
def downloaded(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[Downloaded]:
    home = tmp_path_factory.mktemp("hf-home")
    with serve(tiny_hub(tiny_model_path)) as hub:
        env = hub_env(home, hub.url)
        ids = [TINY_ID, f"{TINY_ID}@v1", "someorg/no-tokenizer"]
        yield Downloaded(home, hub, {model: run_cli(env, "download", model) for model in ids})


@pytest.fixture
def offline(downloaded: Downloaded, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process offline on the downloaded cache. huggingface_hub read its environment when
    it was imported, so its constants are set as a fresh import would set them."""
    use_cache(monkeypatch, downloaded.home)
    return downloaded.cache


def use_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


# --- telling ids apart ----------------------------------------------------------------------------


def test_ids_are_told_apart_from_builtins_and_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B", "main")
    assert parse_hub_id("Qwen/Qwen3-0.6B@v1.0") == HubId("Qwen/Qwen3-0.6B", "v1.0")
    assert parse_hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    for value in ("builtin:tiny", "/models/qwen", "./qwen", "~/qwen", "qwen", "a/b/c", "a b/c"):
        assert parse_hub_id(value) is None, value
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None  # a directory of that name wins, as in vLLM
    with pytest.raises(ValueError, match="nothing after '@'"):
        parse_hub_id("org/other@")
    assert str(HubId("org/name", "main")) == "org/name"
    assert str(HubId("org/name", "v1")) == "org/name@v1"


# --- downloading ----------------------------------------------------------------------------------


def test_download_fetches_only_the_files_a_server_reads_into_the_hubs_layout(
    downloaded: Downloaded, tiny_model_path: Path
) -> None:
    result = downloaded.results[TINY_ID]
    assert result.returncode == 0, result.stderr
    repo = downloaded.cache / REPO_DIR
    assert (repo / "refs" / "main").read_text() == MAIN
    snapshot = repo / "snapshots" / MAIN
    served = sorted(p.name for p in tiny_model_path.iterdir() if p.name != "pdcluster-build.json")
    assert sorted(p.name for p in snapshot.iterdir()) == served
    for path in snapshot.iterdir():
        assert path.is_symlink() and path.resolve().parent == repo / "blobs"
        assert path.read_bytes() == (tiny_model_path / path.name).read_bytes()
    fetched = [r for r in downloaded.hub.requests if "/resolve/" in r]
    assert not [r for r in fetched if any(r.endswith(name) for name in NOT_SERVED)]
    # progress on stderr: ours, around huggingface_hub's bar
    assert f"[model download] {TINY_ID}: fetching config, tokenizer" in result.stderr
    assert f"[model download] {TINY_ID}: ready in {snapshot}" in result.stderr
    assert "Fetching 6 files" in result.stderr


def test_an_unknown_repo_or_revision_on_the_hub_is_one_line(
    downloaded: Downloaded, tmp_path: Path
) -> None:
    env = hub_env(tmp_path / "home", downloaded.hub.url)
    no_repo = run_cli(env, "download", "someorg/nothing")
    assert no_repo.returncode == 2
    assert error_lines(no_repo) == [
        f"error: model 'someorg/nothing': no model someorg/nothing on the hub at "
        f"{downloaded.hub.url}, or it is gated or private (set HF_TOKEN to a token allowed to "
        "read it)"
    ]
    no_revision = run_cli(env, "download", f"{TINY_ID}@v9")
    assert no_revision.returncode == 2
    assert error_lines(no_revision) == [
        f"error: model '{TINY_ID}@v9': {TINY_ID} has no revision 'v9' on the hub at "
        f"{downloaded.hub.url}"
    ]


def test_an_unreachable_hub_without_the_model_cached_is_one_line(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = run_cli(hub_env(tmp_path / "home", endpoint), "download", "someorg/missing")
    assert result.returncode == 2
    [line] = error_lines(result)
    assert line.startswith(
        f"error: model 'someorg/missing' is not in the Hugging Face cache "
        f"{(tmp_path / 'home' / 'hub').resolve()} and the hub at {endpoint} cannot be reached "
        "(ConnectError"
    ), line


# --- resolving offline ----------------------------------------------------------------------------


def test_an_id_resolves_offline_to_its_snapshot_and_the_frontend_reports_the_id(
    offline: Path, tiny_model_path: Path
) -> None:
    from frontend.model_info import load_model_info

    snapshot = offline / REPO_DIR / "snapshots" / MAIN
    assert resolve_model_dir(TINY_ID) == snapshot
    assert cached_snapshot(HubId(TINY_ID, "main")) == snapshot
    assert prepare_snapshot(HubId(TINY_ID, "main")) == snapshot  # cached: no download
    info = load_model_info(ClusterConfig(model=TINY_ID))
    assert info.model_dir == snapshot
    assert info.name == TINY_ID  # what /v1/models lists and requests name
    assert (
        info.vocab_size == json.loads((tiny_model_path / "config.json").read_text())["vocab_size"]
    )


def test_a_revision_resolves_to_its_own_snapshot(offline: Path) -> None:
    tag = resolve_model_dir(f"{TINY_ID}@v1")
    assert tag == offline / REPO_DIR / "snapshots" / V1
    assert json.loads((tag / "generation_config.json").read_text())["top_k"] == 7
    assert resolve_model_dir(f"{TINY_ID}@{MAIN}") == offline / REPO_DIR / "snapshots" / MAIN
    assert resolve_model_dir(f"{TINY_ID}@main") == offline / REPO_DIR / "snapshots" / MAIN
    with pytest.raises(HubModelError, match=f"'{TINY_ID}@v2' is not in the Hugging Face cache"):
        resolve_model_dir(f"{TINY_ID}@v2")


def test_hf_home_and_hf_hub_cache_choose_the_cache(downloaded: Downloaded, tmp_path: Path) -> None:
    """In fresh processes, as every process of a cluster reads them: at import."""

    def resolve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        code = f"from common.builtin_models import resolve_model_dir as r; print(r({TINY_ID!r}))"
        return subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip

    snapshot = str(downloaded.cache / REPO_DIR / "snapshots" / MAIN)
    empty_home = tmp_path / "empty-home"
    assert resolve(hub_env(downloaded.home)).stdout.strip() == snapshot
    by_cache = resolve(hub_env(empty_home, HF_HUB_CACHE=str(downloaded.home / "hub")))
    assert by_cache.stdout.strip() == snapshot, by_cache.stderr
    elsewhere = resolve(hub_env(empty_home))
    assert elsewhere.returncode != 0
    assert f"is not in the Hugging Face cache {empty_home.resolve() / 'hub'} " in elsewhere.stderr


def test_offline_and_not_cached_is_one_line_naming_the_id_the_cache_and_the_fixes(
    offline: Path,
) -> None:
    with pytest.raises(HubModelError) as caught:
        prepare_snapshot(HubId("someorg/missing", "main"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"model 'someorg/missing' is not in the Hugging Face cache {offline} and HF_HUB_OFFLINE "
        "is set: download it where the hub is reachable (`orchestrator download someorg/missing`)"
    ), message
    assert "point HF_HOME or HF_HUB_CACHE at a cache that holds it" in message
    assert message.endswith("or set model: to a local model directory")


def test_a_snapshot_missing_files_is_one_line(
    downloaded: Downloaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def damaged_copy(name: str) -> Path:
        shutil.copytree(downloaded.home / "hub", tmp_path / name / "hub", symlinks=True)
        return tmp_path / name / "hub" / REPO_DIR

    # the hub's listing of the commit (trees/) says what is missing: huggingface_hub's check
    repo = damaged_copy("cut-short")
    (repo / "snapshots" / MAIN / "model.safetensors").unlink()
    use_cache(monkeypatch, tmp_path / "cut-short")
    with pytest.raises(HubModelError) as caught:
        resolve_model_dir(TINY_ID)
    assert str(caught.value) == (
        f"model '{TINY_ID}': the cached snapshot {repo.resolve() / 'snapshots' / MAIN} is "
        "incomplete (a download was cut short?): `orchestrator download someorg/tiny-test` "
        "completes it where the hub is reachable"
    )
    # a cache without the listing (written by an older client): our check of what serving reads
    repo = damaged_copy("no-listing")
    shutil.rmtree(repo / "trees")
    (repo / "snapshots" / MAIN / "tokenizer.json").unlink()
    (repo / "snapshots" / MAIN / "model.safetensors").unlink()
    use_cache(monkeypatch, tmp_path / "no-listing")
    with pytest.raises(HubModelError) as caught:
        resolve_model_dir(TINY_ID)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"model '{TINY_ID}': the snapshot {repo.resolve() / 'snapshots' / MAIN} has no "
        "tokenizer.json, *.safetensors (served: config.json, tokenizer.json and safetensors "
        "weights"
    ), message


def test_a_repo_without_a_fast_tokenizer_is_one_line_online_and_offline(
    downloaded: Downloaded, offline: Path
) -> None:
    snapshot = offline / "models--someorg--no-tokenizer" / "snapshots" / NO_TOKENIZER
    expected = f"model 'someorg/no-tokenizer': the snapshot {snapshot} has no tokenizer.json ("
    result = downloaded.results["someorg/no-tokenizer"]
    assert result.returncode == 2
    [line] = error_lines(result)
    assert line.startswith(f"error: {expected}"), line
    with pytest.raises(HubModelError) as caught:
        resolve_model_dir("someorg/no-tokenizer")
    assert str(caught.value).startswith(expected)
