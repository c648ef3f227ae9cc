"""The engine against Hugging Face transformers on the tiny model: tokens, logprobs, blocks, bad
input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def hf(tiny_model_path: Path) -> tuple[object, object]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def hf_greedy(hf: tuple) -> list[list[int]]:
    """Reference continuations, one prompt at a time (no padding effects)."""
    model, tokenizer = hf
    outputs = []
    for prompt in TEST_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    # Small blocks, so that the short test prompts fill whole blocks and hit the prefix cache.
    return LLM(str(tiny_model_path), num_blocks=1024, block_size=4)


def assert_no_blocks_in_use(llm: LLM) -> None:
    stats = llm.engine.kv.usage
    assert stats.used == 0, stats
    assert stats.free + stats.cached == stats.total, stats


def test_greedy_batch_matches_hf_generate(llm: LLM, hf_greedy: list[list[int]]) -> None:
    assert len(TEST_PROMPTS) >= 8
    results = llm.generate(TEST_PROMPTS, GREEDY)
    for result, expected in zip(results, hf_greedy, strict=True):
        assert result.outputs[0].token_ids == expected
    assert_no_blocks_in_use(llm)


def test_greedy_with_prefix_cache_hits_matches_hf(llm: LLM, hf_greedy: list[list[int]]) -> None:
    llm.generate(TEST_PROMPTS, GREEDY)  # warm the prefix cache
    results = llm.generate(TEST_PROMPTS, GREEDY)
    assert any(r.num_cached_tokens > 0 for r in results), "expected prefix-cache hits"
    assert [r.outputs[0].token_ids for r in results] == hf_greedy
    assert_no_blocks_in_use(llm)


def test_greedy_with_small_chunked_prefill_matches_hf(
    tiny_model_path: Path, hf_greedy: list[list[int]]
) -> None:
    small = LLM(str(tiny_model_path), num_blocks=512, block_size=4, max_num_batched_tokens=7)
    results = small.generate(TEST_PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == hf_greedy
    assert_no_blocks_in_use(small)


def test_preemption_keeps_outputs_identical(
    tiny_model_path: Path, hf_greedy: list[list[int]]
) -> None:
    # Few blocks: the batch cannot fit, so running sequences are preempted and recomputed.
    tight = LLM(str(tiny_model_path), num_blocks=24, block_size=4, enable_prefix_caching=False)
    results = tight.generate(TEST_PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == hf_greedy
    assert_no_blocks_in_use(tight)


def test_shared_prefix_hits_cache_and_matches_hf(llm: LLM, hf: tuple) -> None:
    model, tokenizer = hf
    shared = " ".join(TEST_PROMPTS)  # long enough to fill several blocks
    prompts = [shared + " First question:", shared + " Second question:"]
    llm.generate([prompts[0]], GREEDY)
    result = llm.generate([prompts[1]], GREEDY)[0]
    assert result.num_cached_tokens >= 16
    ids = tokenizer(prompts[1], return_tensors="pt").input_ids
    expected = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)[0, ids.shape[1] :]
    assert result.outputs[0].token_ids == expected.tolist()


def test_logprobs_equal_hf_log_softmax(llm: LLM, hf: tuple) -> None:
    model, tokenizer = hf
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    for result in llm.generate(TEST_PROMPTS[:3], params):
        out = result.outputs[0]
        ids = torch.tensor([result.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[len(result.prompt_token_ids) - 1 : -1]
        for step, token_id in enumerate(out.token_ids):
            assert abs(out.logprobs[step] - reference[step, token_id].item()) < 1e-4
            top_ids = [t for t, _ in out.top_logprobs[step]]
            assert top_ids == reference[step].topk(5).indices.tolist()
            for t, lp in out.top_logprobs[step]:
                assert abs(lp - reference[step, t].item()) < 1e-4


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate([TEST_PROMPTS[0]], seeded)[0].outputs[0].token_ids
    again = llm.generate([TEST_PROMPTS[0]], seeded)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=0.9, max_tokens=16)
    batch = llm.generate(TEST_PROMPTS[:4], [seeded, unseeded, unseeded, unseeded])
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16)
    different = llm.generate([TEST_PROMPTS[0]], other_seed)[0].outputs[0].token_ids
    assert alone == again == batch[0].outputs[0].token_ids
    assert alone != different


def test_n_choices_share_the_prompt_and_differ(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    result = llm.generate([TEST_PROMPTS[1]], params)[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    assert_no_blocks_in_use(llm)


def test_stop_token_ids_and_min_tokens(llm: LLM, hf_greedy: list[list[int]]) -> None:
    stop_at = hf_greedy[0][5]
    stopped = llm.generate(
        [TEST_PROMPTS[0]],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] == stop_at and stop_at not in stopped.token_ids[:-1]
    forced = llm.generate(
        [TEST_PROMPTS[0]],
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert len(forced.token_ids) == 10 and stop_at not in forced.token_ids
    assert forced.finish_reason == "length"


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode(TEST_PROMPTS[2])
    engine.add_request("to-abort", ids, SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("to-finish", ids, SamplingParams(temperature=0.0, max_tokens=3))
    for _ in range(4):
        engine.step()
    assert engine.kv.usage.used > 0
    aborted = engine.abort("to-abort")
    assert [o.finish_reason for o in aborted] == ["abort"]
    assert not engine.has_unfinished()
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 5000, SamplingParams(max_tokens=1), "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=5000), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2, 3], SamplingParams(logprobs=99), "logprobs"),
        ([1, 2, 3], SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        ([10**7], SamplingParams(), "prompt"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(
    llm: LLM, prompt: list[int], params: SamplingParams, param: str, hf_greedy: list[list[int]]
) -> None:
    with pytest.raises(InvalidRequest) as info:
        llm.engine.add_request("bad", prompt, params)
    assert info.value.param == param
    assert not llm.engine.has_unfinished()
    assert llm.generate([TEST_PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == hf_greedy[0]


def test_unknown_sampling_field_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_a_context_longer_than_the_models_positions_is_refused_at_start() -> None:
    """Past max_position_embeddings the rotary tables have no rows: refused, not read past."""
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM("builtin:tiny", max_model_len=10**7)


def test_a_bfloat16_engine_runs_on_any_cpu(hf_greedy: list[list[int]]) -> None:
    """bfloat16 weights go to oneDNN where oneDNN runs bfloat16 on this CPU, else (an AVX2-only
    host refuses to pack them) to the panel kernel. Either way the engine starts and generates."""
    from engine.linear import Linear

    llm = LLM(dtype="bfloat16", num_blocks=64)
    layouts = {m.layout for m in llm.engine.model.modules() if isinstance(m, Linear)}
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert layouts == {"onednn" if onednn else "panels"}
    [out] = llm.generate([TEST_PROMPTS[0]], GREEDY)
    assert len(out.outputs[0].token_ids) == MAX_NEW
    # bfloat16 rounding may change a late token, not the first ones
    assert out.outputs[0].token_ids[:4] == hf_greedy[0][:4]


def test_float32_layers_run_the_panel_kernel(hf_greedy: list[list[int]]) -> None:
    """float32 weights are repacked into cpu_linear.c's panels and still give HF's greedy tokens
    (odd shapes and row counts: test_cpu_kernels.py)."""
    from engine.linear import Linear

    llm = LLM(num_blocks=64)
    assert {m.layout for m in llm.engine.model.modules() if isinstance(m, Linear)} == {"panels"}
    [out] = llm.generate([TEST_PROMPTS[0]], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_run.sh runs it)")
def test_greedy_on_the_gpu_matches_hf_on_the_cpu(hf_greedy: list[list[int]]) -> None:
    """The GPU path (Triton paged attention, CUDA KV cache) gives the CPU reference's tokens in
    float32; in bfloat16 rounding may change late tokens, so most prompts, not all, stay equal
    (seen on an H200: 7 of 10)."""
    llm = LLM(device="cuda", num_blocks=1024, block_size=16)
    assert [o.outputs[0].token_ids for o in llm.generate(list(TEST_PROMPTS), GREEDY)] == hf_greedy
    llm = LLM(device="cuda", dtype="bfloat16", num_blocks=1024, block_size=16)
    outs = llm.generate(list(TEST_PROMPTS), GREEDY)
    same = sum(o.outputs[0].token_ids == ids for o, ids in zip(outs, hf_greedy, strict=True))
    assert same > len(hf_greedy) // 2, f"{same} of {len(hf_greedy)} prompts equal in bfloat16"


def test_outputs_say_how_long_the_sequence_waited_and_has_run() -> None:
    """queue_s: arrival → first admission; run_s: since then. A request that waits for the
    only slot has a queue time at least the other's whole run."""
    llm = LLM(max_num_seqs=1, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.engine.add_request("first", [5, 6, 7], params)
    llm.engine.add_request("second", [8, 9, 10], params)
    outputs: dict[str, list] = {"first": [], "second": []}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outputs[out.request_id].append(out)
    first, second = outputs["first"], outputs["second"]
    assert [o.run_s for o in first] == sorted(o.run_s for o in first) and first[0].run_s > 0
    assert first[0].queue_s < second[0].queue_s
    assert second[0].queue_s >= first[-1].run_s
    assert {o.queue_s for o in second} == {second[0].queue_s}  # fixed at admission


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="bfloat16 keeps oneDNN's layout, and the C step's copy beside it, where oneDNN runs it",
)
def test_the_c_decode_steps_copy_is_kept_only_where_the_step_runs(smollm2_path: Path) -> None:
    """SmolLM2 in bfloat16 keeps a copy of its layers for the C decode step, and so does a model
    with per-head norms (the tiny Qwen3); with the torch attention backend the step does not run
    and the copy is freed."""
    from engine.config import EngineConfig
    from engine.linear import Linear
    from engine.llm_engine import LLMEngine

    def copies(config: EngineConfig) -> tuple[int, list[bool]]:
        model = LLMEngine(config).model
        layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
        return model.c_decode_max_rows, [m.decode_copy is not None for m in layers]

    for model in (str(smollm2_path), "builtin:tiny"):
        rows, kept = copies(EngineConfig(model=model, dtype="bfloat16", num_blocks=64))
        assert rows > 0 and all(kept), model
    config = EngineConfig(model=str(smollm2_path), dtype="bfloat16", num_blocks=64,
                          attention_backend="torch")  # fmt: skip
    rows, kept = copies(config)
    assert rows == 0 and not any(kept)
