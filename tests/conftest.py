from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The builtin:tiny model directory, built into the cache on first use (under a minute)."""
    from engine.builtin_build import ensure_builtin  # lazy: torch-free tests must not import torch

    return ensure_builtin("builtin:tiny")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """builtin:smollm2-135m (float32), built into the cache on first use (about 30 s)."""
    from engine.builtin_build import ensure_builtin

    return ensure_builtin("builtin:smollm2-135m")
