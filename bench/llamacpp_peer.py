"""llama.cpp as a peer of bench/peers.py: its server, built from PyPI on this host, serving the GGUF
file a model ships as, under the same load generator as vLLM and the clusters.

Both of llama.cpp's servers come from one PyPI source distribution, `llama-cpp-python` (pinned
below, with the llama.cpp commit it vendors), built on first use into
~/.cache/pdcluster (15 and 8 minutes on this 2-core host; 380 MB of build, a 200 MB venv):

- `llamacpp`: llama.cpp's own C++ server, `llama-server`, built with CMake from the sdist's
  vendored llama.cpp tree. It serves many requests at once: `--parallel N` slots, continuous
  batching (every running slot's next token and the waiting prompts' tokens in one batch per step,
  up to `--batch-size` tokens): llama.cpp's own answer to serving many users.
- `llamacpp-python`: `python -m llama_cpp.server`, the package's own FastAPI server over one
  `Llama` object. It takes one request at a time (every request waits on one lock; by default a
  new request even cuts the running one short, which `--interrupt_requests False` turns off), so
  at 8 or 32 concurrent requests it queues them: throughput stays that of one request.

Both run one compute thread (`--threads 1`), pinned with taskset to the core vLLM's CPU backend
binds its compute thread to (core 0: vLLM reserves the last core for its front end); llama.cpp's
HTTP threads share that core. Both are built for this CPU (`-march=native`: ggml's AVX-512,
VNNI and BF16 kernels where the CPU has them) with OpenMP and no BLAS.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.serving import free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e570"  # the llama.cpp it vendors (its CHANGELOG; cmake prints it too)
LLAMACPP_VENV = Path.home() / ".cache/pdcluster/llamacpp-venv"
LLAMACPP_BUILD = Path.home() / ".cache/pdcluster/llamacpp-build"
# The CPU's own kernels (ggml picks AVX-512 F/BW/VL/VNNI/BF16/VBMI from -march=native), OpenMP
# for ggml's threads, no BLAS: decode is matrix-vector work on quantized blocks, ggml's own path.
CMAKE_ARGS = ("-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DGGML_BLAS=OFF")
SERVER_CMAKE_ARGS = (
    *CMAKE_ARGS,
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build downloads the web UI from a model hub
    "-DLLAMA_BUILD_UI=OFF",  # else npm builds it
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
LLAMACPP_SYSTEMS = ("llamacpp", "llamacpp-python")
COMPUTE_CORE = 0  # where vLLM's CPU backend binds its one compute thread on this 2-core host
SLOTS = 32  # llama-server's parallel sequences: the benchmark's highest concurrency
SLOT_CONTEXT = 512  # tokens per slot: a 256-token prompt and 128 outputs fit
BATCH_TOKENS = 512  # tokens per step (llama.cpp's ubatch; the cluster's CPU step budget too)
START_TIMEOUT_S = 120


# --- installation ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LlamaCppInstall:
    """What the two servers run from."""

    llama_server: Path  # the C++ server binary
    python: Path  # the venv's python, with llama_cpp and its server extra


def ensure_llamacpp(systems: list[str]) -> LlamaCppInstall:
    """The servers of `systems`, each built on first use (the sdist once, then llama-server or
    the package), each step skipped when its output is there."""
    install = LlamaCppInstall(LLAMACPP_VENV / "bin/llama-server", LLAMACPP_VENV / "bin/python")
    if not install.python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], check=True)
    if "llamacpp" in systems and not install.llama_server.exists():
        _build_llama_server(_sdist(), install.llama_server)
    if "llamacpp-python" in systems:
        has_server = subprocess.run(
            [str(install.python), "-c", "import llama_cpp.server.app"], capture_output=True
        )
        if has_server.returncode != 0:
            _install_llama_cpp_python(_sdist(), install.python)
    return install


def _sdist() -> Path:
    """llama-cpp-python's source distribution, downloaded once and unpacked beside it."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    archive = LLAMACPP_BUILD / f"{name}.tar.gz"
    if not archive.exists():
        LLAMACPP_BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", str(LLAMACPP_BUILD), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            check=True,
        )  # fmt: skip
    if not (LLAMACPP_BUILD / name).is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(LLAMACPP_BUILD, filter="data")
    return archive


def _build_llama_server(sdist: Path, target: Path) -> None:
    source = sdist.parent / sdist.name.removesuffix(".tar.gz") / "vendor/llama.cpp"
    build = LLAMACPP_BUILD / "server-build"
    log = LLAMACPP_BUILD / "server-build.log"
    print(f"[peers] building llama-server from {source} (~15 min on 2 cores; {log})", flush=True)
    with log.open("ab") as out:
        for command in (
            ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *SERVER_CMAKE_ARGS],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count())],
        ):
            subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)
    shutil.copy2(build / "bin/llama-server", target)


def _install_llama_cpp_python(sdist: Path, python: Path) -> None:
    log = LLAMACPP_BUILD / "llama-cpp-python-build.log"
    print(f"[peers] building llama-cpp-python[server] (~8 min on 2 cores; {log})", flush=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(CMAKE_ARGS), "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    with log.open("ab") as out:
        subprocess.run(
            [str(python), "-m", "pip", "install", "-v",
             f"llama-cpp-python[server] @ {sdist.as_uri()}"],
            stdout=out, stderr=subprocess.STDOUT, env=env, check=True,
        )  # fmt: skip


# --- models ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GgufModel:
    """A builtin that is a GGUF file served as stored: llama.cpp serves the file in its built
    directory, the clusters the builtin (engine/formats/gguf.py reads the same file)."""

    quantization: str  # the file's main weight type: the dtype key in peers.json
    end_token_ids: tuple[int, ...]  # the tokens llama.cpp stops at (end of generation)


GGUF_MODELS = {  # <|endoftext|> 0 and <|im_end|> 2 (the GGUF's eos): the wheel's tokenizer
    "builtin:smollm2-135m-q4": GgufModel("q4_1", end_token_ids=(0, 2)),
    "builtin:smollm2-135m-q8": GgufModel("q8_0", end_token_ids=(0, 2)),
}
ACTIVATION_DTYPE = "float32"  # the clusters' dtype for a GGUF builtin: its activations'


def gguf_file(model_dir: Path) -> Path:
    """The one GGUF file in a GGUF builtin's directory."""
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"{model_dir}: {len(files)} .gguf files, expected one")
    return files[0]


# --- the servers ----------------------------------------------------------------------------------


def llama_server_command(binary: Path, gguf: Path, model: str, port: int) -> list[str]:
    """llama-server with SLOTS slots of SLOT_CONTEXT tokens each (the KV cache split per slot,
    llama.cpp's default for an explicit --parallel), continuous batching, one thread."""
    return [
        "taskset", "-c", str(COMPUTE_CORE), str(binary), "--model", str(gguf), "--alias", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--threads", "1", "--threads-batch", "1",
        "--parallel", str(SLOTS), "--cont-batching", "--ctx-size", str(SLOTS * SLOT_CONTEXT),
        "--batch-size", str(BATCH_TOKENS), "--ubatch-size", str(BATCH_TOKENS),
        "--metrics",  # tokens_generated() reads its count
        *(["--no-repack"] if amx_host() else []),
    ]  # fmt: skip


def amx_host() -> bool:
    """A CPU with AMX_INT8, where this llama.cpp (0c1e570) segfaults on its first eval of a Q4_1
    or Q8_0 file with its weights repacked for AMX: there it runs with --no-repack, the plain
    path every other CPU runs these types on."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " amx_int8" in cpuinfo.read_text()


# llama_cpp.server answers 400 to a request whose X-Request-ID is not a UUID (starlette-context's
# check; the id is only echoed back), and `vllm bench serve` sends "<prefix><n>": the check is
# turned off, the server otherwise run as `python -m llama_cpp.server` runs it.
LLAMA_CPP_PYTHON_LAUNCHER = (
    "import runpy, starlette_context.plugins.base as base; "
    "base.PluginUUIDBase.validate_uuid = lambda self, value: None; "
    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"
)


def llama_cpp_python_command(python: Path, gguf: Path, model: str, port: int) -> list[str]:
    """llama_cpp.server with one context of SLOT_CONTEXT tokens (it runs one request at a time),
    the running request left to finish when another arrives."""
    return [
        "taskset", "-c", str(COMPUTE_CORE), str(python), "-c", LLAMA_CPP_PYTHON_LAUNCHER,
        "--model", str(gguf), "--model_alias", model, "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(SLOT_CONTEXT),
        "--n_batch", str(BATCH_TOKENS), "--n_ubatch", str(BATCH_TOKENS),
        "--interrupt_requests", "False",
        # its SSE pings (every 15 s, to a request waiting for the lock) are separated by
        # "\r\n", its events by "\n"; vllm bench serve's parser (events split at "\n\n")
        # then finds no event in such a stream and fails it ("never received a valid chunk")
        "--disable_ping_events", "True",
    ]  # fmt: skip


def configuration() -> dict:
    """How the llama.cpp peers were built and run, for peers.json."""
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "cmake_args": list(CMAKE_ARGS),
        "llama_server_cmake_args": list(SERVER_CMAKE_ARGS),
        "pinned_core": COMPUTE_CORE,
        "no_repack": amx_host(),
        "threads": 1,
        "slots": SLOTS,
        "slot_context": SLOT_CONTEXT,
        "batch_tokens": BATCH_TOKENS,
    }


def extra_body(system: str, model: GgufModel) -> dict | None:
    """What a request to `system` must carry for the workload's "EOS ignored": llama-server reads
    `ignore_eos` as vLLM does; llama_cpp.server has no such field, so its end tokens are banned."""
    if system == "llamacpp-python":
        return {"logit_bias": {str(token): -100.0 for token in model.end_token_ids}}
    return None


def request_headers(system: str) -> dict[str, str] | None:
    """llama-server (this version) answers a streamed request with `Keep-Alive` and then closes
    the connection; aiohttp, under `vllm bench serve`, sends the next request on it and fails
    with "Server disconnected" (curl retries, and says "Connection died"). `Connection: close`
    makes the client open a connection per request, as the server does anyway."""
    if system == "llamacpp":
        return {"Connection": "close"}
    return None


class LlamaCppServer:
    """One of llama.cpp's servers on a free port, in its own process group; stopped with
    SIGTERM (SIGKILL after 30 s)."""

    def __init__(self, install: LlamaCppInstall, system: str, model: str, gguf: Path,
                 workdir: Path) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / f"{system}.log").open("ab")
        self.system = system
        if system == "llamacpp":
            command = llama_server_command(install.llama_server, gguf, model, self.port)
        elif system == "llamacpp-python":
            command = llama_cpp_python_command(install.python, gguf, model, self.port)
        else:
            raise ValueError(f"{system!r} is not one of {LLAMACPP_SYSTEMS}")
        self.log.write(f"$ {' '.join(command)}\n".encode())
        self.log.flush()
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready(model)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, model: str) -> None:
        """Until /v1/models answers with the model (llama-server's /health says 503 while the
        model loads; llama_cpp.server has no /health)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.log.name}: the server exited")
            try:
                response = httpx.get(f"{self.url}/v1/models", timeout=2)
                if response.status_code == 200 and model in response.text:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.log.name}: the server did not start in {START_TIMEOUT_S} s")

    def tokens_generated(self) -> int | None:
        """llama-server's own count of the tokens it generated so far (its Prometheus counter),
        or None for llama_cpp.server, which keeps none. `vllm bench serve` cannot count
        llama-server's tokens: it reads `usage` only from a chunk without choices, and
        llama-server sends it in the last chunk with the finish reason, so the load generator
        re-tokenizes the text instead, which counts fewer tokens than were generated (65 for
        128 on one random prompt here)."""
        if self.system != "llamacpp":
            return None
        metrics = httpx.get(f"{self.url}/metrics", timeout=10)
        metrics.raise_for_status()
        for line in metrics.text.splitlines():
            if line.startswith("llamacpp:tokens_predicted_total "):
                return int(float(line.split()[1]))
        raise RuntimeError(f"{self.url}/metrics has no llamacpp:tokens_predicted_total")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
