"""Weight-only quantized linear layers on the CPU: a QuantizedWeight packed once at load into
cpu_quant.c's blocks, and the matmul that streams them (5 bits a weight for 4-bit groups of 32,
8.5 for 8-bit ones, where float32 panels read 32: a decode step's time is those bytes).

Packing rounds the float32 scales and mins to float16 (the block stores them so). That is exact
for GGUF's Q8_0 / Q4_0 / Q4_1 and GPTQ's float16 scales; K-quants' products (Q4_K's d * sc and
dmin * m, Q6_K's d * sc: a float16 times a 6- or 8-bit integer) round to at most 2^-11 of
themselves.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels import cpu_kernels
from engine.quant.weight import QuantizedWeight

PANEL = 16  # output columns per panel (cpu_quant.c's QP)
# int8 activations from this many rows, where the kernels have them (AVX2 or later): as fast as
# the float path or faster at every row count measured (bench/kernels_quant.py, SmolLM2's
# matrices, one thread; AVX512-VNNI: 4 bits 1.2-1.5x at 1 row, 8 bits the same there, both
# memory-bound; 2.3x at 8 rows and 2.4x at 32; an x86-64-v3 build, AVX2: 2-3x at 1 row, 2-4x
# from 8: cpu_quant.c's header), and a row's result does not depend on the rows beside it (exact
# integer sums, the same float steps per row), which the float path's row-count-dependent
# summation order does not give. Their error is the activations' rounding (cpu_quant.c's header), as
# llama.cpp's Q8 activations have it for 4-bit weights; 8-bit weights take two int8 planes (16
# bits; 1.3-1.9x the time from 8 rows, still faster than the float path, which is exact to
# rounding: int8_activations=False).
INT8_MIN_ROWS = 1


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """A QuantizedWeight as quant_linear reads it: data (ceil(N / 16), K / group_size,
    block_bytes) uint8, cpu_quant.c's layout."""

    data: torch.Tensor
    bits: int
    group_size: int
    out_features: int  # N
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        """What one multiplication streams."""
        return self.data.numel()


def block_bytes(bits: int, group_size: int) -> int:
    """Bytes of one group of a panel's 16 columns: values, float16 scales (and mins)."""
    return group_size * PANEL * bits // 8 + PANEL * 2 * (2 if bits == 4 else 1)


def pack_quantized(w: QuantizedWeight) -> PackedQuant:
    """w in cpu_quant.c's layout (see its header); N padded to a multiple of 16 with zeros."""
    n, k = w.shape
    g = w.group_size
    if g % 16:
        raise ValueError(f"group size {g} is not a multiple of 16")
    panels, groups = -(-n // PANEL), k // g
    padded_n = panels * PANEL
    values = torch.zeros(padded_n, k, dtype=torch.uint8)
    if w.bits == 4:
        if n and int(w.values.max()) > 15:
            raise ValueError("4-bit values must lie in 0..15")
        values[:n] = w.values
        v = values.view(panels, PANEL, groups, g // 8, 2, 4)  # (.., chunk, nibble, lane byte)
        packed = v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)  # (panel, col, group, chunk, 4)
        packed = packed.permute(0, 2, 3, 1, 4).reshape(panels, groups, 8 * g)
    else:
        values[:n] = (w.values.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd's unsigned
        v = values.view(panels, PANEL, groups, g // 4, 4)  # (panel, col, group, chunk, 4)
        packed = v.permute(0, 2, 3, 1, 4).reshape(panels, groups, 16 * g)
    parts = [packed, _halves(w.scales, padded_n, "scales")]
    if w.mins is not None:
        parts.append(_halves(w.mins, padded_n, "mins"))
    data = torch.cat(parts, dim=-1).contiguous()
    assert data.shape[-1] == block_bytes(w.bits, g)
    return PackedQuant(data, w.bits, g, n, k)


def _halves(x: torch.Tensor, padded_n: int, name: str) -> torch.Tensor:
    """(N, groups) float32 as each block's 16 float16 values: (panels, groups, 32) bytes."""
    n, groups = x.shape
    if x.numel() and not bool((x.abs() <= 65504.0).all()):  # NaN fails too
        raise ValueError(f"{name} must be finite and within float16's range (65504)")
    padded = torch.zeros(padded_n, groups, dtype=torch.float16)
    padded[:n] = x.to(torch.float16)
    halves = padded.view(-1, PANEL, groups).transpose(1, 2).contiguous()  # (panels, groups, 16)
    return halves.view(torch.uint8)


@functools.cache
def int8_available() -> bool:
    """Whether the kernels have the int8-activation path (built for AVX2, AVX-VNNI or
    AVX512-VNNI: cpu_quant.c); asked on every call of a quantized matmul, so answered once."""
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.quant_int8_available())


def takes_int8(rows: int) -> bool:
    """Whether a matmul of `rows` rows takes int8 activations by default: from INT8_MIN_ROWS
    rows, where the kernels have them (quant_linear, the C decode step, the prefetch pick)."""
    return rows >= INT8_MIN_ROWS and int8_available()


def read_rates_gb_s(buffer: torch.Tensor, rounds: int = 3) -> dict[str, float]:
    """How fast one core streams `buffer` (uint8, its length a multiple of 256) through
    cpu_quant.c's stream_read, each line prefetched in software ("software") or left to the
    hardware prefetcher ("hardware"): GB/s, the best of `rounds` reads each, taken in turn so
    that both see the same moments of a shared host."""
    lib = cpu_kernels.library()
    assert lib is not None
    best = {"software": 0.0, "hardware": 0.0}
    for _ in range(rounds):
        for way in best:
            start = time.perf_counter()
            lib.stream_read(buffer.data_ptr(), buffer.numel(), int(way == "software"))
            best[way] = max(best[way], buffer.numel() / (time.perf_counter() - start) / 1e9)
    return best


def quant_linear(
    x: torch.Tensor,
    packed: PackedQuant,
    bias: torch.Tensor | None = None,
    int8_activations: bool | None = None,
) -> torch.Tensor:
    """x (..., K) @ W.T + bias in float32 (..., N), as cpu_kernels.panel_linear: x float32 or
    bfloat16 (other dtypes are widened to float32), bias (N,) or None. int8_activations:
    quantize x per row and group (AVX2 or later); None picks it from INT8_MIN_ROWS rows where
    the kernels have it. Runs on torch's thread count."""
    lib = cpu_kernels.library()
    assert lib is not None
    n, k = packed.out_features, packed.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in cpu_kernels.DTYPE_CODES:
        x = x.float()
    rows = x.reshape(-1, k).contiguous()  # (M, K)
    m = rows.shape[0]
    if int8_activations is None:
        int8_activations = takes_int8(m)
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {n} outputs")
        bias = bias.float().contiguous()
    out = torch.empty(m, n)
    status = prepared_quant_linear(rows, packed, bias, int8_activations, out)()
    if status == -1:
        raise ValueError("int8 activations need AVX2 (and FMA, F16C), which these kernels lack")
    assert status == 0, f"quant_linear: layout not taken ({status})"
    return out.reshape(*x.shape[:-1], n)


def prepared_quant_linear(
    rows: torch.Tensor,
    packed: PackedQuant,
    bias: torch.Tensor | None,
    int8_activations: bool,
    out: torch.Tensor,
) -> Callable[[], int]:
    """quant_linear's kernel call for these contiguous rows (M, K), float32 bias (or None) and
    out (M, N), its scratch allocated once; each call returns the kernel's status. The engine
    times it at load (engine/weight_arena.py), where a small matrix's product takes less time
    than quant_linear's checks around it."""
    lib = cpu_kernels.library()
    assert lib is not None
    m, k = rows.shape
    scratch = torch.empty(lib.quant_linear_scratch(m, k, packed.group_size), dtype=torch.uint8)
    code = cpu_kernels.DTYPE_CODES[rows.dtype]

    def call() -> int:  # it holds every tensor it points the kernel at (and so keeps them alive)
        return cpu_kernels.run(
            "quant_linear", rows.data_ptr(), code, packed.data.data_ptr(), packed.bits,
            packed.group_size, cpu_kernels.address(bias), out.data_ptr(), m, packed.out_features,
            k, int(int8_activations), scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    return call
