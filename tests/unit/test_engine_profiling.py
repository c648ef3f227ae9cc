"""engine/profiling.py: the torch profiler switched on and off around real engine steps."""

from __future__ import annotations

import time
from pathlib import Path

from common.protocol import Profile, ProfileDone
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.profiling import EngineProfiler


def test_a_session_writes_a_trace_and_the_op_table_of_the_steps_it_saw(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    llm = LLM(str(tiny_model_path))
    profiler = EngineProfiler(str(tmp_path / "traces"), "gen-0", "cpu")
    assert profiler.answer(Profile(action="start")) == ProfileDone(
        action="start", workers=["gen-0"]
    )
    assert profiler.running
    llm.generate(["profiled"], SamplingParams(max_tokens=3, temperature=0.0))
    assert profiler.answer(Profile(action="stop")) is None  # written on a thread
    assert not profiler.running
    assert profiler.answer(Profile(action="start")).errors == [
        "gen-0: the last session is still being written"
    ]
    deadline = time.monotonic() + 120
    while (done := profiler.poll()) is None:
        assert time.monotonic() < deadline, "the profile was not written in time"
        time.sleep(0.05)
    assert profiler.poll() is None  # answered once
    assert done.workers == ["gen-0"] and not done.errors
    trace, table = (Path(f) for f in done.files)
    assert trace.name.startswith("gen-0-") and trace.name.endswith(".pt.trace.json.gz")
    assert trace.stat().st_size > 0 and trace.parent == tmp_path / "traces"
    ops = table.read_text()
    assert table.name.endswith(".ops.txt") and "Self CPU" in ops and "aten::" in ops


def test_commands_that_do_not_fit_the_state_are_answered_with_the_reason(tmp_path: Path) -> None:
    off = EngineProfiler(None, "ctx-0", "cpu")
    assert off.answer(Profile(action="start")).errors == [
        "ctx-0: profiling is off (profiler_dir is not set)"
    ]
    profiler = EngineProfiler(str(tmp_path), "ctx-0", "cpu")
    assert profiler.answer(Profile(action="stop")).errors == ["ctx-0: the profiler is not running"]
    assert not profiler.answer(Profile(action="start")).errors
    again = profiler.answer(Profile(action="start"))
    assert again == ProfileDone(action="start", errors=["ctx-0: the profiler is already running"])
    profiler.close()  # a worker shutting down mid-session: nothing is written
    assert not profiler.running and list(tmp_path.iterdir()) == []
