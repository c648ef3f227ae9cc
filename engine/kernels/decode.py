"""Triton paged decode attention: one new token per sequence against its cached context.

Decode is bound by reading K/V, so the kernel is built to read every cached byte once:
- a program owns one (sequence, KV head) pair and all `group` query heads that share it (GQA), so
  each K/V tile is loaded once per group and fed to one `tl.dot` of (group padded to 16) x head_dim;
- long contexts are cut into splits (flash-decoding) so a small batch still fills every SM, and a
  second kernel merges the splits.

Split-KV scheme for one (sequence b, KV head), context [start, ctx) with start > 0 under a window:

    keys:      start                                                          ctx
               |---- split 0 ----|---- split 1 ----|---- split 2 ----|- s3 -|
                 tiles of BLOCK_N (per-token block-table lookup, any page size)
    stage 1:   (o_0, lse_0)        (o_1, lse_1)      (o_2, lse_2)      (o_3, lse_3)
               o_s = softmax_s(scores) @ V_s   lse_s = log2 sum_s 2^(score)   (fp32, per query head)
    stage 2:   M = max_s lse_s;  w_s = 2^(lse_s - M);  out = sum_s w_s o_s / sum_s w_s

Each split is a multiple of BLOCK_N long, so an empty split (a short sequence in a batch sized for a
long one) just writes lse = -inf and weighs nothing. With one split, stage 1 writes the output.

Attention sinks (gpt-oss: one extra logit per query head, with a zero value) join the softmax once:
stage 2 treats the sink as one more split with lse = sink and o = 0 (it only adds to the
denominator); with one split, stage 1 starts its online softmax from the sink (m = sink, l = 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # scores live in log2 units for exp2
BLOCK_N = 64  # keys per tile
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more to merge than it saves
MAX_SPLITS = 64
WAVES_PER_SM = 4  # programs per SM the split heuristic aims for
# A small batch (fewer (sequence, KV head) programs than SMs) is latency-bound: its few programs
# each walk a long chain of dependent tile loads while most SMs idle (an H200 at batch 1: 4-18 %
# of the copy bandwidth). It gets shorter tiles and shorter splits, so more programs read at once.
SMALL_BATCH_BLOCK_N = 32
SMALL_BATCH_MIN_TOKENS_PER_SPLIT = 64


# LOG2E, tanh, dot, load_kv_tiles, attend_tile and needs_upcast are shared with prefill.py.
# Device functions carry only tl.constexpr annotations: Triton gives parameter annotations meaning.


@triton.jit
def tanh(x):
    # 2*sigmoid(2x) - 1 saturates cleanly to +-1 and needs no libdevice (the interpreter has none).
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # UPCAST: the CPU interpreter multiplies bfloat16 bit patterns in tl.dot (triton#11584), so its
    # bfloat16 operands go through float32; the operands are already bfloat16-rounded, so the maths
    # matches the GPU's bfloat16 dot with fp32 accumulation.
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def load_kv_tiles(
    k_ptr, v_ptr, table_ptr, pos, n_mask, kv_head, offs_d, d_mask, stride_btn,
    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """K and V tiles (BLOCK_N, BLOCK_D) of one KV head at key positions `pos`, through the
    sequence's block table: position p lives in block table[p // PAGE_SIZE], slot p % PAGE_SIZE.
    INT8: the cache's rows are kv_quant.py's (HEAD_DIM int8 values, then a float32 scale, the
    strides in bytes): the tiles come back dequantized, float32."""
    block = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_btn, mask=n_mask, other=0)
    block = block.to(tl.int64)[:, None]  # int64: block * stride(0) can pass 2**31 elements
    slot = (pos % PAGE_SIZE)[:, None]
    mask = n_mask[:, None] & d_mask[None, :]
    dims = offs_d[None, :]
    k_offsets = block * stride_kb + slot * stride_kt + kv_head * stride_kh + dims * stride_kd
    v_offsets = block * stride_vb + slot * stride_vt + kv_head * stride_vh + dims * stride_vd
    k = tl.load(k_ptr + k_offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + v_offsets, mask=mask, other=0.0)
    if INT8:
        k_row = block * stride_kb + slot * stride_kt + kv_head * stride_kh + HEAD_DIM
        v_row = block * stride_vb + slot * stride_vt + kv_head * stride_vh + HEAD_DIM
        f32 = tl.pointer_type(tl.float32)
        k_scale = tl.load((k_ptr + k_row).to(f32), mask=n_mask[:, None], other=0.0)
        v_scale = tl.load((v_ptr + v_row).to(f32), mask=n_mask[:, None], other=0.0)
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    return k, v


@triton.jit
def attend_tile(
    q, k, v, allowed, m_i, l_i, acc, scale, soft_cap,
    HAS_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a key tile, scores in log2 units; returns (m, l, acc).

    A row that has seen no allowed key keeps m = -inf; m_safe makes its exp2 terms 0, not NaN.
    A cache of another dtype than q (a bfloat16 KV cache under a float32 model) is widened.
    """
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = dot(q, tl.trans(k), UPCAST, PRECISION)  # (rows, BLOCK_N) fp32
    if HAS_SOFT_CAP:
        s = soft_cap * tanh(s * (scale / soft_cap)) * LOG2E
    else:
        s = s * (scale * LOG2E)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return m_new, l_i, acc


@triton.jit
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr,
    part_out_ptr, part_lse_ptr, out_ptr,
    scale, soft_cap, sliding_window, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """Stage 1: attention of one (sequence, KV head group) over one split of the context."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - sliding_window, 0)
    split_len = tl.cdiv(tl.cdiv(ctx - start, num_splits), BLOCK_N) * BLOCK_N
    split_start = start + split * split_len
    split_end = tl.minimum(split_start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # query heads of this group; rows >= GROUP are padding
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS and SINGLE_SPLIT:  # the sink is the first "key": weight 2^(sink - m), value 0
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_btb
    for n0 in range(split_start, split_end, BLOCK_N):
        pos = n0 + offs_n  # (BLOCK_N,) token positions
        n_mask = pos < split_end
        k, v = load_kv_tiles(
            k_ptr, v_ptr, table, pos, n_mask, kv_head, offs_d, d_mask, stride_btn,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
            PAGE_SIZE, HEAD_DIM, INT8,
        )  # (BLOCK_N, BLOCK_D) each  # fmt: skip
        m_i, l_i, acc = attend_tile(
            q, k, v, n_mask[None, :], m_i, l_i, acc, scale, soft_cap,
            HAS_SOFT_CAP, UPCAST, PRECISION,
        )  # fmt: skip

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split leaves zeros
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr,
    num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Stage 2: merge the splits of one (sequence, query head) by their log-sum-exp weights."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (b * tl.num_programs(1) + head) * num_splits + offs_s  # (BLOCK_S,)
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # empty splits weigh 0
    o = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(w, 0)
    if HAS_SINKS:  # one more split whose output is zero: it only adds to the denominator
        total += tl.exp2(sink - m_safe)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@functools.lru_cache(maxsize=8)
def device_num_sms(device: torch.device) -> int:
    """SM count for the split heuristic (queried once per device)."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one; splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, num_sms: int, min_tokens: int | None = None
) -> int:
    """Split until batch * kv_heads * splits is about WAVES_PER_SM programs per SM, keeping splits
    at least `min_tokens` long (default MIN_TOKENS_PER_SPLIT) and at most MAX_SPLITS of them."""
    programs = max(1, batch * num_kv_heads)
    by_occupancy = WAVES_PER_SM * num_sms // programs
    by_length = max(1, max_context_len // (min_tokens or MIN_TOKENS_PER_SPLIT))
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """One launch's tuning: splits of the context, keys per tile, warps per program."""

    num_splits: int
    block_n: int = BLOCK_N
    num_warps: int = 4


def choose_decode_config(
    batch: int, num_kv_heads: int, max_context_len: int, num_sms: int
) -> DecodeConfig:
    """The split heuristic, with small batches (fewer programs than SMs) on short tiles and
    short splits: bench/kernels.py's sweep times the alternatives per shape on a GPU."""
    if batch * num_kv_heads < num_sms:
        splits = choose_num_splits(
            batch, num_kv_heads, max_context_len, num_sms, SMALL_BATCH_MIN_TOKENS_PER_SPLIT
        )
        return DecodeConfig(splits, SMALL_BATCH_BLOCK_N)
    return DecodeConfig(choose_num_splits(batch, num_kv_heads, max_context_len, num_sms))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Same contract as `paged_decode_attention_ref`; `num_splits`, `block_n` (keys per tile, a
    power of two >= 16) and `num_warps` override the heuristic's (choose_decode_config).

    q: (batch, num_heads, head_dim); k_cache, v_cache: (num_blocks, block_size, num_kv_heads,
    head_dim), any strides, or int8 rows of head_dim + 4 (kv_quant.py); block_tables: (batch,
    max_blocks) int32; context_lens: (batch,) counting the query token; sinks: (num_heads,)
    float32 or None. Returns (batch, num_heads, head_dim) in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    # The block table's width bounds every context without reading context_lens on the host.
    max_context_len = block_tables.shape[1] * page_size
    chosen = choose_decode_config(batch, num_kv_heads, max_context_len, device_num_sms(q.device))
    num_splits = num_splits or chosen.num_splits
    block_n = block_n or chosen.block_n
    num_warps = num_warps or chosen.num_warps
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if num_splits > 1:
        part_out = q.new_empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = q.new_empty(batch, num_heads, num_splits, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused: stage 1 writes `out`
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, sinks,
        part_out, part_lse, out,
        scale, soft_cap or 0.0, sliding_window or 0, num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, SINGLE_SPLIT=num_splits == 1, UPCAST=needs_upcast(q),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INT8=k_cache.dtype == torch.int8, num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, sinks, out, num_splits, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None, num_warps=4,
        )  # fmt: skip
    return out


def needs_upcast(x: torch.Tensor) -> bool:
    """bfloat16 on CPU means the interpreter, whose tl.dot cannot multiply bfloat16."""
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"
