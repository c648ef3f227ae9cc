"""The model cache: built once, verified on reuse, one builder at a time across processes."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from common import model_cache
from common.builtin_models import SMOLLM2_135M, TINY, builtin_model, resolve_model_dir
from common.model_cache import ensure_built, is_complete, is_verified, read_record

BUILD_S = 1.0


def slow_build(path: Path) -> None:
    """A stand-in model: one weights file, written slowly so that builders overlap; each call
    leaves a mark in the shared log so the test can count builds."""
    with (path.parent / "builds.log").open("a") as log:
        log.write("build\n")
    time.sleep(BUILD_S)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights" * 1000)


def build_in_child(target: str) -> None:
    ensure_built(Path(target), "builtin:test", "float32", slow_build)


def test_a_built_model_is_complete_verified_and_reused(tmp_path: Path) -> None:
    target = tmp_path / "model-v1"
    assert ensure_built(target, "builtin:test", "float32", slow_build) == target
    record = read_record(target)
    assert record is not None and record.model == "builtin:test" and record.dtype == "float32"
    assert is_complete(target) and is_verified(target)
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    ensure_built(target, "builtin:test", "float32", slow_build)
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
    assert (tmp_path / "builds.log").read_text().count("build") == 1
    # nothing left of the staging directory but the lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".model-v1.lock",
        "builds.log",
        "model-v1",
    ]


def test_concurrent_builders_build_once_and_both_get_the_model(tmp_path: Path) -> None:
    target = tmp_path / "model-v1"
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=build_in_child, args=(str(target),)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert (tmp_path / "builds.log").read_text().count("build") == 1
    assert is_verified(target)


def test_damaged_weights_are_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "model-v1"
    ensure_built(target, "builtin:test", "float32", slow_build)
    (target / "model.safetensors").write_bytes(b"corrupted")
    assert not is_verified(target)
    ensure_built(target, "builtin:test", "float32", slow_build)
    assert is_verified(target)
    assert (tmp_path / "builds.log").read_text().count("build") == 2
    assert "weights changed; rebuilding" in capsys.readouterr().err


def test_an_interrupted_build_leaves_nothing_in_place(tmp_path: Path) -> None:
    target = tmp_path / "model-v1"

    def failing_build(path: Path) -> None:
        (path / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        ensure_built(target, "builtin:test", "float32", failing_build)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".model-v1.lock"]


def test_builtins_resolve_to_their_cache_directory_or_say_how_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert builtin_model("builtin:tiny") is TINY and builtin_model("/some/dir") is None
    with pytest.raises(ValueError, match="builtin:tiny, builtin:smollm2-135m"):
        builtin_model("builtin:gpt-5")
    assert SMOLLM2_135M.model_dir("bfloat16").name.endswith("-bfloat16")
    assert TINY.model_dir("bfloat16") == TINY.model_dir("float32")  # one float32 build serves
    monkeypatch.setattr("common.builtin_models.CACHE_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match="orchestrator build-model builtin:smollm2-135m"):
        resolve_model_dir("builtin:smollm2-135m")


def test_progress_lines_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    model_cache.progress("stage 1/2")
    assert capsys.readouterr().err == "[model build] stage 1/2\n"


def test_resolve_model_dir(tmp_path: Path, tiny_model_path: Path) -> None:
    assert resolve_model_dir("builtin:tiny") == TINY.model_dir() == tiny_model_path
    assert resolve_model_dir(str(tiny_model_path)) == tiny_model_path
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model_dir(str(tmp_path / "missing"))
