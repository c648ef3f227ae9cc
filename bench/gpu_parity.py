"""Greedy parity of the GPU engine against transformers on the same device, and the decode step's
share of the card's memory bandwidth, on a full-size checkpoint (bench/gpu_run.sh).

    python -m bench.gpu_parity --model builtin:qwen2.5-0.5b-bench --device cuda --out parity.json

Parity: a few prompts, each continued greedily (to its EOS or --max-tokens) by the engine (CUDA
graphs on: every decode step after the first replays a captured graph) and by transformers'
`generate`, one prompt at a time, both on --device. float32 must agree token for token on every
prompt (else the exit status is 1); bfloat16 is reported (rounding may flip a late near-tie), and
so are the engine's bfloat16 tokens with graphs off against graphs on.

Decode steps: at batch 1 / 8 / 32 / 64 (--step-batches), prompts of --step-prompt-len tokens
prefilled, then --steps decode steps of `LLMEngine.step()` timed (each ends on the host with its
sampled tokens), with graphs on and off. bytes/step = the weights (each parameter once: a tied
embedding is read whole as the LM head) + the K/V the batch's attention reads; its rate over the
step's time is the fraction of the card's peak bandwidth (bench/gpu_summary.py's table) and of
a device copy's (bench/kernels.py's, when --kernels names its JSON).

`--device cpu` runs the same harness on the CPU (gpu_run.sh --dry-run, a small checkpoint).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_summary import peak_bandwidth
from common.sampling_params import SamplingParams
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS


def engine_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def hf_tokens(
    model_dir: Path, dtype: torch.dtype, device: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, stopping at its EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)
        outputs.append(out[0, len(prompt) :].tolist())
    del model
    free_memory(device)
    return outputs


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """How many prompts agree, and where each that does not first differs."""
    first_diff = []
    for a, b in zip(got, want, strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        first_diff.append(None if a == b else (i if i is not None else min(len(a), len(b))))
    return {
        "equal": sum(d is None for d in first_diff),
        "prompts": len(got),
        "first_difference": first_diff,
    }


def graphs_state(llm: LLM) -> dict[str, Any]:
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return {"on": False}
    return {"on": graphs.enabled, "buckets": list(graphs.buckets),
            "captured": sorted(graphs.graphs), "captures": graphs.num_captures}  # fmt: skip


def parity(
    model: str, device: str, dtype: str, prompts: list[list[int]], max_tokens: int, blocks: int
) -> dict[str, Any]:
    llm = LLM(model, device=device, dtype=dtype, num_blocks=blocks, max_num_seqs=64)
    model_dir = llm.engine.model_dir
    torch_dtype = llm.engine.config.torch_dtype
    start = time.perf_counter()
    got = engine_tokens(llm, prompts, max_tokens)
    result: dict[str, Any] = {"engine_s": time.perf_counter() - start, "graphs": graphs_state(llm)}
    del llm
    free_memory(device)
    want = hf_tokens(model_dir, torch_dtype, device, prompts, max_tokens)
    result |= compare(got, want)
    result["engine_tokens"], result["hf_tokens"] = got, want
    if dtype == "bfloat16":  # the same engine with graphs off: what graphs change, if anything
        eager = LLM(model, device=device, dtype=dtype, num_blocks=blocks, cuda_graphs=False)
        result["graphs_off_vs_on"] = compare(engine_tokens(eager, prompts, max_tokens), got)
        del eager
        free_memory(device)
    print(f"parity {dtype}: {result['equal']} of {result['prompts']} prompts equal to "
          f"transformers; graphs {result['graphs']}", flush=True)  # fmt: skip
    return result


def decode_steps(
    model: str,
    device: str,
    dtype: str,
    graphs: bool,
    batches: list[int],
    prompt_len: int,
    steps: int,
    blocks: int,
) -> list[dict[str, Any]]:
    """ms per decode step at each batch size, and the bytes a step reads."""
    llm = LLM(model, device=device, dtype=dtype, num_blocks=blocks, max_num_seqs=max(batches),
              cuda_graphs=graphs)  # fmt: skip
    engine = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    cfg = engine.model_config
    kv_token_bytes = (
        cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * engine.kv_cache.pool.element_size()
    )
    vocab = cfg.vocab_size
    rows = []
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            prompt = [(7 * i + 13 * j) % min(vocab, 49152) + 3 for j in range(prompt_len)]
            engine.add_request(f"steps-{batch}-{i}", prompt, params)
        while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
        ):
            engine.step()  # the prompts, and their first tokens
        engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        context = prompt_len + 2 + steps // 2  # the mean context over the timed steps
        ms = statistics.median(times) * 1e3
        kv_bytes = batch * context * kv_token_bytes
        rows.append({"batch": batch, "step_ms": ms, "weight_bytes": weight_bytes,
                     "kv_bytes_read": kv_bytes, "context_len": context,
                     "gbps": (weight_bytes + kv_bytes) / ms / 1e6,
                     "tokens_per_s": batch / ms * 1e3})  # fmt: skip
        while engine.has_unfinished():
            engine.step()
    state = graphs_state(llm)
    del llm, engine
    free_memory(device)
    for row in rows:
        print(f"decode step b={row['batch']:2d} graphs {'on ' if graphs else 'off'} "
              f"{row['step_ms']:.2f} ms {row['gbps']:.0f} GB/s", flush=True)  # fmt: skip
    return [{**row, "graphs": state} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen2.5-0.5b-bench")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--kernels", type=Path, help="bench.kernels' JSON: its copy bandwidth")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.config import EngineConfig

    tokenizer = AutoTokenizer.from_pretrained(EngineConfig(model=args.model).model_dir())
    prompts = [tokenizer.encode(p) for p in TEST_PROMPTS[: args.prompts]]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result: dict[str, Any] = {"model": args.model, "device": card, "torch": torch.__version__,
                              "max_tokens": args.max_tokens}  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        result[f"parity_{dtype}"] = parity(
            args.model, args.device, dtype, prompts, args.max_tokens, args.num_blocks
        )
    steps = {}
    for graphs in (True, False):
        steps["graphs_on" if graphs else "graphs_off"] = decode_steps(
            args.model, args.device, "bfloat16", graphs, args.step_batches,
            args.step_prompt_len, args.steps, args.num_blocks,
        )  # fmt: skip
    peak = peak_bandwidth(card)
    copy_gbps = None
    if args.kernels and args.kernels.exists():
        copy_gbps = json.loads(args.kernels.read_text()).get("copy", {}).get("gbps")
    for rows in steps.values():
        for row in rows:
            row["fraction_of_peak"] = row["gbps"] * 1e9 / peak["bytes_per_s"] if peak else None
            row["fraction_of_copy"] = row["gbps"] / copy_gbps if copy_gbps else None
    result["decode_steps"] = steps
    result["peak_bandwidth"] = peak
    f32 = result["parity_float32"]
    graphs_ok = args.device != "cuda" or f32["graphs"].get("on", False)
    result["ok"] = f32["equal"] == f32["prompts"] and graphs_ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}; float32 parity {'ok' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
