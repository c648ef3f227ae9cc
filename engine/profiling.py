"""The torch profiler around an engine worker's steps, switched on and off at run time.

POST /start_profile and /stop_profile reach every engine worker (`Profile` in common/protocol/).
Between the two (and for at most `profiler.max_steps` steps), torch records each operator the
worker's steps run; then the worker writes two files into `profiler.dir`: a Chrome trace
(`<worker>-<time>.pt.trace.json.gz`, for chrome://tracing or Perfetto) and the operator table
sorted by self time (`<worker>-<time>.ops.txt`, in the layout of the table vLLM writes as
`profiler_out.txt`), which bench/peers.py sets beside vLLM's.

Why bounded, and why the table is not torch's `key_averages`: torch's stop and trace export run
in C++ holding the GIL, about 10 ms per SmolLM2 step recorded (a 400-step session held it over
5 s in a worker, and the orchestrator declared that worker dead: its heartbeat thread could not
run), and key_averages takes ~25 s more per 250 steps with holds of over a second. So recording
ends after `max_steps` steps (100 by default: ~1 s; vLLM bounds its sessions the same way), and
the table is summed from the exported trace on a thread in plain Python, which lets the
heartbeat in; `poll()` hands the worker its answer when
the files are complete, while the worker goes on serving.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from pathlib import Path

import msgspec
from torch.profiler import ProfilerActivity, profile

from common.protocol import Profile, ProfileDone

TABLE_ROWS = 50  # as vLLM's CPU table
TABLE_EVENTS = ("cpu_op", "user_annotation")


class ProfilingError(RuntimeError):
    """A command that does not fit the profiler's state (start twice, stop when off)."""


class EngineProfiler:
    def __init__(self, directory: str | None, name: str, device: str, max_steps: int) -> None:
        self.directory = Path(directory).expanduser() if directory else None
        self.name = name
        self.max_steps = max_steps
        self.activities = [ProfilerActivity.CPU]
        if device == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.session: profile | None = None
        self.steps = 0
        self.writer: threading.Thread | None = None
        self.written: ProfileDone | None = None  # the writer's answer, for the stop command
        self.stop_asked = False

    @property
    def running(self) -> bool:
        return self.session is not None

    def answer(self, command: Profile) -> ProfileDone | None:
        """Carry out a Profile command: the answer, or None for a stop whose files are being
        written (poll() gives it later). What went wrong goes back in the answer, not raised."""
        try:
            if command.action == "start":
                self.start()
            else:
                self.stop()
                return None
        except (ProfilingError, OSError) as exc:
            return ProfileDone(action=command.action, errors=[f"{self.name}: {exc}"])
        return ProfileDone(action=command.action, workers=[self.name])

    def step_done(self) -> None:
        """After each engine step: end the recording once it holds `max_steps` steps."""
        if self.session is not None:
            self.steps += 1
            if self.steps >= self.max_steps:
                self._end_recording()

    def poll(self) -> ProfileDone | None:
        """The answer to the stop command, once it was asked and the files are complete."""
        if not self.stop_asked or self.writer is None or self.writer.is_alive():
            return None
        self.writer, self.stop_asked = None, False
        done, self.written = self.written, None
        return done

    def start(self) -> None:
        if self.directory is None:
            raise ProfilingError("profiling is off (profiler.dir is not set)")
        if self.session is not None or self.writer is not None:
            raise ProfilingError("the profiler is already running (or its session is not stopped)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.steps = 0
        self.session = profile(activities=self.activities)
        self.session.start()

    def stop(self) -> None:
        """End the recording if it still runs; the answer waits for its files."""
        if self.stop_asked or (self.session is None and self.writer is None):
            raise ProfilingError("the profiler is not running")
        self.stop_asked = True
        if self.session is not None:
            self._end_recording()

    def _end_recording(self) -> None:
        assert self.session is not None and self.directory is not None
        session, self.session = self.session, None
        session.stop()
        stem = self.directory / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        trace = stem.with_name(stem.name + ".pt.trace.json")
        session.export_chrome_trace(str(trace))
        self.writer = threading.Thread(
            target=self._write, args=(trace, stem), name="profile-writer", daemon=True
        )
        self.writer.start()

    def _write(self, trace: Path, stem: Path) -> None:
        try:
            raw = trace.read_bytes()
            packed = trace.with_name(trace.name + ".gz")
            packed.write_bytes(gzip.compress(raw, compresslevel=1))
            trace.unlink()
            ops = stem.with_name(stem.name + ".ops.txt")
            events = msgspec.json.decode(raw)["traceEvents"]
            ops.write_text(op_table(events) + "\n")
        except (OSError, msgspec.DecodeError, KeyError) as exc:
            self.written = ProfileDone(action="stop", errors=[f"{self.name}: {exc}"])
            return
        files = [str(packed), str(ops)]
        self.written = ProfileDone(action="stop", workers=[self.name], files=files)

    def close(self) -> None:
        """A worker shutting down mid-session: stop recording, write nothing."""
        if self.session is not None:
            self.session.stop()
            self.session = None


def op_table(events: list[dict]) -> str:
    """Operators by self CPU time, in the layout of torch's `key_averages().table()` (the one
    vLLM writes): self time is an event's duration less that of the events directly inside it
    on the same thread."""
    spans = sorted(
        ((e["pid"], e["tid"], float(e["ts"]), float(e["dur"]), e["name"])
         for e in events if e.get("ph") == "X" and e.get("cat") in TABLE_EVENTS),
        key=lambda span: (span[0], span[1], span[2], -span[3]),  # a parent before its children
    )  # fmt: skip
    self_us: dict[str, float] = defaultdict(float)
    total_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    open_spans: list[tuple[tuple[object, object], float, str]] = []  # (thread, end, name)
    for pid, tid, ts, dur, name in spans:
        thread = (pid, tid)
        while open_spans and (open_spans[-1][0] != thread or open_spans[-1][1] <= ts):
            open_spans.pop()
        if open_spans:
            self_us[open_spans[-1][2]] -= dur  # the parent's self time excludes this child
        self_us[name] += dur
        total_us[name] += dur
        calls[name] += 1
        open_spans.append((thread, ts + dur, name))
    whole = sum(self_us.values()) or 1.0
    names = sorted(self_us, key=lambda n: -self_us[n])[:TABLE_ROWS]
    width = max([len("Name"), *(len(n) for n in names)])
    columns = ("Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "# of Calls")
    ruler = "  ".join(["-" * width, *("-" * 12 for _ in columns)]) + "  "
    lines = [ruler, "  ".join([f"{'Name':>{width}}", *(f"{c:>12}" for c in columns)]) + "  ", ruler]
    for n in names:
        cells = (f"{100 * self_us[n] / whole:.2f}%", _duration(self_us[n]),
                 f"{100 * total_us[n] / whole:.2f}%", _duration(total_us[n]),
                 _duration(total_us[n] / calls[n]), str(calls[n]))  # fmt: skip
        lines.append("  ".join([f"{n:>{width}}", *(f"{c:>12}" for c in cells)]) + "  ")
    lines += [ruler, f"Self CPU time total: {_duration(whole)}"]
    return "\n".join(lines)


def _duration(us: float) -> str:
    """torch's table format: 1.234s, 12.345ms or 123.456us."""
    if us >= 1e6:
        return f"{us / 1e6:.3f}s"
    if us >= 1e3:
        return f"{us / 1e3:.3f}ms"
    return f"{us:.3f}us"
