"""The seed's conversation affinity (its `conversation` router, first rule): a request that names
a conversation (`conversation_params.conversation_id`) goes to the worker of its role that served
the conversation's last turn, while that worker is routable; otherwise the router picks, and the
conversation follows the pick. The turns of one conversation share their prefix, so the worker
that holds it computes only the new turn. The table is an LRU of at most `max_sessions`
conversations (the seed's 100,000); requests that name none are routed as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from orchestrator.registry import WorkerRecord
from orchestrator.router import Router

MAX_SESSIONS = 100_000


class ConversationAffinity:
    def __init__(self, router: Router, max_sessions: int = MAX_SESSIONS) -> None:
        self.router = router
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, str] = OrderedDict()  # conversation id -> worker id

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        block_hashes: Sequence[int],
        conversation_id: str | None = None,
    ) -> WorkerRecord:
        if conversation_id is not None:
            last = self.sessions.get(conversation_id)
            for worker in workers:
                if worker.worker_id == last:
                    self.sessions.move_to_end(conversation_id)
                    return worker
        chosen = self.router.pick(workers, block_hashes)
        if conversation_id is not None:
            self.sessions[conversation_id] = chosen.worker_id
            self.sessions.move_to_end(conversation_id)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return chosen
