"""A gpt-oss model directory for the unit tests: the harmony tokenizer (tools/tiny_arch/
harmony.py) and a config.json with model_type gpt_oss; no weights (the frontend and the postproc
workers read only these)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.tiny_arch.harmony import EOS_TOKEN_IDS, RETURN_ID, VOCAB_SIZE, write_harmony_tokenizer


def write_harmony_model_dir(path: Path) -> Path:
    write_harmony_tokenizer(path)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "max_position_embeddings": 4096,
        "eos_token_id": RETURN_ID,
    }
    (path / "config.json").write_text(json.dumps(config))
    generation = {"eos_token_id": list(EOS_TOKEN_IDS)}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path
