"""The cluster across hosts: every role in a network namespace of its own (tests/integration/
netns.py), each process started there by hand as on bare metal (`python -m <role>.main`, bound on
0.0.0.0, `--advertise-host` its address, the CURVE keys from `security.keys_dir`), KV over NIXL
on UCX's TCP transport between the hosts, and the test itself the client, from a host of its own.

    orch 10.213.0.2   orchestrator            gen0 10.213.0.4   gen-0
    ctx0 10.213.0.3   ctx-0                   gen1 10.213.0.5   gen-1
    pp0  10.213.0.6   pp-0                    fe0  10.213.0.7   fe-0       client 10.213.0.8

Then a host is cut off (its link down) mid-stream or between a prefill and its pull, and the
cluster must end or finish every request, take the host back once its link is up, and hold no
block or request for what was lost. Greedy parity is in the fast suite; the two partitions
(about 30 s together, the cut-off of a generation host held for PARTITION_S) are `long`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from common.curve import generate_keys
from common.protocol import WorkerInfo
from tests.integration.harness import (
    MODEL,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Cluster,
    hf_greedy_texts,
    wait_for,
)
from tests.integration.netns import NetnsBed, netns_bed
from tools.tiny_model.build import TEST_PROMPTS

HOSTS = ["orch", "ctx0", "gen0", "gen1", "pp0", "fe0", "client"]
ROLES = [  # (host, worker id, module); the orchestrator first: the others register with it
    ("orch", "orchestrator", "orchestrator.main"),
    ("ctx0", "ctx-0", "context_worker.main"),
    ("gen0", "gen-0", "generation_worker.main"),
    ("gen1", "gen-1", "generation_worker.main"),
    ("pp0", "pp-0", "postproc_worker.main"),
    ("fe0", "fe-0", "frontend.main"),
]
ORCHESTRATOR_PORT = 5550  # every host has its own ports: fixed ones cannot collide
FRONTEND_PORT = 8000
WORKER_TIMEOUT_S = 3.0
LEASE_S = 5.0
PULL_TIMEOUT_S = 2.0
ERROR_WITHIN_S = WORKER_TIMEOUT_S + 3.0  # a partitioned worker's streams end by then
REJOIN_WITHIN_S = 30.0
MAX_NEW = 24
LONG_TOKENS = 3000  # a stream still running when its host is cut off
SHORT_TOKENS = 300  # one that finishes while the other host is cut off
# Long past the worker timeout, as real outages are: TCP then backs off retransmitting to the
# lost host, and what the orchestrator queued to it arrives seconds after the link is back.
PARTITION_S = 16.0
CUT_PROMPT = "Handed off, then cut off before the read. " * 4  # in no cache yet
HOST_OF = {worker_id: host for host, worker_id, _ in ROLES}
# The namespaces share one kernel: left alone, UCX would move KV between them by shared memory
# or CMA, which no two real hosts can and which no partition stops.
UCX_ENV = {"UCX_TLS": "tcp"}


def write_config(path: Path, bed: NetnsBed, keys_dir: Path) -> Path:
    """One cluster.yaml for every host: each process binds the wildcard and is told its own
    address with --advertise-host."""
    path.write_text(
        f"model: {MODEL}\n"
        "mode: disaggregated\n"
        "internal_host: 0.0.0.0\n"
        f"frontend: {{host: 0.0.0.0, port: {FRONTEND_PORT}}}\n"
        f'orchestrator: {{address: "tcp://{bed.address("orch")}:{ORCHESTRATOR_PORT}", '
        f'bind: "tcp://0.0.0.0:{ORCHESTRATOR_PORT}", router: round_robin, '
        f"worker_timeout_seconds: {WORKER_TIMEOUT_S}, heartbeat_interval_seconds: 0.25}}\n"
        "kv_cache: {block_size: 16, num_blocks: 512}\n"
        "generation_workers: {count: 2}\n"
        "postproc_workers: {count: 1}\n"
        f"transfer: {{lease_seconds: {LEASE_S}, pull_timeout_seconds: {PULL_TIMEOUT_S}}}\n"
        f"security: {{keys_dir: {keys_dir}}}\n"
        # one engine per "host", yet all on this machine's cores: no pinning to the same one
        "cpu: {pin: false, threads_per_engine: 1}\n"
    )
    return path


def start_role(
    bed: NetnsBed, host: str, worker_id: str, module: str, config: Path, log: IO[bytes]
) -> subprocess.Popen[bytes]:
    """One process of the cluster on its host, as an operator starts it there."""
    argv = [sys.executable, "-m", module, "--config", str(config)]
    if module != "orchestrator.main":
        argv += ["--worker-id", worker_id, "--advertise-host", bed.address(host)]
    env = {**os.environ, **UCX_ENV}
    return subprocess.Popen(
        bed.command(host, argv), stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,
    )  # fmt: skip


def wait_serving(cluster: Cluster, processes: list[subprocess.Popen[bytes]]) -> None:
    """Until every worker is ready and /health says 200; fails early when a process exits."""
    expected = {worker_id for _, worker_id, _ in ROLES} - {"orchestrator"}
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            pytest.fail(f"a process exited during start-up:\n{cluster.log_tail()}")
        try:
            ready = {w.worker_id for w in cluster.info().workers if w.state == "ready"}
            if expected <= ready and httpx.get(f"{cluster.url}/health", timeout=2).is_success:
                return
        except (OSError, httpx.HTTPError):
            pass  # the frontend is not up yet
        time.sleep(0.5)
    pytest.fail(f"not serving within {START_TIMEOUT_S} s:\n{cluster.log_tail()}")


def stop_all(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    """SIGINT each (stop now: SIGTERM would drain the workers), wait, SIGKILL what is left;
    the pids that needed the SIGKILL."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    killed = []
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
            killed.append(process.pid)
    return killed


@pytest.fixture(scope="module")
def bed() -> Iterator[NetnsBed]:
    with netns_bed(HOSTS) as bed:
        yield bed


@pytest.fixture(scope="module")
def cluster(
    bed: NetnsBed, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[Cluster]:
    """The cluster over the hosts, with this test process on the client host throughout."""
    tmp = tmp_path_factory.mktemp("multi-host")
    keys_dir = tmp / "keys"
    generate_keys(keys_dir)  # on bare metal: `orchestrator keys`, copied to every host
    config = write_config(tmp / "cluster.yaml", bed, keys_dir)
    log_path = tmp / "cluster.log"
    processes: list[subprocess.Popen[bytes]] = []
    with log_path.open("ab") as log, bed.inside("client"):
        try:
            for host, worker_id, module in ROLES:
                processes.append(start_role(bed, host, worker_id, module, config, log))
            url = f"http://{bed.address('fe0')}:{FRONTEND_PORT}"
            cluster = Cluster(url, processes[0], log_path)
            wait_serving(cluster, processes)
            yield cluster
        finally:
            killed = stop_all(processes)
    assert not killed, f"processes that ignored SIGINT: {killed}"


@pytest.fixture(scope="module")
def hf_texts(tiny_model_path: Path) -> dict[str, str]:
    return hf_greedy_texts(tiny_model_path, [*TEST_PROMPTS, CUT_PROMPT], MAX_NEW)


# --- helpers --------------------------------------------------------------------------------------


def complete(cluster: Cluster, prompt: str, max_tokens: int = MAX_NEW) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def worker(cluster: Cluster, worker_id: str) -> WorkerInfo:
    rows = [w for w in cluster.info().workers if w.worker_id == worker_id]
    assert rows, f"{worker_id} is not listed"
    return rows[0]


def state(cluster: Cluster, worker_id: str) -> str:
    """ready, stalled, dead, or forgotten (dead so long that its record was dropped)."""
    rows = [w.state for w in cluster.info().workers if w.worker_id == worker_id]
    return rows[0] if rows else "forgotten"


def assert_nothing_held(cluster: Cluster) -> None:
    """No request in the table, and no worker holding a block, a lease or a request."""
    info = cluster.wait_idle(timeout_s=LEASE_S + 10)
    assert info.num_requests == 0, info
    for w in info.workers:
        if w.role != "orchestrator":
            assert (w.blocks_used, w.blocks_leased, w.active_requests) == (0, 0, 0), w


def report(case: str, error_s: float | str, rejoin_s: float) -> None:
    """One row of the table in the issue note (run with -s to see them)."""
    error = f"{error_s:.1f} s" if isinstance(error_s, float) else error_s
    print(f"\n| {case} | {error} | {rejoin_s:.1f} s |")


def other_generation_worker(worker_id: str) -> str:
    return {"gen-0": "gen-1", "gen-1": "gen-0"}[worker_id]


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """SIGSTOP the processes for the block (SIGCONT on the way out, whatever happens)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


class Stream:
    """A streamed completion read in a thread: its data payloads with their arrival times."""

    def __init__(self, cluster: Cluster, prompt: str, max_tokens: int) -> None:
        self.events: list[tuple[str, float]] = []
        self.started = threading.Event()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(cluster, body))
        self.thread.start()

    def _read(self, cluster: Cluster, body: dict) -> None:
        url = f"{cluster.base_url}/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append((line[6:], time.monotonic()))
                    self.started.set()

    @property
    def error_at(self) -> float | None:
        """When its final error frame came, if it ended with one."""
        if len(self.events) >= 2 and self.events[-1][0] == "[DONE]":
            payload, at = self.events[-2]
            return at if payload.startswith('{"error"') else None
        return None

    @property
    def completed(self) -> bool:
        return bool(self.events) and self.events[-1][0] == "[DONE]" and self.error_at is None


def start_on(cluster: Cluster, prompt: str, max_tokens: int) -> tuple[Stream, str]:
    """A stream, and the generation worker it decodes on: the one the orchestrator routed one
    more request to (a total, so a stream finishing meanwhile elsewhere cannot hide it)."""

    def routed() -> dict[str, int]:
        return {w.worker_id: w.requests_routed for w in cluster.workers("generation")}

    before = routed()
    stream = Stream(cluster, prompt, max_tokens)
    assert stream.started.wait(30), "no first token"
    # the first token may reach the client before the orchestrator has chosen its decoder
    wait_for(lambda: sum(routed().values()) > sum(before.values()), 10, "routed to a decoder")
    after = routed()
    gens = [worker_id for worker_id in after if after[worker_id] > before.get(worker_id, 0)]
    assert len(gens) == 1, f"not one generation worker took the stream: {before} -> {after}"
    return stream, gens[0]


# --- tests ----------------------------------------------------------------------------------------


def test_greedy_completions_across_hosts_match_hf_generate(
    bed: NetnsBed, cluster: Cluster, hf_texts: dict[str, str]
) -> None:
    """Prompts through the frontend on its own host, prefilled on one host and decoded on two
    others (the KV read over TCP), give Hugging Face's greedy text; the workers registered the
    addresses of their own hosts."""
    pulled_before = sum(w.kv_bytes_pulled for w in cluster.workers("generation"))
    texts: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda p=prompt: texts.update({p: complete(cluster, p)}))
        for prompt in TEST_PROMPTS
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert texts == {prompt: hf_texts[prompt] for prompt in TEST_PROMPTS}
    time.sleep(0.5)  # the next heartbeats carry the stats
    assert sum(w.kv_bytes_pulled for w in cluster.workers("generation")) > pulled_before
    postproc = worker(cluster, "pp-0")  # where the generation workers push its token batches
    assert postproc.address.startswith(f"tcp://{bed.address('pp0')}:"), postproc
    frontend = worker(cluster, "fe-0")
    assert frontend.address == f"http://{bed.address('fe0')}:{FRONTEND_PORT}", frontend


@pytest.mark.long
def test_a_generation_host_cut_off_mid_stream_fails_its_streams_and_rejoins(
    bed: NetnsBed, cluster: Cluster
) -> None:
    """Its streams end with an error once the orchestrator stops hearing from it (the worker
    timeout); the other worker's streams finish untouched; once its link is back the same
    process is taken back (when what was queued to it has got through), serves at once, and
    nothing of the lost streams is held anywhere."""
    assert_nothing_held(cluster)
    first, target = start_on(cluster, "Cut off mid-stream. ", max_tokens=LONG_TOKENS)
    # round robin: the next streams alternate between the other worker and this one
    streams: dict[str, list[Stream]] = {target: [first]}
    for i in range(3):
        expected = target if i % 2 else other_generation_worker(target)
        length = LONG_TOKENS if expected == target else SHORT_TOKENS
        stream, gen = start_on(cluster, f"Stream {i} across hosts. ", max_tokens=length)
        assert gen == expected, f"round robin sent stream {i} to {gen}, not {expected}"
        streams.setdefault(gen, []).append(stream)
    victims, bystanders = streams.pop(target), next(iter(streams.values()))
    host, pid = HOST_OF[target], worker(cluster, target).pid
    cut_at = time.monotonic()
    bed.link_down(host)
    try:
        for stream in victims:
            stream.thread.join(ERROR_WITHIN_S + 10)
            assert stream.error_at is not None, stream.events[-3:]
            assert stream.error_at - cut_at < ERROR_WITHIN_S, stream.error_at - cut_at
            assert target in stream.events[-2][0]  # the error names the lost worker
        assert state(cluster, target) == "dead"
        for stream in bystanders:
            stream.thread.join(60)
            assert stream.completed, stream.events[-3:]
        time.sleep(max(0.0, cut_at + PARTITION_S - time.monotonic()))
    finally:
        bed.link_up(host)
    log_start = len(cluster.log_tail(num_chars=None))
    rejoin_s = wait_for(lambda: state(cluster, target) == "ready", REJOIN_WITHIN_S, "rejoined")
    assert worker(cluster, target).pid == pid  # the same process, taken back
    generated_before = worker(cluster, target).generation_tokens
    for i in range(2):  # round robin: one of the two decodes on the worker that rejoined
        sent_at = time.monotonic()
        assert complete(cluster, f"Served after the partition, request {i}. ", max_tokens=4)
        assert time.monotonic() - sent_at < LEASE_S  # nothing sent to it sat in a backlog
    wait_for(lambda: worker(cluster, target).generation_tokens > generated_before, 5, "served")
    assert_nothing_held(cluster)
    assert "lease expired" not in cluster.log_tail(num_chars=None)[log_start:]  # read in time
    error_s = max(v.error_at or 0 for v in victims) - cut_at
    report("generation host cut off mid-stream", error_s, rejoin_s)


@pytest.mark.long
def test_a_context_host_cut_off_between_prefill_and_pull(
    bed: NetnsBed, cluster: Cluster, hf_texts: dict[str, str]
) -> None:
    """The reader cannot reach the blocks it was handed: it gives up at the pull timeout and
    prefills the prompt itself (the same greedy text); once the link is back the context worker
    is taken back, its lease is gone, and KV is read from it again."""
    assert_nothing_held(cluster)
    recomputed_before = sum(w.prompts_recomputed for w in cluster.workers("generation"))
    result: dict[str, str] = {}
    sender = threading.Thread(target=lambda: result.update(text=complete(cluster, CUT_PROMPT)))
    with stopped([w.pid for w in cluster.workers("generation")]):  # the reader comes late
        sender.start()
        wait_for(lambda: worker(cluster, "ctx-0").blocks_leased > 0, 5, "prefilled, leased")
        cut_at = time.monotonic()
        bed.link_down("ctx0")
    try:
        sender.join(60)
        done_s = time.monotonic() - cut_at
        assert result.get("text") == hf_texts[CUT_PROMPT], result
        wait_for(
            lambda: (
                sum(w.prompts_recomputed for w in cluster.workers("generation")) > recomputed_before
            ),
            5,
            "the prompt prefilled again where it decodes",
        )
        wait_for(lambda: state(cluster, "ctx-0") == "dead", 10, "ctx-0 declared dead")
    finally:
        bed.link_up("ctx0")
    rejoin_s = wait_for(lambda: state(cluster, "ctx-0") == "ready", REJOIN_WITHIN_S, "rejoined")
    assert_nothing_held(cluster)  # the lease ended, on the context host too
    pulled_before = sum(w.kv_bytes_pulled for w in cluster.workers("generation"))
    assert complete(cluster, "Read from the context host again. " * 4)
    wait_for(
        lambda: sum(w.kv_bytes_pulled for w in cluster.workers("generation")) > pulled_before,
        5,
        "a READ from ctx-0",
    )
    assert_nothing_held(cluster)
    outcome = f"none (prefilled again, done {done_s:.1f} s after the cut)"
    report("context host cut off between prefill and pull", outcome, rejoin_s)
