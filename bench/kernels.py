"""Benchmark the Triton paged-attention kernels; writes JSON (default bench/results/kernels.json).

On a CUDA device: decode at batch 1/16/64 x context 1k/4k/16k (32 query heads, 8 KV heads,
head_dim 128, bf16, block size 16, shuffled blocks of a two-layer block-major pool), timed against
torch SDPA over the same KV already gathered contiguous (and FlashAttention / FlashInfer when they
import), as achieved bandwidth = bytes of K/V read / median time; plus a device-to-device copy so
decode_bw / copy_bw can be read against what the memory can do. Prefill is timed against SDPA too,
and both with attention sinks (gpt-oss) against themselves without. The grouped MoE kernel is
timed by bench/kernels_moe.py. Without CUDA it runs a small correctness pass in the Triton
interpreter instead.

Batch 1-8 at short contexts is swept too (`decode_sweep`): each shape's heuristic choice
(decode.choose_decode_config) and every (keys per tile, splits) beside it, timed as CUDA-graph
replays (the GPU's time alone, as the engine's captured decode step sees it) against SDPA's, both
also timed eagerly (with the host's launch cost): the next tuning of the heuristic reads it.

`--dry-run` runs the GPU harness itself on the CPU in the Triton interpreter at tiny shapes
(timings meaningless), so that a broken harness shows before a GPU is lent (bench/gpu_run.sh).

    .venv/bin/python -m bench.kernels [--out bench/results/kernels.json] [--dry-run]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (1024, 4096, 16384)
PREFILL_CASES = ((4, 0, 2048), (4, 4096, 512), (16, 1024, 256))  # (batch, prefix, new tokens)
SWEEP_BATCHES = (1, 2, 4, 8)
SWEEP_CONTEXTS = (256, 1024, 4096)
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
# prefill tunings timed beside the default (64, 64, 4 warps, 2 stages): (block_m, block_n, warps,
# stages), the shapes FlashAttention-style Triton kernels favour on Hopper among them
PREFILL_SWEEP = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                 (128, 128, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3))  # fmt: skip
DEVICE = "cuda"  # the GPU section's device (a CPU dry run of the harness may swap it)
DRY_RUN = False  # --dry-run: the GPU section on the CPU at tiny shapes, untimed in any real sense


def use_dry_run_shapes() -> None:
    """Tiny shapes for the GPU section on the CPU (the Triton interpreter is ~1e5x slower)."""
    global DEVICE, DRY_RUN, DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_CASES
    global SWEEP_BATCHES, SWEEP_CONTEXTS, SWEEP_BLOCK_N, SWEEP_SPLITS, PREFILL_SWEEP
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    from bench import kernels_moe

    DEVICE, DRY_RUN = "cpu", True
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
    DECODE_BATCHES, DECODE_CONTEXTS = (1, 2), (40, 100)
    PREFILL_CASES = ((1, 0, 12), (2, 20, 5))
    SWEEP_BATCHES, SWEEP_CONTEXTS, SWEEP_BLOCK_N, SWEEP_SPLITS = (1, 2), (64,), (16, 32), (1, 2)
    PREFILL_SWEEP = ((16, 16, 4, 2), (32, 16, 2, 3))
    kernels_moe.DEVICE = "cpu"
    kernels_moe.MOE_SHAPES = {"tiny": (4, 2, 32, 16, "silu", False)}
    kernels_moe.MOE_TOKENS = (1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/kernels.json")
    parser.add_argument("--dry-run", action="store_true", help="the GPU harness on the CPU")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels)
    if args.dry_run:
        use_dry_run_shapes()
    import triton

    result: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(sections: dict[str, Any]) -> None:
        """Written after each section: a run stopped at its time limit keeps what it measured."""
        args.out.write_text(json.dumps(result | sections, indent=2) + "\n")

    result |= gpu_benchmark(save) if on_gpu or args.dry_run else cpu_correctness()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    wrong = [f"{path} {err:.3g}" for path, err in errors(result) if err > MAX_ABS_ERR]
    if wrong:  # a kernel or a tuning that disagrees with SDPA / the reference fails the run
        raise SystemExit(f"errors above {MAX_ABS_ERR}: " + "; ".join(wrong))


MAX_ABS_ERR = 0.1  # bfloat16 outputs of magnitude ~1 (the rows seen: 2e-4 to 2e-2)


def errors(node: object, path: str = "") -> list[tuple[str, float]]:
    """Every `max_abs_err*` value in the result, with where it sits."""
    if isinstance(node, dict):
        found = [(f"{path}.{k}", float(v)) for k, v in node.items() if k.startswith("max_abs_err")]
        for k, v in node.items():
            found += errors(v, f"{path}.{k}")
        return found
    if isinstance(node, list):
        return [e for i, v in enumerate(node) for e in errors(v, f"{path}[{i}]")]
    return []


# --- shared ---------------------------------------------------------------------------------------


def make_cache(
    num_blocks: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A two-layer block-major pool and its layer-0 K/V views (strided like the engine's)."""
    pool = torch.randn(
        num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device
    )  # (num_blocks, num_layers, K/V, block_size, num_kv_heads, head_dim)
    return pool, pool[:, 0, 0], pool[:, 0, 1]


def block_tables_for(lens: list[int], num_blocks: int, device: str) -> torch.Tensor:
    """Disjoint shuffled blocks per sequence: (batch, max_blocks) int32."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    order = torch.randperm(num_blocks, device=device)[: sum(need)].to(torch.int32)
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start : start + n]
        start += n
    return table


def kv_bytes(lens: list[int], element_size: int) -> int:
    return sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * element_size


# --- GPU ------------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> float:
    """Median of repeats with L2 flushed between them (triton's do_bench); launched eagerly, so
    a kernel shorter than its launch measures the host."""
    if DRY_RUN:
        return host_median_ms(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of one call replayed from a CUDA graph: the GPU's time without the launch."""
    if DRY_RUN:
        return host_median_ms(fn)
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def host_median_ms(fn: Callable[[], object], repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def gpu_benchmark(save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    dtype = torch.bfloat16
    copy = copy_bandwidth(64 << 10 if DRY_RUN else 4 << 30)
    torch.cuda.empty_cache()
    max_tokens = max(DECODE_BATCHES) * max(DECODE_CONTEXTS)
    num_blocks = max_tokens // BLOCK_SIZE + 64
    pool, k_cache, v_cache = make_cache(num_blocks, dtype, DEVICE)
    baselines = optional_baselines()
    rows = []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            row = decode_case(batch, ctx, k_cache, v_cache, num_blocks, baselines)
            row["ratio_to_copy"] = row["triton_gbps"] / copy["gbps"]
            rows.append(row)
            torch.cuda.empty_cache()  # the gathered copies of the last case
            print(
                f"decode b={batch:3d} ctx={ctx:6d} splits={row['num_splits']:2d} "
                f"triton {row['triton_ms']:.3f} ms {row['triton_gbps']:7.0f} GB/s "
                f"({row['ratio_to_copy']:.0%} of copy)  sdpa {row['sdpa_ms']:.3f} ms  "
                f"err {row['max_abs_err_vs_sdpa']:.1e}"
            )
    mode = "gpu-dry-run" if DRY_RUN else "gpu"
    save({"mode": mode + " (partial)", "copy": copy, "decode": rows})
    sweep = decode_sweep(k_cache, v_cache, num_blocks)
    save({"mode": mode + " (partial)", "copy": copy, "decode": rows, "decode_sweep": sweep})
    prefill_rows = [prefill_case(*case, k_cache, v_cache, num_blocks) for case in PREFILL_CASES]
    save({"mode": mode + " (partial)", "copy": copy, "decode": rows, "decode_sweep": sweep,
          "prefill": prefill_rows})  # fmt: skip
    sinks = (
        sinks_case(k_cache, v_cache, num_blocks, 2, 40, 1, 12)
        if DRY_RUN
        else sinks_case(k_cache, v_cache, num_blocks)
    )
    del pool, k_cache, v_cache  # 8.6 GB of KV; the MoE weights need the room
    torch.cuda.empty_cache()
    from bench.kernels_moe import moe_benchmark

    moe_rows = moe_benchmark(median_ms)
    goal = next((r for r in rows if r["batch"] == 64 and r["context_len"] == 4096), None)
    return {
        "mode": mode,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
        "copy": copy,
        "decode": rows,
        "decode_sweep": sweep,
        "prefill": prefill_rows,
        "sinks": sinks,
        "moe": moe_rows,
        "baselines": {name: "ok" if fn else err for name, (fn, err) in baselines.items()},
        "goal_decode_b64_ctx4k_ratio_to_copy": goal and goal["ratio_to_copy"],
    }  # fmt: skip


def copy_bandwidth(num_bytes: int = 4 << 30) -> dict[str, float]:
    """Device-to-device copy; bandwidth counts the bytes read plus the bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(functools.partial(dst.copy_, src))
    return {"bytes_read_plus_written": 2 * num_bytes, "ms": ms, "gbps": 2 * num_bytes / ms / 1e6}


def decode_case(
    batch: int,
    ctx: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_blocks: int,
    baselines: dict[str, tuple[Baseline | None, str]],
) -> dict[str, Any]:
    from engine.kernels import decode
    from engine.kernels.reference import gather_kv

    lens = [ctx] * batch
    tables = block_tables_for(lens, num_blocks, DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5
    num_splits = decode.choose_decode_config(
        batch, NUM_KV_HEADS, tables.shape[1] * BLOCK_SIZE, decode.device_num_sms(q.device)
    ).num_splits

    def run_triton() -> torch.Tensor:
        return decode.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)

    k = gather_kv(k_cache, tables, ctx).transpose(1, 2).contiguous()  # (batch, kvh, ctx, d)
    v = gather_kv(v_cache, tables, ctx).transpose(1, 2).contiguous()
    q4 = q[:, :, None]  # (batch, heads, 1, d)

    def run_sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, scale=scale, enable_gqa=True
        )

    num_bytes = kv_bytes(lens, k_cache.element_size())
    row: dict[str, Any] = {"batch": batch, "context_len": ctx, "num_splits": num_splits,
                           "kv_bytes": num_bytes}  # fmt: skip
    row["max_abs_err_vs_sdpa"] = float((run_triton() - run_sdpa()[:, :, 0]).abs().max())
    for name, fn in [("triton", run_triton), ("sdpa", run_sdpa)]:
        ms = median_ms(fn)
        row[f"{name}_ms"], row[f"{name}_gbps"] = ms, num_bytes / ms / 1e6
    for name, (factory, _) in baselines.items():
        if factory is None:
            continue
        try:
            inputs = DecodeInputs(q, k_cache, v_cache, tables, context_lens, k, v, scale)
            fn = factory(inputs)
            ms = median_ms(fn)
            row[f"{name}_ms"], row[f"{name}_gbps"] = ms, num_bytes / ms / 1e6
        except Exception as exc:  # a baseline's API drift must not lose the whole run
            row[f"{name}_error"] = repr(exc)[:300]
    return row


def decode_sweep(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_blocks: int
) -> list[dict[str, Any]]:
    """Batch 1-8 at short contexts: the heuristic's launch and every (block_n, splits) beside it
    as graph replays, SDPA's likewise, and both eagerly; each row names the fastest tuning."""
    rows = []
    for batch in SWEEP_BATCHES:
        for ctx in SWEEP_CONTEXTS:
            row = sweep_case(batch, ctx, k_cache, v_cache, num_blocks)
            rows.append(row)
            best, chosen = row["best"], row["heuristic"]
            print(
                f"sweep b={batch} ctx={ctx:5d}: heuristic ({chosen['num_splits']} splits x "
                f"{chosen['block_n']}) {row['heuristic_graph_ms']:.4f} ms graph "
                f"{row['heuristic_eager_ms']:.4f} eager; best ({best['num_splits']} x "
                f"{best['block_n']}) {best['graph_ms']:.4f}; sdpa {row['sdpa_graph_ms']:.4f} "
                f"graph {row['sdpa_eager_ms']:.4f} eager; heuristic/sdpa "
                f"{row['heuristic_vs_sdpa']:.2f} best/sdpa {row['best_vs_sdpa']:.2f}"
            )
    return rows


def sweep_case(
    batch: int, ctx: int, k_cache: torch.Tensor, v_cache: torch.Tensor, num_blocks: int
) -> dict[str, Any]:
    from engine.kernels import decode
    from engine.kernels.reference import gather_kv

    scale = HEAD_DIM**-0.5
    lens = [ctx] * batch
    tables = block_tables_for(lens, num_blocks, DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device=DEVICE)
    k = gather_kv(k_cache, tables, ctx).transpose(1, 2).contiguous()
    v = gather_kv(v_cache, tables, ctx).transpose(1, 2).contiguous()
    q4 = q[:, :, None]

    def run(splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
        return decode.paged_decode_attention(
            q, k_cache, v_cache, tables, context_lens, scale, num_splits=splits, block_n=block_n
        )

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, scale=scale, enable_gqa=True
        )

    expected = sdpa()[:, :, 0]
    chosen = decode.choose_decode_config(
        batch, NUM_KV_HEADS, tables.shape[1] * BLOCK_SIZE, decode.device_num_sms(q.device)
    )
    row: dict[str, Any] = {
        "batch": batch, "context_len": ctx, "kv_bytes": kv_bytes(lens, k_cache.element_size()),
        "heuristic": {"num_splits": chosen.num_splits, "block_n": chosen.block_n},
        "heuristic_graph_ms": graph_ms(run), "heuristic_eager_ms": median_ms(run, 10, 50),
        "sdpa_graph_ms": graph_ms(sdpa), "sdpa_eager_ms": median_ms(sdpa, 10, 50),
        "configs": [],
    }  # fmt: skip
    for block_n in SWEEP_BLOCK_N:
        for splits in SWEEP_SPLITS:
            if splits > 1 and (splits - 1) * block_n >= ctx:
                continue  # the last split would hold no key
            err = float((run(splits, block_n) - expected).abs().max())
            ms = graph_ms(functools.partial(run, splits, block_n))
            row["configs"].append({"block_n": block_n, "num_splits": splits, "graph_ms": ms,
                                   "max_abs_err_vs_sdpa": err})  # fmt: skip
    best = min(row["configs"], key=lambda c: c["graph_ms"])
    row["best"] = best
    row["heuristic_vs_sdpa"] = row["heuristic_graph_ms"] / row["sdpa_graph_ms"]
    row["best_vs_sdpa"] = best["graph_ms"] / row["sdpa_graph_ms"]
    return row


def prefill_case(
    batch: int, prefix: int, new: int, k_cache: torch.Tensor, v_cache: torch.Tensor, num_blocks: int
) -> dict[str, Any]:
    from engine.kernels import prefill
    from engine.kernels.reference import gather_kv

    ctx = prefix + new
    tables = block_tables_for([ctx] * batch, num_blocks, DEVICE)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * new, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5

    def run_triton() -> torch.Tensor:
        return prefill.paged_prefill_attention(q, k_cache, v_cache, tables, cu, context_lens, scale)

    k = gather_kv(k_cache, tables, ctx).transpose(1, 2).contiguous()  # (batch, kvh, ctx, d)
    v = gather_kv(v_cache, tables, ctx).transpose(1, 2).contiguous()
    q4 = q.view(batch, new, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # (batch, heads, new, d)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(new, ctx)  # new tokens sit after the prefix

    def run_sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    expected = run_sdpa().transpose(1, 2)
    err = run_triton().view(batch, new, NUM_HEADS, HEAD_DIM) - expected
    visible_keys = new * prefix + new * (new + 1) // 2  # per sequence and head
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * visible_keys
    row: dict[str, Any] = {"batch": batch, "prefix_len": prefix, "new_tokens": new,
                           "max_abs_err_vs_sdpa": float(err.abs().max())}  # fmt: skip
    for name, fn in [("triton", run_triton), ("sdpa", run_sdpa)]:
        ms = median_ms(fn)
        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
    row["sweep"] = []
    for block_m, block_n, warps, stages in PREFILL_SWEEP:

        def tuned(m: int = block_m, n: int = block_n, w: int = warps, st: int = stages) -> object:
            return prefill.paged_prefill_attention(
                q, k_cache, v_cache, tables, cu, context_lens, scale,
                block_m=m, block_n=n, num_warps=w, num_stages=st,
            )  # fmt: skip

        try:
            got = tuned().view(batch, new, NUM_HEADS, HEAD_DIM)  # type: ignore[attr-defined]
            row["sweep"].append({
                "block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                "max_abs_err_vs_sdpa": float((got - expected).abs().max()),
                "ms": median_ms(tuned, 10, 50),
            })  # fmt: skip
        except Exception as exc:  # out of shared memory for the tile: recorded, not fatal
            row["sweep"].append({"block_m": block_m, "block_n": block_n, "num_warps": warps,
                                 "num_stages": stages, "error": repr(exc)[:200]})  # fmt: skip
    timed = [c for c in row["sweep"] if "ms" in c]
    best = min(timed, key=lambda c: c["ms"]) if timed else None
    row["best"], row["best_vs_sdpa"] = best, best and best["ms"] / row["sdpa_ms"]
    print(
        f"prefill b={batch} prefix={prefix} new={new}: triton {row['triton_ms']:.3f} ms "
        f"{row['triton_tflops']:.0f} TFLOP/s, sdpa {row['sdpa_ms']:.3f} ms"
        + (f"; best tuning {best['block_m']}x{best['block_n']} {best['num_warps']} warps "
           f"{best['num_stages']} stages {best['ms']:.3f} ms" if best else "")
    )  # fmt: skip
    return row


def sinks_case(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_blocks: int,
    batch: int = 16,
    context_len: int = 4096,
    prefill_batch: int = 4,
    new_tokens: int = 2048,
) -> dict[str, Any]:
    """Decode (batch x context_len) and prefill (prefill_batch x new_tokens) with and without
    sinks, full and gpt-oss's 128-token window: what the sink costs, and its error against the
    reference (decode only: the prefill reference would materialise every score)."""
    from engine.kernels import decode, prefill
    from engine.kernels.reference import paged_decode_attention_ref

    sinks = torch.randn(NUM_HEADS, device=DEVICE)
    scale = HEAD_DIM**-0.5
    tables = block_tables_for([context_len] * batch, num_blocks, DEVICE)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device=DEVICE)
    args = (q, k_cache, v_cache, tables, lens, scale)
    row: dict[str, Any] = {
        "decode_batch": batch,
        "decode_context_len": context_len,
        "prefill_batch": prefill_batch,
        "prefill_new_tokens": new_tokens,
    }
    for window in (None, 128):
        for label, s in [("no_sinks", None), ("sinks", sinks)]:
            row[f"decode_window_{window}_{label}_ms"] = median_ms(
                lambda w=window, s=s: decode.paged_decode_attention(*args, w, None, s)
            )
        expected = paged_decode_attention_ref(*args, window, None, sinks)
        got = decode.paged_decode_attention(*args, window, None, sinks)
        row[f"decode_window_{window}_max_abs_err_vs_ref"] = float((got - expected).abs().max())
    cu = torch.arange(0, (prefill_batch + 1) * new_tokens, new_tokens, device=DEVICE).int()
    qp = torch.randn(prefill_batch * new_tokens, NUM_HEADS, HEAD_DIM, dtype=q.dtype, device=DEVICE)
    prefill_lens = torch.full((prefill_batch,), new_tokens, dtype=torch.int32, device=DEVICE)
    prefill_args = (qp, k_cache, v_cache, tables[:prefill_batch], cu, prefill_lens, scale)
    for label, s in [("no_sinks", None), ("sinks", sinks)]:
        row[f"prefill_{label}_ms"] = median_ms(
            lambda s=s: prefill.paged_prefill_attention(*prefill_args, None, None, s)
        )
    print(
        f"sinks: decode {row['decode_window_None_sinks_ms']:.3f} ms vs "
        f"{row['decode_window_None_no_sinks_ms']:.3f} without, prefill "
        f"{row['prefill_sinks_ms']:.3f} vs {row['prefill_no_sinks_ms']:.3f}"
    )
    return row


@dataclass(slots=True)
class DecodeInputs:
    q: torch.Tensor  # (batch, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim), strided pool view
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (batch, max_blocks) int32
    context_lens: torch.Tensor  # (batch,) int32
    k: torch.Tensor  # (batch, num_kv_heads, ctx, head_dim), gathered contiguous
    v: torch.Tensor
    scale: float


Baseline = Callable[[DecodeInputs], Callable[[], torch.Tensor]]


def optional_baselines() -> dict[str, tuple[Baseline | None, str]]:
    """FlashAttention (over the gathered cache) and FlashInfer (our paged views), if importable."""
    found: dict[str, tuple[Baseline | None, str]] = {}
    try:
        from flash_attn import flash_attn_with_kvcache

        def flash_attn(x: DecodeInputs) -> Callable[[], torch.Tensor]:
            kc = x.k.transpose(1, 2).contiguous()  # (batch, ctx, kvh, d): its native layout
            vc = x.v.transpose(1, 2).contiguous()
            q4 = x.q[:, None]  # (batch, 1, heads, d)
            return lambda: flash_attn_with_kvcache(
                q4, kc, vc, cache_seqlens=x.context_lens, softmax_scale=x.scale
            )

        found["flash_attn"] = (flash_attn, "")
    except Exception as exc:
        found["flash_attn"] = (None, f"unavailable: {exc!r}"[:200])
    try:
        import flashinfer

        def flash_infer(x: DecodeInputs) -> Callable[[], torch.Tensor]:
            batch = x.q.shape[0]
            blocks = -(-x.context_lens.long() // BLOCK_SIZE)  # (batch,)
            indptr = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
            indptr[1:] = blocks.cumsum(0)
            width = x.block_tables.shape[1]
            keep = torch.arange(width, device=DEVICE)[None] < blocks[:, None]
            indices = x.block_tables[keep].int()
            last = ((x.context_lens - 1) % BLOCK_SIZE + 1).int()
            workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(indptr, indices, last, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                         q_data_type=x.q.dtype, kv_data_type=x.k_cache.dtype,
                         sm_scale=x.scale)  # fmt: skip
            return lambda: wrapper.run(x.q, (x.k_cache, x.v_cache))

        found["flashinfer"] = (flash_infer, "")
    except Exception as exc:
        found["flashinfer"] = (None, f"unavailable: {exc!r}"[:200])
    return found


# --- CPU ------------------------------------------------------------------------------------------


def cpu_correctness() -> dict[str, Any]:
    """Tiny shapes through the interpreter against the torch reference (no timing claims)."""
    from engine.kernels import decode, prefill
    from engine.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        lens = [7, 100, 33]
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 4
        _, k_cache, v_cache = make_cache(num_blocks, dtype, "cpu")
        tables = block_tables_for(lens, num_blocks, "cpu")
        context_lens = torch.tensor(lens, dtype=torch.int32)
        scale = HEAD_DIM**-0.5
        q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, dtype=dtype)
        sinks = torch.randn(NUM_HEADS)
        for num_splits, s in [(1, None), (2, None), (1, sinks), (2, sinks)]:
            args = (q, k_cache, v_cache, tables, context_lens, scale, None, None, s)
            start = time.perf_counter()
            out = decode.paged_decode_attention(*args, num_splits=num_splits)
            ref = paged_decode_attention_ref(*args)
            err = float((out.float() - ref.float()).abs().max())
            rows.append({"kernel": "decode" + (" sinks" if s is not None else ""),
                         "dtype": str(dtype), "num_splits": num_splits,
                         "lens": lens, "max_abs_err": err,
                         "interpreter_s": time.perf_counter() - start})  # fmt: skip
        q_lens = [5, 40, 1]  # prefixes 2, 60, 32
        cu = torch.tensor([0, 5, 45, 46], dtype=torch.int32)
        qp = torch.randn(46, NUM_HEADS, HEAD_DIM, dtype=dtype)
        for s in (None, sinks):
            args = (qp, k_cache, v_cache, tables, cu, context_lens, scale, None, None, s)
            start = time.perf_counter()
            out = prefill.paged_prefill_attention(*args)
            ref = paged_prefill_attention_ref(*args)
            rows.append({"kernel": "prefill" + (" sinks" if s is not None else ""),
                         "dtype": str(dtype), "lens": lens, "q_lens": q_lens,
                         "max_abs_err": float((out.float() - ref.float()).abs().max()),
                         "interpreter_s": time.perf_counter() - start})  # fmt: skip
    from bench.kernels_moe import moe_correctness

    rows += moe_correctness()
    for row in rows:
        print(f"{row['kernel']:22s} {row['dtype']:15s} max_abs_err {row['max_abs_err']:.2e}")
    return {"mode": "cpu-correctness", "correctness": rows}


if __name__ == "__main__":
    main()
