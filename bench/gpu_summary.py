"""The GPU run's summary (bench/gpu_run.sh): its JSON files read back into one markdown page,
with the decode step's share of the card's memory bandwidth.

    python -m bench.gpu_summary DIR          # DIR/summary.md: DIR/{kernels,parity,serving}.json
    python -m bench.gpu_summary --slug NAME  # "NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3

Bandwidth: a decode step reads every weight once and the K/V of the batch's contexts, so at one
sequence its floor is (weight bytes + KV bytes) / peak bandwidth. The fraction reached is those
bytes / the step's time / the card's peak from PEAKS (the vendors' datasheet figures), for the
in-process step (parity.json, bench/gpu_parity.py) and for the served inter-token latency at one
client (serving.json: ITL p50 holds the step and the serving path's own time).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# (words all in nvidia-smi's lowercased name, peak bytes/s, what it is); the first match wins
PEAKS: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("h200",), 4.8e12, "H200 (HBM3e), 4.8 TB/s"),
    (("h100", "pcie"), 2.0e12, "H100 PCIe (HBM2e), 2.0 TB/s"),
    (("h100", "nvl"), 3.9e12, "H100 NVL (HBM3), 3.9 TB/s"),
    (("h100",), 3.35e12, "H100 SXM (HBM3), 3.35 TB/s"),
    (("a100", "80gb"), 2.039e12, "A100 80GB SXM (HBM2e), 2.04 TB/s"),
    (("a100",), 1.555e12, "A100 40GB (HBM2), 1.56 TB/s"),
    (("l40s",), 0.864e12, "L40S (GDDR6), 864 GB/s"),
)


def peak_bandwidth(card: str) -> dict[str, Any] | None:
    name = card.lower()
    for words, peak, label in PEAKS:
        if all(w in name for w in words):
            return {"card": card, "bytes_per_s": peak, "source": label}
    return None


def card_slug(card: str) -> str:
    """A results folder's name for the card: nvidia-smi's name, lowercased, less the vendor."""
    name = card.strip().lower().removeprefix("nvidia ").strip()
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-") or "unknown"


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def kernel_sections(kernels: dict[str, Any]) -> list[str]:
    lines = [f"## Kernels ({kernels.get('device')}, {kernels.get('mode')})", ""]
    lines += ["| decode batch | context | splits | triton ms | sdpa ms | triton / sdpa | of copy |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in kernels.get("decode", []):
        ratio, of_copy = r["triton_ms"] / r["sdpa_ms"], pct(r.get("ratio_to_copy"))
        times = f"{r['triton_ms']:.4f} | {r['sdpa_ms']:.4f}"
        lines.append(f"| {r['batch']} | {r['context_len']} | {r['num_splits']} | {times} | "
                     f"{ratio:.2f} | {of_copy} |")  # fmt: skip
    sweep = kernels.get("decode_sweep", [])
    if sweep:
        lines += ["", "Small-batch sweep (CUDA-graph replays, ms; eager in brackets):", "",
                  "| batch | context | heuristic (splits x block_n) | best (splits x block_n) "
                  "| sdpa | heuristic / sdpa | best / sdpa |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in sweep:
            h, b = r["heuristic"], r["best"]
            lines.append(
                f"| {r['batch']} | {r['context_len']} | {r['heuristic_graph_ms']:.4f} "
                f"({h['num_splits']} x {h['block_n']}) [{r['heuristic_eager_ms']:.4f}] | "
                f"{b['graph_ms']:.4f} ({b['num_splits']} x {b['block_n']}) | "
                f"{r['sdpa_graph_ms']:.4f} [{r['sdpa_eager_ms']:.4f}] | "
                f"{r['heuristic_vs_sdpa']:.2f} | {r['best_vs_sdpa']:.2f} |"
            )
    prefill = kernels.get("prefill", [])
    if prefill:
        lines += ["", "| prefill batch | prefix | new | triton ms | sdpa ms | triton / sdpa "
                      "| best tuning (m x n, warps, stages) | best / sdpa |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in prefill:
            b = r.get("best")
            best = (f"{b['ms']:.3f} ({b['block_m']} x {b['block_n']}, {b['num_warps']}, "
                    f"{b['num_stages']}) | {r['best_vs_sdpa']:.2f}") if b else "- | -"  # fmt: skip
            lines.append(f"| {r['batch']} | {r['prefix_len']} | {r['new_tokens']} | "
                         f"{r['triton_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                         f"{r['triton_ms'] / r['sdpa_ms']:.2f} | {best} |")  # fmt: skip
    return lines + [""]


def parity_sections(parity: dict[str, Any], copy_gbps: float | None) -> list[str]:
    """`copy_gbps`: bench/kernels.py's device copy, what the step's rate is read against too."""
    lines = [f"## Parity and decode steps ({parity.get('model')}, {parity.get('device')})", ""]
    for dtype in ("float32", "bfloat16"):
        p = parity.get(f"parity_{dtype}")
        if p:
            extra = ""
            if "graphs_off_vs_on" in p:
                g = p["graphs_off_vs_on"]
                extra = f"; graphs off vs on: {g['equal']} of {g['prompts']} equal"
            lines.append(f"- {dtype}: {p['equal']} of {p['prompts']} prompts token for token "
                         f"equal to transformers (first differences {p['first_difference']}); "
                         f"graphs {p['graphs']}{extra}")  # fmt: skip
    steps = parity.get("decode_steps", {})
    on, off = steps.get("graphs_on", []), steps.get("graphs_off", [])
    if on:
        peak = parity.get("peak_bandwidth") or {}
        lines += ["", f"Decode step, bfloat16 (peak: {peak.get('source', 'unknown card')}):", "",
                  "| batch | graphs on | graphs off | GB/s (on) | of peak | of copy |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for i, r in enumerate(on):
            off_ms = f"{off[i]['step_ms']:.2f} ms" if i < len(off) else "-"
            of_peak = pct(r.get("fraction_of_peak"))
            of_copy = pct(r["gbps"] / copy_gbps if copy_gbps else r.get("fraction_of_copy"))
            lines.append(f"| {r['batch']} | {r['step_ms']:.2f} ms | {off_ms} | {r['gbps']:.0f} | "
                         f"{of_peak} | {of_copy} |")  # fmt: skip
    return lines + [""]


def serving_sections(serving: dict[str, Any], parity: dict[str, Any] | None) -> list[str]:
    lines = [f"## Serving ({serving.get('model')}, {serving.get('device')})", "",
             "| mode | clients | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    modes = [("disaggregated", serving.get("levels", {})),
             ("aggregated", serving.get("aggregated_levels", {}))]  # fmt: skip
    for mode, levels in modes:
        for c in sorted(levels, key=int):
            r = levels[c]
            ttft, itl = f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])}", ms(r["itl_p50_s"])
            lines.append(f"| {mode} | {c} | {r['output_tokens_per_s']:.0f} | {ttft} | {itl} "
                         f"| {ms(r['itl_p99_s'])} |")  # fmt: skip
    one = serving.get("levels", {}).get("1")
    step = ((parity or {}).get("decode_steps", {}).get("graphs_on") or [None])[0]
    peak = (parity or {}).get("peak_bandwidth")
    if one and step and peak and one["itl_p50_s"] > 0:
        read = step["weight_bytes"] + step["kv_bytes_read"]
        fraction = read / one["itl_p50_s"] / peak["bytes_per_s"]
        itl = ms(one["itl_p50_s"])
        lines += ["", f"Served decode at 1 client: {read / 1e9:.2f} GB read a step / ITL p50 "
                      f"{itl} = {fraction:.0%} of the card's peak bandwidth."]  # fmt: skip
    return lines + [""]


def on_gpu(kernels: dict[str, Any] | None) -> bool:
    mode = str((kernels or {}).get("mode", ""))
    return mode.startswith("gpu") and "dry-run" not in mode


def summarize(folder: Path) -> str:
    lines = [f"# GPU run: {folder.name}", ""]
    gpu = folder / "gpu.txt"
    if gpu.exists():
        lines += ["```", gpu.read_text().strip(), "```", ""]
    kernels, parity, serving = (
        load(folder / f"{n}.json") for n in ("kernels", "parity", "serving")
    )
    if kernels:
        lines += kernel_sections(kernels)
    if parity:
        copy_gbps = ((kernels or {}).get("copy") or {}).get("gbps")
        lines += parity_sections(parity, copy_gbps if on_gpu(kernels) else None)
    if serving:
        lines += serving_sections(serving, parity)
    steps = folder / "steps.txt"
    if steps.exists():
        lines += ["## Steps", "", "```", steps.read_text().strip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?")
    parser.add_argument("--slug", help="print the results folder's name for this card name")
    args = parser.parse_args(argv)
    if args.slug is not None:
        print(card_slug(args.slug))
        return
    text = summarize(args.folder)
    (args.folder / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
