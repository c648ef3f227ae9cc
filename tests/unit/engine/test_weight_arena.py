"""The streamed matrices moved into one huge-page arena: the layers compute exactly what they did,
their matrices lie in one buffer in module order, and the arena is backed by huge pages where the
kernel gives them."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.host_memory import huge_page_buffer
from engine.kernels import cpu_kernels
from engine.linear import Linear
from engine.weight_arena import one_row_matmuls, pick_few_rows_prefetch, place_streamed_weights
from tests.unit.engine.quant.test_quantized_linear import random_q4

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the C kernels did not build")


def layers() -> nn.Sequential:
    """A quantized layer, a float32 panels layer with a bias, another quantized one."""
    torch.manual_seed(0)
    with torch.device("meta"):
        first, second = Linear(64, 48, bias=False), Linear(48, 64, bias=True)
        third = Linear(64, 32, bias=False)
    first.quantize(random_q4(48, 64), torch.float32)
    second.weight = nn.Parameter(torch.randn(64, 48), requires_grad=False)
    second.bias = nn.Parameter(torch.randn(64), requires_grad=False)
    third.quantize(random_q4(32, 64, group=16), torch.float32)
    model = nn.Sequential(first, second, third)
    for layer in model:
        layer.pack("panels")
    return model


def test_moved_layers_compute_the_same_and_read_one_buffer_in_order() -> None:
    model = layers()
    x = torch.randn(5, 64)
    before = model(x)
    moved = place_streamed_weights(model)
    assert torch.equal(model(x), before)  # same bytes, same kernels: bit-identical
    starts = [m.streamed_weight().data_ptr() for m in model]  # type: ignore[union-attr]
    assert starts == sorted(starts)
    assert starts[-1] - starts[0] < moved
    assert all(s % 64 == 0 for s in starts)


def test_the_old_copies_are_freed() -> None:
    model = layers()
    old = [weakref.ref(m.streamed_weight()) for m in model]  # type: ignore[arg-type]
    place_streamed_weights(model)
    assert all(ref() is None for ref in old)  # nothing held them: the process is not 2x at load


def test_a_model_with_nothing_streamed_moves_nothing() -> None:
    assert place_streamed_weights(nn.Sequential(nn.Linear(4, 4))) == 0


def test_the_arena_is_zeroed_and_takes_huge_pages_where_the_kernel_gives_them() -> None:
    fallbacks = thp_fallbacks()
    buffer = huge_page_buffer(6 << 20)
    assert buffer.numel() == 6 << 20 and int(buffer[::4096].sum()) == 0
    buffer.fill_(1)  # touch every page
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    if thp_fallbacks() > fallbacks:  # asked for, but the kernel had no free 2 MiB page
        pytest.skip("the kernel fell back to 4 KiB pages (thp_fault_fallback rose)")
    start = buffer.data_ptr()
    huge_kb, inside = 0, False
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low <= start < high
        elif inside and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
    assert huge_kb >= 2048


def thp_fallbacks() -> int:
    """Faults in huge-page-advised memory that got 4 KiB pages instead, host-wide (0 unknown)."""
    vmstat = Path("/proc/vmstat")
    lines = vmstat.read_text().splitlines() if vmstat.exists() else []
    return sum(int(line.split()[1]) for line in lines if line.startswith("thp_fault_fallback "))


def test_few_rows_prefetch_is_picked_from_timed_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pick runs one-row products through the kernels that read the flag (the quantized
    layers, and bfloat16 pairs where the CPU has them; not float32 panels), each way, and
    returns the best times; with the times faked to favour one way, then the other, it sets
    the C flag to the faster; layers none of whose kernels read the flag pick nothing."""
    lib = cpu_kernels.library()
    model = list(layers())
    if cpu_kernels.bf16_pairs_available():
        with torch.device("meta"):
            pairs = Linear(64, 32, bias=False)
        pairs.weight = nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16), requires_grad=False)
        pairs.pack("onednn", keep_decode_copy=True)
        model.append(pairs)
    assert len(one_row_matmuls(model)) == len(model) - 1  # all but the float32 panels
    times = pick_few_rows_prefetch(model)
    lib.set_few_rows_prefetch(1)  # the default back, whichever this host picked
    assert set(times) == {"software", "hardware"} and min(times.values()) > 0
    set_to: list[int] = []
    monkeypatch.setattr(lib, "set_few_rows_prefetch", set_to.append)
    for faster, flag in (("software", 1), ("hardware", 0)):
        monkeypatch.setattr(
            "engine.weight_arena.timed_pass_ms",
            lambda passes, flag=flag: 1.0 if set_to[-1] == flag else 2.0,
        )
        assert pick_few_rows_prefetch(model)[faster] == 1.0
        assert set_to[-1] == flag
    assert pick_few_rows_prefetch([model[1]]) == {}
