"""The paged KV cache tensor: one block-major pool for all layers.

    pool: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
             │            │        └ 0 = K, 1 = V
             └ one block of every layer is one contiguous byte range

Block-major keeps each block in a single region, so a NIXL transfer moves a block with one
descriptor whatever the layer count. Attention sees per-layer views of shape (num_blocks,
block_size, num_kv_heads, head_dim) whose stride(0) spans the other layers.
"""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.block_size = block_size
        self.pool = torch.zeros(
            num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim,
            dtype=dtype, device=device,
        )  # fmt: skip
        self.layers = [(self.pool[:, i, 0], self.pool[:, i, 1]) for i in range(config.num_layers)]

    @property
    def block_num_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()
