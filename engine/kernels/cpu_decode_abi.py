"""The one-call C decode step's interface (cpu_decode_step.h, built into cpu_kernels' library):
the structures that hand it every layer's tensors by address and the model's shape, and the call.
engine/models/cpu_decode.py fills them once per model and KV cache."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_quant
from engine.kernels.cpu_kernels import DTYPE_CODES, library, run

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class QuantSpec(ctypes.Structure):
    """cpu_decode_step.h's QuantSpec: bits 0 (a float matrix) or 4 / 8 in groups (cpu_quant.c)."""

    _fields_ = [("bits", _i64), ("group_size", _i64)]


class LayerAttention(ctypes.Structure):
    """cpu_decode_step.h's LayerAttention: a layer's attention tensors and settings."""

    _fields_ = [
        *((name, _p) for name in (
            "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "sinks", "cos", "sin",
            "k_cache", "v_cache",
        )),
        ("rotary_dim", _i64), ("positions_row", _i64), ("window", _i64), ("scale", _f32),
        ("soft_cap", _f32), ("qkv_quant", QuantSpec), ("o_quant", QuantSpec),
    ]  # fmt: skip


class LayerMlp(ctypes.Structure):
    """cpu_decode_step.h's LayerMlp: dense (gate_up, down) or a mixture (router set)."""

    _fields_ = [
        *((name, _p) for name in (
            "gate_up", "down", "router", "router_bias", "experts_gate_up", "experts_down",
            "experts_gate_up_bias", "experts_down_bias",
        )),
        ("activation", _i64), ("gate_up_quant", QuantSpec), ("down_quant", QuantSpec),
    ]  # fmt: skip


class DecodeLayer(ctypes.Structure):
    """cpu_decode_step.h's DecodeLayer: one layer's tensors, by address."""

    _fields_ = [
        ("attn", LayerAttention),
        *((name, _p) for name in ("input_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")),
        ("mlp", LayerMlp),
    ]


class MoeShape(ctypes.Structure):
    """cpu_decode_step.h's MoeShape: the mixture of experts' settings (zeros: none)."""

    _fields_ = [
        *((name, _i64) for name in (
            "num_experts", "top_k", "intermediate", "chunk_bytes", "routing", "renormalize",
            "activation", "pairs",
        )),
        ("alpha", _f32), ("limit", _f32),
    ]  # fmt: skip


class DecodeShape(ctypes.Structure):
    """cpu_decode_step.h's DecodeShape: the model's sizes and the step's attention layout."""

    _fields_ = [
        *((name, _i64) for name in (
            "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "block_size",
            "block_stride", "max_blocks",
        )),
        ("eps", _f32), ("threads", _int), ("dtype", _int), ("pairs", _int), ("gemma", _int),
        ("moe", MoeShape), ("quant_int8", _int), ("kv_dtype", _int),
    ]  # fmt: skip


class DecodeEnds(ctypes.Structure):
    """cpu_decode_step.h's DecodeEnds: the embedding table (and its multiplier) and the LM head,
    where the step makes its input rows and its logits itself."""

    _fields_ = [
        ("embedding", _p), ("multiplier", _f32), ("head", _p), ("head_bias", _p),
        ("head_quant", QuantSpec), ("vocab", _i64),
    ]  # fmt: skip


MLP_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # cpu_decode_step.h's MLP_*
ROUTINGS = {"topk_softmax": 0, "softmax_topk": 1}  # cpu_decode_step.h's TOPK_SOFTMAX, ...


def decode_step(
    layers: ctypes.Array[DecodeLayer],
    shape: DecodeShape,
    x: torch.Tensor,
    final_norm: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    ends: DecodeEnds | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode-only forward pass (cpu_decode_step.c): x (rows, hidden), the embeddings of each
    sequence's new token, in (or, with ends.embedding set, the rows they are made into from
    token_ids, int64); the final hidden states out (x itself), and with ends.head set the
    (rows, vocab) float32 logits (else None). positions: (n, rows), the rotary tables' rows
    per token, row i read by the layers whose positions_row is i."""
    lib = library()
    assert lib is not None and x.dtype in DTYPE_CODES and x.is_contiguous()
    rows = x.shape[0]
    positions = positions.to(torch.int64).contiguous()
    assert positions.dim() == 2 and positions.shape[1] == rows
    slots = slot_mapping.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    shape.max_blocks, shape.threads = tables.shape[1], torch.get_num_threads()
    shape.dtype = DTYPE_CODES[x.dtype]
    shape.quant_int8 = cpu_quant.takes_int8(rows)
    scratch = torch.empty(lib.decode_step_scratch(ctypes.byref(shape), rows))
    if ends is not None and ends.embedding:
        assert token_ids is not None and token_ids.dtype == torch.int64 and len(token_ids) == rows
    logits = torch.empty(rows, ends.vocab) if ends is not None and ends.head else None
    status = run(
        "decode_step",
        layers, len(layers), ctypes.byref(shape), x.data_ptr(), final_norm.data_ptr(), rows,
        positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        scratch.data_ptr(), None if ends is None else ctypes.byref(ends),
        None if token_ids is None else token_ids.data_ptr(),
        None if logits is None else logits.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode step: no memory for the attention scores or the experts")
    return x, logits
