"""Triton grouped MoE: the experts of a mixture-of-experts layer, each expert's weights read once
per block of its rows rather than once per token (the maths is `reference.moe_experts_ref`).

Routing gives token t its top_k (expert, weight) pairs; pair p = t * top_k + j. `moe_align` sorts
the pairs by expert (stable: token order inside an expert) and pads each expert's run to a multiple
of BLOCK_M, so every block of rows belongs to one expert:

    topk_ids (3 tokens, top_k 2):   t0: (2, 0)   t1: (0, 3)   t2: (2, 3)      pairs 0..5
    sorted_ids (BLOCK_M = 4):       [ 1  2  P  P | 0  4  P  P | 3  5  P  P ]  P = padding (= 6)
    block_experts:                  [     0      |     2      |     3      ] then -1 (unused blocks)

    gate_up kernel  (block, n tile): x[pair // top_k] @ gate_up[e][gate/up rows of the tile].T
                                     + bias -> activation -> h[pair]         (num_pairs, inter)
    down kernel     (block, n tile): h[pair] @ down[e][rows of the tile].T + bias -> y[pair]
    sum kernel      (token, n tile): out[t] = sum_j topk_weights[t, j] * y[t * top_k + j]

An expert with c pairs has its weights read ceil(c / BLOCK_M) times: once when c <= BLOCK_M, as in
decode; an expert with no pair is not read. Blocks are the grid's fastest axis, so an expert's
blocks run side by side on the same weight tile (L2 reuse). The grids are sized from shapes alone
(an upper bound on the blocks; blocks past the last exit at once), so nothing waits on the host.
y is kept in x's dtype and weighted in the sum, in top_k order and in float32, as the reference
rounds and adds: deterministic, no atomics on the output. Tile sizes are untuned (no GPU was at
hand when this was written; bench/kernels.py times the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.decode import dot, needs_upcast

BLOCK_N = 64  # output columns per program
BLOCK_K = 32  # reduction slice per step
ACTIVATIONS = {"silu": 0, "gpt_oss": 1}


@dataclass(slots=True)
class MoeAlignment:
    """The (token, slot) pairs grouped by expert, each expert's run padded to `block` rows."""

    sorted_ids: torch.Tensor  # (max_blocks * block,) int32 pair ids; padding = num_pairs
    block_experts: torch.Tensor  # (max_blocks,) int32 expert of each block; -1 past the last
    num_blocks: torch.Tensor  # () int64: blocks in use (a tensor: reading it would sync)
    block: int


def max_blocks(num_pairs: int, num_experts: int, block: int) -> int:
    """Upper bound on sum_e ceil(c_e / block) given sum_e c_e = num_pairs: each expert that gets a
    pair (at most min(num_experts, num_pairs) of them) pads by at most block - 1 rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block - 1)) // block


def moe_align(topk_ids: torch.Tensor, num_experts: int, block: int) -> MoeAlignment:
    """Sort the pairs of `topk_ids` (num_tokens, top_k) by expert, runs padded to `block` rows.

    Torch ops on the ids' device with no host sync; stable, so an expert's rows keep token order.
    """
    flat = topk_ids.flatten().long()  # (num_pairs,) expert of each pair
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (num_experts,); bincount would sync
    padded = (counts + block - 1) // block * block
    run_end = padded.cumsum(0)  # each expert's run is [run_end - padded, run_end)
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    n_blocks = max_blocks(num_pairs, num_experts, block)
    sorted_ids = torch.full((n_blocks * block,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[run_end[expert_of] - padded[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(n_blocks, device=flat.device) * block  # first row of each block
    used = run_end[-1]  # rows in use
    # The expert whose run holds row `start`: the first with run_end > start (empty runs skipped).
    block_experts = torch.searchsorted(run_end, starts, right=True)
    block_experts = torch.where(starts < used, block_experts, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, block_experts, used // block, block)


@triton.jit
def rounded(x, dtype: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest even), kept in float32: the reference's roundings.
    The interpreter's float32 -> bfloat16 cast truncates, so there the bits are rounded here."""
    if INTERPRETED_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        out = x.to(dtype).to(tl.float32)
    return out


@triton.jit
def expert_rows_of_block(sorted_ids_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (-1: unused block) and its BLOCK_M pair ids with their mask."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, sorted_ids_ptr, block_experts_ptr, h_ptr, rows_read_ptr,
    num_pairs, hidden, inter, alpha, limit,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    stride_hp, stride_hn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, COUNT_READS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """h[pair, n tile] = act(gate, up) for one block of one expert's rows; gate and up are the
    same columns of the expert's gate rows and up rows, so the activation fuses here."""
    expert, pairs, row_mask = expert_rows_of_block(
        sorted_ids_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    tokens = (pairs // TOP_K).to(tl.int64)  # (BLOCK_M,) rows of x
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_k = offs_k[:, None] * stride_wk
        wg = tl.load(w_gate + w_k, mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        wu = tl.load(w_up + w_k, mask=w_mask, other=0.0)
        acc_gate += dot(a, wg, INTERPRETED_BF16, PRECISION)
        acc_up += dot(a, wu, INTERPRETED_BF16, PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_be + offs_n * stride_bn
        acc_gate += tl.load(bias, mask=n_mask, other=0.0)[None, :]
        acc_up += tl.load(bias + inter * stride_bn, mask=n_mask, other=0.0)[None, :]
    dtype = x_ptr.dtype.element_ty  # gate and up are rounded to x's dtype, as the reference does
    gate = rounded(acc_gate, dtype, INTERPRETED_BF16)
    up = rounded(acc_up, dtype, INTERPRETED_BF16)
    if ACTIVATION == 0:  # silu(gate) * up
        act = gate * tl.sigmoid(gate) * up
    else:  # gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(
        h_ptr + pairs.to(tl.int64)[:, None] * stride_hp + offs_n[None, :] * stride_hn,
        rounded(act, dtype, INTERPRETED_BF16).to(dtype),
        mask=row_mask[:, None] & n_mask[None, :],
    )
    if COUNT_READS:  # weight rows this program loaded: its gate and up rows
        tl.atomic_add(rows_read_ptr + expert, 2 * tl.sum(n_mask.to(tl.int32), 0))


@triton.jit
def down_kernel(
    h_ptr, w_ptr, bias_ptr, sorted_ids_ptr, block_experts_ptr, y_ptr, rows_read_ptr,
    num_pairs, hidden, inter,
    stride_hp, stride_hk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, COUNT_READS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y[pair, n tile] = h[pair] @ down[e][n tile].T + bias, rounded to x's dtype."""
    expert, pairs, row_mask = expert_rows_of_block(
        sorted_ids_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    rows = pairs.to(tl.int64)[:, None]
    w = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(
            h_ptr + rows * stride_hp + offs_k[None, :] * stride_hk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        wd = tl.load(
            w + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )  # (BLOCK_K, BLOCK_N)
        acc += dot(a, wd, INTERPRETED_BF16, PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_be + offs_n * stride_bn
        acc += tl.load(bias, mask=n_mask, other=0.0)[None, :]
    tl.store(
        y_ptr + rows * stride_yp + offs_n[None, :] * stride_yn,
        rounded(acc, y_ptr.dtype.element_ty, INTERPRETED_BF16).to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & n_mask[None, :],
    )
    if COUNT_READS:  # weight rows this program loaded
        tl.atomic_add(rows_read_ptr + expert, tl.sum(n_mask.to(tl.int32), 0))


@triton.jit
def weighted_sum_kernel(
    y_ptr, weights_ptr, out_ptr, hidden,
    stride_yp, stride_yn, stride_ot, stride_on,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED_BF16: tl.constexpr,
):  # fmt: skip
    """out[t, n tile] = sum_j weights[t, j] * y[t * TOP_K + j], float32, in the order of j."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + j) * stride_yp + offs_n * stride_yn, mask=n_mask, other=0)
        acc += w * y.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = rounded(acc, dtype, INTERPRETED_BF16).to(dtype)
    tl.store(out_ptr + t * stride_ot + offs_n * stride_on, out, mask=n_mask)


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the pairs an expert gets on average (16 to 64), so decode's few rows
    per expert are not padded to 64 and prefill's many do not re-read the weights more often."""
    per_expert = -(-num_pairs // max(1, num_experts))
    return min(64, max(16, triton.next_power_of_2(per_expert)))


def grouped_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    *,
    block_m: int | None = None,
    weight_rows_read: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference.moe_experts_ref` (x float32, float16 or bfloat16; float32
    accumulation). `block_m` overrides `choose_block_m`. `weight_rows_read`: a zeroed
    (2, num_experts) int32 tensor the kernels add the weight rows they load to: [0, e] rows of
    gate_up[e] (each `hidden` long), [1, e] rows of down[e] (each `inter` long); divided by
    2 * inter and by hidden they count how many times each expert's matrices were read.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}")
    if gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape != (
        num_experts, hidden, inter
    ):  # fmt: skip
        raise ValueError(
            f"expert weights gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
            f"fit hidden size {hidden}"
        )
    out = torch.empty_like(x)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out.zero_()
    block_m = block_m or choose_block_m(num_pairs, num_experts)
    align = moe_align(topk_ids, num_experts, block_m)
    n_blocks = align.block_experts.shape[0]
    h = x.new_empty(num_pairs, inter)  # (num_pairs, inter) activations, x's dtype
    y = x.new_empty(num_pairs, hidden)  # (num_pairs, hidden) expert outputs, x's dtype
    count = weight_rows_read is not None
    gate_up_rows, down_rows = weight_rows_read if count else (h, h)  # h: an unused pointer
    # bfloat16 in the interpreter: dot through float32 (triton#11584) and round by hand.
    interpreted_bf16 = needs_upcast(x)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gate_up_kernel[(n_blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, gate_up_bias, align.sorted_ids, align.block_experts, h, gate_up_rows,
        num_pairs, hidden, inter, alpha, limit,
        *x.stride(), *gate_up.stride(), *_bias_strides(gate_up_bias), *h.stride(),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None,
        COUNT_READS=count, INTERPRETED_BF16=interpreted_bf16, PRECISION=precision,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    down_kernel[(n_blocks, triton.cdiv(hidden, BLOCK_N))](
        h, down, down_bias, align.sorted_ids, align.block_experts, y, down_rows,
        num_pairs, hidden, inter,
        *h.stride(), *down.stride(), *_bias_strides(down_bias), *y.stride(),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=down_bias is not None,
        COUNT_READS=count, INTERPRETED_BF16=interpreted_bf16, PRECISION=precision,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    weighted_sum_kernel[(num_tokens, triton.cdiv(hidden, BLOCK_N))](
        y, topk_weights.contiguous(), out, hidden, *y.stride(), *out.stride(),
        TOP_K=top_k, BLOCK_N=BLOCK_N, INTERPRETED_BF16=interpreted_bf16, num_warps=4,
    )  # fmt: skip
    return out


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if bias is None else (bias.stride(0), bias.stride(1))
