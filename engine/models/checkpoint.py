"""Reading a safetensors checkpoint into a model built on the meta device, and the renames that
turn a checkpoint's tensor names into the engine's (fused projections, stacked experts).

Each architecture module says which conversions its checkpoints need; these helpers do them on the
name -> tensor dict before `load_state_dict(assign=True)`, so no tensor is held twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.quant.weight import QuantizedWeight, concat_rows

# a weight-only quantized matrix (a GGUF file's) stays a QuantizedWeight until the model's
# linear layer takes it (engine/models/__init__.py load_model)
State = dict[str, torch.Tensor | QuantizedWeight]


# cluster.yaml `quantization` (as vLLM's --quantization): auto reads what the checkpoint holds;
# a format's name also checks that the checkpoint holds it; dequantize loads quantized matrices
# as float tensors in the model's dtype (served by the float kernels, e.g. to compare)
QUANTIZATIONS = ("auto", "gguf", "compressed-tensors", "gptq", "awq", "dequantize")


def read_checkpoint(model_dir: Path, dtype: torch.dtype, quantization: str = "auto") -> State:
    """The weights in whichever format the directory holds them: one GGUF file (its quantized
    matrices kept as they are stored: engine/formats/gguf.py), else safetensors, quantized
    where config.json's quantization_config says so (engine/formats/hf_quant.py)."""
    stored = checkpoint_format(model_dir)
    if quantization not in ("auto", "dequantize", stored):
        raise ValueError(
            f"quantization: {quantization}, but {model_dir} holds "
            f"{stored + ' weights' if stored else 'unquantized safetensors'}"
        )
    if stored == "gguf":
        from engine.formats.gguf import load_gguf

        (gguf,) = model_dir.glob("*.gguf")
        state: State = dict(load_gguf(gguf).tensors)
    elif stored is not None:
        from engine.formats.hf_quant import read_quantized

        config = json.loads((model_dir / "config.json").read_text())
        state = read_quantized(model_dir, config, dtype)
    else:
        return read_safetensors(model_dir, dtype)
    for name, tensor in state.items():
        if not isinstance(tensor, QuantizedWeight):
            state[name] = tensor.to(dtype)
        elif quantization == "dequantize":
            state[name] = tensor.dequantize().to(dtype)
    return state


def checkpoint_format(model_dir: Path) -> str | None:
    """ "gguf" for a directory holding one GGUF file, else config.json's quantization_config
    quant_method, else None (unquantized safetensors)."""
    ggufs = sorted(model_dir.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ValueError(f"{model_dir}: {len(ggufs)} GGUF files; keep the one to serve")
    if ggufs:
        return "gguf"
    config_json = model_dir / "config.json"
    config = json.loads(config_json.read_text()) if config_json.is_file() else {}
    qconfig = config.get("quantization_config")
    return str(qconfig.get("quant_method", "?")) if qconfig else None


def read_safetensors(model_dir: Path, dtype: torch.dtype) -> State:
    """The weights of every shard (safetensors_files), in `dtype`."""
    state: State = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" not in name:  # old Llama checkpoints store inv_freq
                    state[name] = f.get_tensor(name).to(dtype)
    return state


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards model.safetensors.index.json names, else every *.safetensors (Mistral's
    repos keep a second copy in their own names, consolidated.safetensors, beside the indexed
    shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        files = [model_dir / shard for shard in sorted(shards)]
    else:
        files = [f for f in sorted(model_dir.glob("*.safetensors"))
                 if not f.name.startswith("consolidated")]  # fmt: skip
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def stack(state: State, parts: tuple[str, ...], fused: str) -> None:
    """Checkpoint projections that the model runs as one matmul: their weights (and biases)
    stacked along the output dimension, in `parts` order, under the fused name."""
    first = f".{parts[0]}."
    for name in [n for n in state if first in n]:
        prefix, _, kind = name.rpartition(first)  # kind: weight or bias
        tensors = [state.pop(f"{prefix}.{part}.{kind}") for part in parts]
        quantized = [t for t in tensors if isinstance(t, QuantizedWeight)]
        if not quantized:
            state[f"{prefix}.{fused}.{kind}"] = torch.cat(tensors)  # type: ignore[arg-type]
        elif len(quantized) == len(tensors):
            state[f"{prefix}.{fused}.{kind}"] = concat_rows(quantized)
        else:
            raise ValueError(f"{prefix}: {', '.join(parts)} are partly quantized")


def rename(state: State, pattern: str, replacement: str) -> None:
    """Every name matching the regex `pattern` renamed with re.sub(pattern, replacement)."""
    compiled = re.compile(pattern)
    for name in [n for n in state if compiled.search(n)]:
        state[compiled.sub(replacement, name)] = state.pop(name)


def stack_experts(
    state: State, moe_prefix: str, gate: str, up: str, down: str, num_experts: int
) -> None:
    """Experts stored one by one (`{moe_prefix}.experts.{e}.{gate|up|down}.weight`) as the
    engine's stacked tensors `{moe_prefix}.gate_up` (E, 2 * inter, hidden), gate rows first, and
    `{moe_prefix}.down` (E, hidden, inter), for every layer that has them."""
    pattern = re.compile(rf"^(.*\.{re.escape(moe_prefix)})\.experts\.0\.{re.escape(gate)}\.weight$")
    for name in [n for n in state if pattern.match(n)]:
        layer = pattern.match(name).group(1)  # type: ignore[union-attr]

        def take(e: int, part: str, layer: str = layer) -> torch.Tensor:
            weight = state.pop(f"{layer}.experts.{e}.{part}.weight")
            if isinstance(weight, QuantizedWeight):  # the experts' kernels take float weights
                raise ValueError(f"{layer}.experts: quantized experts are not supported yet "
                                 "(quantized dense linear layers are)")  # fmt: skip
            return weight

        state[f"{layer}.gate_up"] = torch.stack(
            [torch.cat([take(e, gate), take(e, up)]) for e in range(num_experts)]
        )
        state[f"{layer}.down"] = torch.stack([take(e, down) for e in range(num_experts)])


def moe_from_checkpoint(state: State, num_experts: int, gate: str, up: str, down: str) -> None:
    """A MoE layer's router (`mlp.gate`) as `mlp.router`, its experts stacked: one by one in the
    checkpoint (stack_experts) or already stacked, as transformers 5 keeps them in memory
    (experts.gate_up_proj / experts.down_proj)."""
    rename(state, r"\.mlp\.gate\.weight$", ".mlp.router.weight")
    stack_experts(state, "mlp", gate, up, down, num_experts)
    rename(state, r"\.mlp\.experts\.gate_up_proj$", ".mlp.gate_up")
    rename(state, r"\.mlp\.experts\.down_proj$", ".mlp.down")
