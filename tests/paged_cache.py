"""A paged KV cache laid out as the engine's, with random contents, for the attention kernels'
tests (the Triton kernels, the torch path and the CPU's C kernels), and the tolerance they are
held to against the reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported late below: engine's layers import the Triton kernels
    from engine.models.layers import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {  # (atol, rtol): about two units in the last place of outputs of magnitude ~2
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


class PagedCache:
    """K/V views of layer 1 of a block-major pool (strided like the engine's), with shuffled
    per-sequence block tables and random contents."""

    def __init__(
        self,
        lens: list[int],
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        extra_blocks: int = 3,
        device: str = DEVICE,
    ) -> None:
        blocks_per_seq = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks_per_seq) + extra_blocks
        self.pool = torch.randn(
            num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )  # (num_blocks, num_layers, K/V, block_size, num_kv_heads, head_dim)
        self.k, self.v = self.pool[:, 1, 0], self.pool[:, 1, 1]
        order = torch.randperm(num_blocks).tolist()
        width = max(blocks_per_seq)
        tables = []
        for n in blocks_per_seq:
            row, order = order[:n], order[n:]
            tables.append(row + [0] * (width - n))  # padding entries are never read
        self.block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
        self.context_lens = torch.tensor(lens, dtype=torch.int32, device=device)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def decode_metadata(
    lens: list[int], block_size: int, blocks_per_seq: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A decode-only batch over consecutive block tables: sequence i has lens[i] tokens cached
    and decodes one more. Returns (positions, metadata)."""
    from engine.models.layers import AttentionMetadata

    tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), -1)
    positions = torch.tensor(lens)
    slots = tables[torch.arange(len(lens)), positions // block_size].long() * block_size + (
        positions % block_size
    )
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=len(lens), decode_block_tables=tables,
        decode_context_lens=(positions + 1).to(torch.int32),
        prefill_block_tables=torch.zeros(0, blocks_per_seq, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )  # fmt: skip
    return positions, meta
