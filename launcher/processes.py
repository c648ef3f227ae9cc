"""Starting, signalling and stopping child processes, each in its own session.

Each child runs in its own session, so a Ctrl-C in the terminal reaches only the launcher, which
then stops the children itself: SIGINT to each process group (stop now: the whole cluster goes, so
a worker has nobody to drain for), a grace period, SIGKILL to what is left. On Linux each child
also gets PR_SET_PDEATHSIG=SIGINT, so it is told to stop even when the launcher itself is killed
with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from launcher.specs import ProcessSpec

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def start_process(spec: ProcessSpec) -> subprocess.Popen[bytes]:
    """`spec`'s command in a new session, told to stop when this process dies."""
    process = subprocess.Popen(
        spec.argv,
        env={**os.environ, **dict(spec.env)} if spec.env else None,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )
    logger.info("started %s (pid %d)", spec.worker_id, process.pid)
    return process


def stop_processes(running: list[tuple[str, subprocess.Popen[bytes]]], timeout_s: float) -> None:
    """SIGINT each (worker id, process)'s group (stop now, no drain), wait up to `timeout_s` in
    all, SIGKILL the rest."""
    for _, process in running:
        signal_group(process, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for worker_id, process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s still running %.0fs after SIGINT: killing it", worker_id, timeout_s)
            signal_group(process, signal.SIGKILL)
            process.wait()
    logger.info("stopped %d processes", len(running))


def describe_exit(process: subprocess.Popen[bytes]) -> str:
    """An ended child's status in an operator's words."""
    if process.returncode < 0:
        return f"was killed by {signal.Signals(-process.returncode).name}"
    return f"exited with code {process.returncode}"


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """The child and whatever it started (start_new_session: its pid is the group id); only while
    it is unreaped, since a reaped child's pid may already name another process group."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn that has Linux send the child SIGINT when the launcher dies, even by SIGKILL.

    PDEATHSIG fires when the forking *thread* ends, so children are started from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGINT)

    return preexec
