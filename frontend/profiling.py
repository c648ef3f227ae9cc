"""POST /start_profile and /stop_profile: the torch profiler on every engine worker.

The frontend forwards the command to the orchestrator, which sends it to every live engine
worker and answers with their replies merged (orchestrator/profile_round.py). Each worker
writes into `profiler.dir` on its own host (engine/profiling.py); the answer lists the files.
Like every route but /health, these need the API key when one is set. With no `profiler.dir`
the routes answer 404, as vLLM's do when its profiler is not configured.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from starlette.responses import Response

from common.config import ClusterConfig
from common.protocol import PROFILE_ANSWER_TIMEOUT_S
from frontend.cluster_client import ClusterClient
from frontend.generation import error_response

ANSWER_MARGIN_S = 5.0  # past the orchestrator's own deadline, so its partial answer arrives


async def profile_response(
    config: ClusterConfig, client: ClusterClient, action: Literal["start", "stop"]
) -> Response:
    """200 with {action, workers, files, errors} when at least one worker did it; 409 when none
    could (already running, not running, no engine worker up); 503 when the orchestrator is
    silent."""
    if config.profiler.dir is None:
        return error_response(
            404, "profiling is off: set profiler.dir in cluster.yaml", code="not_found"
        )
    done = await client.profile(action, PROFILE_ANSWER_TIMEOUT_S + ANSWER_MARGIN_S)
    if done is None:
        return error_response(503, "the orchestrator does not answer", code="unhealthy")
    if not done.workers:
        return error_response(409, "; ".join(done.errors), code="profiler_state")
    body = msgspec.json.encode(msgspec.structs.asdict(done))
    return Response(body, media_type="application/json")
