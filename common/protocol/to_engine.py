"""What engine workers (context, generation) receive: the part of a request they read
(EngineRequest: the prompt and how to sample it, nothing of its output), wrapped for the
context worker (PrefillRequest) or the generation worker (DecodeRequest, with the context
worker's PrefillDone), and the profiler switch.

PrefillDone is sent to the orchestrator, which reads only its id and times and forwards it whole
in the DecodeRequest: its body is for the generation worker. Profile comes from a frontend and
is fanned out by the orchestrator; each answer (ProfileDone) is in to_frontend.py.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.block_hash import ExtraKey
from common.protocol.to_postproc import TokenDelta
from common.protocol.wire import _Message
from common.sampling_params import SamplingParams
from common.stage_times import StageTimes


def salt_extra_keys(
    cache_salt: str | None, lora_name: str | None = None, images: list[PromptImage] | None = None
) -> tuple[ExtraKey, ...]:
    """What salts a request's block hashes: a cache_salt keeps tenants' prefixes apart, a LoRA
    adapter's name its KV apart from the base model's and other adapters', each image's digest
    its prompt apart from the same tokens with another image. Engine workers and the
    orchestrator's router must hash alike, so both read it here."""
    salt: tuple[ExtraKey, ...] = (("cache_salt", cache_salt),) if cache_salt else ()
    if lora_name:
        salt += ((LORA_KEY, lora_name),)
    return salt + tuple((IMAGE_KEY, image.digest) for image in images or ())


LORA_KEY = "lora"
IMAGE_KEY = "image"


class PromptImage(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt, as the model's image processor made it (frontend/images.py):
    float32 pixel values, little-endian, (channels, size, size) in C order. Sent only to the
    worker that prefills the prompt; a generation worker that pulls the prompt's KV gets the
    digest alone (its prefix-cache key: engine/prompt_images.py `image_key`)."""

    digest: str  # sha256 of `pixels`, hex
    pixels: bytes = b""


def lora_name_of(extra_keys: tuple[ExtraKey, ...]) -> str | None:
    """The LoRA adapter a request runs with, as its extra keys name it (None: the base model)."""
    for key in extra_keys:
        if isinstance(key, tuple) and len(key) >= 2 and key[0] == LORA_KEY:
            return str(key[1])
    return None


class EngineRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What an engine worker (context or generation) reads of a request: its prompt and how to
    sample it. Made by the orchestrator from the GenerateRequest (`engine_request`)."""

    request_id: str
    prompt_token_ids_b64: str
    sampling: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter to run with (None: the base model)
    images: list[PromptImage] = msgspec.field(default_factory=list)  # in prompt order

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return salt_extra_keys(self.cache_salt, self.lora_name, self.images)

    def without_pixels(self) -> EngineRequest:
        """For a worker that pulls the prompt's KV: the images' digests, not their pixels."""
        if not self.images:
            return self
        images = [PromptImage(digest=image.digest) for image in self.images]
        return msgspec.structs.replace(self, images=images)


class PrefillRequest(_Message, tag="prefill"):
    request: EngineRequest
    postproc_address: str
    # A packed PostprocStart, forwarded to the postproc worker only if the first tokens end
    # the request (else the DecodeRequest brings it to the generation worker)
    postproc_start: msgspec.Raw
    # The NIXL agent of another context worker whose host offload tier holds more of the prompt
    # than this worker: read those blocks from it first (engine/kv_tier_share.py)
    tier_peer: str | None = None


class PrefillDone(_Message, tag="prefill_done"):
    """The context worker's answer: each choice's first token, and the leased blocks (of choice 0)
    that hold the prompt's KV, readable through NIXL agent `agent_name`.

    When every choice already finished with its first token, `block_ids` is empty, nothing is
    leased, and the context worker has sent the tokens to the postproc worker itself.
    """

    request_id: str
    worker_id: str
    agent_name: str
    first: list[TokenDelta]  # one per choice, index order
    block_ids: list[int] = msgspec.field(default_factory=list)
    # How long the blocks stay leased, counted from when this was sent: a duration, since the
    # context and generation workers' clocks need not agree (the orchestrator forwards at once;
    # the reader counts it from a moment before this reached it: generation_worker/arrival.py).
    # 0: nothing leased.
    lease_s: float = 0.0
    # the stages up to the first token
    times: StageTimes = msgspec.field(default_factory=StageTimes)

    @property
    def finished(self) -> bool:
        return all(d.finish_reason is not None for d in self.first)


class DecodeRequest(_Message, tag="decode"):
    request: EngineRequest
    postproc_address: str
    postproc_start: msgspec.Raw  # a packed PostprocStart, forwarded with the first tokens
    prefill: PrefillDone | None = None  # None: the generation worker prefills itself


# The orchestrator's wait for every worker's answer: a stop answers once the trace and table are
# written, which takes about a minute per 1000 steps recorded (engine/profiling.py)
PROFILE_ANSWER_TIMEOUT_S = 600.0


class Profile(_Message, tag="profile"):
    """POST /start_profile or /stop_profile: the torch profiler around every engine worker's
    steps (engine/profiling.py)."""

    action: Literal["start", "stop"]


class LoRACommand(_Message, tag="lora"):
    """POST /v1/load_lora_adapter or /v1/unload_lora_adapter (vLLM's bodies): from a frontend,
    fanned out by the orchestrator to every engine worker, each answering a LoRADone."""

    action: Literal["load", "unload"]
    lora_name: str
    lora_path: str = ""  # a PEFT directory on the workers' hosts (load)
