"""The wire protocol: every message round-trips, tags are unique, malformed bytes fail loudly."""

from __future__ import annotations

import typing

import msgspec
import pytest

from common import protocol
from common.parser_choice import ParserState
from common.protocol import decode, decode_token_ids, encode, encode_token_ids
from common.sampling_params import SamplingParams


def sample_request() -> protocol.GenerateRequest:
    return protocol.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids_b64=encode_token_ids([1, 2, 70000]),
        sampling=SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"]),
        output=protocol.OutputOptions(kind="chat", model="tiny", stream=True),
        reply_to="tcp://127.0.0.1:6000",
    )


def test_every_message_class_is_in_the_union_with_a_unique_tag() -> None:
    members = typing.get_args(protocol.Message)
    base = protocol._Message
    defined = [
        obj
        for obj in vars(protocol).values()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base
    ]
    assert set(defined) == set(members)
    tags = [m.__struct_config__.tag for m in members]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(
    "message",
    [
        sample_request(),
        protocol.Abort(request_id="cmpl-1", reason="stop"),
        protocol.Register(worker_id="gen-0", role="generation", protocol_version=1, pid=42),
        protocol.PrefillDone(
            request_id="cmpl-1",
            worker_id="ctx-0",
            agent_name="ctx-0-17",
            first=[protocol.TokenDelta("cmpl-1", 0, [5], num_prompt_tokens=3)],
            block_ids=[3, 4],
        ),
        protocol.DecodeRequest(request=sample_request(), postproc_address="tcp://127.0.0.1:6001"),
        protocol.Heartbeat(worker_id="gen-0", stats=protocol.WorkerStats(blocks_used=3)),
        protocol.ClusterInfo(
            workers=[
                protocol.WorkerInfo(
                    worker_id="gen-0", role="generation", pid=7, address="", state="ready"
                )
            ]
        ),
        protocol.TokenBatch(
            deltas=[protocol.TokenDelta("cmpl-1", 0, [7, 8], [-0.5, -0.25], None, "stop")],
            first=[sample_request()],
        ),
        protocol.Chunk(request_id="cmpl-1", data=b"data: {}\n\n"),
    ],
)
def test_messages_round_trip(message: protocol.Message) -> None:
    assert decode(encode(message)) == message


def test_prompt_token_ids_travel_as_base64_int32() -> None:
    ids = [0, 1, 151643, 2**31 - 1]
    b64 = encode_token_ids(ids)
    assert decode_token_ids(b64) == ids
    assert len(b64) == 4 * ((4 * len(ids) + 2) // 3)


def test_bad_base64_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        decode_token_ids("AAA=")


@pytest.mark.parametrize("data", [b"", b"\xc1", msgspec.msgpack.encode({"type": "nope"})])
def test_malformed_or_unknown_messages_raise(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode(data)


def test_a_response_of_several_prompts_shows_each_stages_slowest() -> None:
    """Prompts of one request run side by side: the merged body's perf_metrics (and the
    Server-Timing header, in milliseconds) take each stage's longest."""
    from common.openai_schema import Completion, CompletionChoice
    from common.stage_times import StageTimes
    from frontend.generation import merge_bodies

    a = StageTimes(queue_s=0.5, prefill_s=0.1, first_token_s=0.7, decode_s=2.0)
    b = StageTimes(queue_s=0.1, prefill_s=0.3, first_token_s=0.5, decode_s=1.0, transfer_s=0.01)
    bodies = [
        msgspec.json.encode(
            Completion(
                id="c",
                created=0,
                model="m",
                perf_metrics=t,
                choices=[CompletionChoice(index=i, text=str(i))],
            )
        )  # fmt: skip
        for i, t in enumerate([a, b])
    ]
    merged = msgspec.json.decode(merge_bodies(bodies), type=Completion)
    slowest = StageTimes(queue_s=0.5, prefill_s=0.3, transfer_s=0.01, first_token_s=0.7, decode_s=2)
    assert merged.perf_metrics == slowest and [c.text for c in merged.choices] == ["0", "1"]
    assert slowest.server_timing(2.5) == (
        "queue;dur=500.0, prefill;dur=300.0, transfer;dur=10.0, first_token;dur=700.0, "
        "decode;dur=2000.0, total;dur=2500.0"
    )


def test_a_finish_reason_outside_the_typed_set_fails_to_decode() -> None:
    for reason in typing.get_args(protocol.FinishReason):
        batch = protocol.TokenBatch(deltas=[protocol.TokenDelta("r", 0, [], finish_reason=reason)])
        assert decode(encode(batch)) == batch
    bad = protocol.TokenBatch(deltas=[protocol.TokenDelta("r", 0, [], finish_reason="tool_calls")])  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        decode(encode(bad))
    finished = protocol.RequestFinished(request_id="r", worker_id="gen-0", finish_reason="done")  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        decode(encode(finished))


def test_a_parser_state_naming_an_unknown_parser_fails_to_decode() -> None:
    good = msgspec.structs.replace(
        sample_request(),
        output=protocol.OutputOptions(
            kind="chat", parser_state=ParserState(reasoning_parser="qwen3", tool_parser="hermes")
        ),
    )
    assert decode(encode(good)) == good
    for bad_state in [
        {"tool_parser": "nope"},
        {"reasoning_parser": "nope"},
        {"in_tool_call": True},  # a forced call with no parser to read it
        {"tool_parser": "hermes", "extra": 1},
    ]:
        raw = msgspec.to_builtins(good)
        raw["output"]["parser_state"] = bad_state
        with pytest.raises(msgspec.ValidationError, match="parser_state"):
            decode(msgspec.msgpack.encode(raw))
