"""The torch path: the reference's maths arranged for speed where no Triton kernel runs (the CPU).

reference.py states the maths plainly and pays for it: advanced indexing gathers every
sequence's keys padded to the longest, and einsum copies them twice more into the layouts a
matrix multiply wants. On a CPU those copies are most of a decode step. Here:

- decode sorts the sequences by length and, a cache-sized group at a time, gathers their blocks
  once with index_select into (group, padded_len, kv_heads, head_dim) and reads each KV head's
  keys and values in place as strided matrices, which batched matrix multiplies take without a
  copy; the mask is an additive bias folded into the first multiply;
- prefill/extend runs each sequence's chunk as two batched multiplies per KV head, with the query
  heads that share it stacked.
Soft caps and attention sinks (gpt-oss: one more logit per query head in each softmax, with no
value) are applied to the scores between the two multiplies.

A bfloat16 or int8 cache (kv_cache_dtype) is widened or dequantized (kv_quant.py) as its
blocks are gathered. Both compute in float32 like the reference;
tests/unit/engine/kernels/test_kernels.py holds them to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.kernels.kv_quant import as_float, head_dim_of
from engine.kernels.reference import key_mask

# K and V of one group of decode sequences: about what a CPU core's caches keep while the group's
# multiplies read them back (measured on the tiny model: half the time of one whole-batch group).
GROUP_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Sequences of similar length attended together: what every layer of one step reuses."""

    seqs: torch.Tensor  # (group,) their rows in the batch
    block_ids: torch.Tensor  # (group * num_blocks,) their first num_blocks blocks, row by row
    bias: torch.Tensor  # (group, 1, num_blocks * block_size): 0 for a key it sees, else -inf
    padded_len: int  # num_blocks * block_size


def plan_decode(
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
) -> list[DecodeGroup]:
    """Sort the sequences by length and cut them into groups whose gathered K/V fit GROUP_BYTES:
    similar lengths pad little, and a group's keys are still in cache when they are multiplied."""
    block_size, num_kv_heads = k_cache.shape[1:3]
    head_dim = head_dim_of(k_cache)
    token_bytes = 2 * num_kv_heads * head_dim * 4  # K and V, in float32
    lens, order = torch.sort(context_lens.long())
    groups = []
    for rows in _runs(lens.tolist(), max(1, GROUP_BYTES // token_bytes)):
        seqs, group_lens = order[rows], lens[rows]
        num_blocks = -(-int(group_lens[-1]) // block_size)
        padded_len = num_blocks * block_size
        allowed = key_mask((group_lens - 1)[:, None], group_lens, padded_len, sliding_window)
        bias = torch.zeros(allowed.shape, device=lens.device).masked_fill_(~allowed, -math.inf)
        block_ids = block_tables[seqs, :num_blocks].reshape(-1)
        groups.append(DecodeGroup(seqs, block_ids, bias, padded_len))
    return groups


def _runs(sorted_lens: list[int], max_tokens: int) -> list[slice]:
    """Consecutive runs of the sorted sequences whose padded lengths add up to at most
    `max_tokens` (a longer sequence makes a run of its own)."""
    runs, start = [], 0
    for end in range(1, len(sorted_lens) + 1):
        if end == len(sorted_lens) or (end + 1 - start) * sorted_lens[end] > max_tokens:
            runs.append(slice(start, end))
            start = end
    return runs


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
    plan: list[DecodeGroup] | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: (batch, num_heads, head_dim).
    `plan` (plan_decode of the same tables and lengths) lets the layers of a step share one."""
    if plan is None:
        plan = plan_decode(k_cache, block_tables, context_lens, sliding_window)
    out = torch.empty_like(q)
    for group in plan:
        out[group.seqs] = _attend_group(
            q[group.seqs], k_cache, v_cache, group, scale, soft_cap, sinks
        )
    return out


def _attend_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    kv_shape = (batch, group.padded_len, num_kv_heads, k_cache.shape[-1])
    k = as_float(k_cache.index_select(0, group.block_ids).view(kv_shape))
    v = as_float(v_cache.index_select(0, group.block_ids).view(kv_shape))
    group_size = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group_size, head_dim).float()
    sink = None if sinks is None else sinks.float().view(num_kv_heads, 1, group_size, 1)
    out = torch.empty(num_kv_heads, batch, group_size, head_dim, device=q.device)
    for h in range(num_kv_heads):
        keys_t = k[:, :, h].transpose(1, 2)  # (batch, head_dim, padded_len), a strided view
        if soft_cap is None:
            scores = torch.baddbmm(group.bias, qg[:, h], keys_t, alpha=scale)
        else:
            scores = torch.bmm(qg[:, h], keys_t).mul_(scale / soft_cap).tanh_()
            scores = scores.mul_(soft_cap).add_(group.bias)
        # Every row keeps its own position (the query token), so no row is all -inf.
        probs = _softmax(scores, None if sink is None else sink[h])
        torch.bmm(probs, v[:, :, h], out=out[h])
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention_ref: q's shape."""
    block_size, num_kv_heads, row = k_cache.shape[1:]
    out = torch.empty_like(q)
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, total in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if start == end:
            continue  # an empty chunk
        num_blocks = -(-total // block_size)
        ids = block_tables[b, :num_blocks]
        k = as_float(k_cache.index_select(0, ids).view(-1, num_kv_heads, row)[:total])
        v = as_float(v_cache.index_select(0, ids).view(-1, num_kv_heads, row)[:total])
        query_pos = torch.arange(total - (end - start), total, device=q.device)
        allowed = key_mask(query_pos[None], context_lens[b : b + 1].long(), total, sliding_window)
        out[start:end] = _attend_chunk(q[start:end], k, v, allowed[0], scale, soft_cap, sinks)
    return out


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's chunk, q: (q_len, num_heads, d), over k, v: (num_keys, num_kv_heads, d)
    with allowed: (q_len, num_keys). The query heads that share a KV head are stacked into one
    (group * q_len, d) matrix, so each KV head is two plain matrix multiplies with no copy of
    its keys per query head (scaled_dot_product_attention with a mask and GQA takes its
    unfused path here, about twice as slow)."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    stacked = q.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    stacked = stacked.reshape(num_kv_heads, group * q_len, head_dim)
    bias = torch.zeros(allowed.shape, device=q.device).masked_fill_(~allowed, -math.inf)
    bias = bias.repeat(group, 1)
    sink = None  # (num_kv_heads, group * q_len, 1): each stacked row's head's sink
    if sinks is not None:
        sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, -1)
        sink = sink.reshape(num_kv_heads, group * q_len, 1)
    if _onednn_runs(q):
        attended = _attend_onednn(stacked, k.float(), v.float(), bias, scale, soft_cap, sink)
    else:
        scores = torch.bmm(stacked, k.float().permute(1, 2, 0))
        # Every query sees its own position, so no row is all -inf.
        probs = _softmax(_logits(scores, bias, scale, soft_cap), sink)
        attended = torch.bmm(probs, v.float().transpose(0, 1))
    attended = attended.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return attended.reshape(q_len, num_heads, head_dim).to(q.dtype)


def _onednn_runs(x: torch.Tensor) -> bool:
    return not x.is_cuda and torch.backends.mkldnn.is_available()


def _attend_onednn(
    stacked: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """The same two multiplies per KV head through oneDNN's matmul (as engine/linear.py, for
    the same reason: torch's CPU bmm calls MKL, which takes a generic path on AMD hosts). About
    3x faster than baddbmm / bmm at a 192-token chunk of SmolLM2; float32 throughout."""
    linear = torch.ops.mkldnn._linear_pointwise
    out = torch.empty_like(stacked)
    for head in range(stacked.shape[0]):
        scores = linear(stacked[head], k[:, head].contiguous(), None, "none", [], "")
        logits = _logits(scores, bias, scale, soft_cap)
        # every query sees its own position: no -inf row
        probs = _softmax(logits, None if sink is None else sink[head])
        out[head] = linear(probs, v[:, head].t().contiguous(), None, "none", [], "")
    return out


def _logits(
    scores: torch.Tensor, bias: torch.Tensor, scale: float, soft_cap: float | None
) -> torch.Tensor:
    """q . k scores (overwritten) to the softmax's logits: scaled, soft-capped
    (cap * tanh(s / cap)), then masked by the additive bias."""
    scores.mul_(scale)
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    return scores.add_(bias)


def _softmax(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with `sink` (logits' shape with a last dim of 1, or one that
    broadcasts to it), the sink's logit joins each row as one more key whose probability is
    then dropped (reference.attend)."""
    if sink is None:
        return torch.softmax(logits, dim=-1)
    sink = sink.expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
