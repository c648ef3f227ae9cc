"""The generation worker's loop without sockets: a real engine on the tiny model, a context
worker prefilling for it, NIXL agents that copy blocks in-process (tests/unit/worker_doubles.py)
and a clock the test moves. Pull failure, abort during a pull, short leases and drains as plain
calls, with what the worker sends read off its Outbox."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.protocol import (
    FAILED,
    Abort,
    Chunk,
    GenerateRequest,
    Message,
    PeersRequest,
    PrefillDone,
    Registered,
    RequestFailed,
    RequestFinished,
    TokenBatch,
    pack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.tokenizer import load_tokenizer
from common.worker_process import ORCHESTRATOR, EngineFault, Outbox
from context_worker.worker import ContextWorker
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from generation_worker.worker import GenerationWorker
from postproc_worker.worker import PostprocWorker
from tests.unit.worker_doubles import (
    BLOCK_SIZE,
    FRONTEND,
    NUM_BLOCKS,
    POSTPROC,
    Clock,
    FakeAgent,
    cluster_config,
    decode_request,
    generate_request,
    prefill_request,
    sent,
)

PROMPT = list(range(40, 54))  # 3 full blocks and 2 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
MAX_STEPS = 100


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """(context, generation, reference), shared by the module's tests: each leaves them empty."""
    config = EngineConfig(model=str(tiny_model_path), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engines = LLMEngine(config), LLMEngine(config), LLMEngine(config)
    for engine in engines:  # the first steps are slow (kernels warm up): not in a test's time
        reference_tokens(engine, [1, 2, 3], SamplingParams(max_tokens=2))
    return engines


@dataclass
class Pair:
    """A context and a generation worker that read each other's KV."""

    context: ContextWorker
    generation: GenerationWorker
    source: FakeAgent  # the context worker's agent
    reader: FakeAgent  # the generation worker's
    clock: Clock

    def prefill(self, request: GenerateRequest) -> PrefillDone:
        """Prefill on the context worker until it answers."""
        assert self.context.handle(prefill_request(request), self.clock.now) == []
        for _ in range(MAX_STEPS):
            for message in sent(self.context.step(self.clock.now)):
                if isinstance(message, PrefillDone):
                    return message
        raise AssertionError("no PrefillDone")

    def decode(self, message: Message) -> Outbox:
        """Hand `message` to the generation worker and step it until it is idle."""
        out = self.generation.handle(message, self.clock.now)
        for _ in range(MAX_STEPS):
            out += self.generation.step(self.clock.now)
            if self.generation.idle(self.clock.now):
                return out
        raise AssertionError("the generation worker never went idle")


def pair_of(model_path: Path, engines, **transfer: object) -> Pair:
    """Workers over engines[0] (context) and engines[1] (generation), their agents linked."""
    context_engine, generation_engine, _ = engines
    config = cluster_config(model_path, **transfer)
    clock, fabric = Clock(), {}
    source = FakeAgent("ctx-agent", context_engine.kv_cache.pool, fabric)
    reader = FakeAgent("gen-agent", generation_engine.kv_cache.pool, fabric)
    context = ContextWorker(config, "ctx-0", context_engine, source, clock)
    generation = GenerationWorker(config, "gen-0", generation_engine, reader, clock)
    generation.handle(Registered(peers=[source.info()]), clock.now)
    return Pair(context, generation, source, reader, clock)


@pytest.fixture
def make_pair(tiny_model_path: Path, engines) -> Iterator:
    context_engine, generation_engine, _ = engines

    def make(**transfer: object) -> Pair:
        return pair_of(tiny_model_path, engines, **transfer)

    yield make
    for engine in (context_engine, generation_engine):
        assert not engine.has_unfinished()
        assert engine.kv_usage.used == 0 and engine.num_held_blocks == 0


def reference_tokens(engine: LLMEngine, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine.add_request("reference", prompt, sampling)
    tokens = []
    while engine.has_unfinished():
        tokens += [out.token_id for out in engine.step()]
    return tokens


def batches(out: Outbox) -> list[TokenBatch]:
    return [m for m in sent(out, POSTPROC) if isinstance(m, TokenBatch)]


def tokens_out(out: Outbox) -> list[int]:
    return [t for batch in batches(out) for delta in batch.deltas for t in delta.token_ids]


def finish_reasons(out: Outbox) -> list[str | None]:
    return [d.finish_reason for batch in batches(out) for d in batch.deltas if d.finish_reason]


def only(messages: list[Message], kind: type) -> Message:
    matching = [m for m in messages if isinstance(m, kind)]
    assert len(matching) == 1, messages
    return matching[0]


def test_a_request_lives_prefill_to_frames_without_sockets(make_pair, engines, tiny_model_path):
    pair = make_pair()
    request = generate_request("cmpl-life", PROMPT, GREEDY)
    done = pair.prefill(request)
    assert done.lease_s == 30.0 and len(done.block_ids) == -(-len(PROMPT) // BLOCK_SIZE)
    assert pair.context.leases and not pair.context.idle(pair.clock.now)

    out = pair.decode(decode_request(request, done))
    expected = reference_tokens(engines[2], PROMPT, GREEDY)
    assert tokens_out(out) == expected
    first_batch = batches(out)[0]
    # the postproc worker hears of it once, first, as the orchestrator packed it
    assert first_batch.starts == [pack_postproc_start(request.postproc_start())]
    assert all(batch.starts == [] for batch in batches(out)[1:])
    finished = only(sent(out), RequestFinished)
    assert isinstance(finished, RequestFinished)
    assert finished.finish_reason == "length" and finished.num_output_tokens == len(expected)
    assert finished.transfer_num_bytes > 0
    assert pair.generation.stats().kv_pull_failures == 0

    pair.context.step(pair.clock.now)  # the READ's notification ends the lease
    assert pair.context.idle(pair.clock.now)

    postproc = PostprocWorker(load_tokenizer(tiny_model_path), pair.clock)
    frames = [frame for b in batches(out) for frame in postproc.handle(b, pair.clock.now)]
    ((to, body),) = frames  # not streamed: the whole body at the end
    assert to == FRONTEND and isinstance(body, Chunk)
    assert body.done and body.completion_tokens == len(expected)
    text = json.loads(body.data)["choices"][0]["text"]
    assert text == postproc.tokenizer.decode(expected)


def test_a_failed_pull_prefills_the_prompt_here_with_the_same_tokens(make_pair, engines):
    pair = make_pair()
    pair.reader.hold_reads = True
    request = generate_request("cmpl-recompute", PROMPT, GREEDY)
    out = pair.generation.handle(decode_request(request, pair.prefill(request)), pair.clock.now)
    out += pair.generation.step(pair.clock.now)
    ((handle, *_),) = pair.reader.reads.values()
    pair.reader.fail(handle, "the source is gone")
    out += pair.decode(Registered(peers=[pair.source.info()]))

    assert tokens_out(out) == reference_tokens(engines[2], PROMPT, GREEDY)
    assert pair.reader.released == [handle]
    stats = pair.generation.stats()
    assert stats.kv_pull_failures == 1 and stats.prompts_recomputed == 1
    assert not any(isinstance(m, RequestFailed) for m in sent(out))
    pair.context.step(pair.clock.now)  # told that nothing more will be read
    assert pair.context.idle(pair.clock.now)


def test_a_failed_pull_fails_the_request_when_recompute_is_off(make_pair):
    pair = make_pair(recompute_on_failure=False)
    pair.reader.hold_reads = True
    request = generate_request("cmpl-fail", PROMPT, GREEDY)
    out = pair.generation.handle(decode_request(request, pair.prefill(request)), pair.clock.now)
    out += pair.generation.step(pair.clock.now)
    ((handle, *_),) = pair.reader.reads.values()
    pair.reader.fail(handle, "the source is gone")
    out += pair.decode(Registered(peers=[pair.source.info()]))

    failed = only(sent(out), RequestFailed)
    assert isinstance(failed, RequestFailed)
    assert failed.status_code == 503 and failed.code == "kv_transfer_failed"
    assert "the source is gone" in failed.message
    finished = only(sent(out), RequestFinished)
    assert isinstance(finished, RequestFinished) and finished.finish_reason == FAILED
    assert finish_reasons(out) == [FAILED]  # the postproc worker drops it, sends nothing
    pair.context.step(pair.clock.now)
    assert pair.context.idle(pair.clock.now)


def test_abort_during_a_pull_cancels_the_read_before_freeing_its_blocks(make_pair):
    pair = make_pair()
    pair.reader.hold_reads = True
    request = generate_request("cmpl-abort", PROMPT, GREEDY)
    out = pair.generation.handle(decode_request(request, pair.prefill(request)), pair.clock.now)
    out += pair.generation.step(pair.clock.now)
    ((handle, *_),) = pair.reader.reads.values()
    assert pair.generation.engine.kv_usage.used > 0  # blocks the READ writes into

    out += pair.generation.handle(Abort(request_id="cmpl-abort"), pair.clock.now)
    assert pair.reader.released == [handle] and pair.reader.reads == {}
    assert pair.generation.engine.kv_usage.used == 0
    out += pair.generation.step(pair.clock.now)
    finished = only(sent(out), RequestFinished)
    assert isinstance(finished, RequestFinished) and finished.finish_reason == "abort"
    assert finish_reasons(out) == ["abort"]  # the response closes normally
    assert pair.generation.idle(pair.clock.now)
    pair.context.step(pair.clock.now)  # the source was told to free its lease
    assert pair.context.idle(pair.clock.now)


def test_a_lease_too_short_to_read_in_is_prefilled_here(make_pair, engines):
    pair = make_pair()
    request = generate_request("cmpl-short-lease", PROMPT, GREEDY)
    done = pair.prefill(request)
    pair.clock.now += done.lease_s - 1.0  # the hand-off took most of the lease
    out = pair.decode(decode_request(request, done))

    assert pair.reader.reads == {} and pair.reader.released == []  # never read
    assert tokens_out(out) == reference_tokens(engines[2], PROMPT, GREEDY)
    assert pair.generation.stats().prompts_recomputed == 1
    pair.context.step(pair.clock.now)
    assert pair.context.idle(pair.clock.now)


def test_a_source_it_does_not_know_is_asked_for_then_read(make_pair, engines):
    pair = make_pair()
    pair.generation.handle(Registered(peers=[]), pair.clock.now)  # the peer set lags
    request = generate_request("cmpl-unknown-peer", PROMPT, GREEDY)
    decode = decode_request(request, pair.prefill(request))
    out = pair.generation.handle(decode, pair.clock.now)
    out += pair.generation.step(pair.clock.now)
    out += pair.generation.step(pair.clock.now)  # asked once a second at most
    assert [m for m in sent(out) if isinstance(m, PeersRequest)] == [PeersRequest("gen-0")]
    assert not pair.generation.idle(pair.clock.now) and pair.generation.waiting == [decode]

    out += pair.decode(Registered(peers=[pair.source.info()]))
    assert tokens_out(out) == reference_tokens(engines[2], PROMPT, GREEDY)
    assert pair.generation.stats().prompts_recomputed == 0
    pair.context.step(pair.clock.now)


def test_a_request_not_handed_off_is_prefilled_here(make_pair, engines):
    pair = make_pair()
    request = generate_request("cmpl-local", PROMPT, GREEDY)
    out = pair.decode(decode_request(request))
    assert tokens_out(out) == reference_tokens(engines[2], PROMPT, GREEDY)
    first_delta = batches(out)[0].deltas[0]
    assert first_delta.times is not None and first_delta.times.first_token_s >= 0


def test_drain_waits_for_the_pull_and_the_last_batch(make_pair):
    pair = make_pair()
    pair.reader.hold_reads = True
    request = generate_request("cmpl-drain", PROMPT, GREEDY)
    pair.generation.handle(decode_request(request, pair.prefill(request)), pair.clock.now)
    assert not pair.generation.idle(pair.clock.now)  # waiting for a slot
    pair.generation.step(pair.clock.now)
    assert pair.generation.pulls and not pair.generation.idle(pair.clock.now)
    ((handle, *_),) = pair.reader.reads.values()
    pair.reader.complete(handle)
    while not pair.generation.idle(pair.clock.now):
        out = pair.generation.step(pair.clock.now)
    assert any(isinstance(m, RequestFinished) for m in sent(out))
    assert batches(out)  # the last tokens went out with the step that went idle
    pair.context.step(pair.clock.now)


def test_a_failed_engine_step_fails_every_request(make_pair):
    pair = make_pair()
    for request_id in ("cmpl-f1", "cmpl-f2"):
        pair.generation.handle(
            decode_request(generate_request(request_id, PROMPT, GREEDY)), pair.clock.now
        )

    def broken_step() -> list:
        raise RuntimeError("a kernel fault")

    pair.generation.engine.step = broken_step
    try:
        with pytest.raises(EngineFault) as fault:
            pair.generation.step(pair.clock.now)
    finally:
        del pair.generation.engine.step  # the module's engine steps again
    failures = [m for to, m in fault.value.out if to == ORCHESTRATOR]
    assert [(f.request_id, f.status_code) for f in failures] == [("cmpl-f1", 500), ("cmpl-f2", 500)]
    for request_id in ("cmpl-f1", "cmpl-f2"):  # the process exits; the engine is cleared here
        pair.generation.engine.abort(request_id)
