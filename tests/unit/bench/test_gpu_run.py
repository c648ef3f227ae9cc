"""bench/gpu_run.sh --dry-run: every step of the GPU run on the CPU at tiny sizes (the Triton
interpreter, a 2-layer checkpoint of the full one's layout, both cluster modes), so a broken harness
shows here and not on a lend; and bench/gpu_summary.py's card names and peak bandwidths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_summary import card_slug, peak_bandwidth

ROOT = Path(__file__).resolve().parents[3]
STEPS = ("checkpoint", "parity", "kernels", "serving", "tests", "quant")


def test_card_names_and_their_peak_bandwidths() -> None:
    assert card_slug("NVIDIA H200") == "h200"  # bench/results/gpu-h200/, as the last lend's
    assert card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert card_slug("NVIDIA H100 PCIe\n") == "h100-pcie"
    peaks = {name: peak_bandwidth(name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                                     "NVIDIA H100 NVL", "NVIDIA H200")}  # fmt: skip
    assert {n: p and p["bytes_per_s"] for n, p in peaks.items()} == {
        "NVIDIA H100 80GB HBM3": 3.35e12,
        "NVIDIA H100 PCIe": 2.0e12,
        "NVIDIA H100 NVL": 3.9e12,
        "NVIDIA H200": 4.8e12,
    }
    assert peak_bandwidth("cpu") is None


@pytest.mark.long
def test_the_dry_run_runs_every_step_and_writes_what_a_lend_returns(
    tmp_path: Path, smollm2_path: Path
) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "bench/gpu_run.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    out = tmp_path / "gpu-cpu-dry-run"
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu.txt", "steps.txt", "parity.json", "kernels.json", "serving.json",
                            "kernels_quant_gpu.json", "summary.md", "logs.tar.gz"])  # fmt: skip
    assert len(files) <= 8  # what a lend brings back
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in steps] == list(STEPS)
    assert all(": exit 0 " in line for line in steps), steps
    parity = json.loads((out / "parity.json").read_text())
    assert parity["ok"] and parity["parity_float32"]["equal"] == 2
    assert [r["batch"] for r in parity["decode_steps"]["graphs_on"]] == [1, 4]
    kernels = json.loads((out / "kernels.json").read_text())
    assert kernels["mode"] == "gpu-dry-run" and kernels["decode_sweep"] and kernels["prefill"]
    serving = json.loads((out / "serving.json").read_text())
    assert sorted(serving["levels"]) == sorted(serving["aggregated_levels"]) == ["1", "2"]
    summary = (out / "summary.md").read_text()
    for section in ("## Kernels", "Small-batch sweep", "## Parity", "## Serving", "## Steps"):
        assert section in summary
