"""The wire protocol: every message round-trips, tags are unique, malformed bytes fail loudly."""

from __future__ import annotations

import importlib
import pkgutil
import typing

import msgspec
import pytest

from common import protocol
from common.parser_choice import ParserState
from common.protocol import Chunk, decode, decode_token_ids, encode, encode_token_ids, wire
from common.sampling_params import SamplingParams


def sample_request() -> protocol.GenerateRequest:
    return protocol.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids_b64=encode_token_ids([1, 2, 70000]),
        sampling=SamplingParams(temperature=0.0, max_tokens=8),
        output=protocol.OutputOptions(kind="chat", model="tiny", stream=True, stop=["\n"]),
        reply_to="tcp://127.0.0.1:6000",
    )


def test_every_message_class_is_in_the_union_with_a_unique_tag() -> None:
    members = typing.get_args(protocol.Message)
    base = wire._Message
    modules = [
        importlib.import_module(f"common.protocol.{m.name}")
        for m in pkgutil.iter_modules(protocol.__path__)
    ]
    defined = [
        obj
        for module in [protocol, *modules]
        for obj in vars(module).values()
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
        protocol.PrefillRequest(
            request=sample_request().engine_request(),
            postproc_address="tcp://127.0.0.1:6001",
            postproc_start=protocol.pack_postproc_start(sample_request().postproc_start()),
        ),
        protocol.DecodeRequest(
            request=sample_request().engine_request(),
            postproc_address="tcp://127.0.0.1:6001",
            postproc_start=protocol.pack_postproc_start(sample_request().postproc_start()),
        ),
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
            starts=[protocol.pack_postproc_start(sample_request().postproc_start())],
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
    endings = [Chunk(request_id=f"c-{i}", data=body, done=True) for i, body in enumerate(bodies)]
    merged = msgspec.json.decode(merge_bodies(endings), type=Completion)
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


def test_token_ids_are_counted_and_cut_without_decoding() -> None:
    for n in range(12):
        ids = list(range(1000, 1000 + n))
        b64 = encode_token_ids(ids)
        assert protocol.count_token_ids(b64) == n
        tail = decode_token_ids(protocol.tail_token_ids(b64, 5))
        assert min(n, 5) <= len(tail) <= min(n, 7) and tail == ids[n - len(tail) :]


def chat_request(**output: object) -> protocol.GenerateRequest:
    """A request with everything only the postproc worker reads set to something findable."""
    return msgspec.structs.replace(
        sample_request(),
        output=protocol.OutputOptions(
            kind="chat",
            stop=["###SENTINEL"],
            skip_special_tokens=False,
            parser_state=ParserState(reasoning_parser="qwen3", tool_parser="hermes"),
            **output,  # type: ignore[arg-type]
        ),
        cache_salt="tenant-a",
        priority=3,
        prompt_block_hashes=[123456789],
    )


def test_an_engine_worker_reads_no_output_options_or_routing_fields() -> None:
    request = chat_request()
    engine = request.engine_request()
    assert set(engine.__struct_fields__) == {
        "request_id", "prompt_token_ids_b64", "sampling", "cache_salt", "priority", "lora_name",
        "images",
    }  # fmt: skip
    assert engine.extra_keys == request.extra_keys == (("cache_salt", "tenant-a"),)
    with_lora = msgspec.structs.replace(request, lora_name="sql").engine_request()
    assert with_lora.extra_keys == (("cache_salt", "tenant-a"), ("lora", "sql"))
    assert protocol.lora_name_of(with_lora.extra_keys) == "sql"
    image = protocol.PromptImage(digest="ab12", pixels=b"\0" * 16)
    with_image = msgspec.structs.replace(request, images=[image]).engine_request()
    assert with_image.extra_keys == (("cache_salt", "tenant-a"), ("image", "ab12"))
    pulled = with_image.without_pixels()  # what a generation worker that pulls the KV gets
    assert pulled.images == [protocol.PromptImage(digest="ab12")]
    assert pulled.extra_keys == with_image.extra_keys
    assert not {"stop", "skip_special_tokens"} & set(SamplingParams.__struct_fields__)
    prefill = protocol.PrefillRequest(
        request=engine,
        postproc_address="tcp://127.0.0.1:6001",
        postproc_start=protocol.pack_postproc_start(request.postproc_start()),
    )
    # what an engine worker decodes: everything but the packed start it forwards unread
    read = msgspec.msgpack.decode(encode(prefill))
    del read["postproc_start"]
    text = msgspec.json.encode(read)
    for absent in [
        b"SENTINEL",
        b"stop",
        b"skip_special_tokens",
        b"parser",
        b"reply_to",
        b"123456789",
    ]:
        assert absent not in text, absent


def test_the_postproc_worker_gets_the_prompt_only_when_the_answer_shows_it() -> None:
    prompt = list(range(100, 140))
    for output, whole in [
        ({}, False),
        ({"return_token_ids": True}, True),
        ({"kind": "completion", "echo_prompt": "the prompt"}, True),
    ]:
        request = msgspec.structs.replace(
            sample_request(),
            prompt_token_ids_b64=encode_token_ids(prompt),
            sampling=SamplingParams(n=3, logprobs=2, min_tokens=4),
            output=protocol.OutputOptions(**output),  # type: ignore[arg-type]
        )
        start = protocol.unpack_postproc_start(
            protocol.pack_postproc_start(request.postproc_start())
        )
        assert (start.request_id, start.reply_to, start.output) == (
            request.request_id, request.reply_to, request.output
        )  # fmt: skip
        assert (start.n, start.logprobs, start.min_tokens, start.num_prompt_tokens) == (3, 2, 4, 40)
        if whole:
            assert decode_token_ids(start.prompt_token_ids_b64) == prompt
            assert start.prompt_tail_b64 == ""
        else:
            assert start.prompt_token_ids_b64 == ""
            tail = decode_token_ids(start.prompt_tail_b64)
            assert protocol.PROMPT_CONTEXT_TOKENS <= len(tail) < 10 and prompt[-len(tail) :] == tail


def test_cluster_info_json_names_every_field_even_at_its_default() -> None:
    """What /cluster_info and `orchestrator status` print: a reader of the stage balance finds
    `context_bound: false` and unmeasured averages as null, not missing keys."""
    shown = msgspec.json.decode(msgspec.json.encode(protocol.ClusterInfo(workers=[])))
    assert shown["context_bound"] is False
    assert shown["first_token_wait_s"] is None and shown["decode_s"] is None
    assert shown["num_requests"] == 0 and shown["lora_adapters"] == {}
