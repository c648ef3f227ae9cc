"""The grouped MoE kernel's part of bench/kernels.py (run through it, which picks GPU or CPU).

On a CUDA device: engine/kernels/moe.py `grouped_moe` at Qwen3-30B-A3B's expert shapes (128
experts, top 8, hidden 2048, inter 768, silu) and gpt-oss-20b's (32 experts, top 4, hidden 2880,
inter 2880, biases, gpt-oss activation), bfloat16, from 1 token (decode) to 4096 (prefill), timed
against a torch loop over the experts hit (index, two matmuls, index_add: what an unfused
implementation does). Decode reads weights: `weight_gbps` = bytes of the experts hit / time, to
read against the device copy; prefill computes: `tflops`. Without CUDA: a tiny correctness pass
against `moe_experts_ref` in the interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

MOE_SHAPES = {  # name: (num_experts, top_k, hidden, inter, activation, biases)
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "gpt_oss", True),
}
MOE_TOKENS = (1, 16, 64, 512, 4096)
DEVICE = "cuda"  # a CPU dry run of the harness may swap it


def moe_inputs(
    num_tokens: int, shape: tuple[int, int, int, int, str, bool], dtype: torch.dtype, device: str
) -> tuple[Any, ...]:
    """x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias with router-like ids."""
    num_experts, top_k, hidden, inter, _, biases = shape
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    weights, ids = torch.topk(
        torch.randn(num_tokens, num_experts, device=device).softmax(-1), top_k
    )
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    gate_up_bias = torch.randn(num_experts, 2 * inter, device=device) if biases else None
    down_bias = torch.randn(num_experts, hidden, device=device) if biases else None
    return x, ids, weights, gate_up, down, gate_up_bias, down_bias


def torch_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """The baseline: per expert hit, gather its rows, two matmuls, weighted index_add."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token] @ gate_up[e].T  # (rows, 2 * inter)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(h.dtype)
        gate, up = h[:, :inter], h[:, inter:]
        if activation == "silu":
            act = torch.nn.functional.silu(gate) * up
        else:
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        y = act @ down[e].T
        if down_bias is not None:
            y = y + down_bias[e].to(y.dtype)
        out.index_add_(0, token, weights[token, slot, None] * y.float())
    return out.to(x.dtype)


def moe_benchmark(median_ms: Callable[[Callable[[], object]], float]) -> list[dict[str, Any]]:
    rows = []
    for name, shape in MOE_SHAPES.items():
        for num_tokens in MOE_TOKENS:
            row = moe_case(name, shape, num_tokens, median_ms)
            rows.append(row)
            print(
                f"moe {name} tokens={num_tokens:5d} experts hit {row['experts_hit']:3d}: triton "
                f"{row['triton_ms']:.3f} ms {row['triton_weight_gbps']:6.0f} GB/s "
                f"{row['triton_tflops']:5.1f} TFLOP/s, torch {row['torch_ms']:.3f} ms"
            )
            torch.cuda.empty_cache()
    return rows


def moe_case(
    name: str,
    shape: tuple[int, int, int, int, str, bool],
    num_tokens: int,
    median_ms: Callable[[Callable[[], object]], float],
) -> dict[str, Any]:
    from engine.kernels import moe

    num_experts, top_k, hidden, inter, activation, _ = shape
    inputs = moe_inputs(num_tokens, shape, torch.bfloat16, DEVICE)
    hit = int(inputs[1].unique().numel())
    weight_bytes = hit * 3 * inter * hidden * 2  # gate, up and down rows, bfloat16
    flops = 2 * num_tokens * top_k * 3 * inter * hidden

    def run_triton() -> torch.Tensor:
        return moe.grouped_moe(*inputs, activation)

    def run_torch() -> torch.Tensor:
        return torch_experts(*inputs, activation)

    row: dict[str, Any] = {
        "shape": name,
        "num_tokens": num_tokens,
        "experts_hit": hit,
        "block_m": moe.choose_block_m(num_tokens * top_k, num_experts),
        "max_abs_err_vs_torch": float((run_triton().float() - run_torch().float()).abs().max()),
    }
    for kind, fn in [("triton", run_triton), ("torch", run_torch)]:
        ms = median_ms(fn)
        row[f"{kind}_ms"] = ms
        row[f"{kind}_weight_gbps"] = weight_bytes / ms / 1e6
        row[f"{kind}_tflops"] = flops / ms / 1e9
    return row


def moe_correctness() -> list[dict[str, Any]]:
    """Tiny shapes through the interpreter against moe_experts_ref (no timing claims)."""
    from engine.kernels import moe
    from engine.kernels.reference import moe_experts_ref

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (_, top_k, _, _, activation, biases) in MOE_SHAPES.items():
            shape = (8, top_k, 64, 48, activation, biases)  # the model's routing, tiny matrices
            inputs = moe_inputs(6, shape, dtype, "cpu")
            start = time.perf_counter()
            out = moe.grouped_moe(*inputs, activation)
            seconds = time.perf_counter() - start
            ref = moe_experts_ref(*inputs, activation)
            rows.append({"kernel": f"moe {name}", "dtype": str(dtype),
                         "max_abs_err": float((out.float() - ref.float()).abs().max()),
                         "interpreter_s": seconds})  # fmt: skip
    return rows
