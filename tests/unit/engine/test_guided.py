"""Guided decoding in the engine: with the tiny model, only the grammar makes output valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from common import guided
from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from tools.tiny_model.build import TEST_PROMPTS

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}

TIME = {**WEATHER, "name": "get_time"}


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=16)


def generate(llm: LLM, spec, seed: int, max_tokens: int = 96, prompt: str = TEST_PROMPTS[0]):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, guided=spec)
    return llm.generate([prompt], params)[0].outputs[0]


def test_json_schema_output_validates_for_20_seeds(llm: LLM) -> None:
    spec = guided.json_schema(SCHEMA)
    for seed in range(20):
        out = generate(llm, spec, seed)
        assert out.finish_reason == "stop", out.text  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_output_matches(llm: LLM) -> None:
    spec = guided.regex(r"[0-9]{3}-[a-z]{2,4}")
    for seed in range(5):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", generate(llm, spec, seed).text)


def test_required_tool_calls_parse(llm: LLM) -> None:
    syntax = guided.CallSyntax.of("hermes", llm.tokenizer.get_vocab().get)
    spec = guided.required_tool_calls([WEATHER], syntax)
    for seed in range(5):
        text = generate(llm, spec, seed, max_tokens=128).text
        calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)
        assert calls and text == "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        for call in calls:
            parsed = json.loads(call)
            assert parsed["name"] == "get_weather"
            jsonschema.validate(parsed["arguments"], WEATHER["parameters"])


def test_a_pulled_request_replays_its_first_token_into_the_grammar(tiny_model_path: Path) -> None:
    config = EngineConfig(model=str(tiny_model_path), num_blocks=128, block_size=4)
    context, generation = LLMEngine(config), LLMEngine(config)
    prompt = list(range(300, 322))
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=96, guided=guided.json_schema(SCHEMA)
    )
    context.add_request("r", prompt, params, prefill_only=True)
    (first,) = context.step()
    source = context.held_block_table("r")
    table, num_valid = generation.add_pulled_request("r", prompt, params, {0: first.token_id})
    for src, dst in zip(source[num_valid // 4 :], table[num_valid // 4 :], strict=True):
        generation.kv_cache.pool[dst] = context.kv_cache.pool[src]
    generation.pull_done("r")
    context.release_held("r")
    tokens = [first.token_id]
    while generation.has_unfinished():
        tokens += [o.token_id for o in generation.step()]
    text = llm_text(tiny_model_path, tokens)
    jsonschema.validate(json.loads(text), SCHEMA)


def llm_text(model_path: Path, tokens: list[int]) -> str:
    from common.tokenizer import load_tokenizer

    return load_tokenizer(model_path).decode(tokens, skip_special_tokens=True)


def test_bad_grammars_are_refused_before_any_worker(tiny_model_path: Path) -> None:
    tokenizer = guided.ll_tokenizer(tiny_model_path, 4096, (4072,))
    with pytest.raises(InvalidRequest, match="guided_grammar"):
        guided.check(guided.lark("start: nope"), tokenizer)
    with pytest.raises(InvalidRequest, match="guided_regex"):
        guided.check(guided.regex("[unclosed"), tokenizer)


def test_strict_tools_leave_text_free_until_a_call_opens(tiny_model_path: Path) -> None:
    import llguidance
    import numpy as np

    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    ll = guided.ll_tokenizer(tiny_model_path, 4096, (4072,))
    matcher = llguidance.LLMatcher(ll, guided.triggered_tool_calls([WEATHER]).grammar)

    def allowed() -> set[int]:
        words = np.zeros(128, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return set(np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0])

    free_text = tokenizer.encode("Sure, let me look")
    assert matcher.consume_tokens(free_text)  # any text before a call
    assert len(allowed()) > 1000
    assert matcher.consume_tokens(tokenizer.encode("<tool_call>\n"))
    inside = allowed()  # only what continues {"name": "get_weather", ...
    assert inside and all(tokenizer.decode([t]).lstrip().startswith("{") for t in inside)


def test_forced_calls_use_text_tags_where_the_tokenizer_has_no_tag_tokens(
    smollm2_path: Path,
) -> None:
    """SmolLM2 has no <tool_call> token: its forced-call grammar spells the tags as text, and
    parallel_tool_calls false allows exactly one call."""
    import llguidance

    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    assert tokenizer.token_to_id("<tool_call>") is None
    ll = guided.ll_tokenizer(smollm2_path, 49152, (2,))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'

    def accepts(spec, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, spec.grammar)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    syntax = guided.CallSyntax.of("hermes", tokenizer.token_to_id)
    for parallel in (True, False):
        spec = guided.required_tool_calls([WEATHER], syntax, parallel=parallel)
        guided.check(spec, ll)
        assert accepts(spec, call)
        assert accepts(spec, call + "\n" + call) == parallel
        assert not accepts(spec, call.replace("get_weather", "get_time"))
    named = guided.named_tool_call(WEATHER, syntax)
    assert accepts(named, call.removeprefix(guided.TOOL_CALL_BEGIN))


def test_an_answer_format_beside_tools_allows_the_answer_or_calls(tiny_model_path: Path) -> None:
    """tool_choice auto with an output format (an agent with tools and an output type): the
    answer in its JSON schema, or tool calls; nothing else."""
    import llguidance

    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    ll = guided.ll_tokenizer(tiny_model_path, 4096, (4072,))
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"],
              "additionalProperties": False}  # fmt: skip
    syntax = guided.CallSyntax.of("hermes", tokenizer.token_to_id)
    assert syntax.marker_ids  # the tiny tokenizer has <tool_call> and </tool_call> as tokens
    spec = guided.answer_or_tool_calls(schema, [WEATHER], syntax)
    guided.check(spec, ll)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, spec.grammar)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts('{"days":3}')
    assert accepts('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>')
    assert not accepts("Sunny, I think.")
    assert not accepts('{"hours":3}')


def test_log_probs_under_a_grammar_come_from_the_masked_distribution(llm: LLM) -> None:
    """The seed's rule: with a grammar, log-probs are those of the distribution after its mask
    (renormalized over the allowed tokens), so no forbidden token is among the top ones."""
    digits = {str(d) for d in range(10)}
    spec = guided.regex(r"[0-9]{4}")
    free = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)
    guided_params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, guided=spec)
    raw, masked = (llm.generate([TEST_PROMPTS[0]], p)[0].outputs[0] for p in (free, guided_params))
    assert re.fullmatch(r"[0-9]{4}", masked.text)
    for step, top in enumerate(masked.top_logprobs):
        texts = [llm.tokenizer.decode([token_id]) for token_id, _ in top]
        assert all(t and set(t) <= digits for t in texts), (step, texts)  # allowed tokens only
        assert masked.logprobs[step] == top[0][1]  # greedy: the chosen one is the most likely
    # renormalized: the first token's log-prob is above the raw one of the same token
    raw_first = dict(raw.top_logprobs[0]).get(masked.token_ids[0])
    assert raw_first is None or masked.logprobs[0] > raw_first
    assert masked.logprobs[0] <= 0.0


@pytest.mark.parametrize(
    ("thinking", "accepted"),
    [
        ("off", {"call"}),
        ("optional", {"call", "think, call"}),
        ("open", {"rest of thought, call"}),
    ],
)
def test_required_calls_let_a_thinking_model_think_first(
    tiny_model_path: Path, thinking: str, accepted: set[str]
) -> None:
    """tool_choice required with thinking on: the grammar lets the model think (go on thinking
    when the prompt ends inside <think>, or open a block when it may), then forces the calls."""
    import llguidance

    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    ll = guided.ll_tokenizer(tiny_model_path, 4096, (4072,))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    texts = {
        "call": call,
        "think, call": "<think>\nRain < sun? Check.\n</think>\n\n" + call,
        "rest of thought, call": "Rain < sun? Check.\n</think>\n\n" + call,
        "think, no call": "<think>\nhm\n</think>\n\nIt rains.",
        "text": "It rains.",
    }
    syntax = guided.CallSyntax.of("hermes", tokenizer.token_to_id)
    spec = guided.required_tool_calls([WEATHER], syntax, thinking=thinking)  # type: ignore[arg-type]
    guided.check(spec, ll)
    for name, text in texts.items():
        matcher = llguidance.LLMatcher(ll, spec.grammar)
        ok = matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()
        assert ok == (name in accepted), name


# One call of get_weather in each tool parser's format, as a forced call's grammar (compact JSON)
# writes it, and what separates two calls.
FORMATS = {
    "hermes": ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
               "{call}\n{call}"),
    "llama3_json": ('{"name":"get_weather","parameters":{"city":"Oslo"}}', "{call}; {call}"),
    "mistral": ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
                '[TOOL_CALLS][{{"name":"get_weather","arguments":{{"city":"Oslo"}}}}, '
                '{{"name":"get_weather","arguments":{{"city":"Oslo"}}}}]'),
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city":"Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜>{one}{one}<｜tool▁calls▁end｜>",
    ),
}  # fmt: skip


@pytest.mark.parametrize("tool_parser", sorted(FORMATS))
def test_forced_calls_take_the_tool_parsers_format_and_parse_back(
    tiny_model_path: Path, tool_parser: str
) -> None:
    """tool_choice required / named in the format of the parser in use: the grammar takes one
    call (two when parallel) in that format and nothing else, and the postproc worker's parser
    of the same format reads the forced text back as the call."""
    import llguidance

    from common.tokenizer import load_tokenizer
    from frontend.structured import plan_tools
    from postproc_worker.parsers.tools import TOOL_PARSERS, ToolCallArguments, ToolCallStart

    tokenizer = load_tokenizer(tiny_model_path)
    ll = guided.ll_tokenizer(tiny_model_path, 4096, (4072,))
    syntax = guided.CallSyntax.of(tool_parser, tokenizer.token_to_id)
    one, two_pattern = FORMATS[tool_parser]
    if tool_parser == "deepseek_v3":
        inner = one.removeprefix("<｜tool▁calls▁begin｜>").removesuffix("<｜tool▁calls▁end｜>")
        two = two_pattern.format(one=inner)
    else:
        two = two_pattern.format(call=one)

    def accepts(spec: object, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, spec.grammar)  # type: ignore[attr-defined]
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        plan = plan_tools(tools, choice, syntax, parallel=False)
        guided.check(plan.guided, ll)  # type: ignore[arg-type]
        prompt_prefix = plan.prompt_prefix
        assert accepts(plan.guided, one.removeprefix(prompt_prefix))
        assert not accepts(plan.guided, two.removeprefix(prompt_prefix))
        assert not accepts(plan.guided, "Sunny in Oslo.")
        assert not accepts(plan.guided, one.replace("Oslo", "O").replace("city", "town"))
    parallel = plan_tools(tools, "required", syntax, parallel=True).guided
    assert accepts(parallel, two) and accepts(parallel, one.replace("get_weather", "get_time"))
    parser = TOOL_PARSERS[tool_parser]()
    events = [*parser.feed(two), *parser.finish()]
    starts = [e.name for e in events if isinstance(e, ToolCallStart)]
    arguments = "".join(e.text for e in events if isinstance(e, ToolCallArguments))
    assert starts == ["get_weather", "get_weather"]
    assert arguments.replace(" ", "") == '{"city":"Oslo"}' * 2
    assert "".join(e for e in events if isinstance(e, str)).strip() == ""
