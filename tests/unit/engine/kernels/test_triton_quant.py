"""The Triton weight-only quantized matmul against QuantizedWeight.dequantize() and torch's linear,
its packed layout, and how often it loads each weight byte.

Without a GPU the kernels run in the Triton interpreter, which must be switched on before triton is
first imported (see test_kernels.py's docstring: the same skip-and-rerun-in-a-subprocess fallback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.kernels import quant_matmul as qm  # noqa: E402
from engine.quant.weight import QuantizedWeight  # noqa: E402
from tests.paged_cache import DEVICE, assert_close  # noqa: E402

RUN_HERE = ON_GPU or all(
    isinstance(fn, InterpretedFunction)
    for fn in (tl.cdiv, qm.quant_matmul_kernel, qm.split_sum_kernel)
)
needs_kernels = pytest.mark.skipif(
    not RUN_HERE, reason="triton was imported compiled before this module: run in a subprocess"
)
ROOT = Path(__file__).resolve().parents[4]


def _weight(
    bits: int, n: int, k: int, group_size: int, float16_scales: bool = True
) -> QuantizedWeight:
    """Random values with scales sized so that x @ W.T stays O(1) for x ~ N(0, 1); scales
    (and mins, -8 * scale as Q4_0's) exact in float16 as GGUF's are, unless asked otherwise
    (Q4_K's d * sc products are not)."""
    scales = (torch.rand(n, k // group_size) + 0.5) / (6 * k**0.5)
    if bits == 8:
        scales = scales / 16
    if float16_scales:
        scales = scales.half().float()
    if bits == 4:
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        weight = QuantizedWeight(4, group_size, values, scales, -8 * scales)
    else:
        values = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        weight = QuantizedWeight(8, group_size, values, scales, None)
    return weight


def _to_device(w: QuantizedWeight) -> QuantizedWeight:
    mins = None if w.mins is None else w.mins.to(DEVICE)
    return QuantizedWeight(w.bits, w.group_size, w.values.to(DEVICE), w.scales.to(DEVICE), mins)


def _reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """What the engine computes today with the weight dequantized to the activations' dtype."""
    return F.linear(x, w.dequantize().to(x.dtype), bias)


# --- packing --------------------------------------------------------------------------------------


def test_pack_puts_two_nibbles_per_byte_low_first() -> None:
    values = torch.tensor([[1, 2, 3, 4] * 8, [15, 0, 0, 15] * 8], dtype=torch.uint8)
    scales = torch.ones(2, 1)
    packed = qm.pack_for_triton(QuantizedWeight(4, 32, values, scales, -scales))
    assert packed.values.dtype == torch.uint8 and packed.values.shape == (2, 16)
    assert packed.values[0, :2].tolist() == [1 | 2 << 4, 3 | 4 << 4]
    assert packed.values[1, :2].tolist() == [15, 15 << 4]
    assert packed.shape == (2, 32) and packed.mins is not None


def test_pack_bytes_per_weight_are_gguf_s() -> None:
    """4-bit groups of 32 with float16 scale and min: Q4_1's 5 bits; 8-bit: Q8_0's 8.5 (a min-less
    format, no min stored)."""
    q4 = qm.pack_for_triton(_weight(4, 64, 256, 32))
    q8 = qm.pack_for_triton(_weight(8, 64, 256, 32))
    assert q4.scales.dtype == torch.float16 and q4.bits_per_weight == 5.0
    assert q8.mins is None and q8.bits_per_weight == 8.5
    assert q4.nbytes == 64 * 128 + 2 * 64 * 8 * 2


def test_pack_keeps_float16_scales_only_where_exact() -> None:
    exact, inexact = _weight(4, 8, 64, 32), _weight(4, 8, 64, 32, float16_scales=False)
    assert qm.pack_for_triton(exact).scales.dtype == torch.float16
    kept = qm.pack_for_triton(inexact)
    assert kept.scales.dtype == torch.float32 and torch.equal(kept.scales, inexact.scales)
    forced = qm.pack_for_triton(inexact, scale_dtype=torch.float16)
    assert forced.scales.dtype == torch.float16 and forced.mins is not None
    assert torch.equal(forced.scales, inexact.scales.half())
    assert torch.equal(forced.mins, inexact.mins.half())  # type: ignore[union-attr]


def test_pack_refuses_what_the_kernel_cannot_read() -> None:
    values = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 16"):
        qm.pack_for_triton(QuantizedWeight(4, 8, values, torch.ones(2, 4), torch.ones(2, 4)))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        bad = values.clone()
        bad[1, 3] = 16
        qm.pack_for_triton(QuantizedWeight(4, 32, bad, torch.ones(2, 1), torch.ones(2, 1)))
    huge = QuantizedWeight(8, 32, values.to(torch.int8), torch.full((2, 1), 1e5), None)
    with pytest.raises(ValueError, match="float16's range"):
        qm.pack_for_triton(huge, scale_dtype=torch.float16)
    assert qm.pack_for_triton(huge).scales.dtype == torch.float32


# --- against the reference ------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_matmul_matches_the_dequantized_linear(
    bits: int, group_size: int, dtype: torch.dtype
) -> None:
    """N = 80 (not a multiple of the 64-column tile); 1 and 5 rows take the decode tiles with
    split-K, 33 the larger ones; with and without bias."""
    torch.manual_seed(bits * 1000 + group_size)
    weight = _to_device(_weight(bits, 80, 256, group_size))
    packed = qm.pack_for_triton(weight)
    for rows, with_bias in [(1, True), (5, False), (33, True)]:
        x = torch.randn(rows, 256, device=DEVICE).to(dtype)
        bias = torch.randn(80, device=DEVICE).to(dtype) if with_bias else None
        assert_close(qm.quant_matmul(x, packed, bias), _reference(x, weight, bias))


@needs_kernels
def test_float32_scales_float16_activations_and_leading_dims() -> None:
    """Q4_K-like scales kept in float32; activations (2, 3, K) float16; a float32 bias on a
    float16 input is added in float32."""
    torch.manual_seed(1)
    weight = _to_device(_weight(4, 48, 128, 32, float16_scales=False))
    packed = qm.pack_for_triton(weight)
    assert packed.scales.dtype == torch.float32
    x = torch.randn(2, 3, 128, device=DEVICE)
    bias = torch.randn(48, device=DEVICE)
    out = qm.quant_matmul(x.half(), packed, bias)
    assert out.shape == (2, 3, 48)
    assert_close(out, (F.linear(x.half().float(), weight.dequantize().half().float(), bias)).half())
    assert_close(qm.quant_matmul(x, packed, bias), _reference(x, weight, bias))


@needs_kernels
@pytest.mark.parametrize(
    "bits, group_size, k, blocks",
    [
        (8, 128, 256, qm.QuantBlocks(16, 32, 32, split_k=3)),  # 4 K tiles per group, 3 splits
        (4, 16, 256, qm.QuantBlocks(16, 64, 64, split_k=2)),  # 4 groups per K tile
        (4, 32, 96, qm.QuantBlocks(32, 64, 64, split_k=1)),  # last K tile half past K
        (4, 32, 224, qm.QuantBlocks(16, 16, 32, split_k=16)),  # 7 K tiles: 7 splits of one
    ],
)
def test_block_overrides_and_split_k_agree_with_the_reference(
    bits: int, group_size: int, k: int, blocks: qm.QuantBlocks
) -> None:
    torch.manual_seed(k + group_size)
    weight = _to_device(_weight(bits, 40, k, group_size))
    packed = qm.pack_for_triton(weight)
    x = torch.randn(7, k, device=DEVICE)
    bias = torch.randn(40, device=DEVICE)
    out = qm.quant_matmul(x, packed, bias, blocks=blocks)
    assert_close(out, _reference(x, weight, bias))
    assert torch.equal(out, qm.quant_matmul(x, packed, bias, blocks=blocks))  # deterministic


@needs_kernels
def test_per_channel_int8_with_one_group_of_a_non_power_of_two_k() -> None:
    """int8 per output channel (one group of K = 96): K tiles of 32 that divide it."""
    torch.manual_seed(2)
    weight = _to_device(_weight(8, 24, 96, 96))
    assert qm.choose_blocks(3, 24, 96, 96, num_sms=1).block_k == 32
    x = torch.randn(3, 96, device=DEVICE, dtype=torch.bfloat16)
    assert_close(qm.quant_matmul(x, qm.pack_for_triton(weight)), _reference(x, weight, None))


# --- loads ----------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "bits, group_size, blocks, group_loads",
    [
        (4, 32, qm.QuantBlocks(16, 64, 128, split_k=2), 1),  # 4 groups per K tile
        (8, 128, qm.QuantBlocks(16, 64, 32, split_k=4), 4),  # each group over 4 K tiles
    ],
)
def test_a_decode_step_loads_each_weight_byte_once(
    bits: int, group_size: int, blocks: qm.QuantBlocks, group_loads: int
) -> None:
    """5 rows (one row block), split-K: every packed byte loaded exactly once per call, every
    group's scale once per K tile over it."""
    torch.manual_seed(3)
    weight = _to_device(_weight(bits, 80, 256, group_size))
    packed = qm.pack_for_triton(weight)
    counts = qm.ReadCounts.zeros_for(packed)
    x = torch.randn(5, 256, device=DEVICE)
    out = qm.quant_matmul(x, packed, blocks=blocks, read_counts=counts)
    assert_close(out, _reference(x, weight, None))
    assert bool((counts.values == 1).all())
    assert bool((counts.groups == group_loads).all())


@needs_kernels
def test_prefill_loads_the_weights_once_per_row_block() -> None:
    """33 rows in blocks of 16: three row blocks, each reads the weight once."""
    torch.manual_seed(4)
    weight = _to_device(_weight(4, 80, 128, 32))
    packed = qm.pack_for_triton(weight)
    counts = qm.ReadCounts.zeros_for(packed)
    x = torch.randn(33, 128, device=DEVICE)
    blocks = qm.QuantBlocks(16, 64, 64)
    assert_close(
        qm.quant_matmul(x, packed, blocks=blocks, read_counts=counts), x @ weight.dequantize().T
    )
    assert bool((counts.values == 3).all()) and bool((counts.groups == 3).all())


# --- choices and edges ----------------------------------------------------------------------------


def test_block_k_never_straddles_a_group() -> None:
    assert qm.fit_block_k(128, 32) == 128  # four whole groups
    assert qm.fit_block_k(128, 256) == 128  # half a group
    assert qm.fit_block_k(128, 576) == 64  # SmolLM2's K per channel
    assert qm.fit_block_k(128, 48) == 16
    assert qm.fit_block_k(64, 14336) == 64


def test_decode_splits_k_to_fill_the_gpu_and_prefill_does_not() -> None:
    """A 4096 x 4096 layer on 132 SMs: 64 column tiles at 1 row split 8 ways (32 K tiles of 128,
    4 each); 14336 columns need fewer splits; 256 rows take 64 x 128 tiles, no split."""
    decode = qm.choose_blocks(1, 4096, 4096, 32, num_sms=132)
    assert (decode.block_m, decode.block_n, decode.block_k, decode.split_k) == (16, 64, 128, 8)
    assert qm.choose_blocks(16, 14336, 4096, 32, num_sms=132).split_k == 3
    prefill = qm.choose_blocks(256, 4096, 4096, 32, num_sms=132)
    assert (prefill.block_m, prefill.block_n, prefill.split_k) == (64, 128, 1)
    assert qm.choose_blocks(33, 4096, 4096, 32, num_sms=132).block_m == 64


@needs_kernels
def test_no_rows_give_an_empty_output() -> None:
    packed = qm.pack_for_triton(_to_device(_weight(4, 16, 32, 32)))
    out = qm.quant_matmul(torch.zeros(0, 32, device=DEVICE, dtype=torch.bfloat16), packed)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_quant_matmul_rejects_mismatched_inputs() -> None:
    packed = qm.pack_for_triton(_to_device(_weight(4, 16, 64, 32)))
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="width 32"):
        qm.quant_matmul(x[:, :32], packed)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        qm.quant_matmul(x.long(), packed)
    with pytest.raises(ValueError, match="bias of shape"):
        qm.quant_matmul(x, packed, torch.zeros(15, device=DEVICE))
    with pytest.raises(ValueError, match="straddle"):
        qm.quant_matmul(x, packed, blocks=qm.QuantBlocks(16, 16, 48))


@pytest.mark.skipif(ON_GPU or not RUN_HERE, reason="the dry run is the interpreter's")
def test_the_gpu_benchmark_dry_runs_in_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/kernels_quant_gpu.py's cases and sweep, on tiny shapes: it parses, runs, writes."""
    from bench import kernels_quant_gpu

    out = tmp_path / "quant.json"
    monkeypatch.setattr(sys, "argv", ["kernels_quant_gpu", "--dry-run", "--out", str(out)])
    with pytest.raises(SystemExit) as exited:
        kernels_quant_gpu.main()
    assert exited.value.code == 0
    result = json.loads(out.read_text())
    assert len(result["cases"]) == len(kernels_quant_gpu.FORMATS) * len(kernels_quant_gpu.DRY_ROWS)
    assert all(case["within_bf16_tolerance"] for case in result["cases"])
    assert {case["bits_per_weight"] for case in result["cases"]} == {4.25, 5.0, 8.5}
    assert len(result["sweep"]) == 8


@pytest.mark.skipif(RUN_HERE, reason="the kernels run in this process")
def test_quant_kernels_in_a_fresh_interpreter_process() -> None:
    """Triton was imported compiled before this module: rerun the file in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    argv += ["-k", "not test_quant_kernels_in_a_fresh_interpreter_process"]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1]  # the kernels really ran there
