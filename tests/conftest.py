from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The builtin:tiny model directory, built into the default cache on first use (~1 min)."""
    from engine.tiny_model import ensure_tiny_model  # lazy: torch-free tests must not import torch

    return ensure_tiny_model()
