"""The torch profiler around an engine worker's steps, switched on and off at run time.

POST /start_profile and /stop_profile reach every engine worker (common/protocol.py `Profile`).
Between the two, torch records each operator the worker's steps run; on stop the worker writes
two files into the configured directory: a Chrome trace (`<worker>-<time>.pt.trace.json.gz`,
for chrome://tracing or Perfetto) and the operator table sorted by self time
(`<worker>-<time>.ops.txt`, the table vLLM writes as `profiler_out.txt`), which bench/peers.py
sets beside vLLM's to say where each server's time goes.

Writing takes long: torch's `key_averages` walks every recorded event in Python (~20 s for 250
steps of SmolLM2). So a stop ends the recording at once and writes on a thread while the worker
goes on serving; `poll()` hands the worker its answer when the files are complete.
"""

from __future__ import annotations

import gzip
import shutil
import threading
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from common.protocol import Profile, ProfileDone

TABLE_ROWS = 50  # as vLLM's CPU table


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
        self.writer: threading.Thread | None = None
        self.written: ProfileDone | None = None  # the writer's answer, until poll() takes it

    @property
    def running(self) -> bool:
        return self.session is not None

    def answer(self, command: Profile) -> ProfileDone | None:
        """Carry out a Profile command: the answer, or None for a stop that is writing (poll()
        gives it later). What went wrong goes back in the answer, not raised."""
        try:
            if command.action == "start":
                self.start()
            else:
                self.stop()
                return None
        except (ProfilingError, OSError) as exc:
            return ProfileDone(action=command.action, errors=[f"{self.name}: {exc}"])
        return ProfileDone(action=command.action, workers=[self.name])

    def poll(self) -> ProfileDone | None:
        """The answer to the last stop, once its files are written (else None)."""
        if self.writer is None or self.writer.is_alive():
            return None
        self.writer = None
        done, self.written = self.written, None
        return done

    def start(self) -> None:
        if self.directory is None:
            raise ProfilingError("profiling is off (profiler_dir is not set)")
        if self.session is not None:
            raise ProfilingError("the profiler is already running")
        if self.writer is not None:
            raise ProfilingError("the last session is still being written")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.session = profile(activities=self.activities)
        self.session.start()

    def stop(self) -> None:
        """End the recording now; its trace and table are written on a thread."""
        if self.session is None or self.directory is None:
            raise ProfilingError("the profiler is not running")
        session, self.session = self.session, None
        session.stop()
        stem = self.directory / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.writer = threading.Thread(
            target=self._write, args=(session, stem), name="profile-writer", daemon=True
        )
        self.writer.start()

    def _write(self, session: profile, stem: Path) -> None:
        try:
            trace = stem.with_name(stem.name + ".pt.trace.json")
            session.export_chrome_trace(str(trace))
            with trace.open("rb") as plain, gzip.open(f"{trace}.gz", "wb") as packed:
                shutil.copyfileobj(plain, packed)
            trace.unlink()
            sort_by = "self_cuda_time_total" if len(self.activities) > 1 else "self_cpu_time_total"
            table = session.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
            ops = stem.with_name(stem.name + ".ops.txt")
            ops.write_text(table + "\n")
        except OSError as exc:
            self.written = ProfileDone(action="stop", errors=[f"{self.name}: {exc}"])
            return
        self.written = ProfileDone(
            action="stop", workers=[self.name], files=[f"{trace}.gz", str(ops)]
        )

    def close(self) -> None:
        """A worker shutting down mid-session: stop recording, write nothing."""
        if self.session is not None:
            self.session.stop()
            self.session = None
