"""The grouped experts kernel (engine/kernels/cpu_moe.c) against reference.moe_experts_ref and
Hugging Face's expert modules, its routing edge cases, and its count of expert weight passes."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from engine.kernels import cpu_kernels
from engine.kernels.reference import moe_experts_ref
from tests.paged_cache import assert_close

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this host")

PAIRS = cpu_kernels.bf16_pairs_available()
LAYOUTS = [  # (dtype, pairs): float32 panels, bfloat16 panels (widened), bfloat16 pairs
    (torch.float32, False),
    (torch.bfloat16, False),
    pytest.param(
        torch.bfloat16, True, marks=pytest.mark.skipif(not PAIRS, reason="no AVX512-BF16 here")
    ),
]


class Experts:
    """Random experts of one layer, their packed copies, and a routing of `tokens` tokens."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, pairs: bool,
        biases: bool = False,
    ) -> None:  # fmt: skip
        self.inter, self.dtype = inter, dtype
        self.gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
        self.down = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
        self.gate_up_bias = torch.randn(num_experts, 2 * inter) if biases else None
        self.down_bias = torch.randn(num_experts, hidden) if biases else None
        self.packed = (
            cpu_kernels.pack_experts(self.gate_up, pairs),
            cpu_kernels.pack_experts(self.down, pairs),
        )

    def run(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, activation: str = "silu",
        **kwargs: int,
    ) -> torch.Tensor:  # fmt: skip
        return cpu_kernels.moe_experts(
            x, ids, weights, *self.packed, self.gate_up_bias, self.down_bias, self.inter,
            activation, **kwargs,
        )  # fmt: skip

    def reference(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, activation: str = "silu"
    ) -> torch.Tensor:
        return moe_experts_ref(
            x, ids, weights, self.gate_up, self.down, self.gate_up_bias, self.down_bias,
            activation,
        )  # fmt: skip


def route(tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k distinct experts and their softmax weights, as a router gives them."""
    weights, ids = torch.softmax(torch.randn(tokens, num_experts), dim=-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def check(got: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:  # sums in another order: a few units in the last place
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_close(got, expected)


@pytest.mark.parametrize(("dtype", "pairs"), LAYOUTS)
@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_grouped_experts_match_the_reference(
    dtype: torch.dtype, pairs: bool, activation: str
) -> None:
    """Sizes that are not multiples of the 16-column panels; gpt-oss's with its biases and
    large gate / up values (its clamps at 7 matter)."""
    torch.manual_seed(1)
    experts = Experts(6, 72, 40, dtype, pairs, biases=activation == "gpt_oss")
    ids, weights = route(13, 6, 3)
    x = (4 * torch.randn(13, 72)).to(dtype)
    check(experts.run(x, ids, weights, activation), experts.reference(x, ids, weights, activation))


def test_matches_hugging_faces_expert_modules_in_float32() -> None:
    """Qwen3-MoE's experts (Mixtral's are the same module) and gpt-oss's, whose gate_up is
    stored transposed with gate and up columns interleaved: the loader's rearrangement here."""
    torch.manual_seed(2)
    x, (ids, weights) = torch.randn(9, 72), route(9, 6, 3)
    qwen = Qwen3MoeExperts(
        Qwen3MoeConfig(hidden_size=72, moe_intermediate_size=40, num_experts=6)
    )  # fmt: skip
    gpt_oss = GptOssExperts(
        GptOssConfig(hidden_size=72, intermediate_size=40, num_local_experts=6)
    )  # fmt: skip
    with torch.no_grad():
        for p in (*qwen.parameters(), *gpt_oss.parameters()):
            p.normal_(0, 0.3)
        expected_qwen, expected_gpt_oss = qwen(x, ids, weights), gpt_oss(x, ids, weights)
    got = cpu_kernels.moe_experts(
        x, ids, weights, cpu_kernels.pack_experts(qwen.gate_up_proj.data),
        cpu_kernels.pack_experts(qwen.down_proj.data), None, None, 40,
    )  # fmt: skip
    check(got, expected_qwen)
    w, b = gpt_oss.gate_up_proj.data, gpt_oss.gate_up_proj_bias.data  # (E, H, 2I), (E, 2I)
    gate_up = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1).transpose(1, 2)  # (E, 2I, H)
    got = cpu_kernels.moe_experts(
        x, ids, weights, cpu_kernels.pack_experts(gate_up.contiguous()),
        cpu_kernels.pack_experts(gpt_oss.down_proj.data.transpose(1, 2).contiguous()),
        torch.cat([b[:, ::2], b[:, 1::2]], dim=-1), gpt_oss.down_proj_bias.data, 40, "gpt_oss",
        gpt_oss.alpha, gpt_oss.limit,
    )  # fmt: skip
    check(got, expected_gpt_oss)


@pytest.mark.parametrize(("dtype", "pairs"), LAYOUTS)
def test_routing_edge_cases(dtype: torch.dtype, pairs: bool) -> None:
    """Experts no token is routed to, every token to one expert (more rows than one sweep
    takes), top_k = num_experts, one token; and an expert id out of range."""
    torch.manual_seed(3)
    experts = Experts(5, 32, 24, dtype, pairs)
    cases = [
        (torch.tensor([[1, 3], [3, 1], [1, 3]]), torch.rand(3, 2)),  # experts 0, 2, 4 idle
        (torch.full((60, 1), 2), torch.rand(60, 1)),  # one expert, 60 rows: two sweeps
        (torch.stack([torch.randperm(5) for _ in range(4)]), torch.rand(4, 5)),  # all experts
        (torch.tensor([[4, 0, 2]]), torch.tensor([[0.5, 0.3, 0.2]])),  # one token
    ]
    for ids, weights in cases:
        x = torch.randn(ids.shape[0], 32).to(dtype)
        before = cpu_kernels.expert_passes()
        check(experts.run(x, ids, weights), experts.reference(x, ids, weights))
        sweeps = sum(-(-int((ids == e).sum()) // 48) for e in range(5))
        assert cpu_kernels.expert_passes() - before == sweeps
    with pytest.raises(ValueError, match="outside 0 .. 4"):
        experts.run(torch.randn(2, 32).to(dtype), torch.tensor([[0], [5]]), torch.ones(2, 1))


def test_a_decode_step_reads_each_expert_once() -> None:
    """32 sequences, top 8 of 64 experts: one pass over each expert routed to, not one per
    (token, expert) pair; and the same sums, bit for bit, on one thread or two."""
    torch.manual_seed(4)
    experts = Experts(64, 64, 32, torch.float32, pairs=False)
    ids, weights = route(32, 64, 8)
    x = torch.randn(32, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        before = cpu_kernels.expert_passes()
        one = experts.run(x, ids, weights)
        assert cpu_kernels.expert_passes() - before == ids.unique().numel() < ids.numel()
        torch.set_num_threads(2)
        assert torch.equal(experts.run(x, ids, weights), one)
    finally:
        torch.set_num_threads(threads)
    check(one, experts.reference(x, ids, weights))


def test_a_prefill_goes_in_chunks_that_fit_the_buffer_budget() -> None:
    """With buffers for 7 tokens, 40 tokens take 6 chunks: one pass per expert per chunk, and
    the reference's sums."""
    torch.manual_seed(5)
    experts = Experts(6, 32, 16, torch.float32, pairs=False)
    ids, weights = route(40, 6, 2)
    x = torch.randn(40, 32)
    token_bytes = 2 * 4 * (2 * 32 + 3 * 16)  # top_k rows of float32 buffers (cpu_moe.c)
    before = cpu_kernels.expert_passes()
    got = experts.run(x, ids, weights, chunk_bytes=7 * token_bytes)
    chunks = [ids[t : t + 7] for t in range(0, 40, 7)]
    assert cpu_kernels.expert_passes() - before == sum(c.unique().numel() for c in chunks)
    check(got, experts.reference(x, ids, weights))
