"""The weights a CPU decode step streams, moved into one arena of huge pages in the order the step
reads them.

At one sequence a decode step's time is its weight bytes over the rate one core reads them. Left
where torch allocates them (4 KiB pages, each matrix on its own), that rate stays well below
what the core can read: the L2 streamer stops at every 4 KiB page boundary and every page costs a
TLB miss. In one private mapping advised as transparent huge pages (2 MiB pages; Linux's default
THP mode, `madvise`, gives them only where asked), laid out layer after layer as the step reads
them, the weights are one stream with few page boundaries. On the project's AMX host a 96 MB
read went from 10.9 GB/s to 19.5 (25 with cpu_quant.c's prefetch), and SmolLM2 Q4_1's
one-sequence decode step from 12.7 ms to 6.4 (the same kernels; bench/README.md).

Only the matrices the C decode step and the LM head stream are moved: quantized blocks
(cpu_quant.c), float32 panels, the bfloat16 pairs or panels kept beside oneDNN. Each is copied
once, at load; the old tensors are freed and their pages handed back as the copy goes (else the
process would hold both copies at its peak: keep_freed_memory keeps freed heap pages).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.host_memory import huge_page_buffer, release_freed_memory
from engine.kernels import cpu_kernels
from engine.kernels.cpu_quant import read_rates_gb_s
from engine.linear import Linear

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # each matrix starts on a cache line
TRIM_EVERY_BYTES = 64 << 20  # old copies handed back to the kernel this often while moving
PREFETCH_PROBE_BYTES = 64 << 20  # of the arena read to pick few-row prefetching: ~2 ms a read


def place_streamed_weights(model: nn.Module) -> int:
    """Move every CPU Linear's streamed matrix into one huge-page arena, in module order (each
    decoder layer's projections as its forward calls them, then the LM head). Returns the bytes
    moved (0 where nothing streams from the CPU). Then times reads of the arena to pick how
    the kernels' matmuls of one or two rows prefetch on this host (pick_few_rows_prefetch)."""
    sizes: dict[Linear, int] = {}  # bytes; the tensors are fetched one at a time below
    for module in model.modules():
        if isinstance(module, Linear):
            tensor = module.streamed_weight()
            if tensor is not None and tensor.device.type == "cpu":
                sizes[module] = tensor.numel() * tensor.element_size()
    if not sizes:
        return 0
    total = sum(-(-n // ALIGN_BYTES) * ALIGN_BYTES for n in sizes.values())
    arena = huge_page_buffer(total)
    at = freed = 0
    for module, num_bytes in sizes.items():
        tensor = module.streamed_weight()
        assert tensor is not None
        moved = arena[at : at + num_bytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        module.replace_streamed_weight(moved)
        del tensor  # the module's reference was the last: the old copy is freed here
        at += -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES
        freed += num_bytes
        if freed >= TRIM_EVERY_BYTES:  # the old copies leave as the new ones come in
            release_freed_memory()
            freed = 0
    release_freed_memory()
    pick_few_rows_prefetch(arena)
    return total


def pick_few_rows_prefetch(weights: torch.Tensor) -> dict[str, float]:
    """Set whether the C kernels' matmuls of one or two rows prefetch their weights in software
    (engine/kernels/cpu_prefetch.h): on where `weights` (a uint8 arena, as a decode step streams
    it) reads faster so, and log the pick. Hosts differ by a quarter either way. Returns the rates
    it compared (GB/s), or {} where there is nothing to read or no C library."""
    lib = cpu_kernels.library()
    usable = min(weights.numel(), PREFETCH_PROBE_BYTES) // 256 * 256
    if lib is None or usable == 0:
        return {}
    rates = read_rates_gb_s(weights[:usable], rounds=5)
    prefetch = rates["software"] >= rates["hardware"]
    lib.set_few_rows_prefetch(int(prefetch))
    logger.info(
        "weights read at %.1f GB/s prefetched, %.1f left to the hardware: "
        "matmuls of one or two rows %s",
        rates["software"],
        rates["hardware"],
        "prefetch" if prefetch else "do not prefetch",
    )
    return rates
