"""The orchestrator alone under load: its real process, pinned to one core, driven over its real
ROUTER socket (CURVE on, as in every cluster) by simulated frontends and workers that speak the
real protocol and answer at once (no model). Linux (/proc, sched_setaffinity).

    .venv/bin/python -m bench.orchestrator_load [--workers 8 32 128 512]
        [--blocks 1000 100000 1000000 10000000] [--duration-s 3] [--profile]
        [--out bench/results/orchestrator.json]

The orchestrator is the cluster's one serial stage: each request crosses its loop three times
(GenerateRequest in, PrefillRequest out; PrefillDone in, DecodeRequest out; RequestFinished in),
beside every worker's heartbeats and KV events. Per number of engine workers (half context, half
generation; one postproc worker per 8 of them, at least 2; 2 frontends), one orchestrator is
started, registered with, and its KV-aware index filled through KV events to each size in turn:

- `routed_per_s`: requests through that whole path per second at saturation (closed loop,
  `--window` in flight), and `orchestrator_cpu`, the cores it kept busy meanwhile (about 1.0:
  the orchestrator, not this driver, was the limit); `routed_per_cpu_s`, the same requests per
  second of the orchestrator's CPU time: what one core of its own sustains, also on a host
  whose other processes took part of that core.
- `route_p50_ms` / `route_p99_ms`: a frontend's GenerateRequest sent → the context worker's
  PrefillRequest received; `decode_route_*`: PrefillDone sent → DecodeRequest received. Open
  loop at half the saturated rate; every stamp on this process's monotonic clock.
- `hits_to_holder`: of the requests whose prompt starts with a chain one worker holds, the share
  routed to that worker (the index was consulted; load can outweigh a hit).
- `rss_mib`, `fill_blocks_per_s`: the orchestrator's resident memory with the index at that size,
  and how fast it took in the KV events that filled it.

The workload and the simulated processes: bench/simulated_cluster.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from bench.cluster_profile import cpu_seconds, hot_functions
from bench.simulated_cluster import (
    BLOCK_SIZE,
    CHAIN_BLOCKS,
    CHAINS_PER_MESSAGE,
    FRONTENDS,
    HEARTBEAT_INTERVAL_S,
    HIT_RATIO,
    OUTPUT_TOKENS,
    PROMPT_BLOCKS,
    WAIT_S,
    Simulator,
)
from common.curve import generate_keys

ROOT = Path(__file__).resolve().parents[1]


# --- the orchestrator's process -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class OrchestratorProcess:
    """`python -m orchestrator.main` on a free loopback port with fresh CURVE keys, pinned (with
    its ZeroMQ I/O and ZAP threads) to `core`; stopped with SIGTERM."""

    def __init__(self, workdir: Path, core: int | None) -> None:
        self.keys = generate_keys(workdir / "keys")
        self.address = f"tcp://127.0.0.1:{free_port()}"
        config = workdir / "cluster.yaml"
        # every request handed off (no deflection): the three crossings this bench counts, and
        # the simulated workers answer a decode only after their own PrefillDone
        orchestrator = f'address: "{self.address}", router: kv_aware, max_prefill_queue_size: 0'
        config.write_text(
            f"orchestrator: {{{orchestrator}}}\n"
            f"kv_cache: {{block_size: {BLOCK_SIZE}}}\n"
            f"security: {{keys_dir: {workdir / 'keys'}}}\n"
            "cpu: {pin: false}\n"  # pinned here instead, to one core
        )
        self.log_path = workdir / "orchestrator.log"
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.main", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin, cwd=ROOT,
            )  # fmt: skip
        deadline = time.monotonic() + WAIT_S
        while "listening on" not in self.log_path.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the orchestrator did not start; see {self.log_path}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


# --- the run ------------------------------------------------------------------------------------


def percentile_ms(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1e3, 3)


def driver_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(sim: Simulator, pid: int, args: argparse.Namespace, profile: Path | None) -> dict:
    """Saturated throughput, then latency at half that rate, on the index as it is now."""
    sim.pool = sim.prompts()
    sampler = None
    if profile is not None:
        py_spy = Path(sys.executable).with_name("py-spy")
        sampler = subprocess.Popen(
            [str(py_spy), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
             "--nonblocking", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    driver_cpu, wall = driver_cpu_s(), time.perf_counter()
    saturated = sim.saturate(args.duration_s, args.window, clock=lambda: cpu_seconds(pid))
    driver_cpu, wall = driver_cpu_s() - driver_cpu, time.perf_counter() - wall
    routed_per_s = saturated.routed / saturated.wall_s
    hot = {}
    if sampler is not None and profile is not None:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        sampler.wait(30)
        hot = hot_functions(profile.read_text()) if profile.exists() else {}
    paced = sim.paced(routed_per_s / 2, args.latency_s)
    closed = saturated.load
    hits = paced.hits + closed.hits
    return {
        "requests": closed.submitted + paced.submitted,
        "routed": len(closed.routed_at) + len(paced.routed_at),
        "routed_per_s": round(routed_per_s, 1),
        "routed_per_cpu_s": round(saturated.routed / saturated.clock_s, 1),
        "orchestrator_cpu": round(saturated.clock_s / saturated.wall_s, 3),
        "driver_cpu": round(driver_cpu / wall, 3),
        "latency_rate_per_s": round(routed_per_s / 2, 1),
        "route_p50_ms": percentile_ms(paced.route_s, 50),
        "route_p99_ms": percentile_ms(paced.route_s, 99),
        "decode_route_p50_ms": percentile_ms(paced.decode_route_s, 50),
        "decode_route_p99_ms": percentile_ms(paced.decode_route_s, 99),
        "hits_to_holder": round((paced.hits_to_holder + closed.hits_to_holder) / hits, 3)
        if hits
        else None,
        **({"profile": hot} if hot else {}),
    }


def check_log(orchestrator: OrchestratorProcess) -> None:
    """A worker the orchestrator marked dead (this driver fell behind its heartbeats) would
    make the run a different one: stop."""
    log = orchestrator.log_path.read_text(errors="replace")
    for bad in ("marked dead", "refused", "Traceback"):
        if bad in log:
            raise RuntimeError(f"the orchestrator logged {bad!r}; see {orchestrator.log_path}")


def run_cluster(num_workers: int, args: argparse.Namespace, core: int | None,
                workdir: Path) -> list[dict]:  # fmt: skip
    """One orchestrator and `num_workers` engine workers, measured at each index size."""
    (workdir / str(num_workers)).mkdir()
    orchestrator = OrchestratorProcess(workdir / str(num_workers), core)
    sim = None
    try:
        sim = Simulator(orchestrator.address, orchestrator.keys, num_workers, args.seed)
        sim.register()
        cells = []
        for blocks in sorted(set(args.blocks)):
            added = blocks - sim.num_blocks
            fill_s = sim.fill(blocks)
            check_log(orchestrator)
            cell = {
                "workers": num_workers,
                "context_workers": len(sim.context_workers),
                "generation_workers": len(sim.generation_workers),
                "postproc_workers": len(sim.postprocs),
                "blocks": blocks,
                "rss_mib": round(rss_mib(orchestrator.pid), 1),
                "fill_s": round(fill_s, 2),
                "fill_blocks_per_s": round(added / fill_s),
            }
            profile = workdir / f"profile-{num_workers}-{blocks}.txt" if args.profile else None
            cell.update(measure(sim, orchestrator.pid, args, profile))
            check_log(orchestrator)
            print(json.dumps({k: v for k, v in cell.items() if k != "profile"}), flush=True)
            cells.append(cell)
        return cells
    except BaseException:
        log = orchestrator.log_path.read_text(errors="replace").splitlines()
        print("the orchestrator's log ended with:", *log[-20:], sep="\n", file=sys.stderr)
        raise
    finally:
        if sim is not None:
            sim.close()
        orchestrator.stop()


def host(core: int | None, driver_cores: list[int]) -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.partition(":")[2].strip()
            break
    return {"machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
            "python": platform.python_version(), "zmq": zmq.zmq_version(),
            "orchestrator_core": core, "driver_cores": driver_cores,
            "load_average_at_start": round(os.getloadavg()[0], 2)}  # fmt: skip


def plot(result: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    workers = sorted({c["workers"] for c in cells})
    sizes = sorted({c["blocks"] for c in cells})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("routed_per_cpu_s", axes[0], "routed requests per orchestrator CPU-s"),
              ("route_p99_ms", axes[1], "routing ms at half load: p99, p50 dotted"))  # fmt: skip
    for key, ax, label in panels:
        for color, blocks in enumerate(sizes):
            row = [c for c in cells if c["blocks"] == blocks]
            x = [c["workers"] for c in row]
            ax.plot(x, [c[key] for c in row], marker="o", color=f"C{color}",
                    label=f"{blocks:.0e} cached blocks")  # fmt: skip
            if key == "route_p99_ms":
                ax.plot(x, [c["route_p50_ms"] for c in row], ":", color=f"C{color}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.set_xlabel("engine workers")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for num_workers in workers:
        row = [c for c in cells if c["workers"] == num_workers]
        axes[2].plot([c["blocks"] for c in row], [c["rss_mib"] for c in row], marker="o",
                     label=f"{num_workers} workers")  # fmt: skip
    axes[2].set_xscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("cached blocks in the KV-aware index")
    axes[2].set_ylabel("orchestrator RSS (MiB)")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    cpu = result["host"]["cpu"] or "this host"
    fig.suptitle(f"the orchestrator alone on one core of {cpu}, CURVE on, KV-aware routing")
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--blocks", type=lambda v: int(float(v)), nargs="+",
                        default=[1000, 100_000, 1_000_000, 10_000_000])  # fmt: skip
    parser.add_argument("--duration-s", type=float, default=3.0, help="each saturated run")
    parser.add_argument("--latency-s", type=float, default=2.0, help="each half-load run")
    parser.add_argument("--window", type=int, default=256, help="requests in flight, saturated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="py-spy the saturated runs")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/orchestrator.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the orchestrator on the way out
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1] if len(cores) > 1 else None
    driver_cores = cores[:-1] if core is not None else cores
    os.sched_setaffinity(0, driver_cores)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "benchmark": "orchestrator",
        "host": host(core, driver_cores),
        "setup": {"router": "kv_aware", "curve": True, "block_size": BLOCK_SIZE,
                  "prompt_tokens": PROMPT_BLOCKS * BLOCK_SIZE, "output_tokens": OUTPUT_TOKENS,
                  "hit_ratio": HIT_RATIO, "hit_blocks": CHAIN_BLOCKS, "window": args.window,
                  "duration_s": args.duration_s, "latency_s": args.latency_s,
                  "latency_load": 0.5, "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
                  "frontends": FRONTENDS,
                  "blocks_per_kv_events": CHAINS_PER_MESSAGE * CHAIN_BLOCKS},
        "cells": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="orchestrator-load-") as tmp:
        for num_workers in sorted(set(args.workers)):
            result["cells"] += run_cluster(num_workers, args, core, Path(tmp))
    if not args.no_plot:
        result["plot"] = plot(result, args.out)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
