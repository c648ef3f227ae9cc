"""The context worker's loop without sockets: a real engine on the tiny model, a NIXL agent
double (tests/unit/worker_doubles.py) and a clock the test moves. Leases end by a reader's
notification, by expiry or by abort, each a plain call."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.protocol import (
    Abort,
    PrefillDone,
    RequestFailed,
    TokenBatch,
    unpack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.worker_process import EngineFault
from context_worker.worker import ContextWorker
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.unit.worker_doubles import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    POSTPROC,
    Clock,
    FakeAgent,
    cluster_config,
    generate_request,
    prefill_request,
    sent,
)

PROMPT = list(range(40, 54))  # 3 full blocks and 2 tokens
SAMPLING = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LEASE_S = 30.0  # transfer.lease_seconds's default
MAX_STEPS = 50


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LLMEngine:
    """Shared by the module's tests: each leaves it empty."""
    config = EngineConfig(model=str(tiny_model_path), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine = LLMEngine(config)
    engine.add_request("warm-up", [1, 2, 3], SamplingParams(max_tokens=1))
    while engine.has_unfinished():  # the first steps are slow: not in a test's time
        engine.step()
    return engine


@pytest.fixture
def worker(tiny_model_path: Path, engine: LLMEngine):
    clock = Clock()
    agent = FakeAgent("ctx-agent", engine.kv_cache.pool, {})
    yield ContextWorker(cluster_config(tiny_model_path), "ctx-0", engine, agent, clock)
    assert not engine.has_unfinished()
    assert engine.kv_usage.used == 0 and engine.num_held_blocks == 0


def prefill(worker: ContextWorker, request_id: str, sampling: SamplingParams = SAMPLING):
    """Everything the worker sends until it answers the request, and the answer."""
    clock = worker.clock
    request = generate_request(request_id, PROMPT, sampling)
    out = worker.handle(prefill_request(request), clock())
    for _ in range(MAX_STEPS):
        out += worker.step(clock())
        answers = [m for m in sent(out) if isinstance(m, PrefillDone | RequestFailed)]
        if answers:
            return out, answers[0]
    raise AssertionError("no answer")


def test_prefill_done_leases_the_prompt_blocks_until_the_reader_says_it_read_them(worker):
    out, done = prefill(worker, "cmpl-read")
    assert isinstance(done, PrefillDone)
    assert done.agent_name == "ctx-agent" and done.worker_id == "ctx-0"
    assert len(done.block_ids) == -(-len(PROMPT) // BLOCK_SIZE) and done.lease_s == LEASE_S
    assert [(d.index, len(d.token_ids)) for d in done.first] == [(0, 1)]
    assert done.times.first_token_s >= 0
    assert worker.engine.num_held_blocks == len(done.block_ids)
    assert sent(out, POSTPROC) == []  # the generation worker forwards the first token
    assert not worker.idle(worker.clock())  # a drain waits for the reader

    worker.agent.notifications.append(("gen-agent", b"cmpl-read"))  # the READ completed
    worker.step(worker.clock())
    assert worker.engine.num_held_blocks == 0 and worker.idle(worker.clock())


def test_an_expired_lease_frees_the_blocks(worker):
    _, done = prefill(worker, "cmpl-expire")
    worker.clock.now += LEASE_S - 0.1
    worker.step(worker.clock())
    assert worker.engine.num_held_blocks == len(done.block_ids)  # not yet
    worker.clock.now += 0.1
    worker.step(worker.clock())
    assert worker.engine.num_held_blocks == 0 and not worker.leases
    worker.agent.notifications.append(("gen-agent", b"cmpl-expire"))  # a late reader: no-op
    worker.step(worker.clock())


def test_abort_while_prefilling_frees_everything_and_answers_nothing(worker):
    request = generate_request("cmpl-abort", PROMPT, SAMPLING)
    worker.handle(prefill_request(request), worker.clock())
    assert not worker.idle(worker.clock())
    assert worker.handle(Abort(request_id="cmpl-abort"), worker.clock()) == []
    assert worker.prefilling == {} and worker.idle(worker.clock())
    assert not any(isinstance(m, PrefillDone) for m in sent(worker.step(worker.clock())))


def test_abort_of_a_leased_request_ends_the_lease(worker):
    prefill(worker, "cmpl-abort-leased")
    worker.handle(Abort(request_id="cmpl-abort-leased"), worker.clock())
    assert not worker.leases and worker.engine.num_held_blocks == 0


def test_a_first_token_that_ends_every_choice_goes_to_the_postproc_worker(worker):
    out, done = prefill(worker, "cmpl-one", SamplingParams(temperature=0.0, max_tokens=1))
    assert isinstance(done, PrefillDone) and done.finished
    assert done.block_ids == [] and done.lease_s == 0.0 and not worker.leases
    (batch,) = sent(out, POSTPROC)
    assert isinstance(batch, TokenBatch)
    assert [unpack_postproc_start(s).request_id for s in batch.starts] == ["cmpl-one"]
    assert [(d.finish_reason, d.times) for d in batch.deltas] == [("length", done.times)]
    assert [m for _, m in out].index(batch) < [m for _, m in out].index(done)  # tokens first


def test_each_choice_has_its_first_token_in_one_answer(worker):
    sampling = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    _, done = prefill(worker, "cmpl-n3", sampling)
    assert isinstance(done, PrefillDone)
    assert [d.index for d in done.first] == [0, 1, 2]
    assert all(len(d.token_ids) == 1 for d in done.first)
    assert worker.prefilling == {}
    worker.handle(Abort(request_id="cmpl-n3"), worker.clock())


def test_an_invalid_prompt_fails_with_a_400(worker):
    request = generate_request("cmpl-bad", [1, 10**6], SAMPLING)
    (failed,) = sent(worker.handle(prefill_request(request), worker.clock()))
    assert isinstance(failed, RequestFailed)
    assert (failed.status_code, failed.code, failed.param) == (400, "invalid_request", "prompt")
    assert worker.prefilling == {} and worker.idle(worker.clock())


def test_a_failed_engine_step_fails_every_prefill(worker):
    for request_id in ("cmpl-f1", "cmpl-f2"):
        request = generate_request(request_id, PROMPT, SAMPLING)
        worker.handle(prefill_request(request), worker.clock())

    def broken_step() -> list:
        raise RuntimeError("a kernel fault")

    worker.engine.step = broken_step
    try:
        with pytest.raises(EngineFault) as fault:
            worker.step(worker.clock())
    finally:
        del worker.engine.step  # the module's engine steps again
    failures = sent(fault.value.out)
    assert [(f.request_id, f.status_code) for f in failures] == [
        ("cmpl-f1", 500),
        ("cmpl-f2", 500),
    ]
    for request_id in ("cmpl-f1", "cmpl-f2"):  # the process exits; the engine is cleared here
        worker.engine.abort(request_id)
