"""The benchmarks end to end on small workloads. bench/serving.py: it starts both clusters, runs
every side of the comparison, and writes the JSON with its stable keys, the plots and the
profile. bench/orchestrator_load.py: the real orchestrator under simulated frontends and workers
routes every request it is sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEVEL_KEYS = {"output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
              "itl_p99_s"}  # fmt: skip
RATIOS = ("pipeline_efficiency", "vs_hf_sequential", "vs_hf_batched", "disagg_vs_agg",
          "prefix_ttft_ratio")  # fmt: skip


ORCHESTRATOR_CELL_KEYS = {"workers", "context_workers", "generation_workers", "postproc_workers",
                          "blocks", "rss_mib", "fill_s", "fill_blocks_per_s", "requests", "routed",
                          "routed_per_s", "routed_per_cpu_s", "orchestrator_cpu", "driver_cpu",
                          "latency_rate_per_s", "route_p50_ms", "route_p99_ms",
                          "decode_route_p50_ms", "decode_route_p99_ms",
                          "hits_to_holder"}  # fmt: skip


def run_bench(module: str, args: list[str], timeout_s: float) -> None:
    """`python -m <module> <args>` to its end; stopped (SIGTERM: each bench stops what it
    started) and failed if it outlives `timeout_s`."""
    command = [sys.executable, "-m", module, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(60)
    assert process.returncode == 0, output.decode(errors="replace")[-3000:]


def test_serving_bench_writes_every_figure(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "latest.json"
    run_bench("bench.serving", ["--concurrency", "1", "2", "--repeats", "1", "--prompt-len", "16",
                                "48", "--output-len", "4", "12", "--hf-sequential-requests", "1",
                                "--out", str(out)], timeout_s=300)  # fmt: skip

    result = json.loads(out.read_text())
    assert set(result["levels"]) == {"1", "2"}
    for figures in [*result["levels"].values(), result["aggregated"]]:
        assert set(figures) == LEVEL_KEYS
        assert figures["output_tokens_per_s"] > 0 and figures["requests_per_s"] > 0
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert 0 < figures["itl_p50_s"] <= figures["itl_p99_s"]
    for key in RATIOS:
        assert result[key] > 0, key
    assert result["headline_concurrency"] == 2 and len(result["pipeline_efficiency_runs"]) == 1
    assert result["engine_output_tokens_per_s"] > 0
    assert result["hf_sequential_output_tokens_per_s"] > 0
    # Ratios are the figures they name, divided.
    cluster = result["levels"]["2"]["output_tokens_per_s"]
    hf_sequential = result["hf_sequential_output_tokens_per_s"]
    assert (
        abs(result["vs_hf_sequential"] - cluster / hf_sequential)
        < 0.01 * result["vs_hf_sequential"] + 0.01
    )

    for name in result["plots"]:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    profile = result["profile"]
    assert {"client", "orchestrator", "fe-0", "ctx-0", "gen-0"} <= set(profile)
    assert profile["gen-0"]["cpu_cores"] > 0 and profile["gen-0"]["samples"] > 0
    assert any("engine/" in name for name in profile["gen-0"]["inclusive"])
    assert (tmp_path / "latest-profile" / "gen-0.txt").stat().st_size > 0


def test_orchestrator_bench_routes_every_request(tmp_path: Path) -> None:
    out = tmp_path / "orchestrator.json"
    run_bench("bench.orchestrator_load", ["--workers", "4", "--blocks", "1000", "--duration-s", "1",
                                          "--latency-s", "0.5", "--window", "32",
                                          "--out", str(out)], timeout_s=60)  # fmt: skip

    result = json.loads(out.read_text())
    assert result["setup"]["curve"] and result["host"]["cpus"] >= 1
    [cell] = result["cells"]
    assert set(cell) == ORCHESTRATOR_CELL_KEYS
    assert (cell["workers"], cell["blocks"]) == (4, 1000)
    assert cell["requests"] == cell["routed"] > 100  # each one sent reached a generation worker
    assert cell["routed_per_s"] > 0 and cell["routed_per_cpu_s"] > 0 and cell["rss_mib"] > 0
    assert 0 < cell["route_p50_ms"] <= cell["route_p99_ms"]
    assert 0 < cell["decode_route_p50_ms"] <= cell["decode_route_p99_ms"]
    assert (tmp_path / result["plot"]).read_bytes().startswith(b"\x89PNG")
