"""The paged KV cache tensor: one block-major pool for all layers.

    pool: (num_blocks, num_layers, 2, block_size, num_kv_heads, row)
             │            │        └ 0 = K, 1 = V
             └ one block of every layer is one contiguous byte range

Block-major keeps each block in a single region, so a NIXL transfer moves a block with one
descriptor whatever the layer count. Attention sees per-layer views of shape (num_blocks,
block_size, num_kv_heads, row) whose stride(0) spans the other layers.

The pool's dtype is the engine's kv_cache_dtype: the model's (auto), bfloat16 (under a float32
model: stores round, attention widens), or int8, whose rows are head_dim int8 values and their
float32 scale (kernels/kv_quant.py: row = head_dim + 4 bytes); otherwise row = head_dim.
"""

from __future__ import annotations

import math

import torch

from engine.host_memory import huge_page_buffer
from engine.kernels.kv_quant import row_width
from engine.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.block_size = block_size
        row = row_width(config.head_dim, dtype)
        shape = (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, row)
        if device == "cpu":  # huge pages: a layer's rows of a block lie a block's bytes apart
            num_bytes = math.prod(shape) * dtype.itemsize
            self.pool = huge_page_buffer(num_bytes).view(dtype).view(shape)
            self.pool.zero_()  # committed now, as torch.zeros would: no page faults mid-step
        else:
            self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.pool[:, i, 0], self.pool[:, i, 1]) for i in range(config.num_layers)]
        # what a peer's pool must equal for its blocks to be read as this one's (kv_transfer.py)
        self.layout = (
            f"{str(dtype).removeprefix('torch.')} kv, {config.num_layers} layers x"
            f" {block_size} tokens x {config.num_kv_heads} kv heads x {config.head_dim}"
        )

    @property
    def block_num_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()
