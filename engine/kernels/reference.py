"""Torch reference for paged attention: the maths the Triton kernels must match, and the CPU path.

Cache layout, per layer (a view into the block-major pool, see engine/kv_cache.py):

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)   stride(0) may exceed
                      block_size * num_kv_heads * head_dim; each block is contiguous.

A sequence's token at position p lives in block block_table[p // block_size], slot p % block_size.
The attention functions expect the KV of the tokens being computed to be in the cache already
(`store_kv_ref` writes it). A cache's dtype may differ from q's (kv_cache_dtype): bfloat16 is
read widened to float32; an int8 cache's rows are head_dim int8 values and a float32 scale
(kv_quant.py: the last dim is head_dim + 4), quantized when stored and dequantized when read.
"""

from __future__ import annotations

import torch

from engine.kernels import kv_quant


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's first `max_len` cached tokens: (batch, max_len, num_kv_heads, head_dim),
    float32 for an int8 cache (dequantized), else the cache's dtype."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # (batch, num_blocks, block_size, kvh, d)
    rows = blocks.flatten(1, 2)[:, :max_len]
    return kv_quant.dequantize(rows) if cache.dtype == torch.int8 else rows


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked GQA attention on padded batches.

    q: (batch, num_q, num_heads, d); k, v: (batch, num_keys, num_kv_heads, d);
    allowed: (batch, num_q, num_keys) bool. Returns (batch, num_q, num_heads, d).
    sinks: (num_heads,) logits of one extra key per head with a zero value (gpt-oss's attention
    sinks): they join each row's softmax, so the row's weights sum to less than one.
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_q, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale  # (b, kvh, g, q, k)
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.nan_to_num(0.0)  # rows with no key give zeros
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(batch, num_q, num_heads, head_dim).to(q.dtype)


def key_mask(
    query_pos: torch.Tensor, context_lens: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """(batch, num_q, num_keys) bool: causal, inside the context, inside the sliding window."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
        key_pos[None, None, :] < context_lens[:, None, None]
    )
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    return allowed


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, at position context_lens - 1.

    q: (batch, num_heads, head_dim); block_tables: (batch, max_blocks) int32;
    context_lens: (batch,) int32, counting the query token. Returns (batch, num_heads, head_dim).
    """
    max_len = int(context_lens.max())
    k = gather_kv(k_cache, block_tables, max_len)
    v = gather_kv(v_cache, block_tables, max_len)
    query_pos = (context_lens.long() - 1)[:, None]  # (batch, 1)
    allowed = key_mask(query_pos, context_lens.long(), max_len, sliding_window)
    return attend(q[:, None], k, v, allowed, scale, soft_cap, sinks)[:, 0]


def paged_prefill_attention_ref(
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
    """Causal attention of new tokens over a cached prefix plus themselves, variable lengths.

    q: (num_tokens, num_heads, head_dim), sequences packed back to back; cu_seqlens_q: (batch + 1,)
    int32 offsets into q; context_lens: (batch,) int32 total length (prefix + new tokens). New
    token j of sequence b sits at position context_lens[b] - q_len[b] + j. Returns q's shape.
    """
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    batch, max_q = q_lens.shape[0], int(q_lens.max())
    ctx = context_lens.long()
    # Scatter packed queries into a padded (batch, max_q, ...) tensor.
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=q.device), q_lens)
    idx_in_seq = torch.arange(q.shape[0], device=q.device) - cu[:-1][seq_of_token]
    padded = q.new_zeros(batch, max_q, *q.shape[1:])
    padded[seq_of_token, idx_in_seq] = q
    max_len = int(ctx.max())
    k = gather_kv(k_cache, block_tables, max_len)
    v = gather_kv(v_cache, block_tables, max_len)
    query_pos = (ctx - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]
    allowed = key_mask(query_pos, ctx, max_len, sliding_window)
    out = attend(padded, k, v, allowed, scale, soft_cap, sinks)
    return out[seq_of_token, idx_in_seq]


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v: (num_tokens, num_kv_heads, head_dim) into the cache views in place at
    slot_mapping: (num_tokens,) = block_id * block_size + offset; negative slots (padding) skip.
    Converted to the cache's dtype; quantized for an int8 cache."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    at = (slots // block_size, slots % block_size)
    k_cache[at] = kv_quant.to_cache(k, k_cache.dtype)  # index_put on the view writes the pool
    v_cache[at] = kv_quant.to_cache(v, v_cache.dtype)


def moe_experts_ref(
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
) -> torch.Tensor:
    """A mixture-of-experts layer's experts, token by token (the maths the grouped kernels keep).

    x: (num_tokens, hidden); topk_ids: (num_tokens, top_k) int, the experts each token was
    routed to; topk_weights: (num_tokens, top_k) float32, their weights; gate_up:
    (num_experts, 2 * inter, hidden), each expert's gate rows then its up rows; down:
    (num_experts, hidden, inter); biases (float32) (num_experts, 2 * inter) and
    (num_experts, hidden) or None. activation "silu": silu(gate) * up (Qwen3-MoE, Mixtral);
    "gpt_oss": gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). Each expert's output is rounded to x's dtype, then
    weighted and added in the order of top_k. Returns x's shape and dtype.
    """
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = gate_up[e].float() @ x[t].float()  # (2 * inter,)
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].float()
            gate, up = h[:inter].to(x.dtype).float(), h[inter:].to(x.dtype).float()
            if activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            elif activation == "gpt_oss":
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            else:
                raise ValueError(f"unknown expert activation {activation!r}")
            y = down[e].float() @ act.to(x.dtype).float()  # (hidden,)
            if down_bias is not None:
                y = y + down_bias[e].float()
            out[t] += topk_weights[t, j].float() * y.to(x.dtype).float()
    return out.to(x.dtype)
