"""The weights a CPU decode step streams, moved into one arena of huge pages in the order the step
reads them.

At one sequence a decode step's time is its weight bytes over the rate one core reads them. Left
where torch allocates them (4 KiB pages, each matrix on its own), that rate stays well below
what the core can read: the L2 streamer stops at every 4 KiB page boundary and every page costs a
TLB miss. In one private mapping advised as transparent huge pages (2 MiB pages; Linux's default
THP mode, `madvise`, gives them only where asked), laid out layer after layer as the step reads
them, the weights are one stream with few page boundaries (bench/kernels_quant.py's `arena`
rows: the same kernels, the same bytes, read faster).

Only the matrices the C decode step and the LM head stream are moved: quantized blocks
(cpu_quant.c), float32 panels, the bfloat16 pairs or panels kept beside oneDNN. Each is copied
once, at load; the old tensors are freed.
"""

from __future__ import annotations

from torch import nn

from engine.host_memory import huge_page_buffer
from engine.linear import Linear

ALIGN_BYTES = 64  # each matrix starts on a cache line


def place_streamed_weights(model: nn.Module) -> int:
    """Move every CPU Linear's streamed matrix into one huge-page arena, in module order (each
    decoder layer's projections as its forward calls them, then the LM head). Returns the bytes
    moved (0 where nothing streams from the CPU)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    tensors = [m.streamed_weight() for m in layers]
    placed = [(m, t) for m, t in zip(layers, tensors, strict=True)
              if t is not None and t.device.type == "cpu"]  # fmt: skip
    if not placed:
        return 0
    offsets, total = [], 0
    for _, tensor in placed:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    arena = huge_page_buffer(total)
    for (module, tensor), at in zip(placed, offsets, strict=True):
        num_bytes = tensor.numel() * tensor.element_size()
        moved = arena[at : at + num_bytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        module.replace_streamed_weight(moved)
    return total
