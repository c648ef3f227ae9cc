"""The torch profiler around an engine worker's steps, switched on and off at run time.

POST /start_profile and /stop_profile reach every engine worker (common/protocol.py `Profile`).
Between the two, torch records each operator the worker's steps run; on stop the worker writes
two files into the configured directory: a Chrome trace (`<worker>-<time>.pt.trace.json.gz`,
for chrome://tracing or Perfetto) and the operator table sorted by self time
(`<worker>-<time>.ops.txt`, the same table vLLM writes as `profiler_out.txt`), which is what
bench/peers.py sets beside vLLM's to say where a step's time goes in each server.
"""

from __future__ import annotations

import gzip
import shutil
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from common.protocol import Profile, ProfileDone

TABLE_ROWS = 40


class ProfilingError(RuntimeError):
    """A command that does not fit the profiler's state (start twice, stop when off)."""


class EngineProfiler:
    def __init__(self, directory: str | None, name: str, device: str) -> None:
        self.directory = Path(directory).expanduser() if directory else None
        self.name = name
        self.activities = [ProfilerActivity.CPU]
        if device == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.session: profile | None = None

    @property
    def running(self) -> bool:
        return self.session is not None

    def start(self) -> None:
        if self.directory is None:
            raise ProfilingError("profiling is off (profiler_dir is not set)")
        if self.session is not None:
            raise ProfilingError("the profiler is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.session = profile(activities=self.activities)
        self.session.start()

    def stop(self) -> list[str]:
        """End the session and write its trace and table; returns their paths."""
        if self.session is None or self.directory is None:
            raise ProfilingError("the profiler is not running")
        session, self.session = self.session, None
        session.stop()
        stem = self.directory / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        trace = stem.with_name(stem.name + ".pt.trace.json")
        session.export_chrome_trace(str(trace))
        with trace.open("rb") as plain, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(plain, packed)
        trace.unlink()
        sort_by = "self_cuda_time_total" if len(self.activities) > 1 else "self_cpu_time_total"
        table = session.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        ops = stem.with_name(stem.name + ".ops.txt")
        ops.write_text(table + "\n")
        return [f"{trace}.gz", str(ops)]

    def answer(self, command: Profile) -> ProfileDone:
        """Carry out a Profile command; what went wrong goes back in the answer, not raised."""
        try:
            files = self.stop() if command.action == "stop" else []
            if command.action == "start":
                self.start()
        except (ProfilingError, OSError) as exc:
            return ProfileDone(action=command.action, errors=[f"{self.name}: {exc}"])
        return ProfileDone(action=command.action, workers=[self.name], files=files)

    def close(self) -> None:
        """A worker shutting down mid-session: stop recording, write nothing."""
        if self.session is not None:
            self.session.stop()
            self.session = None
