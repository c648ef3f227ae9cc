"""lm-eval's `local-completions` against the cluster on the real model: the log-likelihoods it
reads (echo + logprobs, one sampled token left out) equal those lm-eval's own transformers
backend (`hf`) computes, within 1e-3, on a small local multiple-choice task and a rolling
(perplexity) one. Before the prompt's log-probs were served, every score came back 0.

Slow (SmolLM2 on two shared cores, and a transformers run beside it): `long`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.harness import Cluster

pytestmark = pytest.mark.long

MODEL = "builtin:smollm2-135m"
QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "a banana"], 0),
    ("Water freezes at a temperature of", ["zero degrees Celsius", "ninety degrees"], 0),
    ("A spider has", ["eight legs", "three wings", "no body"], 0),
    ("The opposite of hot is", ["cold", "purple"], 0),
]
PASSAGES = [
    "The sea was calm that morning, and the fishing boats left the harbour one after another.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside leaves.",
]
CHOICE_TASK = """\
task: pd_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
ROLLING_TASK = """\
task: pd_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    choices = root / "choices.jsonl"
    choices.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "label": label}) + "\n"
            for q, c, label in QUESTIONS
        )
    )
    rolling = root / "rolling.jsonl"
    rolling.write_text("".join(json.dumps({"text": t}) + "\n" for t in PASSAGES))
    (root / "pd_choices.yaml").write_text(CHOICE_TASK.format(data=choices))
    (root / "pd_rolling.yaml").write_text(ROLLING_TASK.format(data=rolling))
    return root


def evaluate(model: str, model_args: str, tasks_dir: Path) -> dict[str, list[float]]:
    """Each task's per-request log-likelihoods, in document order."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["pd_choices", "pd_rolling"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        batch_size=1,
    )
    scores = {}
    for task, samples in results["samples"].items():
        ordered = sorted(samples, key=lambda s: s["doc_id"])
        scores[task] = [_loglikelihood(r) for s in ordered for r in s["resps"]]
        assert all(math_ok(v) for v in scores[task]), (task, scores[task])
    return scores


def _loglikelihood(response: list) -> float:
    """A sample's response: [(log-likelihood, is_greedy)] or [log-likelihood] (rolling)."""
    first = response[0]
    return float(first[0] if isinstance(first, list | tuple) else first)


def math_ok(value: float) -> bool:
    return value < 0 and value == value  # a real log-likelihood: negative, not NaN


def test_local_completions_log_likelihoods_equal_transformers(
    start_cluster, smollm2_path: Path, tasks_dir: Path
) -> None:
    cluster: Cluster = start_cluster("disaggregated", model=MODEL)
    served = evaluate(
        "local-completions",
        f"base_url={cluster.base_url}/completions,model={MODEL},tokenizer={smollm2_path},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=120",
        tasks_dir,
    )
    reference = evaluate("hf", f"pretrained={smollm2_path},dtype=float32,device=cpu", tasks_dir)
    assert served.keys() == reference.keys()
    for task in reference:
        assert len(served[task]) == len(reference[task]) > 0, task
        for ours, theirs in zip(served[task], reference[task], strict=True):
            assert abs(ours - theirs) < 1e-3, (task, served[task], reference[task])
