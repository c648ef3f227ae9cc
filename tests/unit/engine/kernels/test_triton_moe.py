"""The Triton grouped MoE kernels against `moe_experts_ref`, and the pair alignment they run on.

Without a GPU the kernels run in the Triton interpreter, which must be switched on before triton is
first imported (see test_kernels.py's docstring: the same skip-and-rerun-in-a-subprocess fallback).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.kernels import moe  # noqa: E402
from engine.kernels.decode import needs_upcast  # noqa: E402
from engine.kernels.reference import moe_experts_ref  # noqa: E402
from tests.paged_cache import DEVICE, assert_close  # noqa: E402

RUN_HERE = ON_GPU or all(
    isinstance(fn, InterpretedFunction)
    for fn in (tl.cdiv, moe.gate_up_kernel, moe.down_kernel, moe.weighted_sum_kernel)
)
needs_kernels = pytest.mark.skipif(
    not RUN_HERE, reason="triton was imported compiled before this module: run in a subprocess"
)


def _routing(
    num_tokens: int, num_experts: int, top_k: int, unused: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k distinct experts per token and their softmax weights, as a router gives them; the
    last `unused` experts get no token."""
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    logits[:, num_experts - unused :] = float("-inf")
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return ids, weights  # (num_tokens, top_k) int64 and float32


def _experts(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gate_up (E, 2 * inter, hidden), down (E, hidden, inter) scaled to keep outputs O(1),
    float32 biases (E, 2 * inter) and (E, hidden) or None."""
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=DEVICE) / inter**0.5).to(dtype)
    if not bias:
        return gate_up, down, None, None
    gate_up_bias = torch.randn(num_experts, 2 * inter, device=DEVICE)
    down_bias = torch.randn(num_experts, hidden, device=DEVICE)
    return gate_up, down, gate_up_bias, down_bias


# --- moe_align ------------------------------------------------------------------------------------


def test_moe_align_matches_the_worked_example() -> None:
    """The diagram in moe.py's docstring."""
    ids = torch.tensor([[2, 0], [0, 3], [2, 3]], device=DEVICE)
    align = moe.moe_align(ids, num_experts=5, block=4)
    p = 6  # padding
    assert align.sorted_ids.tolist() == [1, 2, p, p, 0, 4, p, p, 3, 5, p, p] + [p] * 8
    assert align.block_experts.tolist() == [0, 2, 3, -1, -1]
    assert int(align.num_blocks) == 3


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block",
    [(1, 4, 2, 16), (9, 8, 3, 4), (50, 6, 2, 16), (40, 64, 4, 16), (7, 3, 3, 2)],
)
def test_moe_align_groups_every_pair_by_expert_in_padded_runs(
    num_tokens: int, num_experts: int, top_k: int, block: int
) -> None:
    torch.manual_seed(num_tokens)
    ids, _ = _routing(num_tokens, num_experts, top_k)
    align = moe.moe_align(ids, num_experts, block)
    num_pairs = num_tokens * top_k
    flat = ids.flatten().cpu()
    sorted_ids = align.sorted_ids.cpu().view(-1, block)  # (max_blocks, block)
    block_experts = align.block_experts.cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    used_blocks = int(((counts + block - 1) // block).sum())
    assert int(align.num_blocks) == used_blocks
    assert sorted_ids.shape[0] == moe.max_blocks(num_pairs, num_experts, block) >= used_blocks
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert bool((sorted_ids[sorted_ids >= num_pairs] == num_pairs).all())  # the rest is padding
    assert bool((block_experts[used_blocks:] == -1).all())
    assert bool((sorted_ids[used_blocks:] == num_pairs).all())
    runs = [int(e) for e in block_experts[:used_blocks]]
    assert runs == sorted(runs)  # experts in order, each run contiguous
    for e in range(num_experts):
        rows = sorted_ids[block_experts == e].flatten()
        rows = rows[rows < num_pairs]
        assert len(rows) == int(counts[e])
        assert bool((flat[rows.long()] == e).all())  # a block holds only its expert's pairs
        assert rows.tolist() == sorted(rows.tolist())  # stable: token order inside a run
        assert int((block_experts == e).sum()) == -(-int(counts[e]) // block)


def test_max_blocks_is_tight_when_every_pair_has_its_own_expert() -> None:
    assert moe.max_blocks(num_pairs=6, num_experts=8, block=16) == 6
    assert moe.max_blocks(num_pairs=64, num_experts=4, block=16) == (64 + 4 * 15) // 16


def test_block_m_follows_the_pairs_per_expert() -> None:
    assert moe.choose_block_m(num_pairs=4 * 8, num_experts=128) == 16  # decode
    assert moe.choose_block_m(num_pairs=4096 * 8, num_experts=128) == 64  # prefill
    assert moe.choose_block_m(num_pairs=30 * 2, num_experts=2) == 32


# --- grouped_moe against the reference ------------------------------------------------------------

MOE_SHAPES = [  # (num_tokens, num_experts, top_k, hidden, inter)
    (1, 4, 2, 32, 32),  # one token: two experts run, two get nothing
    (7, 8, 2, 64, 48),  # inter not a multiple of the tile
    (33, 4, 1, 32, 80),  # several blocks per expert (block_m 16)
    (12, 16, 4, 48, 32),  # many experts, some with no token; hidden not a multiple of the tile
]


@needs_kernels
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter", MOE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_matches_reference(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
    ids, weights = _routing(num_tokens, num_experts, top_k)
    for activation in ("silu", "gpt_oss"):
        for bias in (False, True):
            experts = _experts(num_experts, hidden, inter, dtype, bias)
            out = moe.grouped_moe(x, ids, weights, *experts, activation, block_m=16)
            assert_close(out, moe_experts_ref(x, ids, weights, *experts, activation))


@needs_kernels
def test_grouped_moe_float16_and_the_default_block() -> None:
    torch.manual_seed(20)
    x = torch.randn(20, 64, dtype=torch.float16, device=DEVICE)
    ids, weights = _routing(20, 4, 2)
    experts = _experts(4, 64, 64, torch.float16, bias=True)
    out = moe.grouped_moe(x, ids, weights, *experts, "gpt_oss", alpha=1.5, limit=0.5)
    assert_close(out, moe_experts_ref(x, ids, weights, *experts, "gpt_oss", 1.5, 0.5))


@needs_kernels
def test_grouped_moe_reads_strided_expert_weights() -> None:
    """Checkpoints may hold experts transposed ((E, hidden, 2 * inter)): views are read as is."""
    torch.manual_seed(21)
    x = torch.randn(5, 32, device=DEVICE)
    ids, weights = _routing(5, 3, 2)
    gate_up = torch.randn(3, 32, 96, device=DEVICE).transpose(1, 2) / 6  # (E, 2 * inter, hidden)
    down = torch.randn(3, 48, 32, device=DEVICE).transpose(1, 2) / 7  # (E, hidden, inter)
    gate_up_bias = torch.randn(3, 2, 96, device=DEVICE)[:, 0]  # (E, 2 * inter), strided
    out = moe.grouped_moe(x, ids, weights, gate_up, down, gate_up_bias)
    assert_close(out, moe_experts_ref(x, ids, weights, gate_up, down, gate_up_bias))


# --- each expert's weights once per call ----------------------------------------------------------


def _matrix_reads(
    rows_read: torch.Tensor, hidden: int, inter: int
) -> tuple[list[float], list[float]]:
    """How many times each expert's gate_up and down were read, from the kernels' row counters."""
    gate_up = (rows_read[0].double() / (2 * inter)).tolist()
    down = (rows_read[1].double() / hidden).tolist()
    return gate_up, down


@needs_kernels
def test_each_expert_is_read_once_per_call_not_once_per_token() -> None:
    """A decode step of 16 tokens, top 2 of 8 experts (the last 2 unused): 32 token-expert
    products, but every expert that got a token has its gate_up and down read exactly once; the
    others not at all."""
    torch.manual_seed(22)
    num_tokens, num_experts, top_k, hidden, inter = 16, 8, 2, 32, 96
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    ids, weights = _routing(num_tokens, num_experts, top_k, unused=2)
    experts = _experts(num_experts, hidden, inter, torch.float32, bias=True)
    rows_read = torch.zeros(2, num_experts, dtype=torch.int32, device=DEVICE)
    out = moe.grouped_moe(x, ids, weights, *experts, weight_rows_read=rows_read)
    assert_close(out, moe_experts_ref(x, ids, weights, *experts))
    routed = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert int(routed.min()) == 0 and int(routed.max()) > 1
    expected = [1.0 if n > 0 else 0.0 for n in routed.tolist()]
    assert _matrix_reads(rows_read.cpu(), hidden, inter) == (expected, expected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_taking_every_token_is_read_once_per_block(dtype: torch.dtype) -> None:
    """All 40 tokens routed to expert 2 (top_k 1): 40 products, 3 reads of its weights at
    block_m 16; the other experts get nothing and are never read."""
    torch.manual_seed(23)
    num_tokens, num_experts, hidden, inter = 40, 4, 32, 32
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
    ids = torch.full((num_tokens, 1), 2, device=DEVICE)
    weights = torch.rand(num_tokens, 1, device=DEVICE)
    experts = _experts(num_experts, hidden, inter, dtype, bias=True)
    rows_read = torch.zeros(2, num_experts, dtype=torch.int32, device=DEVICE)
    out = moe.grouped_moe(
        x, ids, weights, *experts, "gpt_oss", block_m=16, weight_rows_read=rows_read
    )
    assert_close(out, moe_experts_ref(x, ids, weights, *experts, "gpt_oss"))
    reads = [0.0, 0.0, 3.0, 0.0]
    assert _matrix_reads(rows_read.cpu(), hidden, inter) == (reads, reads)


# --- edges ----------------------------------------------------------------------------------------


@needs_kernels
def test_grouped_moe_is_deterministic_and_takes_no_tokens() -> None:
    torch.manual_seed(24)
    x = torch.randn(9, 32, dtype=torch.bfloat16, device=DEVICE)
    ids, weights = _routing(9, 4, 2)
    experts = _experts(4, 32, 32, torch.bfloat16, bias=False)
    first = moe.grouped_moe(x, ids, weights, *experts)
    assert torch.equal(first, moe.grouped_moe(x, ids, weights, *experts))
    empty = moe.grouped_moe(x[:0], ids[:0], weights[:0], *experts)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


def test_grouped_moe_rejects_bad_activation_and_shapes() -> None:
    x = torch.zeros(2, 32, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.long, device=DEVICE)
    weights = torch.ones(2, 1, device=DEVICE)
    gate_up, down, _, _ = _experts(2, 32, 16, torch.float32, bias=False)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        moe.grouped_moe(x, ids, weights, gate_up, down, activation="gelu")
    with pytest.raises(ValueError, match="hidden size 32"):
        moe.grouped_moe(x, ids, weights, gate_up, down[:, :16])


@needs_kernels
def test_bfloat16_rounding_matches_torch() -> None:
    """`rounded` (the interpreter's fix for its truncating cast) rounds to nearest even as torch
    does, extremes included; on a GPU it is the hardware cast."""

    @triton.jit
    def kernel(x_ptr, out_ptr, N: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.store(out_ptr + offs, moe.rounded(x, tl.bfloat16, INTERPRETED_BF16))

    torch.manual_seed(25)
    special = [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.0e38, -3.0e38, float("inf")]
    x = torch.cat([torch.randn(1000), 1e30 * torch.randn(1000), 1e-30 * torch.randn(40)])
    x = torch.cat([x, torch.tensor(special)]).to(DEVICE)
    x = torch.nn.functional.pad(x, (0, 2048 - x.numel()))
    out = torch.empty_like(x)
    probe = torch.empty(1, dtype=torch.bfloat16, device=DEVICE)
    kernel[(1,)](x, out, N=2048, INTERPRETED_BF16=needs_upcast(probe))
    assert torch.equal(out, x.to(torch.bfloat16).float())


@pytest.mark.skipif(RUN_HERE, reason="the kernels run in this process")
def test_moe_kernels_in_a_fresh_interpreter_process() -> None:
    """Triton was imported compiled before this module: rerun the file in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    argv += ["-k", "not test_moe_kernels_in_a_fresh_interpreter_process"]
    root = Path(__file__).resolve().parents[4]
    result = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1]  # the kernels really ran there
