"""The CPU fast path of a model: its norms, rotary and activation as the C kernels, and decode-only
batches as one C call (kernels/cpu_decode_step.c) where that pass computes what `forward` would.

The C step strings the same kernels together in the same order, for every layer the registered
architectures build (see `c_step_runs`); it reads each layer's tensors by address from a table
made once per KV cache (`CStep`). Which module fills which field:

    PreNormDecoderLayer      input_layernorm -> input_norm, post_attention_layernorm -> mlp_norm
    GemmaDecoderLayer        input_layernorm -> input_norm, post_attention_layernorm ->
                             attn_out_norm, pre_feedforward_layernorm -> mlp_norm,
                             post_feedforward_layernorm -> mlp_out_norm
    Attention                qkv_proj, q_norm / k_norm, o_proj (+ bias), sinks (float32), the
                             layer's window, scale and soft cap; its rotary's tables
    GatedMLP / SparseMoE     gate_up_proj, down_proj, activation / router, packed experts
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import cpu_decode_abi as decode_abi
from engine.kernels import cpu_kernels
from engine.kernels.cpu_kernels import address
from engine.linear import Linear
from engine.model_config import ModelConfig
from engine.models.decoder import CausalLM, PreNormDecoderLayer
from engine.models.gemma import GemmaDecoderLayer
from engine.models.layers import Attention, AttentionMetadata, GatedMLP, RMSNorm, RotaryEmbedding
from engine.models.moe import SparseMoE

# Beside oneDNN's bfloat16 layers, without the kernels' bfloat16 pairs: the batch size up to
# which the C step (panels widened to float32) is faster than oneDNN's dot products (linear.py).
C_DECODE_MAX_ROWS_BESIDE_ONEDNN = 4
# Beside oneDNN's bfloat16 layers on a CPU with AMX, where oneDNN multiplies in tiles and the
# C step's pairs (AVX512-BF16 dot products, a third of the Zen 4's rate on the Xeon host) lose
# once the batch makes the step compute-bound: the C step up to ROWS_X_HIDDEN / hidden rows. The
# Xeon host, bfloat16, one thread, the C step against oneDNN (bench/decode_batch.py):
# SmolLM2 (hidden 576) at 8 / 16 / 20 / 32 rows 35 / 60 / 70 / 108 ms against 55 / 66 / 69 / 86;
# Qwen3-0.6B (1024) at 8 / 10 / 12 / 32 rows 141 / 172 / 192 / 441 against 160 / 173 / 179 / 277.
# Where the pairs multiply in AMX tiles themselves (cpu_linear.c, cpu_kernels.linear_amx_ready)
# the C step takes every batch: Qwen3-0.6B at 8 / 16 / 32 rows 137 / 170 / 246 ms against
# oneDNN's 198 / 219 / 305.
C_DECODE_ROWS_X_HIDDEN_BESIDE_AMX = 10240


@dataclass(slots=True)
class CStep:
    """What the C step reads for one model on one KV cache: every layer's tensors by address
    (they live as long as the model and the cache do), the model's shape, the float32 copies
    made for it (kept alive here), and the LongRoPE rotaries whose table rows depend on each
    sequence's length (positions_row 1, 2, ...; row 0 is the positions themselves)."""

    cache_address: int
    layers: ctypes.Array[decode_abi.DecodeLayer]
    shape: decode_abi.DecodeShape
    long_rotaries: list[int]
    keep: list[torch.Tensor]
    ends: decode_abi.DecodeEnds  # for decode_tokens_in_c: the embedding, and the LM head's


def use_cpu_kernels(model: CausalLM) -> None:
    """Run the norms, the rotary embedding and the MLP's activation as the C kernels (CPU,
    float32 / bfloat16, where the kernels built; see kernels/cpu_kernels.py): same maths, one
    pass each."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP)):
            module.fused = True


def c_step_runs(model: CausalLM) -> bool:
    """Whether cpu_decode_step.c computes this model's forward: pre-norm or Gemma layers, each
    MLP dense (SiLU or GELU-tanh) or a mixture whose experts run in cpu_moe.c, every norm of one
    kind (Llama's or Gemma's) and one eps, rotary tables over an even number of values."""
    config = model.config
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if any(n.gemma != norms[0].gemma or n.eps != config.rms_norm_eps for n in norms):
        return False
    if any(r.rotary_dim % 2 or r.rotary_dim > config.head_dim for r in model.rotaries):
        return False
    return all(
        isinstance(layer, (PreNormDecoderLayer, GemmaDecoderLayer)) and _mlp_runs(layer.mlp, config)
        for layer in model.model.layers
    )


def _mlp_runs(mlp: object, config: ModelConfig) -> bool:
    if isinstance(mlp, GatedMLP):
        return (
            mlp.activation in decode_abi.MLP_ACTIVATIONS
            and mlp.intermediate_size == config.intermediate_size
        )
    return isinstance(mlp, SparseMoE) and mlp.kernel == "c" and mlp.moe == config.moe


def use_c_decode_step(model: CausalLM) -> bool:
    """Run decode-only batches as one C call where the C pass computes what `forward` would:
    every layer's weights in panels or quantized (cpu_quant.c), or a copy beside oneDNN's (in
    bfloat16 pairs: any batch, or small ones where oneDNN has AMX; in panels: small batches
    only), the C norms and rotary on."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    copies = [m.decode_copy[0] for m in layers if m.decode_copy is not None]
    every_layer = len(copies) == len(layers)
    model.c_decode_pairs = every_layer and all(t.dim() == 4 for t in copies)
    if all(m.layout in ("panels", "quantized") for m in layers):
        max_rows = 1 << 30
    elif model.c_decode_pairs:  # mixtures keep the C step (cpu_moe.c; not timed against AMX)
        dense = not any(isinstance(m, SparseMoE) for m in model.modules())
        hidden = model.config.hidden_size
        amx = dense and cpu_kernels.cpu_has_amx_bf16() and not cpu_kernels.linear_amx_ready()
        max_rows = max(4, C_DECODE_ROWS_X_HIDDEN_BESIDE_AMX // hidden) if amx else 1 << 30
    elif every_layer and all(t.dim() == 3 for t in copies):
        max_rows = C_DECODE_MAX_ROWS_BESIDE_ONEDNN
    else:  # no copies, or pairs and panels mixed (a layer with an odd input size)
        max_rows = 0
    runs = model.model.norm.fused and c_step_runs(model)
    model.c_decode_max_rows = max_rows if runs else 0
    return model.c_decode_max_rows > 0


def decode_in_c(
    model: CausalLM,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """`forward` of a decode-only batch as one C call (kernels/cpu_decode_step.c)."""
    step = _current_c_step(model, kv_caches)
    rows = [positions]
    rows += [model.rotaries[r].table_positions(positions, meta) for r in step.long_rotaries]
    table_positions = positions.reshape(1, -1) if len(rows) == 1 else torch.stack(rows)
    return decode_abi.decode_step(
        step.layers, step.shape, x.contiguous(), model.model.norm.weight, table_positions,
        meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
    )[0]  # fmt: skip


def decode_tokens_in_c(
    model: CausalLM,
    token_ids: list[int],
    positions: list[int],
    slots: list[int],
    block_tables: torch.Tensor,
    context_lens: list[int],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`forward` of a decode-only batch given as plain lists (and its (rows, max_blocks) int32
    block tables), in one C call from the token ids' embeddings to the final hidden states
    (rows, hidden) and, where the C step reads the LM head's layout (quantized, or float
    panels beside panels), its logits as `CausalLM.logits` makes them before any soft cap (else
    None). What engine/model_runner.py runs such a step with on a CPU. Around the same layers,
    forward's AttentionMetadata, module calls and checks, the embedding lookup and the LM head's
    call cost ~0.5 ms of SmolLM2 Q4_1's ~5 ms step at one sequence on the Zen 4 VM: Python run
    right after the step's 96 MB stream, from a cold cache. None where the step needs what
    forward does: the C step off or too few rows for the batch, LongRoPE's per-length tables,
    LoRA, or a position past the rotary tables (forward raises)."""
    rows = len(token_ids)
    if (
        not 0 < rows <= model.c_decode_max_rows
        or model.lora_batch is not None  # forward sets its adapters a step first
        or any(r.long_offset for r in model.rotaries)
        or max(positions) >= model.max_positions
    ):
        return None
    step = _current_c_step(model, kv_caches)
    x = torch.empty(rows, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
    return decode_abi.decode_step(
        step.layers, step.shape, x, model.model.norm.weight, torch.tensor([positions]),
        torch.tensor(slots), block_tables, torch.tensor(context_lens, dtype=torch.int32),
        step.ends, torch.tensor(token_ids),
    )  # fmt: skip


def _current_c_step(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CStep:
    """The model's table for this KV cache: made on first use, and again if the cache moved."""
    step = model._c_step
    if step is None or step.cache_address != kv_caches[0][0].data_ptr():
        step = model._c_step = _c_step(model, kv_caches)
    return step


def _c_step(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CStep:
    long_rotaries = [i for i, r in enumerate(model.rotaries) if r.long_offset]
    keep: list[torch.Tensor] = []
    table = (decode_abi.DecodeLayer * len(model.model.layers))()
    for i, (entry, layer, kv) in enumerate(zip(table, model.model.layers, kv_caches, strict=True)):
        r = model.layer_rotary[i]
        row = long_rotaries.index(r) + 1 if r in long_rotaries else 0
        _fill_attention(entry.attn, layer.self_attn, model.rotaries[r], row, kv, keep)
        _fill_norms(entry, layer)
        _fill_mlp(entry.mlp, layer.mlp)
    k_cache = kv_caches[0][0]
    shape = _shape(model, k_cache)
    ends = _ends(model, shape)
    return CStep(k_cache.data_ptr(), table, shape, long_rotaries, keep, ends)


def _ends(model: CausalLM, shape: decode_abi.DecodeShape) -> decode_abi.DecodeEnds:
    """The embedding table (times its multiplier, held in the model's dtype as `embed` holds
    it), and the LM head where the C step reads its layout: quantized, or panels where the
    layers are not pairs (a bfloat16 head beside oneDNN has no copy for the C step)."""
    table = model.model.embed_tokens.weight.detach()
    assert table.is_contiguous() and table.dtype == model.model.norm.weight.dtype
    ends = decode_abi.DecodeEnds(embedding=table.data_ptr(), vocab=model.config.vocab_size)
    if model.embedding_multiplier is not None:
        held = torch.tensor(model.embedding_multiplier, dtype=table.dtype)
        ends.multiplier = float(held)
    head = model.lm_head
    tensors = head.decode_tensors()
    quantized = head.quant_spec()[0] != 0
    if tensors is not None and (quantized or (head.layout == "panels" and not shape.pairs)):
        ends.head, ends.head_bias = address(tensors[0]), address(tensors[1])
        ends.head_quant = decode_abi.QuantSpec(*head.quant_spec())
    return ends


def _shape(model: CausalLM, k_cache: torch.Tensor) -> decode_abi.DecodeShape:
    c = model.config
    shape = decode_abi.DecodeShape(
        hidden=c.hidden_size, intermediate=c.intermediate_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=k_cache.shape[1],
        block_stride=k_cache.stride(0), eps=c.rms_norm_eps, pairs=model.c_decode_pairs,
        gemma=model.model.norm.gemma, kv_dtype=cpu_kernels.CACHE_DTYPE_CODES[k_cache.dtype],
    )  # fmt: skip
    mixtures = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if mixtures:
        moe = mixtures[0].moe
        shape.moe = decode_abi.MoeShape(
            num_experts=moe.num_experts, top_k=moe.top_k, intermediate=moe.intermediate_size,
            chunk_bytes=cpu_kernels.MOE_CHUNK_BYTES, routing=decode_abi.ROUTINGS[moe.routing],
            renormalize=moe.renormalize,
            activation=cpu_kernels.EXPERT_ACTIVATIONS[moe.activation],
            pairs=mixtures[0].gate_up.dim() == 5, alpha=moe.alpha, limit=moe.limit,
        )  # fmt: skip
    return shape


def _fill_attention(
    entry: decode_abi.LayerAttention,
    attn: Attention,
    rotary: RotaryEmbedding,
    positions_row: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    keep: list[torch.Tensor],
) -> None:
    qkv, o = _decode_tensors(attn.qkv_proj), _decode_tensors(attn.o_proj)
    entry.qkv, entry.qkv_bias = address(qkv[0]), address(qkv[1])
    entry.o, entry.o_bias = address(o[0]), address(o[1])
    entry.qkv_quant = decode_abi.QuantSpec(*attn.qkv_proj.quant_spec())
    entry.o_quant = decode_abi.QuantSpec(*attn.o_proj.quant_spec())
    if attn.qk_norm:
        entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
    if attn.sinks is not None:  # the Python path reads them as float32 too
        keep.append(attn.sinks.detach().float().contiguous())
        entry.sinks = keep[-1].data_ptr()
    entry.cos, entry.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
    entry.k_cache, entry.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
    entry.rotary_dim, entry.positions_row = rotary.rotary_dim, positions_row
    entry.window = attn.sliding_window or 0
    entry.scale, entry.soft_cap = attn.scale, attn.soft_cap or 0.0


def _fill_norms(entry: decode_abi.DecodeLayer, layer: torch.nn.Module) -> None:
    if isinstance(layer, GemmaDecoderLayer):  # the sandwich: a norm on each side of each block
        entry.input_norm = layer.input_layernorm.weight.data_ptr()
        entry.attn_out_norm = layer.post_attention_layernorm.weight.data_ptr()
        entry.mlp_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
        entry.mlp_out_norm = layer.post_feedforward_layernorm.weight.data_ptr()
    else:
        entry.input_norm = layer.input_layernorm.weight.data_ptr()
        entry.mlp_norm = layer.post_attention_layernorm.weight.data_ptr()


def _fill_mlp(entry: decode_abi.LayerMlp, mlp: torch.nn.Module) -> None:
    if isinstance(mlp, SparseMoE):
        router = _decode_tensors(mlp.router)
        entry.router, entry.router_bias = address(router[0]), address(router[1])
        entry.experts_gate_up, entry.experts_down = mlp.gate_up.data_ptr(), mlp.down.data_ptr()
        entry.experts_gate_up_bias = address(mlp.gate_up_bias)
        entry.experts_down_bias = address(mlp.down_bias)
        return
    assert isinstance(mlp, GatedMLP)
    gate_up, down = _decode_tensors(mlp.gate_up_proj), _decode_tensors(mlp.down_proj)
    entry.gate_up, entry.down = gate_up[0].data_ptr(), down[0].data_ptr()
    entry.gate_up_quant = decode_abi.QuantSpec(*mlp.gate_up_proj.quant_spec())
    entry.down_quant = decode_abi.QuantSpec(*mlp.down_proj.quant_spec())
    entry.activation = decode_abi.MLP_ACTIVATIONS[mlp.activation]


def _decode_tensors(linear: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = linear.decode_tensors()
    assert tensors is not None, "use_c_decode_step checked that every layer has them"
    return tensors
