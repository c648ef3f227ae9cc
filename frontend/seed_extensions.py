"""The seed's serving extensions on /v1/completions and /v1/chat/completions (TensorRT-LLM's
request fields), each honoured or refused with a 400 that names it and says why:

    lora_request{lora_name, lora_int_id, lora_path}
                              → the loaded adapter of that name (frontend/lora.py)
    conversation_params{conversation_id}
                              → the orchestrator keeps a conversation's turns on the workers
                                that served it (orchestrator/conversations.py)
    scheduling_params{priority_tier}
                              → priority (higher first)
    scheduling_params{attention_dp_rank}
                              → with attention_dp_relax: a hint, dropped; without: a 400 (the
                                engines here have no attention data-parallel ranks)
    disaggregated_params      → a 400, but the plain "context_and_generation": the orchestrator
                                makes the hand-off itself
    stream_options.continuous_usage_stats
                              → the usage so far on every chunk (completions.StreamOptions)
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from common.errors import InvalidRequest

MAX_CONVERSATION_ID_CHARS = 256


class LoRARequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The seed's (and vLLM's offline) LoRARequest; adapters are named here, the id is unread."""

    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None


class ConversationParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    conversation_id: Annotated[str, msgspec.Meta(max_length=MAX_CONVERSATION_ID_CHARS)] | None = (
        None
    )


class SchedulingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """TensorRT-LLM's SchedulingParams: attention-DP placement and a priority tier."""

    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None
    priority_tier: int | None = None


def conversation_id(params: ConversationParams | None) -> str | None:
    if params is None or params.conversation_id is None:
        return None
    if not params.conversation_id:
        raise InvalidRequest(
            "conversation_params.conversation_id must be a non-empty string", "conversation_params"
        )
    return params.conversation_id


def priority(given: int, scheduling: SchedulingParams | None) -> int:
    """The request's priority: `priority`, or the seed's scheduling_params.priority_tier (both
    higher first); both set to different values is a 400 (either choice would drop one)."""
    if scheduling is None:
        return given
    if scheduling.attention_dp_rank is not None and not scheduling.attention_dp_relax:
        raise InvalidRequest(
            "scheduling_params.attention_dp_rank pins a request to an attention data-parallel "
            "rank; this cluster's engines have none (set attention_dp_relax: true to send it as "
            "a hint, which is dropped)",
            "scheduling_params",
        )
    tier = scheduling.priority_tier
    if tier is None:
        return given
    if given not in (0, tier):
        raise InvalidRequest(
            f"priority ({given}) and scheduling_params.priority_tier ({tier}) disagree",
            "scheduling_params",
        )
    return tier


# The seed's generation-only hand-off fields: what its context server returns for its router to
# relay. Here the orchestrator makes that hand-off inside the cluster (PrefillDone, DecodeRequest).
_WHOLE_REQUEST = {"request_type": "context_and_generation"}


def check_disaggregated(params: dict[str, Any] | None) -> None:
    """None, or the seed's plain "context_and_generation" (what every request is here): accepted;
    a context-only or generation-only hand-off: refused, saying why."""
    if params is None or {k: v for k, v in params.items() if v is not None} in ({}, _WHOLE_REQUEST):
        return
    raise InvalidRequest(
        "disaggregated_params is the seed's hand-off between separate context and generation "
        "servers; this cluster disaggregates itself (its orchestrator moves each request from a "
        "context worker to a generation worker), so a client cannot send a context_only or "
        "generation_only request: send the whole request",
        "disaggregated_params",
    )
