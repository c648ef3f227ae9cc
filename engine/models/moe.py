"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a router picks `top_k` experts per
token, and the experts run grouped, each expert's weights read once per forward pass however many
tokens it was given (a decode step of 32 sequences with top 8 of 64 experts touches each expert
about 4 times token by token, once here).

    router ─▶ (topk_ids, topk_weights)     softmax then top k (then / sum), or top k then softmax
    experts: tokens sorted by expert ─▶ per expert: gate_up ─▶ activation ─▶ down ─▶ × weight
             ─▶ added into each token's row, the experts in ascending order (as transformers adds)

Expert weights are stacked as (num_experts, 2 * inter, hidden) and (num_experts, hidden, inter),
gate rows before up rows; checkpoints that store experts one by one (Qwen3-MoE, Mixtral) or
interleaved (gpt-oss) are converted at load by their architecture module.

Three ways to run the experts, picked once at load (`use_expert_kernels`):
    "c"       CPU with the C kernels: weights repacked for cpu_moe.c (panels, or bfloat16 pairs)
    "triton"  CUDA: kernels/moe.py's grouped matmuls
    "torch"   the grouping below in torch (the reference path, and any other device)
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.linear import Linear
from engine.model_config import ModelConfig, MoeConfig
from engine.models.decoder import CausalLM, pre_norm_model
from engine.models.layers import GatedMLP, RMSNorm


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.moe = moe
        self.router = Linear(hidden_size, e, bias=moe.router_bias)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down = nn.Parameter(torch.empty(e, hidden_size, i))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i)) if moe.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, hidden_size)) if moe.expert_bias else None
        self.expert_passes = 0  # the torch path's experts run (their weights read) since load
        self.kernel = "torch"  # see the module docstring

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids (tokens, k) int64, topk_weights (tokens, k) float32), as each architecture's
        router computes them (Qwen3-MoE's weights are then rounded to the model's dtype)."""
        logits = self.router(x)  # (tokens, num_experts), the model's dtype
        k = self.moe.top_k
        if self.moe.routing == "topk_softmax":
            values, ids = torch.topk(logits, k, dim=-1)
            weights = torch.softmax(values, dim=-1, dtype=values.dtype)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, k, dim=-1)
            if self.moe.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts(x, ids, weights)

    def use_kernel(self, kernel: str) -> None:
        """Run the experts as `kernel` from now on; "c" replaces the weights by cpu_moe.c's
        packed copy (one expert at a time, so the layer is never held twice)."""
        if kernel == "c":
            # one layout for both matrices (the kernel reads them alike): pairs need both K even
            gate_up, down = self.gate_up, self.down
            pairs = (
                gate_up.dtype == torch.bfloat16
                and gate_up.shape[2] % 2 == 0
                and down.shape[2] % 2 == 0
                and cpu_kernels.bf16_pairs_available()
            )
            for name in ("gate_up", "down"):
                packed = cpu_kernels.pack_experts(getattr(self, name).detach(), pairs)
                delattr(self, name)
                self.register_buffer(name, packed, persistent=False)
            for name in ("gate_up_bias", "down_bias"):
                bias = getattr(self, name)
                if bias is not None:
                    delattr(self, name)
                    self.register_buffer(name, bias.detach().float(), persistent=False)
        self.kernel = kernel

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every token's weighted sum of its experts' outputs: (tokens, hidden), x's dtype."""
        moe = self.moe
        if self.kernel == "c":
            return cpu_kernels.moe_experts(
                x, ids, weights, self.gate_up, self.down, self.gate_up_bias, self.down_bias,
                moe.intermediate_size, moe.activation, moe.alpha, moe.limit,
            )  # fmt: skip
        if self.kernel == "triton":
            from engine.kernels.moe import grouped_moe

            return grouped_moe(
                x, ids, weights, self.gate_up, self.down, self.gate_up_bias, self.down_bias,
                moe.activation, moe.alpha, moe.limit,
            )  # fmt: skip
        return self._grouped_in_torch(x, ids, weights)

    def _grouped_in_torch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (tokens * k,) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // k
            y = self._expert(expert, x[tokens])  # (count, hidden)
            out.index_add_(0, tokens, y.float() * weights.reshape(-1)[slots, None])
            self.expert_passes += 1
        return out.to(x.dtype)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        inter = self.moe.intermediate_size
        h = nn.functional.linear(
            x, self.gate_up[e], None if self.gate_up_bias is None else self.gate_up_bias[e]
        )  # (rows, 2 * inter)
        gate, up = h[:, :inter], h[:, inter:]
        if self.moe.activation == "silu":
            act = nn.functional.silu(gate) * up
        else:  # gpt_oss
            limit = self.moe.limit
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.moe.alpha))
        return nn.functional.linear(
            act, self.down[e], None if self.down_bias is None else self.down_bias[e]
        )


def use_expert_kernels(model: nn.Module, device: str, attention_backend: str) -> str:
    """Pick how every SparseMoE of the model runs (module docstring), as the attention backend
    is picked: "torch" keeps the reference path everywhere; else Triton on CUDA ("triton" forces
    it on CPU tensors under the interpreter), and the C kernels on a CPU where they built."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return "none"
    dtype = layers[0].gate_up.dtype
    if attention_backend == "torch":
        kernel = "torch"
    elif device.startswith("cuda") or attention_backend == "triton":
        kernel = "triton"
    elif cpu_kernels.library() is not None and dtype in cpu_kernels.DTYPE_CODES:
        kernel = "c"
    else:
        kernel = "torch"
    for layer in layers:
        layer.use_kernel(kernel)
    return kernel


def mixture_model(config: ModelConfig, qk_norm: type[RMSNorm] | None = None) -> CausalLM:
    """Pre-norm layers whose MLP is a SparseMoE where `config.moe_layers` says, else dense."""
    moe = config.moe
    assert moe is not None

    def mlp(layer: int) -> nn.Module:
        if config.is_moe(layer):
            return SparseMoE(config.hidden_size, moe)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    return pre_norm_model(config, qk_norm=qk_norm, mlp=mlp)
