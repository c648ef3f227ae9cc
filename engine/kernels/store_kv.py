"""Triton kernel writing the new tokens' K/V into the paged cache, one program per token.

A torch index_put on the strided per-layer view does the same (`store_kv_ref` in reference.py); the
kernel exists so the GPU path writes K and V in one launch without materialising index tensors.
A negative slot marks a padding token (a captured batch larger than the real one): skipped.
K and V are converted to the cache's dtype (a bfloat16 cache under a float32 model:
kv_cache_dtype), rounding to nearest even as torch does, or quantized into an int8 cache's rows
(kv_quant.py: head_dim int8 values and a float32 scale; its arithmetic, so the same bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_bfloat16(x):
    """float32 to the nearest bfloat16 (ties to even), still float32: a GPU's cast rounds so, the
    interpreter's truncates; after this both casts are exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows(x, scale):
    """x (rows, d) float32 / scale (rows,), rounded to nearest even and clamped to +-127, 0
    where the scale is 0: kv_quant.quantize's int8 values (IEEE division, as torch's)."""
    step = tl.where(scale > 0, scale, 1.0)[:, None]
    y = tl.math.div_rn(x, step)
    r = tl.floor(y)
    frac = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    return tl.where(scale[:, None] > 0, r, 0.0).to(tl.int8)


@triton.jit
def store_rows(cache_ptr, dst, x, offs_h, offs_d, stride_h, stride_d, mask,
               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               ROUND_BF16: tl.constexpr, INT8: tl.constexpr):  # fmt: skip
    """One token's rows x (BLOCK_H, BLOCK_D) into the cache at dst, as its dtype holds them."""
    ptrs = cache_ptr + dst + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    if INT8:
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)  # padding lanes load 0
        tl.store(ptrs, quantize_rows(x, scale), mask=mask)
        scale_ptrs = (cache_ptr + dst + offs_h * stride_h + HEAD_DIM).to(
            tl.pointer_type(tl.float32)
        )
        tl.store(scale_ptrs, scale, mask=offs_h < NUM_KV_HEADS)
    else:
        if ROUND_BF16:
            x = round_to_bfloat16(x)
        tl.store(ptrs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
    INT8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(
            k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
            mask=mask, other=0.0,
        )  # (BLOCK_H, BLOCK_D)  # fmt: skip
        v = tl.load(
            v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
            mask=mask, other=0.0,
        )  # fmt: skip
        k_dst = block * stride_kcb + offset * stride_kct
        v_dst = block * stride_vcb + offset * stride_vct
        store_rows(
            k_cache_ptr, k_dst, k, offs_h, offs_d, stride_kch, stride_kcd, mask, NUM_KV_HEADS,
            HEAD_DIM, ROUND_BF16, INT8,
        )  # fmt: skip
        store_rows(
            v_cache_ptr, v_dst, v, offs_h, offs_d, stride_vch, stride_vcd, mask, NUM_KV_HEADS,
            HEAD_DIM, ROUND_BF16, INT8,
        )  # fmt: skip


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v: (num_tokens, num_kv_heads, head_dim) at slot_mapping: (num_tokens,) into
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), any strides, or int8
    rows of head_dim + 4 (kv_quant.py), in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        ROUND_BF16=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16,
        INT8=k_cache.dtype == torch.int8, num_warps=1,
    )  # fmt: skip
