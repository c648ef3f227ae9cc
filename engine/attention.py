"""Attention dispatch: the one place that picks the Triton kernels or the torch path.

"auto" runs Triton on CUDA tensors, and on CPU tensors the C kernels (kernels/cpu_kernels.c:
attention and KV stores reading the paged cache in place, prefill included) where they built,
else the torch path (kernels/torch_paged.py, the reference's maths arranged for a CPU).
"torch", "cpu" and "triton" force one path (the engine config passes the choice down; nothing
here reads the environment). Forcing "triton" on CPU tensors works only under the Triton
interpreter (TRITON_INTERPRET=1); the tests drive it so.

The kernel modules, and with them triton, are imported lazily, so the torch path never imports
triton: @triton.jit (triton's own tl.* helpers included) picks compiled vs interpreted when it
decorates, i.e. when triton is first imported, and a process that imports the engine before it
turns the interpreter on (a test session) must still be able to.
"""

from __future__ import annotations

from typing import Literal, cast

import torch

from engine.kernels import cpu_kernels, torch_paged
from engine.kernels.reference import store_kv_ref

AttentionBackend = Literal["auto", "torch", "cpu", "triton"]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
    shared: dict[str, object] | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context: (batch, num_heads, head_dim).

    `sinks`: (num_heads,) float32 attention-sink logits (gpt-oss), see reference.attend; every
    path takes them.
    `shared`: a dict the layers of one forward pass share; the torch path keeps its plan there
    (sort and grouping of the sequences, gather indices, masks), made by the first layer."""
    if _use_triton(backend, q):
        from engine.kernels import decode

        _check_runnable(q, decode.decode_split_kernel)
        return decode.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, soft_cap,
            sinks,
        )  # fmt: skip
    if _use_cpu_kernels(backend, k_cache):
        return cpu_kernels.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, soft_cap,
            sinks,
        )  # fmt: skip
    key = f"torch_decode_plan/{sliding_window}"  # layers may differ in their window
    plan = cast("list[torch_paged.DecodeGroup] | None", (shared or {}).get(key))
    if plan is None:
        plan = torch_paged.plan_decode(k_cache, block_tables, context_lens, sliding_window)
        if shared is not None:
            shared[key] = plan
    return torch_paged.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, soft_cap, sinks,
        plan,
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Packed new tokens over cached prefix + themselves, causal: q's shape."""
    if _use_triton(backend, q):
        from engine.kernels import prefill

        _check_runnable(q, prefill.prefill_kernel)
        return prefill.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
            sliding_window, soft_cap, sinks,
        )  # fmt: skip
    if _use_cpu_kernels(backend, k_cache):
        return cpu_kernels.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
            sliding_window, soft_cap, sinks,
        )  # fmt: skip
    return torch_paged.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
        sliding_window, soft_cap, sinks,
    )  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: AttentionBackend = "auto",
) -> None:
    """Store the new tokens' K/V (num_tokens, num_kv_heads, head_dim) at their cache slots."""
    if _use_triton(backend, k):
        from engine.kernels import store_kv

        _check_runnable(k, store_kv.store_kv_kernel)
        store_kv.store_kv(k, v, k_cache, v_cache, slot_mapping)
    elif _use_cpu_kernels(backend, k_cache):
        cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _use_triton(backend: AttentionBackend, x: torch.Tensor) -> bool:
    if backend == "auto":
        return x.is_cuda
    if backend in ("torch", "cpu", "triton"):
        return backend == "triton"
    raise ValueError(f"attention backend must be auto, torch, cpu or triton, got {backend!r}")


def _use_cpu_kernels(backend: AttentionBackend, cache: torch.Tensor) -> bool:
    if backend == "cpu":
        if not cpu_kernels.supports(cache):
            raise RuntimeError(
                "attention backend 'cpu' needs a float32, bfloat16 or int8 CPU cache, a head "
                "size that is a multiple of 8, and a C compiler"
            )
        return True
    return backend == "auto" and cpu_kernels.supports(cache)


def _check_runnable(x: torch.Tensor, kernel: object) -> None:
    """Fail with a reason instead of a driver error when Triton is forced on CPU tensors."""
    if x.is_cuda:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "attention backend 'triton' got CPU tensors but the kernels are compiled for a GPU; "
            "set TRITON_INTERPRET=1 before triton is first imported to run them on CPU"
        )
