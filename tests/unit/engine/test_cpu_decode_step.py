"""The one-call C decode step (kernels/cpu_decode_step.c) against the Python forward, for every
architecture the engine serves: the same final hidden states and the same K/V written, on a
random model built by the architecture's own module from its real config scaled down
(tools/tiny_arch/build.py's, or the same sizes for Llama and Qwen2 / Qwen3), in float32 and in
bfloat16 with both layouts. The sequences are long enough to cross every sliding window and
Phi-3's pretraining length (so its LongRoPE rows differ between sequences of one batch)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.linear import Linear, pack_linear_layers
from engine.models import architecture, read_model_config
from engine.models.cpu_decode import decode_tokens_in_c, use_c_decode_step, use_cpu_kernels
from engine.models.decoder import CausalLM
from engine.models.layers import AttentionMetadata
from engine.models.moe import SparseMoE, use_expert_kernels
from tests.unit.engine.quant.test_quantized_linear import random_q4
from tools.tiny_arch.build import CONFIGS, SMALL, WINDOW

LENS = [5, 17, 30, 70]  # tokens cached per sequence (each decodes one more); Phi-3's pretraining
BLOCK_SIZE, BLOCKS_PER_SEQ = 8, 10  # length is 64 in its tiny config
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL, rope_theta=10000.0, max_position_embeddings=2048)


def _qwen2() -> Any:
    """q/k/v biases; the layers from max_window_layers on slide (and the others do not)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=2, max_position_embeddings=2048)  # fmt: skip


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**SMALL, max_position_embeddings=2048)


def _qwen3_moe_mixed() -> Any:
    """Qwen3-MoE with a dense layer among the sparse ones (mlp_only_layers)."""
    config = CONFIGS["qwen3-moe"]()
    config.mlp_only_layers = [1]
    return config


ARCHES: dict[str, Callable[[], Any]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, **CONFIGS,
    "qwen3-moe-mixed": _qwen3_moe_mixed,
}  # fmt: skip
MOE_ARCHES = ["qwen3-moe", "qwen3-moe-mixed", "mixtral", "gpt-oss"]


def random_model(arch: str, tmp_path: Path, dtype: torch.dtype, layout: str) -> CausalLM:
    """The architecture's module tree on its config, random weights whose activations keep their
    scale through the layers, packed and switched to the C kernels as the engine does."""
    (tmp_path / "config.json").write_text(json.dumps(ARCHES[arch]().to_dict()))
    config = read_model_config(tmp_path)
    model = architecture(config.model_type).build(config).eval()
    gemma = config.model_type.startswith("gemma")
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma stores its scale as w - 1
                param.normal_(0.0 if gemma else 1.0, 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, config.hidden_size**-0.5 if gemma else 1.0)
            elif param.dim() == 1:  # biases, sinks
                param.normal_(0.0, 0.5)
            else:  # fan-in scaled: (..., out, in)
                param.normal_(0.0, param.shape[-1] ** -0.5)
    model = model.to(dtype)
    model.attach_rotary(256)  # float32 tables, as load_model makes
    pack_linear_layers(model, layout, decode_copy=layout == "onednn")  # type: ignore[arg-type]
    assert use_expert_kernels(model, "cpu", "auto") in ("c", "none")
    use_cpu_kernels(model)
    return model


def decode_batch(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids, positions, metadata) of one decode token for each of LENS's sequences."""
    tables = torch.arange(len(LENS) * BLOCKS_PER_SEQ, dtype=torch.int32).view(len(LENS), -1)
    positions = torch.tensor(LENS)
    rows = torch.arange(len(LENS))
    slots = tables[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=len(LENS), decode_block_tables=tables,
        decode_context_lens=(positions + 1).to(torch.int32),
        prefill_block_tables=torch.zeros(0, BLOCKS_PER_SEQ, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32), rope_seq_lens=positions + 1,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (len(LENS),), generator=generator)
    return ids, positions, meta


def two_caches(model: CausalLM, dtype: torch.dtype) -> list[KVCache]:
    """Two KV caches holding the same random history (one for each path compared)."""
    caches = [KVCache(model.config, len(LENS) * BLOCKS_PER_SEQ, BLOCK_SIZE, dtype, "cpu")
              for _ in range(2)]  # fmt: skip
    for cache in caches:
        torch.manual_seed(4)
        cache.pool.normal_()
    return caches


def c_and_python(model: CausalLM, dtype: torch.dtype) -> tuple[list[torch.Tensor], ...]:
    """([hidden states, KV pool] through the C step, the same through the Python forward), each
    from the same random history in its own cache."""
    caches = two_caches(model, dtype)
    ids, positions, meta = decode_batch(model)
    rows = model.c_decode_max_rows
    assert rows >= len(LENS)
    in_c = model(ids, positions, caches[0].layers, meta)
    model.c_decode_max_rows = 0
    in_python = model(ids, positions, caches[1].layers, meta)
    model.c_decode_max_rows = rows
    return [in_c, caches[0].pool], [in_python, caches[1].pool]


@pytest.mark.parametrize("arch", list(ARCHES))
@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        (torch.float32, "panels"),
        (torch.bfloat16, "panels"),
        pytest.param(
            torch.bfloat16, "onednn",
            marks=pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bfloat16 here"),
        ),
    ],
)  # fmt: skip
def test_the_c_step_computes_the_python_forward(
    arch: str, dtype: torch.dtype, layout: str, tmp_path: Path
) -> None:
    """The same kernels in the same order, the same roundings: in panels the two agree to float32's
    last places (the attention's and the experts' threads aside, nothing is summed in another
    order). With oneDNN's bfloat16 layers the Python forward multiplies with oneDNN and the C
    step with its own copy (bfloat16 pairs or panels): they agree to bfloat16's rounding."""
    model = random_model(arch, tmp_path, dtype, layout)
    assert use_c_decode_step(model), arch
    (c_hidden, c_pool), (py_hidden, py_pool) = c_and_python(model, dtype)
    if layout == "panels":
        torch.testing.assert_close(c_hidden, py_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_pool, py_pool, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(c_hidden.float(), py_hidden.float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(c_pool.float(), py_pool.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    ("arch", "dtype", "head"),
    [
        ("llama", torch.float32, "panels"),
        ("llama", torch.float32, "q4"),
        ("llama", torch.bfloat16, "q4"),
        ("gemma3", torch.bfloat16, "panels"),
        ("gpt-oss", torch.float32, "panels"),
        ("phi3", torch.float32, "panels"),
    ],
)
def test_a_decode_batch_from_token_ids_is_forwards_c_step_and_lm_head(
    arch: str, dtype: torch.dtype, head: str, tmp_path: Path
) -> None:
    """decode_tokens_in_c, what the model runner runs a CPU decode-only step with, from token
    ids to logits in one C call: the embeddings as `embed` makes them (Gemma's multiplier), the
    layers as forward's C step, the LM head as `logits` (panels, or a 4-bit head, in float32
    or rounded to bfloat16), so the same hidden states, KV and logits bit for bit; None where
    forward must run it: LongRoPE (Phi-3), LoRA, more rows than the C step takes, a position
    past the rotary tables."""
    model = random_model(arch, tmp_path, dtype, "panels")
    if head == "q4":
        config = model.config
        with torch.device("meta"):
            model.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        model.lm_head.quantize(random_q4(config.vocab_size, config.hidden_size), dtype)
        model.lm_head.pack("panels")
    assert use_c_decode_step(model)
    caches = two_caches(model, dtype)
    ids, positions, meta = decode_batch(model)
    lists = (ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(),
             meta.decode_block_tables, meta.decode_context_lens.tolist())  # fmt: skip
    from_ids = decode_tokens_in_c(model, *lists, caches[0].layers)
    if arch == "phi3":
        assert from_ids is None
        return
    assert from_ids is not None and from_ids[1] is not None
    forward = model(ids, positions, caches[1].layers, meta)
    assert torch.equal(from_ids[0], forward) and torch.equal(caches[0].pool, caches[1].pool)
    assert torch.equal(from_ids[1], model.logits(forward))
    model.c_decode_max_rows = len(LENS) - 1
    assert decode_tokens_in_c(model, *lists, caches[0].layers) is None
    model.c_decode_max_rows = 1 << 30
    past = [model.max_positions - 1] * (len(LENS) - 1) + [model.max_positions]
    assert decode_tokens_in_c(model, lists[0], past, *lists[2:], caches[0].layers) is None
    model.lora_batch = object()  # type: ignore[assignment]
    assert decode_tokens_in_c(model, *lists, caches[0].layers) is None


@pytest.mark.skipif(
    not (ONEDNN_BF16 and cpu_kernels.bf16_pairs_available()), reason="no bfloat16 pairs here"
)
@pytest.mark.parametrize(("amx", "own_tiles"), [(False, False), (True, False), (True, True)])
def test_beside_onednns_amx_tiles_the_c_step_takes_small_batches_only(
    amx: bool, own_tiles: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN multiplies in AMX tiles and the pairs cannot (linear_amx_ready false), a
    batch past ROWS_X_HIDDEN / hidden rows (at least 4) runs layer by layer through oneDNN;
    elsewhere the C step's pairs take every batch. Panels (float32) take every batch either
    way."""
    from engine.models import cpu_decode

    monkeypatch.setattr(cpu_kernels, "cpu_has_amx_bf16", lambda: amx)
    monkeypatch.setattr(cpu_kernels, "linear_amx_ready", lambda: own_tiles)
    model = random_model("llama", tmp_path, torch.bfloat16, "onednn")
    assert use_c_decode_step(model) and model.c_decode_pairs
    hidden = model.config.hidden_size
    limit = max(4, cpu_decode.C_DECODE_ROWS_X_HIDDEN_BESIDE_AMX // hidden)
    assert model.c_decode_max_rows == (limit if amx and not own_tiles else 1 << 30)
    floats = random_model("llama", tmp_path, torch.float32, "panels")
    assert use_c_decode_step(floats) and floats.c_decode_max_rows == 1 << 30


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_the_c_step_reads_each_expert_once_per_layer(arch: str, tmp_path: Path) -> None:
    """cpu_moe.c's expert_passes over the C step equals the distinct experts the Python forward's
    router picked, layer by layer, for the same batch: each routed expert's weights once per
    step, not once per token."""
    model = random_model(arch, tmp_path, torch.float32, "panels")
    assert use_c_decode_step(model)
    picked: list[torch.Tensor] = []
    original = SparseMoE.route

    def route(self: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = original(self, x)
        picked.append(ids)
        return ids, weights

    before = cpu_kernels.expert_passes()
    SparseMoE.route = route  # type: ignore[method-assign]
    try:
        c_and_python(model, torch.float32)  # the C step first, then the Python forward
    finally:
        SparseMoE.route = original  # type: ignore[method-assign]
    distinct = sum(int(ids.unique().numel()) for ids in picked)
    # the Python forward's experts ran through cpu_moe.c as well: once more the same count
    assert cpu_kernels.expert_passes() - before == 2 * distinct
    assert distinct < sum(ids.numel() for ids in picked)  # fewer reads than (token, expert) pairs


@pytest.mark.parametrize("arch", MOE_ARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_router_logits_pick_the_experts_torch_picks(
    arch: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """Experts in pairs with the same router row (and bias) tie on every token: the C step takes
    the one of each pair that torch.topk takes, in its order (cpu_topk.cpp), so its output is
    the Python forward's."""
    model = random_model(arch, tmp_path, dtype, "panels")
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        router = moe.router
        with torch.no_grad():  # panels of the (E, hidden) weight: repack the tied copy
            weight = torch.randn(router.out_features, router.in_features, dtype=dtype)
            weight[1::2] = weight[0::2]
            router.weight = torch.nn.Parameter(cpu_kernels.pack_panels(weight), False)
            if router.bias is not None:
                router.bias[1::2] = router.bias[0::2]
    assert use_c_decode_step(model)
    (c_hidden, c_pool), (py_hidden, py_pool) = c_and_python(model, dtype)
    torch.testing.assert_close(c_hidden, py_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_pool, py_pool, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("num_experts", "k"), [(8, 2), (16, 4), (64, 8), (128, 8), (256, 2)])
def test_the_routers_top_k_is_torch_topk_ties_included(num_experts: int, k: int) -> None:
    """bfloat16 logits tie often; torch.topk orders equal values as the C++ library's selection
    leaves them (not by index), and so does the C step's top k (cpu_topk.cpp), NaN first too."""
    torch.manual_seed(6)
    logits = (torch.randn(2000, num_experts) * 2).to(torch.bfloat16)
    logits[0, :3] = float("nan")
    values, ids = cpu_kernels.topk_largest(logits, k)
    want_values, want_ids = torch.topk(logits, k, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values.float(), equal_nan=True, rtol=0, atol=0)
