"""Every message that crosses a process boundary, as tagged msgspec Structs encoded to msgpack,
defined once in a module named for who receives it (to_orchestrator, to_engine, to_postproc,
to_frontend, to_worker: every registered process; wire: what all messages share). Import them
from here: `from common.protocol import GenerateRequest`.

    frontend ──GenerateRequest / Abort──────────────▶ orchestrator (ROUTER)
    frontend, CLI ──ClusterInfoRequest──────────────▶ orchestrator ──ClusterInfo──▶ asker
    frontend ──DrainKVEvents────────────────────────▶ orchestrator ──KVEventsDrained──▶ frontend
    frontend ──Profile──▶ orchestrator ──Profile──▶ every engine worker ──ProfileDone──▶
        orchestrator ──ProfileDone (all answers merged)──▶ frontend
    context / generation worker ──KVEvents──────────▶ orchestrator (kv_aware router, event queue)
    orchestrator ──RequestFailed────────────────────▶ frontend
    worker ──Register / Heartbeat───────────────────▶ orchestrator ──Registered / Refused──▶ worker
    generation worker ──PeersRequest────────────────▶ orchestrator ──Registered──▶ that worker
    orchestrator ──RegisterAgain────────────────────▶ worker it does not know (it restarted)
    worker (SIGTERM), CLI ──Drain───────────────────▶ orchestrator ──Drain (in_flight)──▶ worker
    drained worker ──Leaving────────────────────────▶ orchestrator (forgets it; it exits 0)
    orchestrator ──PrefillRequest / Abort───────────▶ context worker (EngineRequest + packed
                                                      PostprocStart: the GenerateRequest split)
    context worker ──PrefillDone / RequestFailed────▶ orchestrator
    orchestrator ──DecodeRequest / Abort────────────▶ generation worker
    generation worker ══NIXL READ (KV blocks)═══════▶ context worker (notification frees its lease)
    generation worker ──RequestFinished / Failed────▶ orchestrator
    generation worker ──TokenBatch (PUSH)───────────▶ postproc worker (PULL), by request id; a
                                                      request's first brings its PostprocStart
    context worker ──TokenBatch (PUSH)──────────────▶ postproc worker, only when the first token
                                                      ends the request (no generation worker)
    postproc worker ──Abort(reason="stop")──────────▶ orchestrator
    postproc worker ──Chunk (PUSH)──────────────────▶ frontend (PULL at PostprocStart.reply_to)

Bulk data never rides ZMQ: KV moves over NIXL, prompts travel once as base64 int32, tokens as
deltas. Each hop carries what its receiver reads: the orchestrator splits a GenerateRequest once
into the EngineRequest (prompt, sampling) and the PostprocStart (output options, reply address,
the prompt only when the answer shows it), which engines forward packed, unread.
"""

from __future__ import annotations

import msgspec

from common.protocol.to_engine import (
    PROFILE_ANSWER_TIMEOUT_S,
    DecodeRequest,
    EngineRequest,
    LoRACommand,
    PrefillDone,
    PrefillRequest,
    Profile,
    PromptImage,
    lora_name_of,
    salt_extra_keys,
)
from common.protocol.to_frontend import (
    Chunk,
    ClusterInfo,
    KVEventsDrained,
    LoRADone,
    ProfileDone,
    RequestFailed,
    WorkerInfo,
)
from common.protocol.to_orchestrator import (
    Abort,
    ClusterInfoRequest,
    DrainKVEvents,
    GenerateRequest,
    Heartbeat,
    KVEvents,
    Leaving,
    PeersRequest,
    Register,
    RequestFinished,
    Role,
    WorkerStats,
)
from common.protocol.to_postproc import (
    FAILED,
    PROMPT_CONTEXT_TOKENS,
    FinishReason,
    OutputOptions,
    PostprocStart,
    TokenBatch,
    TokenDelta,
    pack_postproc_start,
    unpack_postproc_start,
)
from common.protocol.to_worker import (
    Drain,
    KVPool,
    Refused,
    RegisterAgain,
    Registered,
    TierRegion,
)
from common.protocol.wire import (
    count_token_ids,
    decode_token_ids,
    encode_token_ids,
    tail_token_ids,
)

# Registration carries it: a process of another version is refused by name.
# 7: finish reasons typed (FinishReason).
# 8: each hop carries what its receiver reads: engines get an EngineRequest, postproc workers a
#    packed PostprocStart (TokenBatch.starts); OutputOptions.parser_state a typed ParserState;
#    SamplingParams without stop / skip_special_tokens; the modules grouped by receiver.
# 9: a fanned-out stream's sub-requests end without a usage chunk or [DONE]
#    (OutputOptions.fanned_out) and the frontend writes the one ending from the ending Chunks'
#    numbers (Chunk.cached_tokens added): an older postproc worker or orchestrator would drop
#    the flag unread, and the client would get one [DONE] per prompt.
PROTOCOL_VERSION = 9


Message = (
    GenerateRequest
    | Abort
    | RequestFailed
    | Register
    | Registered
    | Refused
    | RegisterAgain
    | Drain
    | Leaving
    | Heartbeat
    | PeersRequest
    | PrefillRequest
    | PrefillDone
    | DecodeRequest
    | RequestFinished
    | TokenBatch
    | Chunk
    | ClusterInfoRequest
    | ClusterInfo
    | KVEvents
    | DrainKVEvents
    | KVEventsDrained
    | Profile
    | ProfileDone
    | LoRACommand
    | LoRADone
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on malformed or unknown messages."""
    return _decoder.decode(data)


__all__ = [
    "FAILED",
    "PROFILE_ANSWER_TIMEOUT_S",
    "PROMPT_CONTEXT_TOKENS",
    "PROTOCOL_VERSION",
    "Abort",
    "Chunk",
    "ClusterInfo",
    "ClusterInfoRequest",
    "DecodeRequest",
    "Drain",
    "DrainKVEvents",
    "EngineRequest",
    "FinishReason",
    "GenerateRequest",
    "Heartbeat",
    "KVEvents",
    "KVEventsDrained",
    "KVPool",
    "TierRegion",
    "Leaving",
    "Message",
    "OutputOptions",
    "PeersRequest",
    "PostprocStart",
    "PrefillDone",
    "PrefillRequest",
    "Profile",
    "ProfileDone",
    "LoRACommand",
    "LoRADone",
    "Refused",
    "Register",
    "RegisterAgain",
    "Registered",
    "RequestFailed",
    "RequestFinished",
    "Role",
    "TokenBatch",
    "TokenDelta",
    "WorkerInfo",
    "WorkerStats",
    "count_token_ids",
    "decode",
    "decode_token_ids",
    "encode",
    "encode_token_ids",
    "pack_postproc_start",
    "lora_name_of",
    "salt_extra_keys",
    "PromptImage",
    "tail_token_ids",
    "unpack_postproc_start",
]
