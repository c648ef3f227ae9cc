"""bench/peers.py's reading of torch profiler tables (the layout vLLM and our workers write)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from bench.peers import op_profile


def test_a_real_profiler_table_becomes_ms_per_forward_by_op() -> None:
    x, w = torch.randn(4, 64), torch.randn(64, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(10):  # ten "forwards" of three linear layers each
            for _ in range(3):
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").relu_()
    averages = session.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=50)
    self_ms = {e.key: e.self_cpu_time_total / 1000 for e in averages}
    found = op_profile(table, linears_per_forward=3)
    assert found["forwards"] == 10
    top = found["top_ops_ms_per_forward"]
    assert set(top) == set(self_ms) and "mkldnn::_linear_pointwise" in top
    for name, ms in top.items():  # the table rounds to about 3 digits
        assert abs(ms - self_ms[name] / 10) <= 0.01 * self_ms[name] / 10 + 1e-3, name
    total = sum(self_ms.values()) / 10
    assert abs(found["ops_ms_per_forward"] - total) <= 0.01 * total + 1e-3


def test_our_decode_passes_in_c_count_as_one_forward_each() -> None:
    """A decode pass run as one C call shows as `cpu_kernels::decode_step` plus its LM head's
    panel_linear; a prefill pass as 3 linear calls here (linears_per_forward)."""
    from engine.kernels import cpu_kernels

    x, w = torch.randn(4, 64), cpu_kernels.pack_panels(torch.randn(64, 64))
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(2):  # two prefill passes
            for _ in range(3):
                cpu_kernels.panel_linear(x, w, None, 64)
        for _ in range(5):  # five decode passes: the C call (a named range), then the LM head
            with torch.profiler.record_function("cpu_kernels::decode_step"):
                x.relu()
            cpu_kernels.panel_linear(x, w, None, 64)
    table = session.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    assert op_profile(table, linears_per_forward=3)["forwards"] == 7
