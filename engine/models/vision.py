"""The image encoder of a LLaVA-style model: CLIP's vision transformer and the projector into the
language model's embedding space (transformers' CLIPVisionModel and LlavaMultiModalProjector).

    pixels (n, 3, H, W) ─ patch conv ─ [CLS] + patches + positions ─ pre-norm
        ─ encoder layers (as many as feature_layer needs) ─ drop CLS ("default")
        ─ linear ─ act ─ linear ─▶ (n, num_image_tokens, text hidden)

An image is encoded once, when its request is admitted; its rows then replace the placeholder
tokens' embeddings in the prefill (engine/model_runner.py), so the decoder, its KV cache and
the hand-off are those of a text prompt. The encoder is dense and compute-bound (no KV, no
paging): torch's matmul and SDPA are its CPU and GPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import VisionConfig


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)  # transformers' "gelu": the exact erf form


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        patch = config.layout.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, patch, patch,
            bias=False,
        )  # fmt: skip
        num_positions = (config.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixels.to(dtype)).flatten(2).transpose(1, 2)  # (n, p, d)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # (n, p + 1, d)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (n, heads, length, head_dim)
            return t.view(n, length, self.num_heads, d // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, length, d))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.act = config.hidden_act
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_activation(self.act, self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(d, eps), nn.LayerNorm(d, eps)
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """Only the layers up to the feature layer are built: the checkpoint's later ones (and its
    post-layernorm) never reach the language model, and are dropped at loading."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)  # CLIP's name
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.layers_run))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.act = config.projector_act
        bias = config.projector_bias
        self.linear_1 = nn.Linear(config.hidden_size, text_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(_activation(self.act, self.linear_1(x)))


class ImageEncoder(nn.Module):
    """pixels (n, channels, image_size, image_size) -> (n, num_image_tokens, text hidden)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.tower = VisionEncoder(config)
        self.projector = Projector(config, text_hidden_size)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"pixel values of shape {tuple(pixels.shape)}: this model takes "
                             f"(n, {self.config.num_channels}, {size}, {size})")  # fmt: skip
        features = self.tower(pixels)
        if not self.config.layout.keep_cls:
            features = features[:, 1:]
        return self.projector(features)
