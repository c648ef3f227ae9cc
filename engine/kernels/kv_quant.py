"""The 8-bit KV cache's row format (kv_cache.dtype: int8), and its torch quantize / dequantize.

One row is one token's K (or V) for one KV head: head_dim int8 values, then the row's float32
scale in the next 4 bytes (host byte order), so a cache of int8 rows is an int8 tensor whose last
dimension is head_dim + 4 and each block stays one contiguous byte range (what NIXL moves):

    row: [ q_0 ... q_{d-1} | scale (float32) ]     value_i = q_i * scale

Symmetric, one scale per row: scale = max |x| / 127, q = round(x / scale) clamped to [-127, 127]
(a zero row: scale 0, q 0). Why one scale per row rather than llama.cpp's q8_0 (a float16 scale
per 32 values): the same 4 bytes for a 64-value head, and with one scale per row the kernels
take it out of the sums: q . k = scale_k * (q . k_int8) and sum_j p_j v_j = sum_j (p_j scale_j)
v_j, so dequantizing costs a widening per value and one multiply per row. The price is a row's
small values sharing the step of its largest (keys' outlier channels): bench/README.md measures
what that costs.

cpu_kernels.c (kv_row, store_row) and the torch paths read and write the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after each row's values
QMAX = 127


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: head_dim, or for int8 head_dim values plus the scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size of a cache view (..., row_width)."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim), any float dtype, as int8 rows (..., head_dim + 4)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX
    q = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round_().clamp_(-QMAX, QMAX)
    # the scale's bytes as four int8 elements (a float32 tensor viewed as int8)
    scale_bytes = scale.contiguous().view(torch.int8)
    return torch.cat([q.to(torch.int8), scale_bytes], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows (..., head_dim + 4) as float32 (..., head_dim)."""
    values = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # (..., 1)
    return values * scale


def as_float(cache_rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache of any dtype, as float32 (..., head_dim)."""
    return dequantize(cache_rows) if cache_rows.dtype == torch.int8 else cache_rows.float()


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows (..., head_dim) as a cache of `dtype` stores them."""
    return quantize(x) if dtype == torch.int8 else x.to(dtype)
