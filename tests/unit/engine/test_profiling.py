"""engine/profiling.py: the torch profiler switched on and off around real engine steps."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common.protocol import Profile, ProfileDone
from common.sampling_params import SamplingParams
from engine.kernels import cpu_kernels
from engine.llm import LLM
from engine.profiling import EngineProfiler, op_table


def answer_of_stop(profiler: EngineProfiler) -> ProfileDone:
    assert profiler.answer(Profile(action="stop")) is None  # written on a thread
    deadline = time.monotonic() + 120
    while (done := profiler.poll()) is None:
        assert time.monotonic() < deadline, "the profile was not written in time"
        time.sleep(0.05)
    assert profiler.poll() is None  # answered once
    return done


def test_a_session_writes_a_trace_and_the_op_table_of_the_steps_it_saw(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    llm = LLM(str(tiny_model_path))
    profiler = EngineProfiler(str(tmp_path / "traces"), "gen-0", "cpu", max_steps=1000)
    assert profiler.answer(Profile(action="start")) == ProfileDone(
        action="start", workers=["gen-0"]
    )
    llm.generate(["profiled"], SamplingParams(max_tokens=3, temperature=0.0))
    done = answer_of_stop(profiler)
    assert done.workers == ["gen-0"] and not done.errors and not profiler.running
    trace, table = (Path(f) for f in done.files)
    assert trace.name.startswith("gen-0-") and trace.name.endswith(".pt.trace.json.gz")
    assert trace.parent == tmp_path / "traces"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    matmuls = ("aten::mm", "mkldnn", "cpu_kernels::panel_linear")  # torch's, or the C kernel's
    assert any(e.get("name", "").startswith(matmuls) for e in events)
    ops = table.read_text()
    assert table.name.endswith(".ops.txt") and "Self CPU" in ops and "aten::" in ops
    if cpu_kernels.library() is not None:  # the C kernels' ctypes calls are counted too
        # decode runs as one C step per batch (or, off that path, per-op kernels)
        decode = ("cpu_kernels::decode_step", "cpu_kernels::paged_decode")
        assert any(name in ops for name in decode) and "cpu_kernels::rms_norm" in ops


def test_recording_ends_by_itself_after_max_steps_and_stop_then_answers(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    llm = LLM(str(tiny_model_path))
    profiler = EngineProfiler(str(tmp_path), "ctx-0", "cpu", max_steps=2)
    profiler.answer(Profile(action="start"))
    for _ in range(2):
        assert profiler.running
        llm.generate(["one step"], SamplingParams(max_tokens=1, temperature=0.0))
        profiler.step_done()
    assert not profiler.running  # ended at max_steps; its files are written meanwhile
    assert profiler.answer(Profile(action="start")).errors  # not until it is stopped
    done = answer_of_stop(profiler)
    assert done.workers == ["ctx-0"] and len(done.files) == 2
    assert profiler.answer(Profile(action="start")).errors == []  # a new session


def test_commands_that_do_not_fit_the_state_are_answered_with_the_reason(tmp_path: Path) -> None:
    off = EngineProfiler(None, "ctx-0", "cpu", max_steps=10)
    assert off.answer(Profile(action="start")).errors == [
        "ctx-0: profiling is off (profiler.dir is not set)"
    ]
    profiler = EngineProfiler(str(tmp_path), "ctx-0", "cpu", max_steps=10)
    assert profiler.answer(Profile(action="stop")).errors == ["ctx-0: the profiler is not running"]
    assert not profiler.answer(Profile(action="start")).errors
    again = profiler.answer(Profile(action="start"))
    assert again.errors == [
        "ctx-0: the profiler is already running (or its session is not stopped)"
    ]
    profiler.close()  # a worker shutting down mid-session: nothing is written
    assert not profiler.running and list(tmp_path.iterdir()) == []


def test_the_op_table_equals_torchs_own_self_times() -> None:
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(10):
            torch.nn.functional.linear(a, b).relu_()
    torch_self = {e.key: e.self_cpu_time_total for e in session.key_averages()}
    path = Path(__file__).with_name("_trace.json")
    try:
        session.export_chrome_trace(str(path))
        table = op_table(json.loads(path.read_text())["traceEvents"])
    finally:
        path.unlink(missing_ok=True)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if "::" in line}
    assert set(rows) == set(torch_self)
    for name, cells in rows.items():
        ours_us = float(cells[2].removesuffix("us").removesuffix("ms")) * (
            1000 if cells[2].endswith("ms") else 1
        )
        assert abs(ours_us - torch_self[name]) <= 0.01 * torch_self[name] + 1, (name, cells)
    assert int(rows["aten::relu_"][-1]) == 10
