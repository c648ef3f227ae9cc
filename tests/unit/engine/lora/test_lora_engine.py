"""The engine's LoRA adapters against transformers + peft on the tiny model, and a batch mixing
adapters and the base model against each run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import LoRAConfig
from common.errors import InvalidRequest
from common.protocol import salt_extra_keys
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, TokenOutput
from tests.lora_adapters import make_adapter, peft_model
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a0": make_adapter(tiny_model_path, root / "a0", seed=0),
        "a1": make_adapter(
            tiny_model_path, root / "a1", seed=1, rank=4, alpha=8, targets=("q_proj", "v_proj")
        ),  # fmt: skip
        "a2": make_adapter(tiny_model_path, root / "a2", seed=2, rank=16, alpha=8, rslora=True),
        "a3": make_adapter(
            tiny_model_path,
            root / "a3",
            seed=3,
            magnitude=0.15,
            targets=("o_proj", "down_proj", "gate_proj"),
        ),  # fmt: skip
    }


def engine_for(model: Path, adapters: dict[str, Path], **options: object) -> LLMEngine:
    lora = LoRAConfig(adapters={n: str(p) for n, p in adapters.items()}, max_loras=4)
    return LLMEngine(EngineConfig(model=str(model), num_blocks=512, block_size=4, lora=lora,
                                  **options))  # fmt: skip


def run(engine: LLMEngine, jobs: list[tuple[str, list[int], str | None]]) -> dict[str, list]:
    """Every job at once (one batch); each request's tokens and log-probs."""
    for request_id, prompt, lora in jobs:
        engine.add_request(request_id, prompt, GREEDY, salt_extra_keys(None, lora))
    outputs: dict[str, list[TokenOutput]] = {request_id: [] for request_id, _, _ in jobs}
    for _ in range(10 * MAX_NEW):
        for out in engine.step():
            outputs[out.request_id].append(out)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return {r: [(o.token_id, o.logprob) for o in outs] for r, outs in outputs.items()}


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]  # fmt: skip
    return tokens, logprobs


@pytest.fixture(scope="module")
def prompts(tiny_model_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return [tokenizer(p).input_ids for p in TEST_PROMPTS[:5]]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path, adapters: dict[str, Path]) -> LLMEngine:
    return engine_for(tiny_model_path, adapters)


def test_each_adapter_matches_transformers_peft(
    engine: LLMEngine, adapters: dict[str, Path], prompts: list[list[int]], tiny_model_path: Path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    base_tokens, base_logprobs = hf_greedy(base, prompts[0])
    for name, path in adapters.items():
        reference = peft_model(tiny_model_path, path)
        tokens, logprobs = hf_greedy(reference, prompts[0])
        got = run(engine, [(f"one-{name}", prompts[0], name)])[f"one-{name}"]
        assert [t for t, _ in got] == tokens, name
        assert [lp for _, lp in got] == pytest.approx(logprobs, abs=2e-4), name
        # not a real check unless the adapter moves the output: its tokens, or (where the host's
        # float32 arithmetic keeps the greedy tokens) their log-probs far past the tolerance
        moved = tokens != base_tokens or logprobs != pytest.approx(base_logprobs, abs=2e-2)
        assert moved, f"{name} leaves the output unchanged: not a real check"


def test_mixed_batch_gives_each_adapter_its_own_output(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    """Four adapters and the base in one batch (decodes and prefills of different adapters in
    the same steps) against each alone."""
    names: list[str | None] = [None, "a0", "a1", "a2", "a3"]
    # each adapter on its own prompt, and every adapter on prompt 0 (shared tokens: never a
    # shared cached block)
    jobs = [(f"own-{i}", prompt, name)
            for i, (name, prompt) in enumerate(zip(names, prompts, strict=True))]  # fmt: skip
    jobs += [(f"same-{name}", prompts[0], name) for name in names]
    alone = {}
    for request_id, prompt, name in jobs:
        alone.update(run(engine, [(request_id, prompt, name)]))
    mixed = run(engine, jobs)
    for request_id, _, _ in jobs:
        assert [t for t, _ in mixed[request_id]] == [t for t, _ in alone[request_id]], request_id
        assert [lp for _, lp in mixed[request_id]] == pytest.approx(
            [lp for _, lp in alone[request_id]], abs=1e-4
        ), request_id
    logprobs = {tuple(lp for _, lp in mixed[f"same-{name}"]) for name in names}
    assert len(logprobs) == len(names), "two adapters gave the same output"
    usage = engine.kv.usage
    assert usage.used == 0 and usage.free + usage.cached == usage.total


def test_prefix_cache_is_keyed_by_adapter(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """A prompt cached under the base model is not a hit under an adapter, and is one again
    under the same adapter."""
    prompt = list(range(100, 130))  # no other test's
    run(engine, [("warm-base", prompt, None)])
    before = engine.admission.prefix_cache_hit_tokens
    run(engine, [("cold-a0", prompt + [5], "a0")])
    assert engine.admission.prefix_cache_hit_tokens == before
    run(engine, [("hot-a0", prompt + [5], "a0")])
    assert engine.admission.prefix_cache_hit_tokens > before


def test_unknown_adapter_is_refused(engine: LLMEngine, prompts: list[list[int]]) -> None:
    with pytest.raises(InvalidRequest, match="not loaded"):
        engine.add_request("x", prompts[0], GREEDY, salt_extra_keys(None, "nope"))
    assert not engine.has_unfinished()


def test_a_decode_hand_off_without_the_adapter_is_refused(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    """A generation worker handed a prefilled request whose adapter it lacks refuses it (the
    worker answers 400) rather than decode the prompt's KV with other weights."""
    keys = salt_extra_keys(None, "not-here")
    with pytest.raises(InvalidRequest, match="not loaded on this worker"):
        engine.add_pulled_request("pulled", prompts[0], GREEDY, {0: 7}, 0, keys)
    with pytest.raises(InvalidRequest, match="not loaded on this worker"):
        engine.add_continued_request("continued", prompts[0], GREEDY, {0: 7}, keys)
    assert not engine.has_unfinished() and engine.kv.usage.used == 0


def test_load_and_unload_at_run_time(
    engine: LLMEngine, adapters: dict[str, Path], prompts: list[list[int]]
) -> None:
    before = run(engine, [("before", prompts[2], "a1")])["before"]
    with pytest.raises(ValueError, match="slots are taken"):
        engine.load_lora_adapter("extra", str(adapters["a0"]))
    engine.add_request("busy", prompts[2], GREEDY, salt_extra_keys(None, "a1"))
    with pytest.raises(ValueError, match="in use"):
        engine.unload_lora_adapter("a1")
    engine.abort("busy")
    engine.unload_lora_adapter("a1")
    assert engine.lora_adapters == ["a0", "a2", "a3"]
    with pytest.raises(InvalidRequest):
        engine.add_request("gone", prompts[2], GREEDY, salt_extra_keys(None, "a1"))
    # a reload under the same name with other weights: none of the old cached blocks is hit
    engine.load_lora_adapter("a1", str(adapters["a0"]))
    reloaded = run(engine, [("reloaded", prompts[2], "a1")])["reloaded"]
    assert reloaded == run(engine, [("as-a0", prompts[2], "a0")])["as-a0"]
    assert reloaded != before
    engine.unload_lora_adapter("a1")
    engine.load_lora_adapter("a1", str(adapters["a1"]))
    back = run(engine, [("back", prompts[2], "a1")])["back"]
    assert [t for t, _ in back] == [t for t, _ in before]
    assert [lp for _, lp in back] == pytest.approx([lp for _, lp in before], abs=1e-5)


def test_bad_adapters_are_refused_clearly(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = engine_for(tiny_model_path, {})
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_lora_adapter("missing", str(tmp_path))
    big = make_adapter(tiny_model_path, tmp_path / "big", seed=4, rank=32)
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.load_lora_adapter("big", str(big))
    assert engine.lora_adapters == []
    plain = LLMEngine(EngineConfig(model=str(tiny_model_path), num_blocks=64))
    with pytest.raises(InvalidRequest, match="serves no adapters"):
        plain.add_request("x", [1, 2, 3], GREEDY, salt_extra_keys(None, "a0"))
    with pytest.raises(ValueError, match="LoRA is off"):
        plain.load_lora_adapter("a0", str(adapters["a0"]))


@pytest.mark.long
def test_real_model_adapter_matches_transformers_peft(smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2-135M (float32) with a random rank-16 adapter on every projection: the greedy
    tokens and log-probs of transformers + peft, alone and beside the base model in one batch
    (layer by layer there: the C decode step runs no LoRA)."""
    adapter = make_adapter(smollm2_path, tmp_path / "a", seed=7, rank=16, alpha=32,
                           magnitude=0.03)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tokenizer("The three primary colors are").input_ids
    reference = hf_greedy(peft_model(smollm2_path, adapter), prompt)
    base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    base_reference = hf_greedy(base, prompt)
    assert reference[0] != base_reference[0]
    engine = engine_for(smollm2_path, {"a": adapter})
    got = run(engine, [("lora", prompt, "a"), ("base", prompt, None)])
    for request_id, (tokens, logprobs) in (("lora", reference), ("base", base_reference)):
        assert [t for t, _ in got[request_id]] == tokens
        assert [lp for _, lp in got[request_id]] == pytest.approx(logprobs, abs=1e-3)
