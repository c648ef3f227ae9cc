"""cluster.yaml validation: the shipped file loads, a bad one names the key and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import (
    ClusterConfig,
    ConfigError,
    context_length,
    load_cluster_config,
    parse_cluster_config,
)

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_cluster_yaml_is_the_embedded_default() -> None:
    config = load_cluster_config(ROOT / "deploy/local/cluster.yaml")
    assert config == ClusterConfig()
    assert config.model == "builtin:smollm2-135m"
    assert config.frontend.host == "127.0.0.1"


def test_shipped_aggregated_example_is_valid() -> None:
    config = load_cluster_config(ROOT / "deploy/local/cluster-aggregated.yaml")
    assert config.mode == "aggregated"


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_gives_the_defaults(text: str) -> None:
    assert parse_cluster_config(text) == ClusterConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kv_cache: {block_size: 0}", "kv_cache.block_size: Expected `int` >= 1"),
        ("kv_cache: {dtype: fp8}", "kv_cache.dtype: Invalid enum value 'fp8'"),
        ("frontend: {prot: 1}", "frontend: Object contains unknown field `prot`"),
        ("mode: both", "mode: Invalid enum value 'both'"),
        ("quantization: int3", "quantization: Invalid enum value 'int3'"),
        ("orchestrator: {address: foo}", "orchestrator.address: Expected `str` matching"),
        ("generation_workers: {count: x}", "generation_workers.count: Expected `int`, got `str`"),
        ("a: [", "not valid YAML"),
    ],
)
def test_bad_values_name_the_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="^cluster.yaml: ") as info:
        parse_cluster_config(text)
    assert expected in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "nope.yaml")


def test_the_context_length_is_the_models_capped_at_what_the_kv_cache_holds() -> None:
    assert context_length(4096, None, num_blocks=512, block_size=16) == (4096, None)
    length, why = context_length(131072, None, num_blocks=512, block_size=16)
    assert length == 8192 and why is not None and "131072" in why and "num_blocks" in why
    assert context_length(131072, 2048, num_blocks=512, block_size=16) == (2048, None)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 4096"):
        context_length(4096, 5000, num_blocks=4096, block_size=16)
    with pytest.raises(ValueError, match="exceeds the KV cache's 8192 tokens"):
        context_length(131072, 10000, num_blocks=512, block_size=16)
