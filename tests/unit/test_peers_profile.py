"""bench/peers.py's reading of torch profiler tables (the one format vLLM and our workers write)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from bench.peers import op_profile


def test_a_real_profiler_table_becomes_ms_per_output_token_by_op() -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(20):
            torch.mm(a, b).relu_()
    averages = session.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=50)
    self_ms = {e.key: e.self_cpu_time_total / 1000 for e in averages}
    total_ms = sum(self_ms.values())
    found = op_profile(table, tokens=10, wall_ms=4 * total_ms)
    top = found["top_ops_ms_per_output_token"]
    assert set(top) == set(self_ms) and "aten::mm" in top
    for name, ms_per_token in top.items():  # the table rounds to about 3 digits
        assert abs(ms_per_token - self_ms[name] / 10) <= 0.01 * self_ms[name] / 10 + 1e-3, name
    assert abs(found["ops_ms_per_output_token"] - total_ms / 10) <= 0.01 * total_ms / 10 + 1e-3
    assert abs(found["ops_share_of_wall"] - 0.25) < 0.01
