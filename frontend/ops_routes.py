"""The seed's operations routes beside /metrics: its Prometheus path, its P/D clock route and its
energy counters.

- GET /prometheus/metrics: the same Prometheus text as GET /metrics. The seed keeps /metrics
  for JSON iteration stats and Prometheus text at /prometheus/metrics; here /metrics stays
  Prometheus text for the scrapers already pointed at it, and answers JSON (every worker's
  figures, /cluster_info's table) to a request that asks for `application/json` only.
- GET /steady_clock_offset: the seed's NTP-style pair, `receive_ts` and `transmit_ts` on this
  host's monotonic clock (seconds), from which a peer measures its offset to this host:
  ((receive_ts - sent) + (transmit_ts - received)) / 2. POST {"offset"} is the seed's way to
  hand a worker that offset, so that it can shift the instants in its perf metrics onto the
  router's clock; nothing here reports an instant (every stage time is a duration on one
  host's clock, the lease a duration too), so the offset is acknowledged and not applied.
- GET /energy_metrics: the seed's `{total_energy_j, query_time}` from the frontend host's
  energy counters (frontend/energy.py), each counter listed; a 404 saying why where the host
  has none.
"""

from __future__ import annotations

import dataclasses
import math
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend import admin_routes
from frontend.endpoint import decode_body, json_response, off_loop, state_of
from frontend.energy import read_energy
from frontend.generation import error_response

UNAPPLIED = (
    "every timing this cluster reports is a duration measured on one host's monotonic clock, "
    "so there is no instant to shift"
)


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text, or the workers' figures as JSON when only JSON is asked
    for (a scraper's Accept names text/plain or OpenMetrics)."""
    accept = request.headers.get("accept", "")
    if "application/json" in accept and "text/" not in accept:
        info = await state_of(request).client.cluster_info(admin_routes.HEALTH_TIMEOUT_S)
        if info is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        return json_response(info.workers)
    return await admin_routes.prometheus_metrics(request)


async def steady_clock_offset(request: Request) -> Response:
    receive_ts = time.monotonic()
    return json_response({"receive_ts": receive_ts, "transmit_ts": time.monotonic()})


class ClockOffset(msgspec.Struct, forbid_unknown_fields=True):
    offset: float


async def set_steady_clock_offset(request: Request) -> Response:
    body = await decode_body(request, ClockOffset)
    if not math.isfinite(body.offset):
        return error_response(400, "offset must be a finite number of seconds", "offset")
    return json_response({"offset": body.offset, "applied": False, "reason": UNAPPLIED})


async def energy_metrics(request: Request) -> Response:
    readings, why = await off_loop(read_energy)
    if not readings:
        message = f"this host cannot measure its energy: {why}"
        return error_response(404, message, code="energy_metrics_unavailable")
    return json_response(
        {
            "total_energy_j": sum(r.energy_j for r in readings),
            "query_time": time.time(),
            "counters": [dataclasses.asdict(r) for r in readings],
        }
    )
