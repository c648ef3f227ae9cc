"""Where one request's time went: the stages each worker measures, carried with its tokens to
the postproc worker (the `perf_metrics` of a response, when asked) and to the frontend (the
`Server-Timing` header)."""

from __future__ import annotations

import msgspec


class StageTimes(msgspec.Struct, kw_only=True):
    """Where one request's time went, in seconds. Each figure is a duration measured on one
    host's monotonic clock (an engine worker's, the orchestrator's), added up along the
    request's path: hosts' wall clocks need not agree, so no instant of one is ever compared
    with another's. Zero: the stage did not happen (no transfer when aggregated)."""

    queue_s: float = 0.0  # waiting for a place in an engine's batch (context and generation)
    prefill_s: float = 0.0  # admitted to the batch → first token, on the worker that prefilled
    transfer_s: float = 0.0  # the KV pull over NIXL, on the generation worker
    # the cluster's receipt of the request → its first token: measured by the orchestrator
    # (disaggregated), or by the generation worker it dispatched to at once (aggregated)
    first_token_s: float = 0.0
    decode_s: float = 0.0  # the generation worker's first decode step → this choice's last token

    def slowest(self, other: StageTimes) -> StageTimes:
        """Stage by stage, the longer: several prompts of one response run side by side and
        the response waits for the slowest of each."""
        return StageTimes(
            **{
                name: max(getattr(self, name), getattr(other, name))
                for name in self.__struct_fields__
            }
        )

    def server_timing(self, total_s: float) -> str:
        """The HTTP Server-Timing header's value: each stage and the frontend's total, in ms."""
        stages = [(name.removesuffix("_s"), getattr(self, name)) for name in self.__struct_fields__]
        return ", ".join(
            f"{name};dur={seconds * 1e3:.1f}" for name, seconds in [*stages, ("total", total_s)]
        )
