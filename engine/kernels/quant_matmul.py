"""Triton weight-only quantized matmul: out = x @ W.T + bias, W held as 4- or 8-bit values in
groups along K (engine/quant/weight.py `QuantizedWeight`) and dequantized tile by tile in
registers, so a decode step streams the packed bytes instead of bfloat16's two per weight.

Packed layout (`TritonQuant`, made once at load by `pack_for_triton`):

    values   8 bits: (N, K) int8, as given
             4 bits: (N, K / 2) uint8; byte j of row n = v[n, 2j] | v[n, 2j + 1] << 4
    scales   (N, K / group): float16 when every scale and min survives float16 exactly (GGUF's
    mins      Q8_0, Q4_0, Q4_1; GPTQ / AWQ), else float32 (Q4_K's d * sc); mins for 4 bits only

    bits per weight at groups of 32: 4-bit 4 + 2 * 16 / 32 = 5 (float16), 6 (float32);
    8-bit 8.5 (float16), 9 (float32). GGUF: Q4_1 5, Q8_0 8.5.

One program computes a (BLOCK_M rows, BLOCK_N columns) tile of the output over a range of K:

    for each K tile of BLOCK_K values (a tile never straddles a group: BLOCK_K divides the group
    size, or the group size divides BLOCK_K and the tile holds BLOCK_K / group whole groups):
        bytes (BLOCK_N, BLOCK_K / 2) -> low, high nibbles interleaved -> q (BLOCK_N, BLOCK_K)
        w = q * scale[group] + min[group]                    float32, then x's dtype
        acc (BLOCK_M, BLOCK_N) += x tile (BLOCK_M, BLOCK_K) @ w.T       float32 accumulation

    split-K (1-16 rows, too few output tiles to fill the GPU): the K tiles are cut into
    SPLIT_K contiguous ranges, one program each, writing float32 partial sums (SPLIT_K, M, N);
    `split_sum_kernel` adds them in split order with the bias: deterministic, no atomics.

Each weight byte is loaded once per BLOCK_M rows (once per call for up to 16 rows); a group's
scale and min once per K tile that covers it (max(1, group / BLOCK_K) times per BLOCK_M rows).
`ReadCounts` makes the kernel count both, for the tests. Block sizes are untuned (written without
a GPU; bench/kernels_quant_gpu.py times them and sweeps alternatives).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.decode import dot, needs_upcast
from engine.kernels.moe import rounded
from engine.quant.weight import QuantizedWeight

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT16_MAX = 65504.0
MAX_SPLIT_K = 16
WAVES = 4  # programs per SM that split-K aims for
SUM_BLOCK_N = 256  # columns per program of the split sum


@dataclass(frozen=True, slots=True)
class TritonQuant:
    """A `QuantizedWeight` in the layout the kernel reads (module docstring); on one device."""

    bits: int  # 8 or 4
    group_size: int  # a multiple of 16 dividing K
    shape: tuple[int, int]  # (N, K) of the weight it stands for
    values: torch.Tensor  # (N, K) int8, or (N, K // 2) uint8 nibble pairs; contiguous
    scales: torch.Tensor  # (N, K // group_size) float16 or float32; contiguous
    mins: torch.Tensor | None  # like scales, for 4 bits; None for 8

    @property
    def nbytes(self) -> int:
        """The bytes one call streams for the weight (once per BLOCK_M rows)."""
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.values.nbytes + self.scales.nbytes + extra

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def to(self, device: torch.device | str) -> TritonQuant:
        mins = None if self.mins is None else self.mins.to(device)
        return TritonQuant(
            self.bits,
            self.group_size,
            self.shape,
            self.values.to(device),
            self.scales.to(device),
            mins,
        )


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """Tile sizes and launch options of one call; `choose_blocks` picks them from the shapes."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class ReadCounts:
    """int32 counters shaped like a TritonQuant's values and scales: the kernel adds 1 at each
    packed weight byte and each group's scale (with its min) every time it loads them."""

    values: torch.Tensor
    groups: torch.Tensor

    @classmethod
    def zeros_for(cls, packed: TritonQuant) -> ReadCounts:
        values = torch.zeros(packed.values.shape, dtype=torch.int32, device=packed.values.device)
        groups = torch.zeros(packed.scales.shape, dtype=torch.int32, device=packed.scales.device)
        return cls(values, groups)


def pack_for_triton(w: QuantizedWeight, scale_dtype: torch.dtype | None = None) -> TritonQuant:
    """`w` in the kernel's layout, on w's device. `scale_dtype` None: float16 where it is exact,
    else float32; float16 asked for rounds the scales and mins (relative error <= 2**-11, below
    a bfloat16 weight's own rounding) and refuses ones beyond float16's range."""
    n, k = w.shape
    if w.group_size % 16:
        raise ValueError(f"group size {w.group_size} is not a multiple of 16")
    if w.bits == 4:
        if w.values.numel() and int(w.values.max()) > 15:
            raise ValueError("4-bit values must lie in [0, 15]")
        pairs = w.values.reshape(n, k // 2, 2)  # (N, K / 2, 2): v[2j], v[2j + 1]
        values = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    else:
        values = w.values.contiguous()
    dtype = scale_dtype or _exact_scale_dtype(w)
    if dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scales are float16 or float32, not {dtype}")
    group_params = [w.scales] if w.mins is None else [w.scales, w.mins]
    if dtype == torch.float16 and any(
        t.numel() and float(t.abs().max()) > FLOAT16_MAX for t in group_params
    ):
        raise ValueError("scales or mins beyond float16's range: pack them as float32")
    mins = None if w.mins is None else w.mins.to(dtype).contiguous()
    return TritonQuant(w.bits, w.group_size, (n, k), values, w.scales.to(dtype).contiguous(), mins)


def _exact_scale_dtype(w: QuantizedWeight) -> torch.dtype:
    params = [w.scales] if w.mins is None else [w.scales, w.mins]
    exact = all(torch.equal(t.half().float(), t) for t in params)
    return torch.float16 if exact else torch.float32


# --- kernels --------------------------------------------------------------------------------------


@triton.jit
def dequantized_tile(
    values_ptr, scales_ptr, mins_ptr, values_read_ptr, groups_read_ptr, offs_n, n_mask, k0, K,
    stride_vn, stride_sn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, TILE_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MINS: tl.constexpr,
    COUNT_READS: tl.constexpr,
):  # fmt: skip
    """The float32 weights (BLOCK_N, BLOCK_K) of rows offs_n at K values [k0, k0 + BLOCK_K)."""
    rows = offs_n.to(tl.int64)[:, None]
    if BITS == 4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # bytes of the tile
        b_mask = n_mask[:, None] & (offs_b < K // 2)[None, :]
        b_offsets = rows * stride_vn + offs_b[None, :]
        packed = tl.load(values_ptr + b_offsets, mask=b_mask, other=0)  # (BLOCK_N, BLOCK_K / 2)
        q = tl.interleave(packed & 15, packed >> 4)  # (BLOCK_N, BLOCK_K): v[2j], v[2j + 1]
    else:
        offs_b = k0 + tl.arange(0, BLOCK_K)
        b_mask = n_mask[:, None] & (offs_b < K)[None, :]
        b_offsets = rows * stride_vn + offs_b[None, :]
        q = tl.load(values_ptr + b_offsets, mask=b_mask, other=0)  # (BLOCK_N, BLOCK_K)
    q = q.to(tl.float32)
    # The tile's groups: one (a tile inside a group) or TILE_GROUPS whole ones.
    offs_g = k0 // GROUP_SIZE + tl.arange(0, TILE_GROUPS)
    g_mask = n_mask[:, None] & (offs_g < K // GROUP_SIZE)[None, :]
    g_offsets = rows * stride_sn + offs_g[None, :]
    scale = tl.load(scales_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
    if TILE_GROUPS == 1:  # (BLOCK_N, 1) broadcasts over the tile
        w = q * scale
        if HAS_MINS:
            w += tl.load(mins_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
    else:  # (BLOCK_N, TILE_GROUPS, group) against (BLOCK_N, TILE_GROUPS, 1)
        w = tl.reshape(q, (BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS)) * scale[:, :, None]
        if HAS_MINS:
            w += tl.load(mins_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    if COUNT_READS:
        tl.atomic_add(values_read_ptr + b_offsets, 1, mask=b_mask)
        tl.atomic_add(groups_read_ptr + g_offsets, 1, mask=g_mask)
    return w


@triton.jit
def quant_matmul_kernel(
    x_ptr, values_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, values_read_ptr, groups_read_ptr,
    M, N, K, k_tiles_per_split,
    stride_xm, stride_xk, stride_vn, stride_sn, stride_os, stride_om, stride_on,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, TILE_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    COUNT_READS: tl.constexpr, INTERPRETED_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) output tile over split program_id(2)'s K tiles: the final output
    (bias added, rounded to x's dtype) or, split, its float32 partial sums."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    first_tile = split * k_tiles_per_split
    num_tiles = tl.minimum(k_tiles_per_split, tl.cdiv(K, BLOCK_K) - first_tile)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(0, num_tiles):
        k0 = (first_tile + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_rows + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        w = dequantized_tile(
            values_ptr, scales_ptr, mins_ptr, values_read_ptr, groups_read_ptr, offs_n, n_mask,
            k0, K, stride_vn, stride_sn, BITS, GROUP_SIZE, TILE_GROUPS, BLOCK_N, BLOCK_K,
            HAS_MINS, COUNT_READS,
        )  # fmt: skip
        if INTERPRETED_BF16:  # bfloat16 values kept in float32 (the interpreter's dot)
            w = rounded(w, tl.bfloat16, INTERPRETED_BF16)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        acc += dot(a, tl.trans(w), INTERPRETED_BF16, PRECISION)
    out = out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    out += offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(out, rounded(acc, dtype, INTERPRETED_BF16).to(dtype), mask=mask)


@triton.jit
def split_sum_kernel(
    partial_ptr, bias_ptr, out_ptr, N, stride_ps, stride_pm, stride_om, stride_on,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
):  # fmt: skip
    """out[m, n tile] = sum over splits, in order, of the partial sums + bias, in x's dtype."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_ps + m * stride_pm + offs_n, mask=n_mask, other=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = rounded(acc, dtype, INTERPRETED_BF16).to(dtype)
    tl.store(out_ptr + m * stride_om + offs_n * stride_on, out, mask=n_mask)


# --- host side ------------------------------------------------------------------------------------


def fit_block_k(preferred: int, group_size: int) -> int:
    """The largest power of two <= `preferred` (itself one, >= 16) that divides the group size or
    that the group size divides, so no K tile straddles a group; 16 always does."""
    block = preferred
    while block > 16 and group_size % block and block % group_size:
        block //= 2
    return block


def choose_blocks(num_rows: int, n: int, k: int, group_size: int, num_sms: int) -> QuantBlocks:
    """Tiles by row count, as moe.choose_block_m does: up to 16 rows (decode) one row block,
    long K tiles and split-K until about WAVES programs per SM; more rows, larger tiles so each
    dequantized weight tile serves more rows."""
    if num_rows <= 16:
        block_m, block_n, block_k = 16, 64, fit_block_k(128, group_size)
    elif num_rows <= 64:
        block_m, block_n, block_k = 32 if num_rows <= 32 else 64, 64, fit_block_k(64, group_size)
    else:
        block_m, block_n, block_k = 64, 128, fit_block_k(64, group_size)
    split_k = 1
    if num_rows <= 16:
        tiles = triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        wanted = min(MAX_SPLIT_K, k_tiles, triton.cdiv(WAVES * num_sms, tiles))
        split_k = triton.cdiv(k_tiles, triton.cdiv(k_tiles, wanted))  # no empty split
    return QuantBlocks(block_m, block_n, block_k, split_k)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: parallelism buys nothing there
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def quant_matmul(
    x: torch.Tensor,
    packed: TritonQuant,
    bias: torch.Tensor | None = None,
    *,
    blocks: QuantBlocks | None = None,
    read_counts: ReadCounts | None = None,
) -> torch.Tensor:
    """x (..., K) float32, float16 or bfloat16 times the packed (N, K) weight, plus bias (N,)
    (any float dtype): (..., N) in x's dtype, accumulated in float32; the result of
    F.linear(x, dequantized weight in x's dtype, bias) up to summation order. `blocks` overrides
    `choose_blocks`; `read_counts` (ReadCounts.zeros_for(packed)) counts the kernel's loads."""
    n, k = packed.shape
    if x.dtype not in X_DTYPES:
        raise ValueError(f"activations must be float32, float16 or bfloat16, not {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"activations of width {x.shape[-1]} against a weight of K={k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for N={n}")
    if packed.values.device != x.device:
        raise ValueError(f"weight on {packed.values.device}, activations on {x.device}")
    rows = x.reshape(-1, k)  # (M, K)
    m = rows.shape[0]
    out = rows.new_empty(m, n)  # (M, N)
    if m > 0:
        blocks = blocks or choose_blocks(m, n, k, packed.group_size, _num_sms(x.device))
        _launch(rows, packed, bias, out, blocks, read_counts)
    return out.reshape(*x.shape[:-1], n)


def _launch(
    x: torch.Tensor,
    packed: TritonQuant,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    blocks: QuantBlocks,
    read_counts: ReadCounts | None,
) -> None:
    (m, k), n, group = x.shape, packed.shape[0], packed.group_size
    if group % blocks.block_k and blocks.block_k % group:
        raise ValueError(f"block_k {blocks.block_k} and group size {group}: tiles would straddle")
    k_tiles = triton.cdiv(k, blocks.block_k)
    per_split = triton.cdiv(k_tiles, blocks.split_k)
    split_k = triton.cdiv(k_tiles, per_split)  # no empty split
    bias = None if bias is None else bias.contiguous()
    target = out if split_k == 1 else torch.empty(split_k, m, n, device=x.device)  # float32
    counts = read_counts or ReadCounts(out, out)  # unused pointers when not counting
    interpreted_bf16 = needs_upcast(x)  # the interpreter's dot cannot multiply bfloat16
    grid = (triton.cdiv(m, blocks.block_m), triton.cdiv(n, blocks.block_n), split_k)
    quant_matmul_kernel[grid](
        x, packed.values, packed.scales, packed.mins, bias, target, counts.values, counts.groups,
        m, n, k, per_split,
        *x.stride(), packed.values.stride(0), packed.scales.stride(0),
        target.stride(0) if split_k > 1 else 0, target.stride(-2), target.stride(-1),
        BITS=packed.bits, GROUP_SIZE=group, TILE_GROUPS=max(1, blocks.block_k // group),
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        HAS_MINS=packed.mins is not None, HAS_BIAS=bias is not None, WRITE_PARTIAL=split_k > 1,
        COUNT_READS=read_counts is not None, INTERPRETED_BF16=interpreted_bf16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    if split_k > 1:
        split_sum_kernel[(m, triton.cdiv(n, SUM_BLOCK_N))](
            target, bias, out, n, target.stride(0), target.stride(1), *out.stride(),
            SPLIT_K=split_k, BLOCK_N=SUM_BLOCK_N, HAS_BIAS=bias is not None,
            INTERPRETED_BF16=interpreted_bf16,
        )  # fmt: skip
