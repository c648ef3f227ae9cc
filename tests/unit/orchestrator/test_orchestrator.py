"""The orchestrator's logic without sockets: registration, routing, the request state machine,
and what happens to requests when workers die."""

from __future__ import annotations

import random

import msgspec
import pytest

from common.block_hash import block_hashes
from common.config import parse_cluster_config
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClusterInfo,
    ClusterInfoRequest,
    DecodeRequest,
    Drain,
    GenerateRequest,
    Heartbeat,
    KVPool,
    Leaving,
    LoRACommand,
    LoRADone,
    OutputOptions,
    PeersRequest,
    PrefillDone,
    PrefillRequest,
    Profile,
    ProfileDone,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    RequestFailed,
    RequestFinished,
    TokenDelta,
    WorkerStats,
    encode_token_ids,
    unpack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.stage_times import StageTimes
from orchestrator.conversations import ConversationAffinity
from orchestrator.orchestrator import Orchestrator, Outbox, State
from orchestrator.profile_round import ANSWER_TIMEOUT_S
from orchestrator.registry import WorkerRecord
from orchestrator.router import KVAwareRouter, LeastLoadedRouter, PrefixIndex, RoundRobinRouter
from orchestrator.stage_balance import StageBalance

FRONTEND = b"fe-0"


def pool(name: str) -> KVPool:
    return KVPool(
        agent_name=name, agent_metadata=b"m", base_address=1, num_blocks=8, block_num_bytes=64
    )


def register(
    orch: Orchestrator,
    worker_id: str,
    role: str,
    now: float = 0.0,
    pid: int = 1,
    instance: str | None = None,
) -> Outbox:
    """A worker's Register: a new process, or with `instance` the same one again."""
    message = Register(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        protocol_version=PROTOCOL_VERSION,
        pid=pid,
        address=f"tcp://127.0.0.1:{7000 + len(orch.registry.workers)}"
        if role == "postproc"
        else "",
        kv_pool=pool(f"{worker_id}-agent") if role == "context" else None,
    )
    if instance is not None:
        message.instance = instance
    return orch.handle(worker_id.encode(), message, now)


# for tests of routing between context workers, whose prompts pile up there unfinished:
# deflection, which could send some of them to the generation worker, takes no part
NO_DEFLECTION = "orchestrator: {max_prefill_queue_size: 0}"


def cluster(yaml: str = "", contexts: int = 1, generations: int = 1) -> Orchestrator:
    orch = Orchestrator(parse_cluster_config(yaml))
    for i in range(contexts):
        register(orch, f"ctx-{i}", "context")
    for i in range(generations):
        register(orch, f"gen-{i}", "generation")
    register(orch, "pp-0", "postproc")
    return orch


def generate(request_id: str = "cmpl-1", num_tokens: int = 40) -> GenerateRequest:
    """As a frontend sends it: with the prompt's length and block hashes (blocks of 16)."""
    prompt = list(range(num_tokens))
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids_b64=encode_token_ids(prompt),
        sampling=SamplingParams(max_tokens=8),
        output=OutputOptions(),
        reply_to="tcp://127.0.0.1:9999",
        num_prompt_tokens=num_tokens,
        prompt_block_hashes=block_hashes(prompt, 16),
    )


def prefill_done(request_id: str = "cmpl-1", finish_reason: str | None = None) -> PrefillDone:
    first = [TokenDelta(request_id, 0, [5], finish_reason=finish_reason)]
    blocks = [] if finish_reason else [3, 4, 5]
    return PrefillDone(
        request_id=request_id,
        worker_id="ctx-0",
        agent_name="ctx-0-agent",
        first=first,
        block_ids=blocks,
    )


def only(out: Outbox) -> tuple[bytes, object]:
    assert len(out) == 1, out
    return out[0]


def test_version_mismatch_is_refused_with_both_versions_named() -> None:
    orch = Orchestrator(parse_cluster_config(""))
    message = Register(worker_id="gen-0", role="generation", protocol_version=99, pid=1)
    _, reply = only(orch.handle(b"gen-0", message, 0.0))
    assert isinstance(reply, Refused)
    assert "99" in reply.reason and str(PROTOCOL_VERSION) in reply.reason
    assert not orch.registry.workers


def test_a_worker_of_the_previous_protocol_is_refused() -> None:
    """9 ends a prompt list's streams in the frontend: a version-8 postproc worker would drop
    OutputOptions.fanned_out unread and end each prompt's stream with its own [DONE], so a
    mixed deployment must fail at registration instead."""
    assert PROTOCOL_VERSION == 9
    orch = Orchestrator(parse_cluster_config(""))
    old = Register(worker_id="pp-0", role="postproc", protocol_version=8, pid=1)
    _, reply = only(orch.handle(b"pp-0", old, 0.0))
    assert isinstance(reply, Refused) and "8" in reply.reason
    assert not orch.registry.workers


def test_generation_workers_learn_context_pools_at_registration_and_on_change() -> None:
    orch = Orchestrator(parse_cluster_config(""))
    register(orch, "gen-0", "generation")
    out = register(orch, "ctx-0", "context")
    replies = dict(out)
    assert isinstance(replies[b"ctx-0"], Registered)
    update = replies[b"gen-0"]
    assert isinstance(update, Registered)
    assert [p.agent_name for p in update.peers] == ["ctx-0-agent"]
    _, reply = only(register(orch, "gen-1", "generation"))
    assert [p.agent_name for p in reply.peers] == ["ctx-0-agent"]


def updates_for(out: Outbox, worker_id: bytes) -> list[Registered]:
    return [m for to, m in out if to == worker_id and isinstance(m, Registered)]


def heartbeat(orch: Orchestrator, worker_id: str, now: float, **fields: object) -> Outbox:
    return orch.handle(
        f"{worker_id}/heartbeats".encode(), Heartbeat(worker_id=worker_id, **fields), now
    )


def test_a_context_worker_back_from_dead_is_sent_to_the_generation_workers_again() -> None:
    """The wedge of the integrity issue: a context worker silent past the timeout was dropped
    from the generation workers' peers, and its next heartbeat made it ready with nobody told:
    every request then failed on an unknown peer while /health said 200."""
    orch = cluster()
    version = orch.peers_version
    heartbeat(orch, "gen-0", 4.0, peers_version=version)
    heartbeat(orch, "pp-0", 4.0)
    (dropped,) = updates_for(orch.tick(6.0), b"gen-0")  # ctx-0 silent for 6 s: dead
    assert dropped.peers == [] and dropped.peers_version == version + 1
    heartbeat(orch, "ctx-0", 7.0)  # it was only slow: asked to register again
    instance = orch.registry.workers["ctx-0"].instance
    (back,) = updates_for(register(orch, "ctx-0", "context", 7.1, instance=instance), b"gen-0")
    assert [p.agent_name for p in back.peers] == ["ctx-0-agent"]
    assert back.peers_version == version + 2 and orch.registry.workers["ctx-0"].state == "ready"


def test_a_worker_back_from_dead_is_taken_back_once_its_command_socket_delivers() -> None:
    """Its heartbeats arriving again (a partition healed) do not prove that what the
    orchestrator sends it arrives: new work waits until it registers in answer to a
    RegisterAgain sent on its command socket, behind the aborts of the requests it lost."""
    orch = cluster("orchestrator: {router: round_robin}", generations=2)
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)  # decoding on gen-0, the first in turn
    for worker_id in ("ctx-0", "gen-1", "pp-0"):
        heartbeat(orch, worker_id, 4.0)
    out = orch.tick(6.0)  # gen-0 cut off: its request fails, its abort queued to it
    assert (b"gen-0", Abort(request_id="cmpl-1", reason="error")) in out
    assert only(heartbeat(orch, "gen-0", 8.0)) == (b"gen-0", RegisterAgain())  # not heartbeats'
    assert orch.registry.workers["gen-0"].state == "dead"
    for i in range(2):  # until it registers, new work goes elsewhere
        orch.handle(FRONTEND, generate(f"after-{i}"), 8.0)
        decode = orch.handle(b"ctx-0", prefill_done(f"after-{i}"), 8.0)
        assert [to for to, m in decode if isinstance(m, DecodeRequest)] == [b"gen-1"]
    instance = orch.registry.workers["gen-0"].instance
    out = register(orch, "gen-0", "generation", 8.5, instance=instance)
    assert orch.registry.workers["gen-0"].state == "ready"
    assert not [m for to, m in out if to == FRONTEND]  # the same process: nothing more failed


def test_a_generation_worker_behind_on_peers_is_sent_them_again() -> None:
    orch = cluster()
    (update,) = updates_for(heartbeat(orch, "gen-0", 1.0, peers_version=0), b"gen-0")
    assert update.peers_version == orch.peers_version  # to its main socket, not the heartbeats'
    assert (
        updates_for(heartbeat(orch, "gen-0", 1.5, peers_version=orch.peers_version), b"gen-0") == []
    )
    asked = orch.handle(b"gen-0", PeersRequest(worker_id="gen-0"), 2.0)
    assert [p.agent_name for p in updates_for(asked, b"gen-0")[0].peers] == ["ctx-0-agent"]


def test_a_stalled_worker_is_reported_kept_and_routed_around() -> None:
    orch = cluster(NO_DEFLECTION, contexts=2)
    stall_s = orch.config.orchestrator.stall_timeout_seconds
    heartbeat(orch, "ctx-0", 1.0, progress_age_s=stall_s + 1)  # alive, its loop stuck
    assert orch.registry.workers["ctx-0"].state == "stalled"
    for i in range(4):
        to, _ = only(orch.handle(FRONTEND, generate(f"r{i}"), 1.0))
        assert to == b"ctx-1"
    _, info = only(orch.handle(b"cli", ClusterInfoRequest(), 1.0))
    stalled = [w for w in info.workers if w.worker_id == "ctx-0"][0]
    assert stalled.state == "stalled" and stalled.progress_age_s == stall_s + 1
    heartbeat(orch, "ctx-1", 1.0, progress_age_s=stall_s + 1)  # every one stalled: still served
    to, message = only(orch.handle(FRONTEND, generate("r9"), 1.0))
    assert isinstance(message, PrefillRequest)
    heartbeat(orch, "ctx-0", 2.0, progress_age_s=0.1)
    assert orch.registry.workers["ctx-0"].state == "ready"
    assert [p.agent_name for p in orch.peers().peers] == ["ctx-0-agent", "ctx-1-agent"]


def test_role_lists_follow_every_registry_change_and_nothing_else() -> None:
    """Routing and the peer check read each role's workers from lists kept between registry
    changes (a rescan per message made each message cost O(workers)): every registration,
    state change, death and forgetting shows at once; a routine heartbeat rebuilds nothing."""
    orch = cluster(contexts=2)
    registry, stall_s = orch.registry, orch.config.orchestrator.stall_timeout_seconds

    def context_ids(workers: tuple[WorkerRecord, ...]) -> list[str]:
        return [w.worker_id for w in workers]

    assert context_ids(registry.routable("context")) == ["ctx-0", "ctx-1"]
    version = registry.version
    heartbeat(orch, "ctx-0", 1.0)
    heartbeat(orch, "gen-0", 1.0, peers_version=orch.peers_version)
    assert registry.version == version
    heartbeat(orch, "ctx-1", 2.0, progress_age_s=stall_s + 1)
    assert context_ids(registry.ready("context")) == ["ctx-0"]
    assert context_ids(registry.live("context")) == ["ctx-0", "ctx-1"]
    orch.tick(6.5)  # ctx-0 silent for 5.5 s: dead; ctx-1 (stalled) heard 4.5 s ago
    assert context_ids(registry.routable("context")) == ["ctx-1"]
    assert [p.agent_name for p in orch.peers().peers] == ["ctx-1-agent"]
    orch.tick(62.0)  # ctx-0 forgotten
    assert "ctx-0" not in registry.workers
    register(orch, "ctx-0", "context", now=62.0)
    assert context_ids(registry.routable("context")) == ["ctx-0"]


def test_a_draining_worker_gets_no_new_work_but_keeps_its_requests() -> None:
    orch = cluster(generations=2)
    orch.handle(FRONTEND, generate("r0"), 0.0)
    orch.handle(b"ctx-0", prefill_done("r0"), 0.0)
    held = orch.requests["r0"].generation_worker
    assert held is not None
    # the worker asks (SIGTERM), and is told how many requests still pass through it
    out = orch.handle(held.worker_id.encode(), Drain(worker_id=held.worker_id), 1.0)
    assert out == [(held.worker_id.encode(), Drain(worker_id=held.worker_id, in_flight=1))]
    heartbeat(orch, held.worker_id, 1.5, progress_age_s=0.1)  # progress does not undo it
    assert held.state == "draining" and held.alive and not held.ready
    other = "gen-1" if held.worker_id == "gen-0" else "gen-0"
    for i in range(1, 5):
        orch.handle(FRONTEND, generate(f"r{i}"), 2.0)
        to, _ = only(orch.handle(b"ctx-0", prefill_done(f"r{i}"), 2.0))
        assert to == other.encode()
    finished = RequestFinished(request_id="r0", worker_id=held.worker_id, finish_reason="length")
    orch.handle(held.worker_id.encode(), finished, 3.0)
    assert orch.tick(3.0) == [(held.worker_id.encode(), Drain(worker_id=held.worker_id))]
    assert orch.tick(3.1) == []  # told once per change
    assert orch.handle(held.worker_id.encode(), Leaving(worker_id=held.worker_id), 4.0) == []
    assert held.worker_id not in orch.registry.workers


def test_a_draining_context_worker_stays_a_kv_peer_until_it_leaves() -> None:
    orch = cluster(NO_DEFLECTION, contexts=2)
    orch.handle(b"cli", Drain(worker_id="ctx-0"), 0.0)
    assert [p.agent_name for p in orch.peers().peers] == ["ctx-0-agent", "ctx-1-agent"]
    for i in range(3):
        to, _ = only(orch.handle(FRONTEND, generate(f"r{i}"), 1.0))
        assert to == b"ctx-1"
    orch.handle(b"ctx-0", Leaving(worker_id="ctx-0"), 2.0)
    assert [p.agent_name for p in orch.peers().peers] == ["ctx-1-agent"]


def test_a_worker_that_leaves_before_its_requests_end_fails_them() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate("r0"), 0.0)
    orch.handle(b"ctx-0", prefill_done("r0"), 0.0)
    orch.handle(b"gen-0", Drain(worker_id="gen-0"), 0.0)
    out = orch.handle(b"gen-0", Leaving(worker_id="gen-0"), 60.0)  # its drain timed out
    failed = [m for to, m in out if to == FRONTEND]
    assert len(failed) == 1 and isinstance(failed[0], RequestFailed)
    assert failed[0].status_code == 503 and not orch.requests


def test_draining_the_last_worker_of_a_role_leaves_nothing_routable() -> None:
    orch = cluster()
    orch.handle(b"cli", Drain(worker_id="pp-0"), 0.0)
    _, failed = only(orch.handle(FRONTEND, generate("r0"), 0.0))
    assert isinstance(failed, RequestFailed) and failed.status_code == 503
    _, info = only(orch.handle(b"cli", ClusterInfoRequest(), 0.0))
    assert [w.state for w in info.workers if w.worker_id == "pp-0"] == ["draining"]


def test_a_drain_of_an_unknown_worker_is_ignored() -> None:
    orch = cluster()
    assert orch.handle(b"cli", Drain(worker_id="gen-9"), 0.0) == []


def test_heartbeat_from_an_unknown_worker_asks_it_to_register_again() -> None:
    orch = Orchestrator(parse_cluster_config(""))
    _, reply = only(orch.handle(b"gen-7", Heartbeat(worker_id="gen-7"), 0.0))
    assert isinstance(reply, RegisterAgain)


def test_disaggregated_request_goes_prefill_then_decode_then_ends() -> None:
    orch = cluster()
    to, message = only(orch.handle(FRONTEND, generate(), 0.0))
    assert to == b"ctx-0" and isinstance(message, PrefillRequest)
    assert message.postproc_address == orch.registry.workers["pp-0"].address
    assert orch.requests["cmpl-1"].state is State.PREFILLING
    assert orch.registry.workers["ctx-0"].active_tokens == 48

    to, message = only(orch.handle(b"ctx-0", prefill_done(), 0.0))
    assert to == b"gen-0" and isinstance(message, DecodeRequest)
    assert message.prefill is not None and message.prefill.block_ids == [3, 4, 5]
    assert orch.registry.workers["ctx-0"].active_tokens == 0
    assert orch.requests["cmpl-1"].state is State.DECODING

    finished = RequestFinished(request_id="cmpl-1", worker_id="gen-0", finish_reason="length")
    assert orch.handle(b"gen-0", finished, 0.0) == []
    assert not orch.requests
    assert orch.registry.workers["gen-0"].active_tokens == 0


def test_the_request_is_split_once_into_the_engines_part_and_the_postprocs() -> None:
    """Engine workers get what they read; the postproc worker's part rides, packed once, the
    prefill and then the decode request, for the engine worker to forward with the tokens."""
    orch = cluster()
    request = generate()
    request.output = OutputOptions(kind="chat", stop=["###"], skip_special_tokens=False)
    _, prefill = only(orch.handle(FRONTEND, request, 0.0))
    assert isinstance(prefill, PrefillRequest)
    assert prefill.request == request.engine_request()
    assert unpack_postproc_start(prefill.postproc_start) == request.postproc_start()
    _, decode = only(orch.handle(b"ctx-0", prefill_done(), 0.0))
    assert isinstance(decode, DecodeRequest)
    assert decode.request is prefill.request and decode.postproc_start is prefill.postproc_start


def test_the_decode_request_carries_the_time_to_first_token_and_the_lease_as_durations() -> None:
    """The orchestrator's own clock measures receipt → first token; the context worker's
    measures its stages and the lease: no host's instant reaches another host."""
    orch = cluster()
    orch.handle(FRONTEND, generate(), 100.0)
    done = prefill_done()
    done.times, done.lease_s = StageTimes(queue_s=0.25, prefill_s=1.0, first_token_s=1.5), 30.0
    _, message = only(orch.handle(b"ctx-0", done, 102.0))
    assert isinstance(message, DecodeRequest) and message.prefill is not None
    assert message.prefill.times == StageTimes(queue_s=0.25, prefill_s=1.0, first_token_s=2.0)
    assert message.prefill.lease_s == 30.0


def test_first_token_that_ends_the_request_skips_the_generation_worker() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    assert orch.handle(b"ctx-0", prefill_done(finish_reason="stop"), 0.0) == []
    assert not orch.requests


@pytest.mark.parametrize(
    ("yaml", "num_tokens"),
    [("mode: aggregated", 40), ("orchestrator: {max_local_prefill_length: 64}", 40)],
)
def test_aggregated_mode_and_short_prompts_prefill_on_the_generation_worker(
    yaml: str, num_tokens: int
) -> None:
    orch = cluster(yaml)
    to, message = only(orch.handle(FRONTEND, generate(num_tokens=num_tokens), 0.0))
    assert to == b"gen-0" and isinstance(message, DecodeRequest) and message.prefill is None


def test_prompts_past_full_context_queues_are_dealt_to_the_generation_worker() -> None:
    """Load-aware deflection (max_prefill_queue_size: 2): with both context workers holding
    two prefills, a prompt goes to the generation worker while fewer prompts wait there than in
    the shortest context queue, counting those sent since its last heartbeat; a finished
    prefill or a heartbeat showing its queue drained moves the balance."""
    orch = cluster("orchestrator: {max_prefill_queue_size: 2}", contexts=2)
    routed = [only(orch.handle(FRONTEND, generate(f"r{i}"), 0.0)) for i in range(4)]
    assert sorted(to for to, _ in routed) == [b"ctx-0", b"ctx-0", b"ctx-1", b"ctx-1"]
    dealt = [only(orch.handle(FRONTEND, generate(f"d{i}"), 0.0)) for i in range(5)]
    targets = [to for to, _ in dealt]  # the shortest context queue: 2, 2, 2, 2, 3
    assert targets[:2] == [b"gen-0", b"gen-0"] and targets[4] == b"gen-0"
    assert sorted(targets[2:4]) == [b"ctx-0", b"ctx-1"]
    assert all(isinstance(m, DecodeRequest) and m.prefill is None
               for to, m in dealt if to == b"gen-0")  # fmt: skip
    heartbeat(orch, "gen-0", 1.0, stats=WorkerStats(num_waiting=3))  # all three still queued
    to, _ = only(orch.handle(FRONTEND, generate("e0"), 1.0))
    assert to in (b"ctx-0", b"ctx-1")  # 3 waiting there, 3 in each context queue
    heartbeat(orch, "gen-0", 2.0, stats=WorkerStats(num_waiting=0))  # its prompts started
    to, _ = only(orch.handle(FRONTEND, generate("e1"), 2.0))
    assert to == b"gen-0"
    _, info = only(orch.handle(b"cli", ClusterInfoRequest(), 2.0))
    gen = [w for w in info.workers if w.worker_id == "gen-0"][0]
    assert gen.local_prefills_routed == 4


def test_prefills_are_deflected_only_past_the_queue_size_and_never_at_zero() -> None:
    orch = cluster("orchestrator: {max_prefill_queue_size: 3}")
    targets = [only(orch.handle(FRONTEND, generate(f"r{i}"), 0.0))[0] for i in range(4)]
    assert targets == [b"ctx-0", b"ctx-0", b"ctx-0", b"gen-0"]
    orch.handle(b"ctx-0", prefill_done("r0"), 0.0)  # two left there: below the limit again
    assert only(orch.handle(FRONTEND, generate("r4"), 0.0))[0] == b"ctx-0"
    never = cluster(NO_DEFLECTION)
    targets = [only(never.handle(FRONTEND, generate(f"r{i}"), 0.0))[0] for i in range(8)]
    assert set(targets) == {b"ctx-0"}


def finish(orch: Orchestrator, request_id: str, now: float) -> None:
    message = RequestFinished(request_id=request_id, worker_id="gen-0", finish_reason="length")
    assert orch.handle(b"gen-0", message, now) == []


def test_auto_deflects_only_while_first_tokens_wait_longer_than_decodes_take() -> None:
    """max_prefill_queue_size "auto", the default: past a context queue of two, a prompt goes to
    the generation worker only while the requests' average time to their first token (on a
    context worker) is clearly longer than their average decode (hand-off to finish)."""
    orch = cluster()
    targets = [only(orch.handle(FRONTEND, generate(f"r{i}"), 0.0))[0] for i in range(4)]
    assert targets == [b"ctx-0"] * 4  # nothing measured yet: the context worker queues them
    to, _ = only(orch.handle(b"ctx-0", prefill_done("r0"), 10.0))  # its first token at 10 s
    assert to == b"gen-0"
    finish(orch, "r0", 12.0)  # decoded in 2 s: the context side is the bottleneck
    assert orch.stage_balance.context_bound()
    info = orch.cluster_info(12.0)  # what /cluster_info and /metrics show of it
    assert (info.first_token_wait_s, info.decode_s, info.context_bound) == (10.0, 2.0, True)
    to, _ = only(orch.handle(FRONTEND, generate("d0"), 12.0))  # 3 queued there: dealt out
    assert to == b"gen-0"
    # decodes grow long (the generation worker carries prefills now, or its batch grew) and
    # first tokens come sooner: past the crossing the prompts queue at the context worker again
    for i, request_id in enumerate(("r1", "r2", "r3")):
        orch.handle(b"ctx-0", prefill_done(request_id), 13.0 + i)
    for i, request_id in enumerate(("r1", "r2", "r3")):
        finish(orch, request_id, 100.0 + i)
    assert not orch.stage_balance.context_bound()
    heartbeat(orch, "gen-0", 100.0, stats=WorkerStats(num_waiting=0))
    targets = [only(orch.handle(FRONTEND, generate(f"e{i}"), 100.0))[0] for i in range(4)]
    assert targets == [b"ctx-0"] * 4


def test_stage_balance_follows_averages_not_one_request() -> None:
    """One prompt that waited long (a burst's last) does not flip the verdict: the averages do,
    over about the last 16 requests."""
    balance = StageBalance()
    assert not balance.context_bound()
    balance.prefilled(1.0)
    assert not balance.context_bound()  # no decode measured yet
    balance.decoded(7.0)
    balance.prefilled(30.0)  # 1 + (30 - 1) / 16 = 2.8 s on average against 7
    assert not balance.context_bound()
    for _ in range(16):
        balance.prefilled(30.0)
    assert balance.context_bound()
    for _ in range(32):
        balance.decoded(60.0)
    assert not balance.context_bound()


def test_stage_balance_starts_past_one_ratio_and_stops_below_another() -> None:
    """Near the crossing, where a deflected prompt costs its generation worker's decodes more
    than it frees, the verdict holds: it starts at 1.5x the decode time and stops below 1x."""
    balance = StageBalance()
    balance.decoded(10.0)
    balance.prefilled(14.0)  # 1.4x: both sides near their limits
    assert not balance.context_bound()
    balance.prefilled(14.0 + 16 * 2.0)  # the average 16.0: 1.6x
    assert balance.context_bound()
    balance.decoded(10.0 + 16 * 4.0)  # 14.0: 1.14x, within the band: still deflecting
    assert balance.context_bound()
    balance.decoded(14.0 + 16 * 3.0)  # 17.0: 0.94x
    assert not balance.context_bound()
    balance.prefilled(16.0 + 16 * 5.0)  # 21.0 against 17.0: 1.24x, in the band: still queueing
    assert not balance.context_bound()


def test_abort_goes_to_the_worker_that_holds_the_request() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate("a"), 0.0)
    to, message = only(orch.handle(FRONTEND, Abort(request_id="a"), 0.0))
    assert (to, message) == (b"ctx-0", Abort(request_id="a"))

    orch.handle(FRONTEND, generate("b"), 0.0)
    orch.handle(b"ctx-0", prefill_done("b"), 0.0)
    to, message = only(orch.handle(b"pp-0", Abort(request_id="b", reason="stop"), 0.0))
    assert to == b"gen-0"  # after the hand-off the generation worker frees the context's lease
    assert not orch.requests
    assert orch.handle(FRONTEND, Abort(request_id="b"), 0.0) == []  # unknown: ignored


def test_worker_failure_is_forwarded_to_the_frontend() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    failed = RequestFailed(request_id="cmpl-1", status_code=400, message="bad", param="max_tokens")
    out = orch.handle(b"ctx-0", failed, 0.0)
    # the postproc worker is told too: no worker will send it this request's end any more
    abort = Abort(request_id="cmpl-1", reason="error")
    assert out == [(FRONTEND, failed), (b"pp-0", abort), (b"ctx-0", abort)]
    assert not orch.requests


def test_dead_context_worker_prefill_is_retried_on_another() -> None:
    orch = cluster(contexts=2)
    orch.context_router = ConversationAffinity(RoundRobinRouter())
    to, _ = only(orch.handle(FRONTEND, generate(), 0.0))
    other = b"ctx-1" if to == b"ctx-0" else b"ctx-0"
    orch.handle(other, Heartbeat(worker_id=other.decode()), 4.0)
    for worker_id in (b"gen-0", b"pp-0"):
        orch.handle(worker_id, Heartbeat(worker_id=worker_id.decode()), 4.0)
    out = orch.tick(6.0)  # `to` has been silent for 6 s > worker_timeout_seconds
    prefills = [(t, m) for t, m in out if isinstance(m, PrefillRequest)]
    assert [t for t, _ in prefills] == [other]
    assert orch.registry.workers[to.decode()].state == "dead"


def test_dead_generation_worker_fails_its_requests_and_frees_the_lease() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)
    for worker_id in (b"ctx-0", b"pp-0"):
        orch.handle(worker_id, Heartbeat(worker_id=worker_id.decode()), 4.0)
    out = orch.tick(6.0)
    failures = [(t, m) for t, m in out if isinstance(m, RequestFailed)]
    assert len(failures) == 1 and failures[0][0] == FRONTEND
    assert failures[0][1].status_code == 503 and "gen-0" in failures[0][1].message
    assert (b"ctx-0", Abort(request_id="cmpl-1", reason="error")) in out
    assert not orch.requests


def test_no_postproc_or_generation_worker_is_a_503() -> None:
    orch = Orchestrator(parse_cluster_config("mode: aggregated"))
    _, reply = only(orch.handle(FRONTEND, generate(), 0.0))
    assert isinstance(reply, RequestFailed) and reply.status_code == 503
    register(orch, "pp-0", "postproc")
    (_, reply), _ = orch.handle(FRONTEND, generate(), 0.0)
    assert isinstance(reply, RequestFailed) and "generation" in reply.message


def test_cluster_info_lists_every_worker_and_the_orchestrator() -> None:
    orch = cluster()
    _, info = only(orch.handle(b"cli", ClusterInfoRequest(), 1.0))
    assert isinstance(info, ClusterInfo)
    assert [(w.role, w.worker_id) for w in info.workers] == [
        ("orchestrator", "orchestrator"),
        ("context", "ctx-0"),
        ("generation", "gen-0"),
        ("postproc", "pp-0"),
    ]


def test_a_profile_command_reaches_every_engine_worker_and_their_answers_come_back_as_one() -> None:
    orch = cluster(generations=2)
    out = orch.handle(FRONTEND, Profile(action="stop"), 1.0)
    assert sorted(out) == [(w, Profile(action="stop")) for w in (b"ctx-0", b"gen-0", b"gen-1")]
    busy = only(orch.handle(b"fe-1", Profile(action="start"), 1.0))  # one round at a time
    assert busy[0] == b"fe-1" and "in progress" in busy[1].errors[0]
    gen0 = ProfileDone(action="stop", workers=["gen-0"], files=["/p/gen-0.ops.txt"])
    assert orch.handle(b"gen-0", gen0, 1.1) == []
    assert orch.handle(b"gen-0", gen0, 1.1) == []  # a repeat counts once
    assert orch.handle(b"ctx-0", ProfileDone(action="stop", errors=["ctx-0: no"]), 1.2) == []
    gen1 = ProfileDone(action="stop", workers=["gen-1"], files=["/p/gen-1.ops.txt"])
    assert only(orch.handle(b"gen-1", gen1, 1.3)) == (
        FRONTEND,
        ProfileDone(
            action="stop",
            workers=["gen-0", "gen-1"],
            files=["/p/gen-0.ops.txt", "/p/gen-1.ops.txt"],
            errors=["ctx-0: no"],
        ),
    )
    assert orch.profile_round is None


def test_a_profile_round_ends_without_the_workers_that_die_or_stay_silent() -> None:
    orch = cluster()
    orch.handle(FRONTEND, Profile(action="start"), 0.0)
    assert orch.handle(b"gen-0", ProfileDone(action="start", workers=["gen-0"]), 0.1) == []
    orch.handle(b"gen-0", Heartbeat(worker_id="gen-0"), 4.0)  # ctx-0 goes silent
    orch.handle(b"pp-0", Heartbeat(worker_id="pp-0"), 4.0)
    assert not any(isinstance(m, ProfileDone) for _, m in orch.tick(4.5))
    answered = [(t, m) for t, m in orch.tick(6.0) if isinstance(m, ProfileDone)]
    assert answered == [
        (
            FRONTEND,
            ProfileDone(
                action="start", workers=["gen-0"], errors=["ctx-0: lost before it answered"]
            ),
        )
    ]
    orch.handle(FRONTEND, Profile(action="start"), 7.0)  # now to gen-0 only, which stays silent
    for now in (8.0, 7.0 + ANSWER_TIMEOUT_S / 2):
        for worker_id in (b"gen-0", b"pp-0"):
            orch.handle(worker_id, Heartbeat(worker_id=worker_id.decode()), now)
        assert not any(isinstance(m, ProfileDone) for _, m in orch.tick(now))
    orch.handle(b"gen-0", Heartbeat(worker_id="gen-0"), 7.0 + ANSWER_TIMEOUT_S)
    orch.handle(b"pp-0", Heartbeat(worker_id="pp-0"), 7.0 + ANSWER_TIMEOUT_S)
    late = [m for _, m in orch.tick(7.0 + ANSWER_TIMEOUT_S) if isinstance(m, ProfileDone)]
    assert late == [
        ProfileDone(action="start", errors=[f"gen-0: no answer in {ANSWER_TIMEOUT_S:.0f} s"])
    ]


def test_a_profile_command_with_no_engine_worker_up_is_answered_at_once() -> None:
    orch = Orchestrator(parse_cluster_config(""))
    register(orch, "pp-0", "postproc")
    reply = only(orch.handle(FRONTEND, Profile(action="start"), 0.0))
    assert reply == (
        FRONTEND,
        ProfileDone(action="start", errors=["orchestrator: no engine worker is up"]),
    )


def workers(*loads: int) -> list[WorkerRecord]:
    return [
        WorkerRecord(f"w{i}", "generation", 1, "", None, 0.0, active_tokens=load)
        for i, load in enumerate(loads)
    ]


def test_round_robin_cycles() -> None:
    router, pool_ = RoundRobinRouter(), workers(0, 0, 0)
    assert [router.pick(pool_, []).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_least_loaded_picks_fewest_active_tokens() -> None:
    assert LeastLoadedRouter().pick(workers(30, 10, 20), []).worker_id == "w1"


def test_kv_aware_prefers_the_cached_prefix_unless_the_load_outweighs_it() -> None:
    index = PrefixIndex()
    router = KVAwareRouter(index, block_size=16, rng=random.Random(0))
    hashes = [11, 12, 13, 14]
    index.stored("w1", [11, 12, 13])
    assert router.pick(workers(0, 16), hashes).worker_id == "w1"  # 1 uncached + 1 vs 4 + 0
    assert router.pick(workers(0, 16 * 8), hashes).worker_id == "w0"  # w1 is too busy
    index.removed("w1", [11])  # a broken chain: nothing of the prefix is reusable
    assert index.num_cached_blocks("w1", hashes) == 0
    assert router.pick(workers(5, 0), hashes).worker_id == "w1"  # no events: by load


def test_cached_prefixes_are_each_workers_prefix_and_skip_those_without_the_first_block() -> None:
    """The router scores every worker of a role per request: only the holders of the prompt's
    first block are walked along it, and each one's count is its whole cached prefix."""
    index = PrefixIndex()
    hashes = [11, 12, 13, 14]
    index.stored("w0", [11, 12])
    index.stored("w1", [11, 12, 13, 14, 15])
    index.stored("w2", [12, 13, 14])  # a later block without the first: nothing reusable
    found = index.cached_prefixes(["w0", "w1", "w2", "w3"], hashes)
    assert found == {"w0": 2, "w1": 4}
    assert all(index.num_cached_blocks(w, hashes) == found.get(w, 0) for w in ("w2", "w3"))
    assert index.cached_prefixes(["w0"], []) == {}


def test_requests_beyond_the_limit_get_a_429() -> None:
    orch = cluster("orchestrator: {max_requests: 2}")
    for i in range(2):
        orch.handle(FRONTEND, generate(f"r{i}"), 0.0)
    _, reply = only(orch.handle(FRONTEND, generate("r2"), 0.0))
    assert isinstance(reply, RequestFailed) and reply.status_code == 429
    assert reply.code == "rate_limited" and "capacity" in reply.message
    assert len(orch.requests) == 2


def test_at_capacity_a_higher_priority_request_sheds_the_lowest_that_has_not_streamed() -> None:
    orch = cluster("orchestrator: {max_requests: 3}")
    orch.handle(FRONTEND, generate("decoding"), 0.0)
    orch.handle(b"ctx-0", prefill_done("decoding"), 0.0)  # at the generation worker now
    for request_id, priority in (("low-early", 0), ("low-late", 0)):
        orch.handle(FRONTEND, msgspec.structs.replace(generate(request_id), priority=priority), 0.0)
    same = orch.handle(FRONTEND, generate("same-level"), 0.0)  # priority 0 sheds nobody
    assert [m.status_code for _, m in same if isinstance(m, RequestFailed)] == [429]
    urgent = msgspec.structs.replace(generate("urgent"), priority=5)
    out = orch.handle(FRONTEND, urgent, 0.0)
    shed = [(t, m) for t, m in out if isinstance(m, RequestFailed)]
    assert [(t, m.request_id, m.status_code) for t, m in shed] == [(FRONTEND, "low-late", 429)]
    assert "higher-priority" in shed[0][1].message
    assert (b"ctx-0", Abort(request_id="low-late", reason="error")) in out
    assert any(isinstance(m, PrefillRequest) and m.request.request_id == "urgent" for _, m in out)
    assert list(orch.requests) == ["decoding", "low-early", "urgent"]
    out = orch.handle(FRONTEND, msgspec.structs.replace(generate("top"), priority=9), 0.0)
    assert [m.request_id for _, m in out if isinstance(m, RequestFailed)] == ["low-early"]
    out = orch.handle(FRONTEND, msgspec.structs.replace(generate("more"), priority=5), 0.0)
    assert [m.request_id for _, m in out if isinstance(m, RequestFailed)] == ["more"]  # none lower
    assert list(orch.requests) == ["decoding", "urgent", "top"]


def test_without_a_generation_worker_nothing_is_prefilled() -> None:
    """A prefill with nowhere to decode would only hold its blocks for the whole lease."""
    orch = cluster(generations=0)
    out = orch.handle(FRONTEND, generate(), 0.0)
    assert not [m for _, m in out if isinstance(m, PrefillRequest)]
    (failed,) = [m for to, m in out if to == FRONTEND]
    assert isinstance(failed, RequestFailed) and failed.status_code == 503
    assert not orch.requests


def test_a_lost_postproc_worker_stops_the_decode_it_was_fed_by() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)
    for worker_id in ("ctx-0", "gen-0"):
        heartbeat(orch, worker_id, 4.0)
    out = orch.tick(6.0)  # pp-0 silent: its requests fail, and the decode feeding it stops
    assert (b"gen-0", Abort(request_id="cmpl-1", reason="error")) in out
    assert [m.status_code for to, m in out if to == FRONTEND] == [503]


def test_dead_records_are_forgotten_after_a_while() -> None:
    orch = cluster()
    timeout_s = orch.config.orchestrator.worker_timeout_seconds
    for t in range(1, 100):  # everyone but ctx-0 keeps heartbeating
        for worker_id in ("gen-0", "pp-0"):
            heartbeat(orch, worker_id, float(t))
        orch.tick(float(t))
        if t < 12 * timeout_s:
            assert "ctx-0" in orch.registry.workers
    assert "ctx-0" not in orch.registry.workers
    _, reply = only(heartbeat(orch, "ctx-0", 100.0))  # it comes back: it registers again
    assert isinstance(reply, RegisterAgain)


def test_a_duplicate_worker_id_is_refused_while_the_first_process_heartbeats() -> None:
    """Anyone registering as gen-0 took its requests and failed them; now a second process
    under a live worker's id is refused (the first keeps everything)."""
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)  # decoding on gen-0
    heartbeat(orch, "gen-0", 1.0)
    _, reply = only(register(orch, "gen-0", "generation", now=1.2, pid=666))
    assert isinstance(reply, Refused) and "pid 666 is a duplicate" in reply.reason
    assert orch.registry.workers["gen-0"].pid == 1 and "cmpl-1" in orch.requests


def test_a_restart_after_silence_replaces_the_record_and_fails_its_requests() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)
    heartbeat(orch, "gen-0", 1.0)
    out = register(orch, "gen-0", "generation", now=3.0, pid=777)  # silent for 2 s: restarted
    assert any(isinstance(m, Registered) for _, m in out)
    assert [m.status_code for to, m in out if to == FRONTEND] == [503]
    assert orch.registry.workers["gen-0"].pid == 777


def test_the_same_process_registering_again_keeps_its_requests() -> None:
    orch = cluster()
    orch.handle(FRONTEND, generate(), 0.0)
    orch.handle(b"ctx-0", prefill_done(), 0.0)
    again = Register(worker_id="gen-0", role="generation", protocol_version=PROTOCOL_VERSION,
                     pid=1, instance=orch.registry.workers["gen-0"].instance)  # fmt: skip
    out = orch.handle(b"gen-0", again, 0.5)
    assert not [m for to, m in out if to == FRONTEND] and "cmpl-1" in orch.requests


def test_a_lora_load_reaches_every_engine_worker_and_updates_the_adapter_table() -> None:
    orch = cluster("lora: {adapters: {sql: /a/sql}}\n", generations=2)
    assert orch.cluster_info(1.0).lora_adapters == {"sql": "/a/sql"}
    load = LoRACommand(action="load", lora_name="poet", lora_path="/a/poet")
    out = orch.handle(FRONTEND, load, 1.0)
    assert sorted(out) == [(w, load) for w in (b"ctx-0", b"gen-0", b"gen-1")]
    busy = only(orch.handle(b"fe-1", LoRACommand(action="unload", lora_name="sql"), 1.0))
    assert busy[0] == b"fe-1" and "in progress" in busy[1].errors[0]
    for worker in ("ctx-0", "gen-0"):
        done = LoRADone(action="load", lora_name="poet", workers=[worker])
        assert orch.handle(worker.encode(), done, 1.1) == []
    refused = LoRADone(action="load", lora_name="poet", errors=["gen-1: no free slot"])
    answer = only(orch.handle(b"gen-1", refused, 1.2))
    assert answer == (
        FRONTEND,
        LoRADone(action="load", lora_name="poet", workers=["ctx-0", "gen-0"],
                 errors=["gen-1: no free slot"]),
    )  # fmt: skip
    assert orch.cluster_info(1.3).lora_adapters == {"sql": "/a/sql", "poet": "/a/poet"}
    # an unload that one worker refuses leaves the adapter listed
    orch.handle(FRONTEND, LoRACommand(action="unload", lora_name="poet"), 2.0)
    for worker in ("ctx-0", "gen-0", "gen-1"):
        errors = ["gen-1: in use"] if worker == "gen-1" else []
        done = LoRADone(action="unload", lora_name="poet", errors=errors,
                        workers=[] if errors else [worker])  # fmt: skip
        orch.handle(worker.encode(), done, 2.1)
    assert "poet" in orch.cluster_info(2.2).lora_adapters
    orch.handle(FRONTEND, LoRACommand(action="unload", lora_name="poet"), 3.0)
    for worker in ("ctx-0", "gen-0", "gen-1"):
        done = LoRADone(action="unload", lora_name="poet", workers=[worker])
        orch.handle(worker.encode(), done, 3.1)
    assert orch.cluster_info(3.2).lora_adapters == {"sql": "/a/sql"}
    assert orch.lora_round is None


def test_an_engine_worker_that_starts_later_is_sent_the_adapters_loaded_since() -> None:
    orch = cluster("lora: {adapters: {sql: /a/sql}}\n")
    orch.lora_adapters["poet"] = "/a/poet"  # loaded at run time
    out = register(orch, "gen-7", "generation", 1.0, pid=7)
    sent = [m for to, m in out if to == b"gen-7" and isinstance(m, LoRACommand)]
    assert sent == [LoRACommand(action="load", lora_name="poet", lora_path="/a/poet")]
