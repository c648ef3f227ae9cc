"""Batched LoRA in Triton (the contract: engine/kernels/lora.py): one program per (token, block
of BLOCK_N outputs); a base-model token's programs return at once.

    slot = slots[t]                                         -1: nothing to add
    h (BLOCK_R,)  = sum over K tiles of a[slot, :, k] * x[t, k]      float32, times scales[slot]
    y[t, n:n+BLOCK_N] += b[slot, n:n+BLOCK_N, :] @ h

Each program recomputes the shrink h (R x K multiply-adds, R = slices * max_rank, small beside
the layer's own K x N): the simplest correct form, untuned (written without a GPU, checked
under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def lora_add_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, scales_ptr, slots_ptr,
    K, N, R,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_base = a_ptr + slot * R * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        a_tile = tl.load(
            a_base + rs[:, None] * K + ks[None, :],
            mask=(rs[:, None] < R) & (ks[None, :] < K),
            other=0.0,
        )  # (BLOCK_R, BLOCK_K)
        h += tl.sum(a_tile * xk[None, :], axis=1)
    h = h * tl.load(scales_ptr + slot)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_tile = tl.load(
        b_ptr + slot * N * R + ns[:, None] * R + rs[None, :],
        mask=(ns[:, None] < N) & (rs[None, :] < R),
        other=0.0,
    )  # (BLOCK_N, BLOCK_R)
    delta = tl.sum(b_tile * h[None, :], axis=1)
    y = tl.load(y_ptr + t * N + ns, mask=ns < N, other=0.0)
    tl.store(y_ptr + t * N + ns, (y.to(tl.float32) + delta).to(y.dtype), mask=ns < N)


def lora_add_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """In place into y (num_tokens, N); a, b, scales float32; slots (num_tokens,) int32."""
    assert y.is_contiguous() and x.is_contiguous() and a.is_contiguous() and b.is_contiguous()
    num_tokens, n = y.shape
    if num_tokens == 0:
        return
    r = a.shape[1]
    grid = (num_tokens, triton.cdiv(n, BLOCK_N))
    lora_add_kernel[grid](
        x, y, a, b, scales, slots.to(torch.int32),
        x.shape[1], n, r,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=triton.next_power_of_2(r),
    )  # fmt: skip
