"""bench/gpu_checkpoint.py: a bench checkpoint built from SmolLM2's carried tokenizer files (a GPU
machine without internet) is byte for byte the one built from builtin:smollm2-135m here, and lands
where `builtin:<name>-bench` looks for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import gpu_checkpoint
from common.builtin_models import builtin_model
from common.model_cache import is_verified
from tools.tiny_arch import bench_dense

MODEL = "builtin:qwen2.5-0.5b-bench"


def test_built_from_the_carried_tokenizer_it_is_the_same_checkpoint(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    carried = gpu_checkpoint.save_tokenizer(tmp_path / "tokenizer")
    assert sorted(p.name for p in carried.iterdir()) == sorted(bench_dense.TOKENIZER_FILES)
    here = bench_dense.build_dense_bench(
        tmp_path / "here", "qwen2.5-0.5b", dtype="bfloat16", overrides=gpu_checkpoint.SMALL
    )
    small = gpu_checkpoint.build_small(MODEL, "bfloat16", carried, tmp_path / "small")
    builtin = builtin_model(MODEL)
    assert builtin is not None
    relocated = dataclasses.replace(builtin, directory=str(tmp_path / "cache" / "bench"))
    monkeypatch.setattr(gpu_checkpoint, "builtin_model", lambda name: relocated)
    cached = gpu_checkpoint.build(MODEL, "bfloat16", carried, gpu_checkpoint.SMALL)
    assert cached == relocated.model_dir("bfloat16") and is_verified(cached)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        expected = (here / name).read_bytes()
        assert (small / name).read_bytes() == expected, name
        assert (cached / name).read_bytes() == expected, name


def test_only_dense_bench_builtins_are_built() -> None:
    assert gpu_checkpoint.shape_name("builtin:llama-3.2-1b-bench") == "llama-3.2-1b"
    with pytest.raises(ValueError, match="not a dense bench builtin"):
        gpu_checkpoint.shape_name("builtin:tiny")
