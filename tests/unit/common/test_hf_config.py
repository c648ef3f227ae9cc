"""The defaults common/hf_config.py fills in are transformers' own; a checkpoint's fields win."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from common.hf_config import DEFAULTS, language_model_config


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_each_default_is_the_transformers_config_class_s(model_type: str) -> None:
    theirs = AutoConfig.for_model("gemma3_text" if model_type == "gemma3" else model_type)
    rope = theirs.rope_parameters
    global_rope = rope.get("full_attention", rope)
    for key, value in DEFAULTS[model_type].items():
        if key == "rope_theta":
            assert global_rope["rope_theta"] == value, key
        elif key == "rope_local_base_freq":
            assert rope["sliding_attention"]["rope_theta"] == value, key
        elif key == "rope_scaling":
            assert {k: global_rope[k] for k in value} == value, key
        elif key == "sliding_window_pattern":
            types = theirs.layer_types
            assert types[value - 1] == "full_attention" and types.count("full_attention") == (
                len(types) // value
            )  # fmt: skip
        else:
            assert getattr(theirs, key) == value, key


def test_a_checkpoint_s_own_fields_win_and_gpt_oss_layers_alternate() -> None:
    config = language_model_config({"model_type": "gpt_oss", "num_hidden_layers": 3,
                                    "rms_norm_eps": 1e-6})  # fmt: skip
    assert config["rms_norm_eps"] == 1e-6 and config["sliding_window"] == 128
    assert config["layer_types"] == AutoConfig.for_model("gpt_oss", num_hidden_layers=3).layer_types
    given = ["full_attention"] * 3
    assert language_model_config({"model_type": "gpt_oss", "layer_types": given,
                                  "num_hidden_layers": 3})["layer_types"] == given  # fmt: skip


def test_a_multimodal_gemma3_reads_as_its_text_config_keeping_the_top_level_eos() -> None:
    raw = {"model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "num_hidden_layers": 34}}  # fmt: skip
    config = language_model_config(raw)
    assert config["model_type"] == "gemma3" and config["eos_token_id"] == [1, 106]
    assert (config["hidden_size"], config["head_dim"], config["vocab_size"]) == (2560, 256, 262_208)
    assert language_model_config({"model_type": "llama", "vocab_size": 8}) == {
        "model_type": "llama", "vocab_size": 8
    }  # fmt: skip
