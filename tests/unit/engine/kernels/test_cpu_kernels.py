"""The C kernels of the CPU path (engine/kernels/cpu_kernels.c) against the torch reference and
the torch modules, the dispatch that picks them, and the fallback when they cannot be built."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from common.sampling_params import SamplingParams
from engine import attention
from engine.kernels import cpu_kernels, torch_paged
from engine.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from engine.llm import LLM
from engine.model_config import RopeConfig
from engine.models.layers import RMSNorm, RotaryEmbedding
from tests.paged_cache import PagedCache, assert_close, decode_metadata

ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this host")


def cpu_cache(lens: list[int], kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype) -> PagedCache:  # fmt: skip
    return PagedCache(lens, kv_heads, head_dim, block_size, dtype, device="cpu")


SHAPES = [  # (dtype, num_heads, num_kv_heads, head_dim, block_size): specialised and generic d
    (torch.float32, 9, 3, 64, 16),
    (torch.float32, 8, 2, 128, 32),
    (torch.float32, 4, 4, 80, 16),
    (torch.bfloat16, 8, 2, 64, 16),
    (torch.bfloat16, 16, 2, 128, 32),
]


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(1)
    lens = [150, 1, 37, 90, 16]  # unsorted, one token, block-size multiples and not
    cache = cpu_cache(lens, num_kv_heads, head_dim, block_size, dtype)
    q = (4 * torch.randn(len(lens), num_heads, head_dim)).to(dtype)  # large: the cap matters
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (20, None), (None, 3.0), (33, 5.0)]:
        expected = paged_decode_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(cpu_kernels.paged_decode_attention(*args, window, cap), expected)


# (num_heads, num_kv_heads, head_dim): SmolLM2's, Qwen3's and Qwen2.5-0.5B's groups (3, 2, 7
# query heads a KV head: 3 at once, then the rest), d = 96 (three 32-value units, the generic
# copy) and d = 40 (not a multiple of 32: the 8-lane path on every host)
MIXED_SHAPES = [(9, 3, 64), (16, 8, 128), (14, 2, 64), (4, 2, 96), (6, 3, 40)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", MIXED_SHAPES)
def test_float32_queries_over_a_bfloat16_cache_match_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """A float32 model's decode over a bfloat16 cache (a GGUF model's default): on AVX-512 the
    512-bit path, whose widened rows and q come in another lane order; float32's tolerance,
    since only the order of the float32 sums differs."""
    torch.manual_seed(2)
    lens = [300, 1, 9, 64, 129]
    cache = cpu_cache(lens, num_kv_heads, head_dim, 16, torch.bfloat16)
    q = 4 * torch.randn(len(lens), num_heads, head_dim)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    sinks = torch.randn(num_heads)
    for window, cap, sink in [(None, None, None), (50, None, None), (None, 3.0, sinks)]:
        expected = paged_decode_attention_ref(*args, window, cap, sink)
        assert_close(cpu_kernels.paged_decode_attention(*args, window, cap, sink), expected)


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_prefill_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Each new token as a decode query over its prefix: fresh prompts, a chunk after a cached
    prefix, one token, an empty chunk; with a window and a soft cap too."""
    torch.manual_seed(5)
    prefix_lens, q_lens = [0, 45, 19, 7], [70, 1, 22, 0]
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = cpu_cache(lens, num_kv_heads, head_dim, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (4 * torch.randn(sum(q_lens), num_heads, head_dim)).to(dtype)
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (16, None), (9, 5.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        out = attention.prefill_attention(*args, window, cap, backend="cpu")
        assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_threads_matches_one_thread(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    cache = cpu_cache([70, 5, 130, 33], 2, 64, 16, dtype)
    q = torch.randn(4, 8, 64).to(dtype)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_decode_attention(*args)
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernels.paged_decode_attention(*args), one)  # same sums per row
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_of_the_pool_view(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    cache = cpu_cache([40], 2, 64, 16, dtype)
    slots = torch.tensor([3, 17, 33, -1, 47])  # -1: a padding token, not written
    k, v = torch.randn(5, 2, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    expected = cache.pool.clone()
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    cpu_kernels.store_kv(k, v, cache.k, cache.v, slots)
    assert torch.equal(cache.pool, expected)  # other layers and the padding slot untouched


def test_auto_takes_the_c_kernels_on_cpu_and_the_torch_path_where_they_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch path ran")

    torch.manual_seed(4)
    cache = cpu_cache([30, 7], 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    with monkeypatch.context() as patch:
        patch.setattr(torch_paged, "paged_decode_attention", fail)
        assert_close(attention.decode_attention(*args), paged_decode_attention_ref(*args))
    half = cpu_cache([30, 7], 2, 64, 16, torch.float16)  # a type the C kernels do not read
    half_args = (q.half(), half.k, half.v, half.block_tables, half.context_lens, 0.125)
    out = attention.decode_attention(*half_args)
    torch.testing.assert_close(out, paged_decode_attention_ref(*half_args), atol=4e-3, rtol=4e-3)
    with pytest.raises(RuntimeError, match="'cpu' needs a float32, bfloat16 or int8"):
        attention.decode_attention(*half_args, backend="cpu")
    odd = cpu_cache([30, 7], 2, 12, 16, torch.float32)  # the C attention reads 8 values at once
    assert not cpu_kernels.supports(odd.k)
    odd_args = (torch.randn(2, 4, 12), odd.k, odd.v, odd.block_tables, odd.context_lens, 0.3)
    assert_close(attention.decode_attention(*odd_args), paged_decode_attention_ref(*odd_args))


def test_without_a_compiler_the_engine_takes_the_torch_path(tmp_path: Path) -> None:
    """No compiler (and an empty kernel cache): a warning, then the same outputs from torch."""
    script = (
        "import torch, logging; logging.basicConfig();"
        "from engine.kernels import cpu_kernels; from engine import attention;"
        "assert cpu_kernels.library() is None;"
        "from engine.llm import LLM; from common.sampling_params import SamplingParams;"
        "params = SamplingParams(max_tokens=4, ignore_eos=True);"
        "out = LLM('builtin:tiny').generate(['a b c'], params);"
        "print(len(out[0].outputs[0].token_ids))"
    )
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    cache = Path("~/.cache/pdcluster").expanduser()
    for name in cache.glob("tiny-model-*"):  # the tiny model, without building it again
        (home / ".cache/pdcluster").mkdir(exist_ok=True)
        (home / ".cache/pdcluster" / name.name).symlink_to(name)
    env = {**os.environ, "HOME": str(home), "CC": str(tmp_path / "no-such-compiler")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "4"
    assert "CPU attention kernel unavailable, using the torch path" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 90])  # 90: a part vector at each row's end (16 lanes)
def test_rms_norm_and_its_residual_add_match_the_torch_module(dtype: torch.dtype, dim: int) -> None:
    torch.manual_seed(5)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim).to(dtype)
    x, residual = (3 * torch.randn(7, dim)).to(dtype), torch.randn(7, dim).to(dtype)
    expected, expected_sum = norm(x), residual + x
    expected_after_add = norm(expected_sum)
    norm.fused = True
    assert_close(norm(x), expected)
    out, summed = norm.add_and_norm(x, residual.clone())
    assert torch.equal(summed, expected_sum)  # the same rounding of the sum as torch's add
    assert_close(out, expected_after_add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch_over_the_whole_float_range(dtype: torch.dtype) -> None:
    """From values whose exp overflows float32 to ones it flushes to zero, and infinities."""
    torch.manual_seed(7)
    gate = torch.cat([20 * torch.randn(500), torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0])])
    gate = torch.cat([gate, torch.tensor([float("inf"), float("-inf")])])
    gate_up = torch.stack([gate, torch.randn(len(gate))]).T.reshape(1, -1)  # interleaved
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1).repeat(3, 1).to(dtype)
    gate_part, up_part = gate_up.split(len(gate), dim=-1)
    expected = torch.nn.functional.silu(gate_part) * up_part
    got = cpu_kernels.silu_mul(gate_up)
    finite = expected.isfinite()
    assert torch.equal(got.isnan(), expected.isnan())
    assert_close(got[finite], expected[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40])  # 40: halves of 20, a part vector after 16 lanes
def test_rope_in_place_on_views_of_the_fused_projection(dtype: torch.dtype, d: int) -> None:
    torch.manual_seed(6)
    rotary = RotaryEmbedding(RopeConfig(kind="default", theta=10000.0), d, 512)
    qkv = torch.randn(5, (4 + 2 * 2) * d).to(dtype)  # 4 query heads, 2 KV heads
    q, k, _ = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.reshape(5, 4, d), k.reshape(5, 2, d)  # strided views, as the model makes them
    positions = torch.tensor([0, 7, 100, 511, 3])
    expected_q, expected_k = rotary(positions, q, k)
    v_before = qkv[:, 6 * d :].clone()
    rotary.fused = True
    got_q, got_k = rotary(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    assert_close(got_q, expected_q)
    assert_close(got_k, expected_k)
    assert torch.equal(qkv[:, 6 * d :], v_before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_with_the_c_kernels_matches_the_torch_path(dtype: str) -> None:
    """Prefill and decode logits of the tiny model through both paths, and the same greedy
    tokens."""
    prompts = [[5, 9, 31, 4, 77, 12, 8], [40, 2, 18]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM("builtin:tiny", dtype=dtype, attention_backend=backend, block_size=4)
        assert llm.engine.model.model.norm.fused is (backend == "cpu")
        runs[backend] = llm.generate(prompts, params)
    for fused, plain in zip(runs["cpu"], runs["torch"], strict=True):
        assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
        tolerance = 1e-4 if dtype == "float32" else 5e-2
        for a, b in zip(fused.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
            assert abs(a - b) <= tolerance * max(1.0, abs(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_linear_matches_torch(dtype: torch.dtype, threads: int) -> None:
    """Every row count the kernel treats apart (one row, full and partial blocks of 6, more than
    one 48-row block), output counts that are not multiples of its 16-column panels, an odd K,
    with and without a bias."""
    torch.manual_seed(7)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in [(37, 19), (16, 64), (100, 576)]:
            weight = torch.randn(n, k).to(dtype)
            panels = cpu_kernels.pack_panels(weight)
            assert panels.shape == ((n + 15) // 16, k, 16)
            assert_rows_match(cpu_kernels.panel_linear, panels, weight, (1, 2, 5, 6, 13, 50, 101),
                              torch.float32)  # fmt: skip
    finally:
        torch.set_num_threads(previous)


def assert_rows_match(
    linear: Callable[..., torch.Tensor],
    packed: torch.Tensor,
    weight: torch.Tensor,
    row_counts: tuple[int, ...],
    x_dtype: torch.dtype,
) -> None:
    """`linear(x, packed, bias, n)` against x @ weight.T + bias in float64, for random x of each
    row count, with and without a random bias."""
    n, k = weight.shape
    for bias in (None, torch.randn(n)):
        for rows in row_counts:
            x = torch.randn(rows, k).to(x_dtype)
            expected = x.double() @ weight.double().T
            if bias is not None:
                expected += bias.double()
            out = linear(x, packed, bias, n)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


HAS_AMX = cpu_kernels.cpu_has_amx_bf16()


@pytest.mark.skipif(not cpu_kernels.bf16_pairs_available(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize(
    "amx", [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX"))]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_pair_linear_matches_torch(amx: bool, threads: int) -> None:
    """bfloat16 pairs, on AVX512-BF16's dot products or AMX tiles, on one thread or two: row
    counts below the tiles' minimum, whole and partial tiles of 16, four tiles and a fifth,
    output counts that are not multiples of 16, a K the tiles take (a multiple of 32) and one
    they leave to the dot products, with and without a bias."""
    torch.manual_seed(7)
    cpu_kernels.use_linear_amx(amx)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_kernels.linear_amx_ready() == amx
        for n, k in [(37, 64), (100, 576), (16, 40)]:
            weight = torch.randn(n, k).to(torch.bfloat16)
            pairs = cpu_kernels.pack_pairs(weight)
            assert_rows_match(cpu_kernels.pair_linear, pairs, weight, (1, 7, 8, 16, 17, 64, 70),
                              torch.bfloat16)  # fmt: skip
    finally:
        cpu_kernels.use_linear_amx(True)
        torch.set_num_threads(previous)


@pytest.mark.skipif(not cpu_kernels.bf16_pairs_available(), reason="no AVX512-BF16 here")
def test_pair_linear_few_rows_prefetch_changes_no_result() -> None:
    """bfloat16 pairs at one and two rows with the few-row prefetch off and on (the engine's
    pick at load, cpu_prefetch.h): the same bits; the default set back."""
    torch.manual_seed(3)
    lib = cpu_kernels.library()
    weight = torch.randn(100, 576).to(torch.bfloat16)
    pairs = cpu_kernels.pack_pairs(weight)
    try:
        for rows in (1, 2):
            x = torch.randn(rows, 576).to(torch.bfloat16)
            outs = []
            for on in (0, 1):
                lib.set_few_rows_prefetch(on)
                outs.append(cpu_kernels.pair_linear(x, pairs, None, 100))
            assert torch.equal(outs[0], outs[1])
    finally:
        lib.set_few_rows_prefetch(1)


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


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
def test_decode_step_in_c_matches_the_python_forward(dtype: torch.dtype, layout: str) -> None:
    """A decode-only batch through cpu_decode_step.c gives the Python forward's hidden states
    and writes the same K/V: a Qwen2-like model (q/k/v biases), a sliding window, sizes that
    are not multiples of the 16-column panels, sequences of different lengths. With oneDNN's
    bfloat16 layers, the C step reads its own copy (bfloat16 pairs for AVX512-BF16's dot
    products where the kernels have them, else panels) and the Python forward stays on oneDNN:
    the two agree to bfloat16's rounding."""
    from engine.kv_cache import KVCache
    from engine.linear import pack_linear_layers
    from engine.model_config import ModelConfig
    from engine.models import llama
    from engine.models.cpu_decode import use_c_decode_step, use_cpu_kernels

    torch.manual_seed(3)
    config = ModelConfig(
        model_type="qwen2", vocab_size=300, hidden_size=72, intermediate_size=100, num_layers=3,
        num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope=RopeConfig(kind="default", theta=10000.0), max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False, sliding_window=9,
        eos_token_ids=(0,), torch_dtype="float32",
    )  # fmt: skip
    model = llama.build(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(dtype)
    model.attach_rotary(config.max_position_embeddings)  # float32 tables, as load_model makes
    pack_linear_layers(model, layout, decode_copy=layout == "onednn")  # type: ignore[arg-type]
    use_cpu_kernels(model)
    assert use_c_decode_step(model)
    lens = [5, 17, 30]  # tokens already cached per sequence; each decodes one more
    assert model.c_decode_max_rows >= len(lens)
    block_size, blocks_per_seq = 8, 4
    caches = [KVCache(config, 16, block_size, dtype, "cpu") for _ in range(2)]
    for cache in caches:  # the same random history in both
        torch.manual_seed(4)
        cache.pool.normal_()
    positions, meta = decode_metadata(lens, block_size, blocks_per_seq)
    ids = torch.tensor([7, 250, 31])
    in_c = model(ids, positions, caches[0].layers, meta)
    model.c_decode_max_rows = 0
    in_python = model(ids, positions, caches[1].layers, meta)
    if layout == "panels":  # the same kernels, the same roundings
        torch.testing.assert_close(in_c, in_python, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[0].pool, caches[1].pool, rtol=1e-6, atol=1e-6)
    else:  # oneDNN sums in another order: bfloat16's rounding, through three layers
        torch.testing.assert_close(in_c.float(), in_python.float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(
            caches[0].pool.float(), caches[1].pool.float(), rtol=0.05, atol=0.05
        )


SINKS = {  # per-head logits: ordinary, larger than every score, smaller than every score
    "ordinary": lambda n: torch.randn(n),
    "very_large": lambda n: torch.full((n,), 1e4),
    "very_negative": lambda n: torch.full((n,), -1e4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("sink_kind", list(SINKS))
def test_attention_sinks_with_windows_and_soft_caps_match_the_reference(
    dtype: torch.dtype, backend: attention.AttentionBackend, sink_kind: str
) -> None:
    """gpt-oss's sinks on both CPU paths, decode and prefill, with no window, a window shorter
    than some contexts, one longer than all (gpt-oss alternates those), and a soft cap."""
    torch.manual_seed(8)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    sinks = SINKS[sink_kind](num_heads)
    prefix_lens, q_lens = [0, 45, 19, 3], [40, 1, 22, 1]
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = cpu_cache(lens, num_kv_heads, head_dim, 16, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_prefill = (4 * torch.randn(sum(q_lens), num_heads, head_dim)).to(dtype)
    q_decode = (4 * torch.randn(len(lens), num_heads, head_dim)).to(dtype)
    tables, context_lens = cache.block_tables, cache.context_lens
    for window, cap in [(None, None), (16, None), (1000, None), (9, 5.0)]:
        decode_args = (q_decode, cache.k, cache.v, tables, context_lens, head_dim**-0.5)
        expected = paged_decode_attention_ref(*decode_args, window, cap, sinks)
        got = attention.decode_attention(*decode_args, window, cap, sinks=sinks, backend=backend)
        assert_close(got, expected)
        prefill_args = (q_prefill, cache.k, cache.v, tables, cu, context_lens, head_dim**-0.5)
        expected = paged_prefill_attention_ref(*prefill_args, window, cap, sinks)
        got = attention.prefill_attention(*prefill_args, window, cap, sinks=sinks, backend=backend)
        assert_close(got, expected)


def test_a_sink_lowers_the_weights_of_the_values_as_softmax_says() -> None:
    """One key per sequence: its weight is 1 / (1 + e^(sink - score)), so the output is that
    fraction of its value (a check of the sink's place in the sum, not only of agreement)."""
    cache = cpu_cache([1], 1, 8, 16, torch.float32)
    q = torch.zeros(1, 2, 8)  # score 0 for both heads
    sinks = torch.tensor([0.0, math.log(3.0)])
    out = cpu_kernels.paged_decode_attention(
        q, cache.k, cache.v, cache.block_tables, cache.context_lens, 1.0, sinks=sinks
    )
    value = cache.v[cache.block_tables[0, 0], 0, 0]
    torch.testing.assert_close(out[0], torch.stack([value / 2, value / 4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_skip_keys_before_the_window_of_a_long_cached_prefix(
    dtype: torch.dtype,
) -> None:
    """A chunk after a prefix longer than the window (keys before it never gathered), windows
    of one token and of exactly the chunk, group sizes that split the tiles unevenly."""
    torch.manual_seed(9)
    prefix_lens, q_lens = [300, 130, 0], [37, 1, 5]
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    for num_heads, num_kv_heads in [(5, 1), (6, 3)]:
        cache = cpu_cache(lens, num_kv_heads, 32, 16, dtype)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = (3 * torch.randn(sum(q_lens), num_heads, 32)).to(dtype)
        args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, 32**-0.5)
        for window, cap in [(1, None), (37, None), (64, 20.0), (5, 2.0)]:
            expected = paged_prefill_attention_ref(*args, window, cap)
            assert_close(cpu_kernels.paged_prefill_attention(*args, window, cap), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_torch_over_the_whole_float_range(dtype: torch.dtype) -> None:
    """Hugging Face's gelu_pytorch_tanh (torch's gelu, approximate="tanh") times up, each
    rounded to the dtype as torch's ops round: from where tanh saturates to infinities."""
    torch.manual_seed(10)
    gate = torch.cat([20 * torch.randn(600), torch.linspace(-8, 8, 801)])
    gate = torch.cat([gate, torch.tensor([-200.0, 0.0, 200.0, float("inf"), float("-inf")])])
    gate_up = torch.cat([gate, 3 * torch.randn(len(gate))])[None].repeat(3, 1).to(dtype)
    gate_part, up_part = gate_up.split(len(gate), dim=-1)
    expected = nn.functional.gelu(gate_part, approximate="tanh") * up_part
    got = cpu_kernels.gelu_tanh_mul(gate_up)
    finite, infinite = expected.isfinite(), expected.isinf()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[infinite], expected[infinite])
    if dtype == torch.float32:
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-6)
    else:
        assert_close(got[finite], expected[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_and_its_residual_add_match_hugging_face(dtype: torch.dtype) -> None:
    """Gemma's (1 + weight) norm, rounded once: Hugging Face's Gemma2RMSNorm, in both dtypes."""
    torch.manual_seed(11)
    norm = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, residual = (3 * torch.randn(7, 96)).to(dtype), torch.randn(7, 96).to(dtype)
    with torch.no_grad():
        expected, expected_after_add = norm(x), norm(residual + x)
    assert_close(cpu_kernels.rms_norm(x, norm.weight.data, 1e-6, gemma=True), expected)
    summed = residual.clone()
    out = cpu_kernels.rms_norm(x, norm.weight.data, 1e-6, summed, gemma=True)
    assert torch.equal(summed, residual + x)
    assert_close(out, expected_after_add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_heads_normalises_q_and_k_inside_the_fused_qkv_rows(
    dtype: torch.dtype, gemma: bool
) -> None:
    """Qwen3's q/k norms (Llama's rounding) and Gemma 3's ((1 + weight)), in place on strided
    views of the qkv projection's output; v and the other rows' parts stay as they were."""
    torch.manual_seed(12)
    module = Gemma3RMSNorm if gemma else Qwen3RMSNorm
    q_norm, k_norm = module(64, eps=1e-6).to(dtype), module(64, eps=1e-6).to(dtype)
    for norm in (q_norm, k_norm):
        norm.weight.data = torch.randn(64).to(dtype)
    qkv = (3 * torch.randn(9, (4 + 2 * 2) * 64)).to(dtype)  # 4 query heads, 2 KV heads
    q, k, _ = qkv.split([256, 128, 128], dim=-1)
    q, k = q.view(9, 4, 64), k.view(9, 2, 64)  # token stride 512
    with torch.no_grad():
        expected_q, expected_k = q_norm(q), k_norm(k)
    v_before = qkv[:, 384:].clone()
    cpu_kernels.rms_norm_heads_(q, q_norm.weight.data, 1e-6, gemma)
    cpu_kernels.rms_norm_heads_(k, k_norm.weight.data, 1e-6, gemma)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(qkv[:, 384:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_rotates_the_first_rotary_dim_and_passes_the_rest(
    dtype: torch.dtype,
) -> None:
    """Phi-4-mini's partial rotary (factor 0.75 of head_dim 128): Hugging Face's Phi-3
    apply_rotary_pos_emb on float32 tables, computed in float32 and rounded once (the
    engine's convention for bfloat16, as for the full rotary)."""
    torch.manual_seed(13)
    head_dim, rotary_dim = 128, 96
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(300).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    qkv = torch.randn(6, (3 + 2 * 1) * head_dim).to(dtype)  # 3 query heads, 1 KV head
    q, k, _ = qkv.split([3 * head_dim, head_dim, head_dim], dim=-1)
    q, k = q.view(6, 3, head_dim), k.view(6, 1, head_dim)
    positions = torch.tensor([0, 1, 17, 299, 64, 5])
    hf_q, hf_k = phi3_rotary(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        cos[positions][None], sin[positions][None],
    )  # fmt: skip
    expected_q, expected_k = hf_q[0].transpose(0, 1).to(dtype), hf_k[0].transpose(0, 1).to(dtype)
    v_before = qkv[:, 4 * head_dim :].clone()
    cpu_kernels.rope_(q, positions, cos, sin)
    cpu_kernels.rope_(k, positions, cos, sin)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(q[..., rotary_dim:], expected_q[..., rotary_dim:])  # passed through
    assert torch.equal(qkv[:, 4 * head_dim :], v_before)
