"""The routes around generation in-process: the model list, tokenize / detokenize (against
transformers' tokenizer and chat template), version, and /health's reading of the orchestrator's
table. None of them submits a request."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from common.protocol import ClusterInfo, WorkerInfo
from tools.tiny_model.build import TEST_PROMPTS

MODEL = "builtin:tiny"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where do rivers go?"},
]

pytestmark = pytest.mark.usefixtures("nothing_reaches_the_cluster")


def test_models_version_tokenize_detokenize(
    http: TestClient, oai: openai.OpenAI, tiny_model_path: Path
) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert http.get("/version").json()["version"]
    tokens = http.post("/v1/tokenize", json={"prompt": TEST_PROMPTS[2]}).json()
    expected = AutoTokenizer.from_pretrained(tiny_model_path)(TEST_PROMPTS[2]).input_ids
    assert tokens["tokens"] == expected and tokens["count"] == len(expected)
    text = http.post("/v1/detokenize", json={"tokens": expected})
    assert text.json()["prompt"] == TEST_PROMPTS[2]
    rendered = http.post("/v1/tokenize", json={"messages": CHAT})
    hf = AutoTokenizer.from_pretrained(tiny_model_path).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True
    )
    hf_ids = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
    assert rendered.json()["tokens"] == list(hf_ids)


def test_models_retrieve(oai: openai.OpenAI) -> None:
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def worker(worker_id: str, role: str, state: str = "ready") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, pid=1, address="", state=state)


def test_health_says_which_role_has_no_live_worker(http: TestClient, fake) -> None:
    fake.info = None
    silent = http.get("/health")
    assert silent.status_code == 503 and silent.headers["retry-after"] == "1"
    assert silent.json()["error"]["message"] == "the orchestrator does not answer"
    context = worker("ctx-0", "context", "stalled")
    fake.info = ClusterInfo(workers=[context, worker("gen-0", "generation"),
                                     worker("pp-0", "postproc")])  # fmt: skip
    stalled = http.get("/health")
    assert stalled.status_code == 503
    assert stalled.json()["error"]["message"] == "no live context worker (ctx-0 stalled)"
    context.state = "ready"
    assert http.get("/health").status_code == 200
