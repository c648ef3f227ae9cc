"""Batched LoRA: every token of a step gets its own adapter's low-rank update, in one call for
the whole mixed batch (not one forward per adapter):

    y[t] += scales[s] * B[s] @ (A[s] @ x[t])      s = slots[t]; s == -1: the base model, untouched

a (num_slots, R, K) and b (num_slots, N, R) hold every loaded adapter's matrices by slot
(engine/lora/manager.py explains the fused layers' block-diagonal B). Three implementations of
the one contract: `lora_add_ref` in torch (the reference, and the path where no kernel runs),
cpu_lora.c on the CPU, lora_triton.py on a GPU.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_kernels


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """In place into y (num_tokens, N), x (num_tokens, K); slots (num_tokens,) int32."""
    if y.is_cuda:
        from engine.kernels.lora_triton import lora_add_triton

        lora_add_triton(y, x, a, b, scales, slots)
    elif cpu_kernels.library() is not None:
        lora_add_cpu(y, x, a, b, scales, slots)
    else:
        lora_add_ref(y, x, a, b, scales, slots)


def lora_add_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """torch: the tokens of each adapter gathered, shrunk and expanded, in float32."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        h = x[rows].float() @ a[slot].T  # (rows, R)
        delta = (h * scales[slot]) @ b[slot].T  # (rows, N)
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def lora_add_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """cpu_lora.c: float32 x, y, a, b (a bfloat16 y is widened and written back)."""
    assert a.dtype == b.dtype == scales.dtype == torch.float32
    assert a.is_contiguous() and b.is_contiguous()
    x32 = x.float().contiguous()
    y32 = y if y.dtype == torch.float32 and y.is_contiguous() else y.float().contiguous()
    slots32 = slots.to(torch.int32).contiguous()
    cpu_kernels.run(
        "lora_add",
        x32.data_ptr(), y32.data_ptr(), a.data_ptr(), b.data_ptr(), scales.data_ptr(),
        slots32.data_ptr(), x32.shape[0], x32.shape[1], y32.shape[1], a.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
    if y32 is not y:
        y.copy_(y32)
