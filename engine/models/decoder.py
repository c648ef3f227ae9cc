"""The decoder-only causal LM every architecture is: embeddings, a stack of layers, a final norm
and the LM head, plus the pre-norm layer most architectures share.

A layer's forward returns (its output, the residual stream before it): the skip connection is
added by the next norm, the layer's own or the next layer's, in one pass with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.linear import Linear
from engine.model_config import ModelConfig, RopeConfig
from engine.models.layers import (
    Attention,
    AttentionMetadata,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
)

if TYPE_CHECKING:
    from engine.lora.manager import LoRABatch
    from engine.models.cpu_decode import CStep


class PreNormDecoderLayer(nn.Module):
    """Llama's layer (and Qwen's, Mistral's, Phi-3's, the MoE models'): x + attn(norm(x)), then
    + mlp(norm(.)). `mlp` is a GatedMLP or a SparseMoE."""

    def __init__(
        self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, rope: RopeConfig
    ) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.rope = rope

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the stream is the embeddings
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    """Named as Hugging Face's `model.` prefix, so checkpoints load by name."""

    def __init__(self, config: ModelConfig, layers: Sequence[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """The whole decoder: `forward` returns hidden states, `logits` projects the selected rows.

    embedding_multiplier: Gemma scales the embeddings by sqrt(hidden_size) (in the model's
    dtype); final_soft_cap: Gemma 2 caps the logits, cap * tanh(logits / cap)."""

    def __init__(
        self,
        config: ModelConfig,
        layers: Sequence[nn.Module],
        norm: RMSNorm,
        embedding_multiplier: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config, layers, norm)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embedding_multiplier = embedding_multiplier
        self.final_soft_cap = config.final_soft_cap
        self.rotaries = nn.ModuleList()  # attach_rotary: one per distinct RopeConfig
        self.max_positions = 0  # attach_rotary: the rows of the rotary tables
        self.layer_rotary: list[int] = []  # per layer, its index in rotaries
        # decode-only batches of up to this many sequences run as one C call (models/cpu_decode.py)
        self.c_decode_max_rows = 0
        self.c_decode_pairs = False  # its weights in bfloat16 pairs (kernels/cpu_linear.c)
        self._c_step: CStep | None = None  # the C step's table, made on its first call
        self.lora_batch: LoRABatch | None = None  # the step's adapters (engine/lora/manager.py)
        # a LLaVA-style model's images -> placeholder rows (models/llava.py, models/vision.py)
        self.image_encoder: nn.Module | None = None

    def attach_rotary(self, max_positions: int) -> None:
        """Build the rotary tables (not checkpoint tensors: made after loading) for `max_positions`
        positions, one per distinct rotary configuration among the layers."""
        ropes: list[RopeConfig] = []
        self.layer_rotary = []
        for layer in self.model.layers:
            if layer.rope not in ropes:
                ropes.append(layer.rope)
            self.layer_rotary.append(ropes.index(layer.rope))
        device = self.model.embed_tokens.weight.device
        self.max_positions = max_positions
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(rope, self.config.head_dim, max_positions).to(device) for rope in ropes
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        if self.embedding_multiplier is not None:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`embeds`: (token indices, their rows): an image's encoded rows in place of its
        placeholder tokens' embeddings (engine/model_runner.py)."""
        x = self.embed(input_ids)
        if embeds is not None:
            index, rows = embeds
            x[index] = rows.to(x.dtype)
        # the C kernels index the rotary tables unchecked (torch's indexing raises on its own)
        if positions.is_cpu and positions.numel() and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} is past the rotary tables' "
                             f"{self.max_positions} rows")  # fmt: skip
        # the C step has no LoRA: a step with adapters runs layer by layer (Linear adds them)
        with_lora = self.lora_batch is not None and self.lora_batch.slots is not None
        if 0 < meta.num_decode_tokens == x.shape[0] <= self.c_decode_max_rows and not with_lora:
            from engine.models.cpu_decode import decode_in_c

            return decode_in_c(self, x, positions, kv_caches, meta)
        tables = [rotary.table_positions(positions, meta) for rotary in self.rotaries]
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            r = self.layer_rotary[i]
            x, residual = layer(x, residual, tables[r], self.rotaries[r], kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.model.norm.add_and_norm(x, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.soft_capped(self.lm_head(hidden).float())  # (num_rows, vocab_size)

    def soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits as the model reports them: Gemma 2's soft cap applied."""
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits


def pre_norm_model(
    config: ModelConfig,
    qk_norm: type[RMSNorm] | None = None,
    mlp: Callable[[int], nn.Module] | None = None,
) -> CausalLM:
    """A CausalLM of PreNormDecoderLayers: `mlp(layer)` makes a layer's MLP (default: the dense
    SiLU one), `qk_norm` the per-head q / k norms (None: none)."""

    def dense(layer: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)

    make_mlp = mlp or dense
    layers = [
        PreNormDecoderLayer(
            Attention(config, config.window(i), qk_norm), make_mlp(i), config.hidden_size,
            config.rms_norm_eps, config.rope,
        )
        for i in range(config.num_layers)
    ]  # fmt: skip
    return CausalLM(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
