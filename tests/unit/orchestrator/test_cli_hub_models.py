"""`orchestrator up` on a hub id: the model is downloaded once, before anything starts, or the
command stops with one line when it cannot be (offline and not cached)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.unit.common.fake_hub import MAIN, ROOT, TINY_ID, hub_env, run_cli, serve, tiny_hub


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_up_offline_without_the_model_exits_2_with_one_line_and_starts_nothing(
    tmp_path: Path,
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "model: someorg/missing\n"
        f"frontend: {{port: {free_port()}}}\n"
        f'orchestrator: {{address: "tcp://127.0.0.1:{free_port()}"}}\n'
    )
    result = run_cli(hub_env(tmp_path / "home"), "up", str(config))
    assert result.returncode == 2
    cache = (tmp_path / "home" / "hub").resolve()
    assert result.stderr.splitlines() == [
        f"error: model 'someorg/missing' is not in the Hugging Face cache {cache} and "
        "HF_HUB_OFFLINE is set: download it where the hub is reachable (`orchestrator download "
        "someorg/missing`) and copy that cache here, point HF_HOME or HF_HUB_CACHE at a cache "
        "that holds it, or set model: to a local model directory"
    ]
    assert result.stdout == ""


def test_up_downloads_a_missing_model_once_and_then_starts_from_the_cache(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """What `up` runs before it starts any process (ensure_model), twice: the second time the
    hub is not asked at all, and what the workers resolve is the snapshot downloaded."""
    prepare = (
        "import sys; from orchestrator.cli import ensure_model; "
        f"sys.exit(ensure_model({TINY_ID!r}, 'float32'))"
    )
    with serve(tiny_hub(tiny_model_path)) as hub:
        env = hub_env(tmp_path / "home", hub.url)

        def run_prepare() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", prepare], cwd=ROOT, env=env, capture_output=True,
                text=True, timeout=60,
            )  # fmt: skip

        first = run_prepare()
        assert first.returncode == 0, first.stderr
        downloads = [r for r in hub.requests if r.startswith("GET ") and "/resolve/" in r]
        assert len(downloads) == 6, hub.requests  # config, generation config, weights, 3 tokenizer
        asked = len(hub.requests)
        second = run_prepare()
        assert second.returncode == 0, second.stderr
        assert hub.requests[asked:] == []
        assert "[model download]" not in second.stderr
    snapshot = tmp_path / "home" / "hub" / "models--someorg--tiny-test" / "snapshots" / MAIN
    worker = subprocess.run(
        [sys.executable, "-c", f"from engine.config import EngineConfig as E; "
         f"print(E(model={TINY_ID!r}).model_dir())"],
        cwd=ROOT, env=hub_env(tmp_path / "home"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.stdout.strip() == str(snapshot.resolve()), worker.stderr
