"""Time the Triton quantized matmul against torch's bfloat16 matmul on a GPU; writes JSON.

engine/kernels/quant_matmul.py's kernel and torch's F.linear on the same weight dequantized to
bfloat16, at Llama-3-8B's linear shapes.

Shapes (N, K): q/o projection 4096 x 4096, gate/up 14336 x 4096, down 4096 x 14336; rows 1 and
16 (decode: bound by the weight bytes) and 256 (prefill: bound by compute). Formats: q4_g32
(Q4_1's 5 bits: 4-bit groups of 32, float16 scale and min), q4_g128 (GPTQ-like, 4.25 bits),
q8_g32 (Q8_0's 8.5 bits). Per case: quant_ms and weight_gbps (packed values + scales + mins /
median time), bf16_ms and bf16_gbps (N * K * 2 bytes / time), the speedup, TFLOP/s, the blocks
choose_blocks picked, and the max error against F.linear on the dequantized bfloat16 weight. A
device-to-device copy gives the memory's bandwidth to read them against. Then a sweep of other
tiles at 1 and 16 rows (written as it goes, shorter repeats), so choose_blocks can be tuned from
one run. Exits 1 when a case's error passes bfloat16's tolerance (the compiled kernel is wrong).

    python3 -m bench.kernels_quant_gpu [--out bench/results/kernels_quant_gpu.json] [--no-sweep]
    .venv/bin/python -m bench.kernels_quant_gpu --dry-run   # no GPU: tiny shapes, interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qo_proj": (4096, 4096), "gate_up_proj": (14336, 4096), "down_proj": (4096, 14336)}
ROWS = (1, 16, 256)
FORMATS = {"q4_g32": (4, 32), "q4_g128": (4, 128), "q8_g32": (8, 32)}  # name: (bits, group)
DRY_SHAPES = {"tiny": (96, 256)}  # the same cases in the interpreter
DRY_ROWS = (1, 16, 20)
SWEEP_SHAPES = ("qo_proj", "gate_up_proj")
SWEEP_FORMATS = ("q4_g32", "q8_g32")
SWEEP_ROWS = (1, 16)
SWEEP_TILES = [(32, 128), (64, 64), (64, 128), (64, 256), (128, 128)]  # (block_n, block_k)
SWEEP_SPLITS = (1, 2, 4, 8)

BF16_ATOL, BF16_RTOL = 3e-2, 2e-2  # tests/paged_cache.py's bfloat16 tolerance
Timer = Callable[[Callable[[], object]], float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file (default under bench/results/)")
    parser.add_argument("--no-sweep", action="store_true", help="only the chosen blocks")
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: tiny shapes in the Triton interpreter"
    )
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernel)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run for the interpreter's smoke test")
    name = "kernels_quant_gpu_dry.json" if args.dry_run else "kernels_quant_gpu.json"
    out = args.out or ROOT / "bench/results" / name
    device = "cpu" if args.dry_run else "cuda"
    timer, sweep_timer = (once_ms, once_ms) if args.dry_run else (median_ms, sweep_ms)
    import triton

    result: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": "cpu (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "formats": {k: {"bits": b, "group_size": g} for k, (b, g) in FORMATS.items()},
    }
    if not args.dry_run:
        from bench.kernels import copy_bandwidth

        result["copy"] = copy_bandwidth(1 << 30)
        print(f"copy {result['copy']['gbps']:.0f} GB/s (read + written)")
    shapes, rows = (DRY_SHAPES, DRY_ROWS) if args.dry_run else (SHAPES, ROWS)
    result["cases"] = [
        case(fmt, shape, num_rows, device, timer)
        for shape in shapes.items()
        for num_rows in rows
        for fmt in FORMATS
    ]
    write(out, result)
    wrong = [c for c in result["cases"] if not c["within_bf16_tolerance"]]
    for c in wrong:
        print(f"WRONG: {c['format']} {c['shape']} rows={c['rows']} err {c['max_abs_err']:.2e}")
    if not args.no_sweep:
        result["sweep"] = []
        sweep_shapes = list(DRY_SHAPES.items()) if args.dry_run else [
            (s, SHAPES[s]) for s in SWEEP_SHAPES
        ]  # fmt: skip
        for shape in sweep_shapes:
            for fmt in SWEEP_FORMATS:
                for num_rows in SWEEP_ROWS:
                    result["sweep"] += sweep(
                        fmt, shape, num_rows, device, sweep_timer, args.dry_run
                    )
                    write(out, result)  # a timeout keeps what was measured
    sys.exit(1 if wrong else 0)


def median_ms(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median of repeats with L2 flushed between them (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def sweep_ms(fn: Callable[[], object]) -> float:
    return median_ms(fn, rep_ms=30)


def once_ms(fn: Callable[[], object]) -> float:
    """The dry run's timer: one call (interpreter seconds say nothing about a GPU)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def make_weight(bits: int, group_size: int, n: int, k: int, device: str) -> Any:
    """Random values and float16-exact scales (and mins), as a GGUF file's."""
    from engine.quant.weight import QuantizedWeight

    scales = ((torch.rand(n, k // group_size, device=device) + 0.5) / (6 * k**0.5)).half().float()
    if bits == 4:
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
        return QuantizedWeight(4, group_size, values, scales, -8 * scales)
    values = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    return QuantizedWeight(8, group_size, values, scales / 16, None)


def case(
    fmt: str, shape: tuple[str, tuple[int, int]], num_rows: int, device: str, timer: Timer
) -> dict[str, Any]:
    from engine.kernels import quant_matmul as qm

    (shape_name, (n, k)), (bits, group_size) = shape, FORMATS[fmt]
    weight = make_weight(bits, group_size, n, k, device)
    packed = qm.pack_for_triton(weight)
    dense = weight.dequantize().to(torch.bfloat16)  # (N, K) the bf16 baseline's weight
    x = torch.randn(num_rows, k, dtype=torch.bfloat16, device=device)
    out = qm.quant_matmul(x, packed)
    ref = F.linear(x, dense)
    quant_ms = timer(lambda: qm.quant_matmul(x, packed))
    bf16_ms = timer(lambda: F.linear(x, dense))
    sms = qm._num_sms(torch.device(device))
    max_abs_err = float((out.float() - ref.float()).abs().max())
    ref_max_abs = float(ref.float().abs().max())
    row = {
        "format": fmt,
        "shape": shape_name,
        "n": n,
        "k": k,
        "rows": num_rows,
        "blocks": asdict(qm.choose_blocks(num_rows, n, k, group_size, sms)),
        "weight_bytes": packed.nbytes,
        "bits_per_weight": packed.bits_per_weight,
        "max_abs_err": max_abs_err,
        "ref_max_abs": ref_max_abs,
        "within_bf16_tolerance": max_abs_err <= BF16_ATOL + BF16_RTOL * ref_max_abs,
        "quant_ms": quant_ms,
        "weight_gbps": packed.nbytes / quant_ms / 1e6,
        "bf16_ms": bf16_ms,
        "bf16_gbps": n * k * 2 / bf16_ms / 1e6,
        "speedup_vs_bf16": bf16_ms / quant_ms,
        "quant_tflops": 2 * num_rows * n * k / quant_ms / 1e9,
    }
    print(
        f"{fmt:8s} {shape_name:12s} rows={num_rows:4d}: quant {quant_ms:.4f} ms "
        f"{row['weight_gbps']:6.0f} GB/s  bf16 {bf16_ms:.4f} ms {row['bf16_gbps']:6.0f} GB/s  "
        f"x{row['speedup_vs_bf16']:.2f}  err {row['max_abs_err']:.1e}"
    )
    return row


def sweep(
    fmt: str,
    shape: tuple[str, tuple[int, int]],
    num_rows: int,
    device: str,
    timer: Timer,
    dry_run: bool,
) -> list[dict[str, Any]]:
    """Every (block_n, block_k) x split_k in the sweep lists that fits the group, timed."""
    from engine.kernels import quant_matmul as qm

    (shape_name, (n, k)), (bits, group_size) = shape, FORMATS[fmt]
    packed = qm.pack_for_triton(make_weight(bits, group_size, n, k, device))
    x = torch.randn(num_rows, k, dtype=torch.bfloat16, device=device)
    configs = [
        qm.QuantBlocks(16, block_n, block_k, split_k)
        for block_n, block_k in SWEEP_TILES
        for split_k in SWEEP_SPLITS
        if group_size % block_k == 0 or block_k % group_size == 0
    ]
    rows = []
    for blocks in configs[:2] if dry_run else configs:
        ms = timer(functools.partial(qm.quant_matmul, x, packed, blocks=blocks))
        rows.append({"format": fmt, "shape": shape_name, "rows": num_rows, **asdict(blocks),
                     "ms": ms, "weight_gbps": packed.nbytes / ms / 1e6})  # fmt: skip
    best = min(rows, key=lambda r: r["ms"])
    print(
        f"sweep {fmt:8s} {shape_name:12s} rows={num_rows:3d}: best block_n={best['block_n']} "
        f"block_k={best['block_k']} split_k={best['split_k']} {best['weight_gbps']:.0f} GB/s"
    )
    return rows


if __name__ == "__main__":
    main()
