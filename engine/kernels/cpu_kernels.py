"""The CPU path's C kernels (cpu_kernels.c), built once per machine: paged attention (decode and
prefill, with sliding windows, soft caps and attention sinks) and KV stores, RMSNorm (Llama's or
Gemma's rounding, with its residual add, or per head in place for q/k norms), rotary embedding
(full or partial), the MLP's SiLU- or GELU-and-product; the linear layers' panel matmul
(cpu_linear.c, see engine/linear.py) and its weight-only quantized form (cpu_quant.c, called by
cpu_quant.py); a MoE layer's experts grouped by expert (cpu_moe.c); a mixed batch's LoRA
adapters in one call (cpu_lora.c, called by lora.py); and
a whole decode forward pass in one call (cpu_decode_step.c, its MoE layers in
cpu_decode_moe.c, their top-k in torch.topk's order in cpu_topk.cpp: the one C++ source, built
by the same compiler driver, which picks the language by the extension; its structures and call
in cpu_decode_abi.py).

On a decode step the torch path copies every sequence's K/V out of the paged cache before it can
multiply (index_select, then two batched multiplies per KV head): on SmolLM2 at 32 sequences of
~200 tokens that is ~2.6 ms per layer, 40% of the step. The C kernel reads each row where it
lies, once: see the file's header. It is built with the host's C compiler (`$CC`, else `cc`)
into ~/.cache/pdcluster/kernels, keyed by the source, the flags and the CPU's feature flags
(`-march=native`), and loaded with ctypes. Where no compiler is found or the build fails,
`library()` is None and the model takes the torch path (logged once). The norm and rotary
kernels replace 6 and 16 small torch operations per call: ~2 ms of a one-token step of
SmolLM2's 30 layers. In a prefill the activation's one pass replaces torch's silu and product
and their two intermediate tensors (8 x 191 tokens of SmolLM2: ~95-160 ms against 120-220).

Compiled with reassociation allowed (so the dot products vectorize) but not -ffast-math, which
would set flush-to-zero for the whole process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from common.model_cache import CACHE_ROOT
from engine.kernels.kv_quant import head_dim_of

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.c", "cpu_linear.c", "cpu_decode_step.c", "cpu_decode_moe.c", "cpu_moe.c",
        "cpu_topk.cpp", "cpu_quant.c", "cpu_lora.c", "cpu_prefill_pairs.c", "cpu_rows_bf16.c",
    )
)  # fmt: skip
# included by the sources: every header beside them, so that a new one is in the build's key
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
FLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
    "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip
LIBS = ("-lm",)  # after the source on the command line
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# the KV cache's element types: also cpu_kernels.c's I8, rows of int8 values and a scale
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 2}

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # name: (result, arguments), as the C declares them
    "paged_decode": (_int, [_p, _p, _p, _int, _p, _p, _p, *[_i64] * 7, _f32, _i64, _f32, _p, _int]),
    "paged_prefill": (
        _int,
        [_p, _p, _p, _int, _p, _p, _p, _p, *[_i64] * 7, _f32, _i64, _f32, _p, _int],
    ),
    "paged_prefill_bf16": (
        _int,
        [_p, _p, _p, _p, _p, _p, _p, *[_i64] * 7, _f32, _i64, _f32, _p, _int],
    ),
    "store_kv": (None, [_p, _p, _int, _p, _p, _int, _p, *[_i64] * 5]),
    "rms_norm": (None, [_p, _p, _p, _p, _i64, _i64, _f32, _int, _int]),
    "rms_norm_heads": (None, [_p, _i64, _i64, _i64, _i64, _p, _f32, _int, _int]),
    "rope": (None, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _int]),
    "silu_mul": (None, [_p, _p, _i64, _i64, _int]),
    "gelu_tanh_mul": (None, [_p, _p, _i64, _i64, _int]),
    "panel_linear": (None, [_p, _p, _int, _p, _p, _i64, _i64, _i64, _int]),
    "pair_linear": (None, [_p, _p, _p, _p, _i64, _i64, _i64, _int]),
    "decode_step": (_int, [_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _p, _p]),
    "decode_step_scratch": (_i64, [_p, _i64]),
    "bf16_pairs_available": (_int, []),
    "prefill_pairs_available": (_int, []),
    "prefill_amx_ready": (_int, []),
    "prefill_amx_use": (None, [_int]),
    "linear_amx_ready": (_int, []),
    "linear_amx_use": (None, [_int]),
    "moe_experts": (
        _int,
        [*[_p] * 8, *[_i64] * 5, _int, _int, _int, _f32, _f32, _i64, _int],
    ),
    "expert_passes": (_i64, []),
    "topk_largest": (None, [_p, _i64, _i64, _p, _p, _p]),
    "quant_linear": (_int, [_p, _int, _p, _int, _i64, _p, _p, *[_i64] * 3, _int, _p, _int]),
    "quant_linear_scratch": (_i64, [_i64, _i64, _i64]),
    "quant_int8_available": (_int, []),
    "stream_read": (_i64, [_p, _i64, _int]),
    "set_few_rows_prefetch": (None, [_int]),
    "lora_add": (None, [*[_p] * 6, *[_i64] * 4, _int]),
}
EXPERT_ACTIVATIONS = {"silu": 0, "gpt_oss": 1}  # cpu_moe.c's ACT_SILU, ACT_GPT_OSS
MOE_CHUNK_BYTES = 64 << 20  # moe_experts' buffers: 320 tokens of a Qwen3-MoE layer at a time
PANEL = 16  # output columns per weight panel (cpu_linear.c's P)


@functools.cache
def library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", exc)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def runs(x: torch.Tensor) -> bool:
    """The norm and rotary kernels take this tensor: on the CPU, float32 or bfloat16."""
    return x.device.type == "cpu" and x.dtype in DTYPE_CODES and library() is not None


def supports(cache: torch.Tensor) -> bool:
    """The attention and store kernels read this cache: on the CPU, float32, bfloat16 or int8
    rows (kv_quant.py), each block contiguous, and a head size that is a multiple of 8 (the
    attention reads eight values at a time)."""
    return (
        cache.device.type == "cpu"
        and cache.dtype in CACHE_DTYPE_CODES
        and library() is not None
        and cache[0].is_contiguous()
        and head_dim_of(cache) % 8 == 0
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: (batch, num_heads, head_dim)."""
    lib = library()
    assert lib is not None and k_cache.stride() == v_cache.stride()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q32 = q.float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sinks32 = _sink_logits(sinks, num_heads)
    out = torch.empty(batch, num_heads, head_dim)
    status = run(
        "paged_decode",
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype],
        tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads,
        head_dim, block_size, k_cache.stride(0), tables.shape[1], scale, sliding_window or 0,
        soft_cap or 0.0, address(sinks32), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged decode attention: no memory for the scores")
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention_ref: q's shape. Every sequence's new
    tokens in one call, as cpu_kernels.c's tiles (`paged_prefill`; timings in its comment), or
    for a bfloat16 model's queries over a bfloat16 cache cpu_prefill_pairs.c's dot products
    (`paged_prefill_bf16`: q and the output stay bfloat16)."""
    lib = library()
    assert lib is not None and k_cache.stride() == v_cache.stride()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    pairs = (q.dtype == k_cache.dtype == torch.bfloat16 and head_dim % 16 == 0
             and prefill_pairs_available())  # fmt: skip
    model_dtype = q.dtype
    q = q.contiguous() if pairs else q.float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sinks32 = _sink_logits(sinks, num_heads)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    cache = () if pairs else (CACHE_DTYPE_CODES[k_cache.dtype],)  # the pairs' is bfloat16
    status = run(
        "paged_prefill_bf16" if pairs else "paged_prefill",
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *cache,
        tables.data_ptr(), cu.data_ptr(), lens.data_ptr(), out.data_ptr(), lens.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, k_cache.stride(0), tables.shape[1], scale,
        sliding_window or 0, soft_cap or 0.0, address(sinks32), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged prefill attention: no memory for its scratch")
    return out.to(model_dtype)


def _sink_logits(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """The attention sinks as the kernels read them: (num_heads,) float32, contiguous."""
    if sinks is None:
        return None
    assert sinks.shape == (num_heads,), f"sinks {tuple(sinks.shape)} for {num_heads} heads"
    return sinks.detach().to("cpu", torch.float32).contiguous()


def address(x: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument; None (NULL) for no tensor."""
    return None if x is None else x.data_ptr()


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as reference.store_kv_ref (negative slots skip): k, v (num_tokens,
    num_kv_heads, head_dim) converted to the cache's dtype, or quantized into its int8 rows."""
    lib = library()
    assert lib is not None and k_cache.stride() == v_cache.stride()
    source = k.dtype if k.dtype in DTYPE_CODES else torch.float32  # float16: widened first
    k, v = k.to(source).contiguous(), v.to(source).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    run(
        "store_kv",
        k.data_ptr(), v.data_ptr(), DTYPE_CODES[source], k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_DTYPE_CODES[k_cache.dtype], slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2],
        k_cache.shape[1], k_cache.stride(0),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
) -> torch.Tensor:
    """RMSNorm of x: (..., dim); with `residual`, of residual + x, which is written back into
    residual (contiguous, x's dtype) as the decoder's skip connection. Llama's rounding
    (Hugging Face's LlamaRMSNorm: normalise in float32, round, times the weight), or with
    `gemma` Gemma's (normalise and times 1 + weight in float32, round once)."""
    lib = library()
    assert lib is not None and weight.dtype == x.dtype
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.is_contiguous() and residual.dtype == x.dtype
    run(
        "rms_norm",
        x.data_ptr(), address(residual), weight.data_ptr(), out.data_ptr(),
        x.numel() // x.shape[-1], x.shape[-1], eps, int(gemma), DTYPE_CODES[x.dtype],
    )  # fmt: skip
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> None:
    """Per-head RMSNorm in place of x: (tokens, heads, head_dim), each head's values contiguous
    and heads back to back, tokens any stride (q or k as views into the fused qkv rows):
    Qwen3's q/k norms (Llama's rounding) or Gemma 3's (`gemma`); weight (head_dim,)."""
    lib = library()
    assert lib is not None and weight.dtype == x.dtype and weight.shape == x.shape[2:]
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2]
    run(
        "rms_norm_heads",
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], weight.data_ptr(), eps,
        int(gemma), DTYPE_CODES[x.dtype],
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up (..., 2 * inter), the gate's values first: one pass instead of
    torch's silu, split and product (and their two intermediate tensors)."""
    return _gated("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up (Gemma's MLP, Hugging Face's gelu_pytorch_tanh), as
    silu_mul."""
    return _gated("gelu_tanh_mul", gate_up)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    lib = library()
    assert lib is not None and gate_up.dtype in DTYPE_CODES
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    run(
        name, gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
        DTYPE_CODES[gate_up.dtype],
    )  # fmt: skip
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x: (tokens, heads, head_dim) in place; each head's row contiguous, tokens any
    stride (q and k can be views into the fused projection's output). cos, sin: float32
    (max_positions, rotary_dim) tables: the first rotary_dim values of each head are rotated
    (rotate-half within them), the rest pass through (Phi-3's partial rotary)."""
    lib = library()
    assert lib is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    rotary_dim = cos.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= x.shape[2] and cos.shape == sin.shape
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    run(
        "rope",
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], rotary_dim,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), DTYPE_CODES[x.dtype],
    )  # fmt: skip


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) as cpu_linear.c's panels: (ceil(N / 16), K, 16), zero rows padding N."""
    n, k = weight.shape
    padded = torch.zeros((n + PANEL - 1) // PANEL * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()  # (N / 16, K, 16)


def bf16_pairs_available() -> bool:
    """Whether the kernels were built with AVX512-BF16's dot products (cpu_linear.c's pairs)."""
    lib = library()
    return lib is not None and bool(lib.bf16_pairs_available())


def prefill_pairs_available() -> bool:
    """Whether the prefill has its AVX512-BF16 path (cpu_prefill_pairs.c): taken for a bfloat16
    model's queries over a bfloat16 cache, head_dim a multiple of 16."""
    lib = library()
    return lib is not None and bool(lib.prefill_pairs_available())


def prefill_amx_ready() -> bool:
    """Whether that path multiplies in AMX tiles (cpu_prefill_pairs.c): the CPU has AMX-BF16,
    Linux lent this process the tiles, and use_prefill_amx(False) did not turn them off."""
    lib = library()
    return lib is not None and bool(lib.prefill_amx_ready())


def use_prefill_amx(on: bool) -> None:
    """Let paged_prefill's bfloat16 path use AMX tiles where it can (the default), or keep it
    on AVX512-BF16's dot products (tests and bench/prefill_attention.py compare the two)."""
    lib = library()
    if lib is not None:
        lib.prefill_amx_use(int(on))


def linear_amx_ready() -> bool:
    """Whether the C decode step's bfloat16 layers multiply batches of 2 rows or more in AMX
    tiles (cpu_linear.c): as prefill_amx_ready, with use_linear_amx."""
    lib = library()
    return lib is not None and bool(lib.linear_amx_ready())


def use_linear_amx(on: bool) -> None:
    """Let the pairs' linear layers use AMX tiles where they can (the default), or keep them on
    AVX512-BF16's dot products (tests and bench/decode_batch.py compare the two)."""
    lib = library()
    if lib is not None:
        lib.linear_amx_use(int(on))


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 weight (N, K), K even, as cpu_linear.c's pairs: (ceil(N / 16), K / 2, 16, 2)."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and k % 2 == 0
    panels = pack_panels(weight)  # (N / 16, K, 16)
    return panels.view(panels.shape[0], k // 2, 2, PANEL).transpose(2, 3).contiguous()


def pair_linear(
    x: torch.Tensor, pairs: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (rows, K) bfloat16 @ weight.T + bias in float32, the weight as `pack_pairs` left it
    (where bf16_pairs_available); bias float32 or None. Runs on torch's thread count: what the
    C decode step calls for a layer."""
    lib = library()
    assert lib is not None and x.dtype == pairs.dtype == torch.bfloat16
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features)
    run(
        "pair_linear",
        x.data_ptr(), pairs.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), x.shape[0], out_features, x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (rows, K) @ weight.T + bias in float32, the weight as `pack_panels` left it; bias
    float32 or None. Runs on torch's thread count."""
    lib = library()
    assert lib is not None and panels.dtype in DTYPE_CODES
    x32 = x.float().contiguous()
    out = torch.empty(x32.shape[0], out_features)
    run(
        "panel_linear",
        x32.data_ptr(), panels.data_ptr(), DTYPE_CODES[panels.dtype],
        None if bias is None else bias.data_ptr(), out.data_ptr(), x32.shape[0], out_features,
        x32.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def pack_experts(weight: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """Every expert's (N, K) matrix of weight (num_experts, N, K) as moe_experts reads it, in
    the layout engine/linear.py picks for dense layers here: bfloat16 pairs (num_experts,
    ceil(N / 16), K / 2, 16, 2) for AVX512-BF16's dot products where the kernels have them,
    else panels (num_experts, ceil(N / 16), K, 16). `pairs` forces one (a layer's two
    matrices must share it)."""
    num_experts, n, k = weight.shape
    if pairs is None:
        pairs = weight.dtype == torch.bfloat16 and k % 2 == 0 and bf16_pairs_available()
    pack = pack_pairs if pairs else pack_panels
    first = pack(weight[0])
    packed = first.new_empty(num_experts, *first.shape)
    packed[0] = first
    for e in range(1, num_experts):  # one expert's copy at a time: the layer may be gigabytes
        packed[e] = pack(weight[e])
    return packed


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed_gate_up: torch.Tensor,
    packed_down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    inter: int,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    *,
    chunk_bytes: int = MOE_CHUNK_BYTES,
) -> torch.Tensor:
    """reference.moe_experts_ref's maths on the weights as `pack_experts` left them, grouped by
    expert so that each expert's weights are read once per call (cpu_moe.c): x (tokens,
    hidden), float32 or bfloat16; topk_ids, topk_weights (tokens, top_k); biases float32
    (num_experts, 2 * inter) and (num_experts, hidden), or None. Returns x's shape and dtype.
    Tokens go `chunk_bytes` of buffers at a time (a decode step's in one)."""
    lib = library()
    assert lib is not None and x.dtype in DTYPE_CODES and x.dim() == 2
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}")
    pairs = packed_gate_up.dim() == 5
    num_experts, hidden = packed_gate_up.shape[0], x.shape[1]
    for packed, n, k in ((packed_gate_up, 2 * inter, hidden), (packed_down, hidden, inter)):
        assert packed.dtype == x.dtype and packed.dim() == packed_gate_up.dim()
        assert packed.is_contiguous()
        assert packed.shape[:2] == (num_experts, -(-n // PANEL)) and packed[0, 0].numel() == (
            k * PANEL
        ), f"experts packed as {tuple(packed.shape)}, not as ({n}, {k}) matrices"
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    biases = [None if b is None else b.float().contiguous() for b in (gate_up_bias, down_bias)]
    for bias, n in zip(biases, (2 * inter, hidden), strict=True):
        assert bias is None or bias.shape == (num_experts, n)
    out = torch.empty_like(x)
    status = run(
        "moe_experts",
        x.data_ptr(), ids.data_ptr(), weights.data_ptr(), packed_gate_up.data_ptr(),
        packed_down.data_ptr(), address(biases[0]), address(biases[1]), out.data_ptr(),
        x.shape[0], ids.shape[1], num_experts, hidden, inter, DTYPE_CODES[x.dtype], int(pairs),
        EXPERT_ACTIVATIONS[activation], alpha, limit, chunk_bytes, torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise ValueError(f"an expert id is outside 0 .. {num_experts - 1}")
    if status != 0:
        raise MemoryError("moe experts: no memory for its buffers")
    return out


def expert_passes() -> int:
    """Sweeps of an expert's weights (gate_up and down, for up to 48 of its rows) by
    moe_experts since the library was loaded: one per expert routed to, per call, at decode
    sizes (cpu_moe.c)."""
    lib = library()
    assert lib is not None
    return int(lib.expert_passes())


def topk_largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices), (rows, k) each, of the k largest of each row of x (rows, n) read as
    float32: torch.topk's values in its order, ties included (cpu_topk.cpp, what the decode
    step's routers run)."""
    lib = library()
    assert lib is not None and x.dim() == 2 and 0 < k <= x.shape[1]
    x32 = x.float().contiguous()
    rows, n = x32.shape
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    work = torch.empty(n, 2, dtype=torch.int64)  # (value, index) pairs of 16 bytes
    for r in range(rows):
        run(
            "topk_largest", x32[r].data_ptr(), n, k, work.data_ptr(), values[r].data_ptr(),
            ids[r].data_ptr(),
        )  # fmt: skip
    return values, ids


def run(name: str, *args: object) -> object:
    """Call a kernel; under the torch profiler (POST /start_profile) as a named range, so that
    the op table counts the kernels' time too (a ctypes call is invisible to it otherwise)."""
    function = getattr(library(), name)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"cpu_kernels::{name}"):
            return function(*args)
    return function(*args)


def _build() -> Path:
    """The shared library for this source, flags and CPU, compiled on first use. Several
    processes may build at once: each writes its own temporary file and renames it into place."""
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    compiler = compiler.split()[0]
    key = hashlib.sha256()
    command = " ".join((compiler, *FLAGS, *LIBS)).encode()
    for part in (*(f.read_bytes() for f in (*SOURCES, *HEADERS)), command, _cpu_flags()):
        key.update(part)
    target = CACHE_ROOT / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", staging, *LIBS],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        os.replace(staging, target)
    except subprocess.CalledProcessError as exc:
        raise subprocess.SubprocessError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


def cpu_has_amx_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in AMX tiles (oneDNN's matmuls do, where it has)."""
    return b" amx_bf16" in _cpu_flags()


def _cpu_flags() -> bytes:
    """What -march=native compiles for: the kernel built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
