"""The engine serves a hub id from the Hugging Face cache exactly as it serves the directory
the id was downloaded from: the same snapshot for every entry point, the same greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm import LLM
from tests.unit.common.fake_hub import MAIN, TINY_ID, hub_env, run_cli, serve, tiny_hub

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Path]:
    """A Hugging Face cache holding someorg/tiny-test, downloaded by the hub's own client from a
    fake hub on loopback (the tiny model's files)."""
    home = tmp_path_factory.mktemp("hf-home")
    with serve(tiny_hub(tiny_model_path)) as hub:
        result = run_cli(hub_env(home, hub.url), "download", TINY_ID)
    assert result.returncode == 0, result.stderr
    yield home


def test_llm_from_a_hub_id_offline_generates_the_tokens_of_the_directory(
    hf_home: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # offline on that cache; huggingface_hub read its environment at import, hence the constants
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = (hf_home / "hub" / "models--someorg--tiny-test" / "snapshots" / MAIN).resolve()
    assert EngineConfig(model=TINY_ID).model_dir() == snapshot

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    from_id = LLM(TINY_ID, num_blocks=128, block_size=16)
    assert from_id.engine.model_dir == snapshot
    by_id = [out.outputs[0].token_ids for out in from_id.generate(PROMPTS, params)]
    from_dir = LLM(str(tiny_model_path), num_blocks=128, block_size=16)
    by_dir = [out.outputs[0].token_ids for out in from_dir.generate(PROMPTS, params)]
    assert by_id == by_dir
    assert [len(tokens) for tokens in by_id] == [24] * len(PROMPTS)
