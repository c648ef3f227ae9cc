"""conversation_params.conversation_id: a conversation's turns go to the workers that served its
last turn, while they are routable (the seed's conversation router, first rule)."""

from __future__ import annotations

import msgspec

from common.protocol import PrefillRequest
from orchestrator.conversations import ConversationAffinity
from orchestrator.router import RoundRobinRouter
from tests.unit.orchestrator.test_orchestrator import (
    FRONTEND,
    NO_DEFLECTION,
    cluster,
    generate,
    only,
)


def prefill_worker(orch, request_id: str, conversation_id: str | None) -> bytes:
    request = msgspec.structs.replace(generate(request_id), conversation_id=conversation_id)
    to, message = only(orch.handle(FRONTEND, request, 0.0))
    assert isinstance(message, PrefillRequest)
    return to


def test_a_conversation_stays_on_its_context_worker_under_round_robin() -> None:
    orch = cluster(NO_DEFLECTION, contexts=2)
    orch.context_router = ConversationAffinity(RoundRobinRouter())
    first = prefill_worker(orch, "chatcmpl-1", "conv-a")
    # round robin alone would alternate; the conversation's turns stay where it started
    assert {prefill_worker(orch, f"chatcmpl-{i}", "conv-a") for i in range(2, 6)} == {first}
    # requests without a conversation are routed as before: both workers get them
    assert len({prefill_worker(orch, f"cmpl-{i}", None) for i in range(4)}) == 2


def test_the_conversation_table_is_bounded_and_follows_a_lost_worker() -> None:
    orch = cluster(contexts=2)
    affinity = ConversationAffinity(RoundRobinRouter(), max_sessions=2)
    workers = orch.registry.routable("context")
    chosen = affinity.pick(workers, [], "a")
    others = [w for w in workers if w is not chosen]
    assert affinity.pick(others, [], "a") is others[0]  # its worker is gone: the pick follows
    assert affinity.pick(workers, [], "a") is others[0]
    affinity.pick(workers, [], "b")
    affinity.pick(workers, [], "c")
    assert list(affinity.sessions) == ["b", "c"]  # the least recent one left
