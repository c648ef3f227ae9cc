"""Multi-LoRA through a real cluster in both modes, with the openai SDK: an adapter named in
cluster.yaml and one loaded at run time (POST /v1/load_lora_adapter, behind the API key) each
give what transformers + peft give on the same adapter, concurrently with the base model and
each other; /v1/models lists them with their parent; an unloaded or unknown model is a 404;
nothing is held after."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.harness import MODEL, Cluster
from tests.lora_adapters import make_adapter, peft_model

pytestmark = pytest.mark.long

MAX_NEW = 16
API_KEY = "lora-test-key"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(tiny_model_path, root / "sql", seed=10),
        "poet": make_adapter(
            tiny_model_path,
            root / "poet",
            seed=11,
            rank=4,
            alpha=16,
            targets=("q_proj", "v_proj", "down_proj"),
            magnitude=0.1,
        ),  # fmt: skip
    }


@pytest.fixture(scope="module")
def expected(tiny_model_path: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """Each adapter's (and the base model's) greedy tokens from transformers + peft."""
    prompt = AutoTokenizer.from_pretrained(tiny_model_path)(PROMPT).input_ids
    models = {None: AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)}
    models.update({name: peft_model(tiny_model_path, path) for name, path in adapters.items()})
    out = {}
    for name, model in models.items():
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                                 pad_token_id=0)  # fmt: skip
        out[name] = ids[0, len(prompt) :].tolist()
    assert len({tuple(t) for t in out.values()}) == len(out), "an adapter changes nothing"
    return out


def tokens(client: openai.OpenAI, model: str) -> list[int]:
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    return list(result.choices[0].token_ids)  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_adapters_match_peft_and_load_unload_at_run_time(
    mode: str,
    start_cluster: Callable[..., Cluster],
    adapters: dict[str, Path],
    expected: dict[str | None, list[int]],
) -> None:
    lora = f"lora: {{adapters: {{sql: {adapters['sql']}}}, max_loras: 2, max_lora_rank: 8}}\n"
    cluster = start_cluster(mode, extra=lora, api_key=API_KEY)
    client = openai.OpenAI(base_url=cluster.base_url, api_key=API_KEY, timeout=60, max_retries=0)
    admin = httpx.Client(base_url=cluster.base_url, timeout=150,
                         headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip

    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].model_extra["parent"] == MODEL  # type: ignore[index]
    assert tokens(client, "sql") == expected["sql"]
    assert tokens(client, MODEL) == expected[None]

    body = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
    assert httpx.post(f"{cluster.base_url}/load_lora_adapter", json=body).status_code == 401
    loaded = admin.post("/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    again = admin.post("/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already" in again.text
    assert {m.id for m in client.models.list().data} == {MODEL, "sql", "poet"}

    # the base model and both adapters at once, in the same batches: each its own output
    jobs = [MODEL, "sql", "poet"] * 3
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda model: tokens(client, model), jobs))
    for model, got in zip(jobs, results, strict=True):
        assert got == expected[None if model == MODEL else model], model
    chat = client.chat.completions.create(
        model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "poet" and chat.choices[0].message.content is not None

    unloaded = admin.post("/unload_lora_adapter", json={"lora_name": "poet"})
    assert unloaded.status_code == 200, unloaded.text
    assert {m.id for m in client.models.list().data} == {MODEL, "sql"}
    for gone in ("poet", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError):
            tokens(client, gone)
    missing = admin.post("/unload_lora_adapter", json={"lora_name": "poet"})
    assert missing.status_code == 404
    bad = admin.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    assert tokens(client, "sql") == expected["sql"]

    info = cluster.wait_idle()
    busy = [w for w in info.workers if w.blocks_used or w.blocks_leased or w.active_requests]
    assert not busy, busy
    assert info.lora_adapters == {"sql": str(adapters["sql"])}
