"""engine/host_memory.py: glibc keeps a CPU engine's freed activations for the next step."""

from __future__ import annotations

import ctypes
import platform

import pytest

from engine import host_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_blocks_below_the_raised_threshold_stay_in_the_process() -> None:
    """After keep_freed_memory, an 8 MB block (above glibc's default mmap threshold) comes from
    the heap, and freeing it leaves the heap's pages mapped: mallinfo2's arena still holds it."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )]  # fmt: skip

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    assert host_memory.keep_freed_memory()
    size = 8 << 20
    mapped_before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    assert block and libc.mallinfo2().hblkhd == mapped_before  # not an mmapped chunk of its own
    libc.free(block)
    assert libc.mallinfo2().arena >= size  # not trimmed back to the kernel
