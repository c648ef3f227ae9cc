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
import math
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from engine.host_memory import huge_page_buffer, release_freed_memory
from engine.kernels import cpu_kernels
from engine.kernels.cpu_quant import PackedQuant, prepared_quant_linear, takes_int8
from engine.linear import Linear

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # each matrix starts on a cache line
TRIM_EVERY_BYTES = 64 << 20  # old copies handed back to the kernel this often while moving
PREFETCH_PROBE_BYTES = 64 << 20  # of weights multiplied to pick few-row prefetching: ~3 ms a pass
PREFETCH_PROBE_ROUNDS = 5  # passes each way, the best of them kept


def place_streamed_weights(model: nn.Module) -> int:
    """Move every CPU Linear's streamed matrix into one huge-page arena, in module order (each
    decoder layer's projections as its forward calls them, then the LM head). Returns the bytes
    moved (0 where nothing streams from the CPU). Then times one-row products over the arena to
    pick how the kernels' matmuls of one or two rows prefetch on this host
    (pick_few_rows_prefetch)."""
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
    pick_few_rows_prefetch(list(sizes))
    return total


def pick_few_rows_prefetch(layers: list[Linear]) -> dict[str, float]:
    """Set whether the C kernels' matmuls of one or two rows prefetch their weights in software
    (engine/kernels/cpu_prefetch.h), and log the pick: the faster of one-row matmuls through the
    layers' own kernels, over their first PREFETCH_PROBE_BYTES of streamed weights, timed each
    way in turn. Hosts differ by a quarter either way. A plain read of the same bytes
    (cpu_quant.read_rates_gb_s) is no proxy: on the Zen 4 VM it once read 27.9 GB/s prefetched
    against 27.6 without, while SmolLM2 Q4_1's decode step took 6.4 ms prefetched against 4.8.
    Returns the passes' best times (ms) each way, or {} where no layer's kernel reads the flag."""
    lib = cpu_kernels.library()
    passes = one_row_matmuls(layers)
    if lib is None or not passes:
        return {}
    best_ms = {"software": math.inf, "hardware": math.inf}
    for _ in range(PREFETCH_PROBE_ROUNDS):
        for way in best_ms:
            lib.set_few_rows_prefetch(int(way == "software"))
            best_ms[way] = min(best_ms[way], timed_pass_ms(passes))
    prefetch = best_ms["software"] <= best_ms["hardware"]
    lib.set_few_rows_prefetch(int(prefetch))
    logger.info(
        "one-row matmuls over %d matrices: %.2f ms prefetched, %.2f left to the hardware: "
        "matmuls of one or two rows %s",
        len(passes),
        best_ms["software"],
        best_ms["hardware"],
        "prefetch" if prefetch else "do not prefetch",
    )
    return best_ms


def one_row_matmuls(layers: list[Linear]) -> list[Callable[[], object]]:
    """One-row products through the kernels that read the few-rows flag, a layer's each: its
    quantized blocks (cpu_quant.c) or its bfloat16 pairs (cpu_linear.c; 4-d, where panels are
    3-d), until PREFETCH_PROBE_BYTES of weights. Float32 panels keep their own rule."""
    passes: list[Callable[[], object]] = []
    covered = 0
    for layer in layers:
        if covered >= PREFETCH_PROBE_BYTES:
            break
        weight = layer.streamed_weight()
        if weight is None:
            continue
        n, k = layer.out_features, layer.in_features
        if isinstance(layer.packed, PackedQuant):
            x, out = torch.zeros(1, k), torch.empty(1, n)
            passes.append(prepared_quant_linear(x, layer.packed, None, takes_int8(1), out))
        elif weight.dim() == 4 and weight.dtype == torch.bfloat16:
            x = torch.zeros(1, k, dtype=torch.bfloat16)
            passes.append(partial(cpu_kernels.pair_linear, x, weight, None, n))
        else:
            continue
        covered += weight.numel() * weight.element_size()
    return passes


def timed_pass_ms(passes: list[Callable[[], object]]) -> float:
    """One run of every product, in order: milliseconds."""
    start = time.perf_counter()
    for product in passes:
        product()
    return (time.perf_counter() - start) * 1e3
