"""Keep a CPU engine's freed memory for its next step instead of handing it back to the kernel.

Every layer of a prefill chunk allocates its activations afresh (512 tokens of SmolLM2: a 6 MB
gate/up product, its 3 MB activation, ...). glibc serves allocations above its mmap threshold
(128 KB at first) with fresh pages from the kernel and unmaps them on free, and trims the heap's
top beyond 128 KB: either way the next step faults in and zeroes the same megabytes again, a
page at a time (about a microsecond each in a VM). Raising the mmap threshold to its maximum
(32 MB on 64-bit glibc) and the trim threshold beyond the engine's working set keeps those
pages in the process: measured on SmolLM2, the C SiLU-and-product of a 1528-token prefill took
95 ms instead of 160. vLLM gets the same by preloading tcmalloc. Other C libraries (musl) have
no mallopt: nothing is changed there.

The engine's long-lived arrays that a step streams (the weights a decode step reads,
engine/weight_arena.py; the KV pool, engine/kv_cache.py) go in mappings advised as transparent
huge pages instead: 2 MiB pages keep the hardware prefetcher going across what would be 4 KiB
page boundaries and spare the TLB misses of strided reads (a layer's rows of one KV block lie a
block apart). Linux gives huge pages only where asked in its default THP mode (`madvise`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
TRIM_THRESHOLD = 1 << 30  # beyond any engine step's activations
HUGE_PAGE_BYTES = 2 << 20


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False where there is no glibc to ask."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    done = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        logger.info("mallopt refused the thresholds: freed memory goes back to the kernel")
    return done


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim): after load-time
    copies, which keep_freed_memory's thresholds would otherwise keep in the process. False
    where there is no glibc to ask."""
    path = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(path).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """num_bytes of zeroed uint8 memory in a private mapping advised for huge pages (a plain
    mapping where the platform has no madvise). The tensor keeps the mapping alive."""
    size = max(HUGE_PAGE_BYTES, -(-num_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # before the first touch: the faults then take 2 MiB pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:num_bytes]
