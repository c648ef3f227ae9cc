"""Triton kernel writing the new tokens' K/V into the paged cache, one program per token.

A torch index_put on the strided per-layer view does the same (`store_kv_ref` in reference.py); the
kernel exists so the GPU path writes K and V in one launch without materialising index tensors.
A negative slot marks a padding token (a captured batch larger than the real one): skipped.
K and V are converted to the cache's dtype (a bfloat16 cache under a float32 model:
kv_cache_dtype), rounding to nearest even as torch does.
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
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
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
            mask=mask,
        )  # (BLOCK_H, BLOCK_D)
        v = tl.load(
            v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
            mask=mask,
        )
        if ROUND_BF16:
            k = round_to_bfloat16(k)
            v = round_to_bfloat16(v)
        k_dst = block * stride_kcb + offset * stride_kct
        v_dst = block * stride_vcb + offset * stride_vct
        tl.store(
            k_cache_ptr + k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
            k.to(k_cache_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            v_cache_ptr + v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
            v.to(v_cache_ptr.dtype.element_ty),
            mask=mask,
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v: (num_tokens, num_kv_heads, head_dim) at slot_mapping: (num_tokens,) into
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), any strides, in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        ROUND_BF16=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16, num_warps=1,
    )  # fmt: skip
