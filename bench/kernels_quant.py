"""The CPU's quantized linear kernels (engine/kernels/cpu_quant.c) against the float ones.

SmolLM2-135M's matrices (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64): per layer
qkv (960, 576), o (576, 576), gate_up (3072, 576), down (576, 1536), 30 layers each with its
own weights (so that they stream from memory, as in a decode step), plus the LM head
(49152, 576). One thread, 1 / 8 / 32 rows. A "pass" is every matrix once: what a decode step's
linear layers do. Methods: 4-bit groups of 32 and 8-bit groups of 32, each on its float path
and its int8-activation path (AVX2 or later), against cpu_linear.c's float32 panels
(cpu_kernels.panel_linear) and bfloat16 pairs (pair_linear, AVX512-BF16). The C functions are
called through ctypes with every buffer allocated up front, so the times are the kernels'.
`gbps` is the weight bytes of a pass over its time. Rounds interleave the methods; each figure
is the median of the rounds.

This project's 2-core Zen 4 VM (AVX512-VNNI and -BF16), one thread, 15 rounds, while other
jobs kept the host busy (load ~3; single timings swing by up to 2x, the medians by ~10-20%
between runs), 2026-12-05:

    method             MB     1 row ms  GB/s   8 rows ms  GB/s   32 rows ms  GB/s
    q4g32 float xf32    84.0     5.20   16.2     23.64     3.6      87.69     1.0
    q4g32 int8  xf32    84.0     3.90   21.6     10.16     8.3      36.12     2.3
    q4g32 float xbf16   84.0     5.09   16.5     23.68     3.5      87.98     1.0
    q4g32 int8  xbf16   84.0     4.09   20.5     10.11     8.3      36.30     2.3
    q8g32 float xf32   142.9     7.53   19.0     28.08     5.1      92.90     1.5
    q8g32 int8  xf32   142.9     7.84   18.2     12.21    11.7      38.34     3.7
    q8g32 float xbf16  142.9     7.58   18.8     27.94     5.1      92.32     1.5
    q8g32 int8  xbf16  142.9     7.58   18.9     12.06    11.8      38.93     3.7
    f32 panels         537.9    26.46   20.3     38.45    14.0     101.75     5.3
    bf16 pairs         269.0    14.03   19.2     19.82    13.6      51.05     5.3

At one row the weights stream at 18-22 GB/s, what the float kernels get, so time follows
bytes: 4-bit weights with int8 activations are 3.6x faster than bfloat16 pairs and 6.8x than
float32 panels; the 4-bit float path is bound by its unpacking and FMAs there (16 GB/s; 1.2-1.5x
slower than int8 across runs). From 8 rows the float path is bound by its FMAs (16
multiply-adds an instruction, as the float32 panels); int8 activations (vpdpbusd: 64) are
2.3-2.4x faster than it, and 2.0x / 1.4x faster than bfloat16 pairs at 8 / 32 rows (4 bits).

    .venv/bin/python -m bench.kernels_quant [--rounds 7] [--out bench/results/kernels_quant.json]

`--library` times another build of cpu_quant.c alone (its methods only), say the AVX2 one that
an AVX-512 host's kernels never compile (figures: cpu_quant.c's header):

    gcc -O3 -march=x86-64-v3 -fPIC -shared -fopenmp -fno-math-errno -fno-trapping-math \
        -fassociative-math -fno-signed-zeros engine/kernels/cpu_quant.c -o /tmp/quant_v3.so -lm
    .venv/bin/python -m bench.kernels_quant --library /tmp/quant_v3.so  # -> *_quant_v3.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels import cpu_kernels, cpu_quant
from engine.quant.weight import QuantizedWeight

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down (N, K)
HEAD_SHAPE = (49152, 576)
ROWS = (1, 8, 32)
GROUP = 32


@dataclass(slots=True)
class Matrix:
    """One weight in a method's layout, and a ctypes call that multiplies x into out."""

    n: int
    k: int
    call: Callable[[], object]


def random_quantized(bits: int, n: int, k: int) -> QuantizedWeight:
    groups = k // GROUP
    scales = (torch.rand(n, groups) * 0.02 + 1e-3).half().float()
    if bits == 4:
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        return QuantizedWeight(4, GROUP, values, scales, -8 * scales)
    values = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    return QuantizedWeight(8, GROUP, values, scales, None)


def shapes() -> list[tuple[int, int]]:
    return [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD_SHAPE]


def load_library(path: Path | None) -> ctypes.CDLL:
    """The kernels' library, or (path) another build of cpu_quant.c, its functions declared as
    the kernels' library declares them."""
    if path is None:
        lib = cpu_kernels.library()
        if lib is None:
            raise SystemExit("the C kernels did not build on this host")
        return lib
    lib = ctypes.CDLL(str(path.resolve()))
    for name in ("quant_linear", "quant_linear_scratch", "quant_int8_available"):
        function = getattr(lib, name)
        function.restype, function.argtypes = cpu_kernels._SIGNATURES[name]
    return lib


def quant_method(lib: ctypes.CDLL, bits: int, int8: bool, rows: int,
                 packed: list[cpu_quant.PackedQuant], x: torch.Tensor
                 ) -> list[Callable[[], object]]:  # fmt: skip
    calls = []
    max_k = max(k for _, k in LAYER_SHAPES)
    scratch = torch.empty(lib.quant_linear_scratch(rows, max_k, GROUP), dtype=torch.uint8)
    for p in packed:
        out = torch.empty(rows, p.out_features)
        args = (
            x.data_ptr(), cpu_kernels.DTYPE_CODES[x.dtype], p.data.data_ptr(), bits, GROUP, None,
            out.data_ptr(), rows, p.out_features, p.in_features, int(int8), scratch.data_ptr(), 1,
        )  # fmt: skip
        calls.append(_bound(lib.quant_linear, args, keep=(out, scratch, p.data)))
    return calls


def panel_method(rows: int, panels: list[tuple[torch.Tensor, int, int]], x: torch.Tensor
                 ) -> list[Callable[[], object]]:  # fmt: skip
    lib = cpu_kernels.library()
    assert lib is not None
    calls = []
    for w, n, k in panels:
        out = torch.empty(rows, n)
        args = (x.data_ptr(), w.data_ptr(), cpu_kernels.DTYPE_CODES[w.dtype], None, out.data_ptr(),
                rows, n, k, 1)  # fmt: skip
        calls.append(_bound(lib.panel_linear, args, keep=(out, w)))
    return calls


def pair_method(rows: int, pairs: list[tuple[torch.Tensor, int, int]], x: torch.Tensor
                ) -> list[Callable[[], object]]:  # fmt: skip
    lib = cpu_kernels.library()
    assert lib is not None
    function = lib.pair_linear  # not in cpu_kernels' signatures: declared here
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    function.restype = None
    function.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
    calls = []
    for w, n, k in pairs:
        out = torch.empty(rows, n)
        args = (x.data_ptr(), w.data_ptr(), None, out.data_ptr(), rows, n, k, 1)
        calls.append(_bound(function, args, keep=(out, w)))
    return calls


def _bound(function: Any, args: tuple[object, ...], keep: tuple[object, ...]
           ) -> Callable[[], object]:  # fmt: skip
    def call() -> object:
        return function(*args)

    call.keep = keep  # type: ignore[attr-defined]  # the buffers live as long as the call
    return call


def time_pass(calls: list[Callable[[], object]], passes: int) -> float:
    """ms per pass, the best-of-none mean over `passes` back-to-back passes."""
    start = time.perf_counter()
    for _ in range(passes):
        for call in calls:
            call()
    return (time.perf_counter() - start) * 1e3 / passes


def build_weights(quant_only: bool) -> dict[str, tuple[Any, int]]:
    """Each method's weights for every matrix of a pass, and their bytes."""
    torch.manual_seed(0)
    weights: dict[str, tuple[Any, int]] = {}
    for bits in (4, 8):
        packed = [cpu_quant.pack_quantized(random_quantized(bits, n, k)) for n, k in shapes()]
        weights[f"q{bits}"] = (packed, sum(p.nbytes for p in packed))
    if quant_only:
        return weights
    panels = []
    for n, k in shapes():
        panels.append((cpu_kernels.pack_panels(torch.randn(n, k) / k**0.5), n, k))
    weights["f32"] = (panels, sum(n * k * 4 for _, n, k in panels))
    if cpu_kernels.bf16_pairs_available():
        pairs = []
        for n, k in shapes():
            w = (torch.randn(n, k) / k**0.5).bfloat16()
            pairs.append((cpu_kernels.pack_pairs(w), n, k))
        weights["bf16"] = (pairs, sum(n * k * 2 for _, n, k in pairs))
    return weights


def methods_for(rows: int, weights: dict[str, tuple[Any, int]], lib: ctypes.CDLL
                ) -> dict[str, tuple[list[Callable[[], object]], int]]:  # fmt: skip
    max_k = max(k for _, k in LAYER_SHAPES)
    x32 = torch.randn(rows, max_k)
    x16 = x32.bfloat16()
    methods = {}
    for bits in (4, 8):
        packed, nbytes = weights[f"q{bits}"]
        for dtype, x in (("f32", x32), ("bf16", x16)):
            paths = (False, True) if lib.quant_int8_available() else (False,)
            for int8 in paths:
                name = f"q{bits}g{GROUP} {'int8' if int8 else 'float'} x{dtype}"
                methods[name] = (quant_method(lib, bits, int8, rows, packed, x), nbytes)
    if "f32" not in weights:
        return methods
    methods["f32 panels"] = (panel_method(rows, weights["f32"][0], x32), weights["f32"][1])
    if "bf16" in weights:
        methods["bf16 pairs"] = (pair_method(rows, weights["bf16"][0], x16), weights["bf16"][1])
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/kernels_quant[_LIBRARY].json")  # fmt: skip
    parser.add_argument("--library", type=Path, default=None,
                        help="time this build of cpu_quant.c (its methods only)")  # fmt: skip
    args = parser.parse_args()
    if args.out is None:
        suffix = f"_{args.library.stem}" if args.library else ""
        args.out = ROOT / f"bench/results/kernels_quant{suffix}.json"
    lib = load_library(args.library)
    weights = build_weights(quant_only=args.library is not None)
    results: list[dict[str, Any]] = []
    for rows in ROWS:
        methods = methods_for(rows, weights, lib)
        times: dict[str, list[float]] = {name: [] for name in methods}
        passes = 3 if rows == 1 else 1
        for calls, _ in methods.values():
            time_pass(calls, 1)  # warm: page in the weights, the code
        for _ in range(args.rounds):
            for name, (calls, _) in methods.items():
                times[name].append(time_pass(calls, passes))
        for name, (_, nbytes) in methods.items():
            ms = statistics.median(times[name])
            results.append({
                "method": name, "rows": rows, "ms_per_pass": round(ms, 3),
                "weight_mb": round(nbytes / 1e6, 1), "gbps": round(nbytes / ms / 1e6, 1),
                "ms_rounds": [round(t, 3) for t in times[name]],
            })  # fmt: skip
    print_table(results)
    report = {
        "cpu": _cpu_name(), "machine": platform.machine(), "threads": 1, "torch": torch.__version__,
        "library": str(args.library) if args.library else None,
        "int8_available": bool(lib.quant_int8_available()), "rounds": args.rounds,
        "layers": LAYERS, "layer_shapes": LAYER_SHAPES, "head_shape": HEAD_SHAPE,
        "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def print_table(results: list[dict[str, Any]]) -> None:
    names = list(dict.fromkeys(r["method"] for r in results))
    by = {(r["method"], r["rows"]): r for r in results}
    header = f"{'method':<24} {'MB':>6}"
    header += "".join(f" {f'{m} row ms':>11} {'GB/s':>6}" for m in ROWS)
    print(header)
    for name in names:
        line = f"{name:<24} {by[(name, ROWS[0])]['weight_mb']:>6}"
        for rows in ROWS:
            r = by[(name, rows)]
            line += f" {r['ms_per_pass']:>11.2f} {r['gbps']:>6.1f}"
        print(line)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
