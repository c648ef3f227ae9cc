"""A real cluster for integration tests: `orchestrator up` on loopback with free ports, talked to
over HTTP, stopped and checked for leftover processes."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from common.curve import ClusterKeys, load_keys
from common.protocol import ClusterInfo
from launcher.run import SERVING
from launcher.run_records import running_clusters

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 10.0  # what `orchestrator up` promises on SIGTERM
MODEL = "builtin:tiny"


# Ports the tests choose come from below Linux's ephemeral range (32768-60999), which the OS
# hands out to every socket bound to port 0 (the cluster's own PULL sockets, UCX listeners):
# a port chosen there and bound a few seconds later could be taken meanwhile. KV-event
# endpoints bind their base port + k, which no check at choosing time covered.
CHOSEN_PORTS = (20_000, 32_000)


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports free now, outside the ephemeral range."""
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(CHOSEN_PORTS[0], CHOSEN_PORTS[1] - count)
        if all(_bindable(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {CHOSEN_PORTS}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Cluster:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def info(self) -> ClusterInfo:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(f"{self.url}/cluster_info", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return msgspec.json.decode(response.read(), type=ClusterInfo)

    def workers(self, role: str) -> list:
        return [w for w in self.info().workers if w.role == role]

    def wait_idle(self, timeout_s: float = 10.0) -> ClusterInfo:
        """The table once every worker has sent a heartbeat since this call began and reports no
        request and no used or leased block; the last table seen if that never happens."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            asked_at = time.monotonic()
            info = self.info()
            busy = [
                w
                for w in info.workers
                if w.role != "orchestrator"
                and (
                    w.last_heartbeat_s >= asked_at - start  # stats from before this call
                    or w.blocks_used
                    or w.blocks_leased
                    or w.active_requests
                )
            ]
            if not busy or time.monotonic() > deadline:
                return info
            time.sleep(0.2)

    def keys(self) -> ClusterKeys:
        """The CURVE keys `orchestrator up` made for this cluster (its run record names them)."""
        (record,) = [r for r in running_clusters() if r.pid == self.process.pid]
        assert record.keys_dir is not None
        return load_keys(Path(record.keys_dir))

    def insider_context(self) -> zmq.Context:
        """A context whose sockets speak CURVE with this cluster's keys (as its processes do);
        terminate it after use."""
        context = zmq.Context()
        keys = self.keys()
        context.curve_publickey = keys.public
        context.curve_secretkey = keys.secret
        context.curve_serverkey = keys.public
        return context

    def log_tail(self, num_chars: int | None = 6000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text if num_chars is None else text[-num_chars:]


def write_config(
    path: Path,
    mode: str,
    extra: str = "",
    frontend: str = "",
    kv_cache: str = "",
    orchestrator: str = "router: kv_aware, worker_timeout_seconds: 5",
    model: str = MODEL,
) -> tuple[Path, int]:
    """cluster.yaml on free loopback ports; `extra`: more top-level keys; `frontend`, `kv_cache`:
    keys added to those sections; `orchestrator`: that section's keys but the address."""
    port = free_port()
    frontend = f", {frontend}" if frontend else ""
    blocks = "" if "num_blocks" in kv_cache else ", num_blocks: 512"  # a test's own, or 512
    kv_cache = f", {kv_cache}" if kv_cache else ""
    path.write_text(
        f"model: {model}\n"
        f"mode: {mode}\n"
        f"frontend: {{host: 127.0.0.1, port: {port}{frontend}}}\n"
        f'orchestrator: {{address: "tcp://127.0.0.1:{free_port()}", {orchestrator}}}\n'
        f"kv_cache: {{block_size: 16{blocks}{kv_cache}}}\n"
        f"postproc_workers: {{count: 2}}\n"
        f"{extra}"
    )
    return path, port


def launch(tmp_path: Path, mode: str, model: str = MODEL, frontend: str = "") -> Cluster:
    """`orchestrator up` on a config of its own in `tmp_path`, once healthy (stopped, and the
    error raised, if it never gets there); the caller stops it."""
    config, port = write_config(tmp_path / f"{mode}.yaml", mode, frontend=frontend, model=model)
    log_path = tmp_path / f"{mode}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "up", str(config)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    cluster = Cluster(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(cluster)
    except BaseException:
        stop(cluster, [])
        raise
    return cluster


def wait_for(condition: Callable[[], object], timeout_s: float, what: str = "") -> float:
    """Seconds until `condition()` held; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def wait_healthy(cluster: Cluster) -> None:
    """Until `orchestrator up` says it serves (every process ready: until then any exit aborts the
    start-up, so a test must not kill one earlier) and /health agrees."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if cluster.process.poll() is not None:
            pytest.fail(
                f"orchestrator up exited with {cluster.process.returncode}:\n{cluster.log_tail()}"
            )
        if SERVING in cluster.log_tail(num_chars=None):
            try:
                with urllib.request.urlopen(f"{cluster.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.5)
    pytest.fail(f"the cluster was not healthy within {START_TIMEOUT_S} s:\n{cluster.log_tail()}")


def stop(cluster: Cluster, pids: list[int]) -> None:
    """SIGTERM the supervisor; it must be gone, with every process it started, in time."""
    cluster.process.send_signal(signal.SIGTERM)
    try:
        cluster.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(cluster.process.pid, signal.SIGKILL)
        cluster.process.wait(5)
        pytest.fail(f"orchestrator up did not stop within {STOP_TIMEOUT_S} s")
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: its parent (now gone) never reaped it
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def hf_greedy_texts(model_path: Path, prompts: list[str], max_new_tokens: int) -> dict[str, str]:
    """The reference for greedy parity: Hugging Face `generate`, one prompt at a time, decoded
    as the server decodes. Imports torch only when called (the harness itself is torch-free)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        texts[prompt] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return texts
