"""POST /v1/chat/completions: the request body, rendering the conversation with the chat
template, and the translation into a GenerateRequest.

    body ─▶ thinking kwargs made consistent ─▶ template (tools included) ─▶ RenderedPrompt
         ─▶ + forced-call prefix ─▶ tokens;  response_format / guided_* / tool_choice ─▶ grammar
         ─▶ parser state (reasoning parser, thinking resolved from the template's own output,
            tool parser) that travels to the postproc worker

A harmony model (gpt-oss, ModelInfo.harmony) is rendered by common/harmony.py instead of a
template (frontend/harmony_prompt.py), its grammars take harmony's channels (response_format
and guided_* shape the final channel) and its output is parsed by the harmony parser.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from common import guided
from common.errors import InvalidRequest
from common.guided import CallSyntax, ThinkingMode, check
from common.parser_choice import ParserState, reasoning_parser_for
from common.protocol import GenerateRequest, OutputOptions, decode_token_ids, encode_token_ids
from common.sampling_params import ThinkingBudget
from common.thinking import THINK_END, THINK_START, resolve_prefilled_thinking
from frontend import harmony_prompt, seed_extensions
from frontend.chat_template import RenderedPrompt, render, takes_tools
from frontend.completions import StreamOptions, check_token_ids, new_request_id
from frontend.images import expand_placeholders
from frontend.model_info import ModelInfo
from frontend.sampling import (
    SamplingFields,
    check_logprobs,
    logit_bias,
    max_tokens_for,
    sampling_params,
    stop_list,
)
from frontend.seed_extensions import (
    ConversationParams,
    LoRARequest,
    SchedulingParams,
    check_disaggregated,
    conversation_id,
)
from frontend.structured import (
    ResponseFormat,
    ToolPlan,
    answer_schema,
    combine,
    from_guided_fields,
    plan_tools,
)
from frontend.tool_prompt import fold_tools


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class TextPart(_Strict, tag_field="type", tag="text"):
    text: str


class ImagePart(_Strict, tag_field="type", tag="image_url"):
    image_url: dict[str, Any]


class ImageEmbedsPart(_Strict, tag_field="type", tag="image_embeds"):
    """vLLM's precomputed image embeddings: read, to be refused with a reason (image_urls)."""

    image_embeds: Any


ContentPart = TextPart | ImagePart | ImageEmbedsPart


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # What the SDK puts in an assistant message it returned, so it can be sent back unchanged;
    # none of them reaches the template (a non-null function_call is refused: use tool_calls).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class ChatCompletionRequest(
    SamplingFields, forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    """The body of POST /v1/chat/completions: the sampling fields (SamplingFields) and these."""

    model: str
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    user: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # At most this many tokens of thinking; then the end-of-thinking marker is forced (vLLM's
    # name). Needs a model with thinking markers; not with a grammar.
    thinking_token_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # Standard fields that cannot change the output here: accepted and ignored (README).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # Standard fields this server cannot honour: a 400 that says why, when set.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extensions, as in vLLM
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark, llguidance's dialect
    # extensions, as in vLLM
    return_token_ids: bool = False  # prompt and output token ids in the answer (vLLM's)
    return_perf_metrics: bool = False  # where the time went (StageTimes), in the answer
    # the prompt as token ids: the template is not rendered (messages are still required by the
    # schema, and give the tools' and parsers' context only)
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    cache_salt: str | None = None
    priority: int = 0
    # the seed's serving extensions (frontend/seed_extensions.py)
    lora_request: LoRARequest | None = None
    conversation_params: ConversationParams | None = None
    scheduling_params: SchedulingParams | None = None
    disaggregated_params: dict[str, Any] | None = None


def check_unsupported(body: ChatCompletionRequest) -> None:
    """The official fields whose meaning this server cannot honour: refused, saying why."""
    if body.audio is not None or (body.modalities and "audio" in body.modalities):
        raise InvalidRequest("audio output is not supported: this model writes text", "audio")
    if body.functions is not None or body.function_call is not None:
        raise InvalidRequest(
            "functions and function_call are deprecated; use tools and tool_choice", "functions"
        )
    if body.best_of is not None and not body.use_beam_search:
        raise InvalidRequest("best_of is the beam width: set use_beam_search", "best_of")
    if body.web_search_options is not None:
        raise InvalidRequest("web search is not available on this server", "web_search_options")
    for i, message in enumerate(body.messages):
        if message.function_call is not None:
            raise InvalidRequest(
                "function_call in messages is deprecated; use tool_calls",
                f"messages[{i}].function_call",
            )


def check_request(body: ChatCompletionRequest, allow_request_template: bool) -> None:
    if body.chat_template is not None and not allow_request_template:
        raise InvalidRequest(
            "a per-request chat_template is not allowed by this server "
            "(frontend.allow_request_chat_template)",
            "chat_template",
        )
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    check_logprobs(body.top_logprobs, "top_logprobs")
    check_unsupported(body)
    check_disaggregated(body.disaggregated_params)
    if not body.messages:
        raise InvalidRequest("messages must not be empty", "messages")


def image_urls(messages: list[Message]) -> list[tuple[str, str]]:
    """Each image part's URL and the parameter that names it, in prompt order (frontend/images.py
    loads them while the template renders)."""
    found, embeds = [], []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, ImageEmbedsPart):
                embeds.append(f"messages[{i}].content[{j}].image_embeds")
            elif isinstance(part, ImagePart):
                param = f"messages[{i}].content[{j}].image_url"
                url = part.image_url.get("url")
                if not isinstance(url, str):
                    raise InvalidRequest("an image_url part needs a url string", param)
                if message.role != "user":
                    raise InvalidRequest("images can only be in user messages", param)
                found.append((url, param))
    if embeds:  # the seed's rule: media and precomputed embeddings never come together
        if found:
            raise InvalidRequest("images and precomputed image embeddings are mutually "
                                 "exclusive: send one or the other", embeds[0])  # fmt: skip
        refused = "precomputed image embeddings are not accepted: send the image (image_url)"
        raise InvalidRequest(refused, embeds[0])
    return found


def check_images(body: ChatCompletionRequest, model: ModelInfo, given: list[int] | None) -> int:
    """How many images the prompt holds; a 400 where this model or request cannot take them."""
    urls = image_urls(body.messages)
    if urls and model.vision is None:
        raise InvalidRequest("this model takes text only", urls[0][1])
    if urls and given is not None:
        raise InvalidRequest("images cannot come with prompt_token_ids", urls[0][1])
    return len(urls)


_SDK_ONLY_FIELDS = ("refusal", "annotations", "audio", "function_call")


def template_messages(
    messages: list[Message], image_token: str | None = None
) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect: developer is a system turn, and text
    parts are joined into one string (as vLLM does for text models: many templates, SmolLM2's
    among them, concatenate `content` as a string), each image part, for a model that takes
    them, as its `image_token` in its place (frontend/images.py expands it after tokenizing)."""
    out = []
    for message in messages:
        record = msgspec.to_builtins(message)
        for name in _SDK_ONLY_FIELDS:
            record.pop(name, None)
        if record["role"] == "developer":
            record["role"] = "system"
        if isinstance(message.content, list):
            parts = [
                part.text if isinstance(part, TextPart) else image_token for part in message.content
            ]
            record["content"] = "\n".join(p for p in parts if p is not None)
        out.append(record)
    return out


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as the client sent them ({"type": "function", "function": {...}}): the templates
    print them, so the defaulted `type` must not be left out as msgspec's encoder would."""
    return [{"type": t.type, "function": msgspec.to_builtins(t.function)} for t in tools]


def render_chat(body: ChatCompletionRequest, model: ModelInfo) -> RenderedPrompt:
    """The template's output, with `thinking` and `enable_thinking` made equal first: templates
    read one or the other, and the reasoning parser ORs them (a stale one would win). A template
    that ignores `tools` gets them, and the conversation's calls and results, written into the
    turns in the tool parser's format (frontend/tool_prompt.py)."""
    if model.harmony:
        if body.chat_template is not None:
            raise InvalidRequest(
                "this model's prompts are in the harmony format: chat_template does not apply",
                "chat_template",
            )
        return harmony_prompt.render_prompt(
            template_messages(body.messages),
            tool_dicts(body.tools or []),
            effort=body.reasoning_effort,
            template_kwargs=body.chat_template_kwargs or {},
            response_format=body.response_format,
            add_generation_prompt=body.add_generation_prompt,
        )
    tokenizer = model.tokenizer
    source = body.chat_template or tokenizer.chat_template
    if source is None:
        raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
    image_token = model.vision.image_token if model.vision is not None else None
    messages = template_messages(body.messages, image_token)
    tools = tool_dicts(body.tools) if body.tools else None
    if not takes_tools(source):
        messages, tools = fold_tools(messages, tools, model.tool_parser), None
    special_tokens = {
        name: tokenizer.id_to_token(token_id) or ""
        for name, token_id in (
            ("bos_token", tokenizer.bos_token_id),
            ("eos_token", tokenizer.eos_token_id),
        )
        if token_id is not None
    }
    return render(
        source,
        messages,
        tools=tools,
        add_generation_prompt=body.add_generation_prompt,
        special_tokens=special_tokens,
        template_kwargs=thinking_kwargs(body.chat_template_kwargs or {}, body.reasoning_effort),
    )


def thinking_kwargs(kwargs: dict[str, Any], reasoning_effort: str | None = None) -> dict[str, Any]:
    """The template's thinking switches: `enable_thinking` and `thinking` always equal, and set
    from `reasoning_effort` (none / minimal: off; low and up: on) unless the kwargs set them.
    The two set to different values is a 400: which one the template reads depends on the
    template, so either choice would silently ignore one of them."""
    kwargs = dict(kwargs)
    both = [kwargs[k] for k in ("enable_thinking", "thinking") if k in kwargs]
    if len(both) == 2 and bool(both[0]) != bool(both[1]):
        raise InvalidRequest(
            "chat_template_kwargs sets enable_thinking and thinking to different values",
            "chat_template_kwargs",
        )
    if reasoning_effort is not None and not {"enable_thinking", "thinking"} & kwargs.keys():
        kwargs["enable_thinking"] = reasoning_effort not in ("none", "minimal")
    for key, other in (("enable_thinking", "thinking"), ("thinking", "enable_thinking")):
        if key in kwargs and other not in kwargs:
            kwargs[other] = kwargs[key]
    return kwargs


def to_generate_request(
    body: ChatCompletionRequest,
    model: ModelInfo,
    reply_to: str,
    allow_request_template: bool,
) -> GenerateRequest:
    """Validate, render, tokenize and translate; raises InvalidRequest naming the parameter."""
    check_request(body, allow_request_template)
    tokenizer = model.tokenizer
    given = given_prompt_ids(body, model)
    num_images = check_images(body, model, given)
    if given is not None:  # the pass-through path: no template, the ids are the prompt
        text = tokenizer.decode(given, skip_special_tokens=False)
        rendered = RenderedPrompt(text, text)
    else:
        rendered = render_chat(body, model)
        model.check_prompt_chars(len(rendered.template_text), "messages")
    tools = tool_dicts(body.tools or [])
    syntax = CallSyntax.of(model.tool_parser, tokenizer.token_to_id)
    plan = plan_tools(
        tools,
        body.tool_choice,
        syntax=syntax,
        parallel=body.parallel_tool_calls,
        thinking=thinking_mode(model, rendered.template_text),
    )
    other = from_guided_fields(
        body.response_format, body.guided_json, body.guided_regex, body.guided_grammar
    )
    if other is not None and syntax.format.channels:  # harmony: the final answer's text
        other = guided.final_answer(other, syntax)
    constraint = combine(plan, other, answer_schema(body.response_format, body.guided_json))
    if constraint is not None:
        check(constraint, model.ll_tokenizer())
    excluded = 0
    if given is not None:
        if plan.prompt_prefix:
            raise InvalidRequest(
                "a named tool_choice cannot be forced with prompt_token_ids: its opening would "
                "be joined to ids already tokenized, where token boundaries differ",
                "tool_choice",
            )
        prompt = given
    else:
        template_text = rendered.template_text
        rendered = RenderedPrompt(template_text, template_text + plan.prompt_prefix)
        model.check_prompt_chars(len(rendered.prompt_text), "messages")
        prompt = tokenizer.encode(rendered.prompt_text)
        if plan.prompt_prefix:  # the server's doing: usage counts the template's tokens only
            excluded = len(prompt) - len(tokenizer.encode(template_text))
        if model.vision is not None:  # each image's token as many times as it has rows
            prompt = expand_placeholders(prompt, model.vision, num_images)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    sampling = sampling_params(
        body,
        defaults=model.sampling_defaults,
        vocab_size=model.vocab_size,
        max_tokens=max_tokens_for(requested, len(prompt), model.max_model_len),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logit_bias=logit_bias(body.logit_bias, model.vocab_size),
        guided=constraint,
        thinking_budget=thinking_budget(body.thinking_token_budget, model, rendered),
        speculative=model.speculative,
    )
    if model.harmony:
        stops = harmony_prompt.stop_token_ids(tokenizer)
        sampling.stop_token_ids = [*sampling.stop_token_ids, *stops]
    prompt_b64 = encode_token_ids(prompt)
    output = OutputOptions(
        kind="chat",
        model=body.model,
        created=int(time.time()),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        stop=stop_list(body.stop) + list(plan.stop),
        skip_special_tokens=body.skip_special_tokens,
        parser_state=parser_state(model, rendered, plan),
        prompt_tokens_excluded=max(0, excluded),
        return_token_ids=body.return_token_ids,
        perf_metrics=body.return_perf_metrics,
    )
    return GenerateRequest(
        request_id=new_request_id("chatcmpl"),
        prompt_token_ids_b64=prompt_b64,
        sampling=sampling,
        output=output,
        reply_to=reply_to,
        cache_salt=body.cache_salt,
        priority=seed_extensions.priority(body.priority, body.scheduling_params),
        conversation_id=conversation_id(body.conversation_params),
    )


def given_prompt_ids(body: ChatCompletionRequest, model: ModelInfo) -> list[int] | None:
    """prompt_token_ids or prompt_token_ids_b64 (the seed's pass-through: a multi-turn client
    that holds the last turn's ids keeps its prefix cache across template versions)."""
    if body.prompt_token_ids is not None and body.prompt_token_ids_b64 is not None:
        raise InvalidRequest(
            "give at most one of prompt_token_ids and prompt_token_ids_b64", "prompt_token_ids"
        )
    if body.prompt_token_ids_b64 is not None:
        try:
            ids = decode_token_ids(body.prompt_token_ids_b64)
        except ValueError as e:
            raise InvalidRequest(f"prompt_token_ids_b64: {e}", "prompt_token_ids_b64") from None
        param = "prompt_token_ids_b64"
    elif body.prompt_token_ids is not None:
        ids, param = body.prompt_token_ids, "prompt_token_ids"
    else:
        return None
    if not ids:
        raise InvalidRequest(f"{param} must not be empty", param)
    check_token_ids(ids, model, param)
    return list(ids)


def thinking_mode(model: ModelInfo, template_text: str) -> ThinkingMode:
    """What a forced tool call's grammar lets the model do first: go on thinking (the prompt
    ends inside <think>), choose to think (no marker prefilled), or nothing (the template closed
    thinking, the model does not think, or its think tags are not tokens)."""
    if model.harmony:
        return "optional"  # the analysis message before a forced call (common/guided.py)
    tokenizer = model.tokenizer
    if reasoning_parser_for(model.model_type) is None or None in (
        tokenizer.token_to_id(THINK_START),
        tokenizer.token_to_id(THINK_END),
    ):
        return "off"
    prefilled = resolve_prefilled_thinking(template_text)
    return "open" if prefilled is True else "off" if prefilled is False else "optional"


def thinking_budget(
    tokens: int | None, model: ModelInfo, rendered: RenderedPrompt
) -> ThinkingBudget | None:
    """The engine's side of thinking_token_budget: the model's markers as token ids, and whether
    the template left the model inside thinking already (a prefilled start marker)."""
    if tokens is None:
        return None
    if model.harmony:
        return harmony_prompt.thinking_budget(tokens, model.tokenizer)
    if reasoning_parser_for(model.model_type) is None:
        raise InvalidRequest(
            "thinking_token_budget needs a model that thinks in <think> blocks",
            "thinking_token_budget",
        )
    encode = model.tokenizer.encode
    return ThinkingBudget(
        tokens=tokens,
        start=encode(THINK_START),
        end=encode(THINK_END),
        open_at_start=resolve_prefilled_thinking(rendered.template_text) is True,
    )


def parser_state(model: ModelInfo, rendered: RenderedPrompt, plan: ToolPlan) -> ParserState | None:
    """The postproc parsers' starting state (None: no parsing). The thinking state is read from
    the template's own output (not the prompt with an injected prefix): only the frontend sees
    that text."""
    reasoning = reasoning_parser_for(model.model_type)
    if reasoning is None and not plan.parse_tools:
        return None
    return ParserState(
        reasoning_parser=reasoning,
        thinking=resolve_prefilled_thinking(rendered.template_text) if reasoning else None,
        tool_parser=model.tool_parser if plan.parse_tools else None,
        in_tool_call=plan.parse_tools and plan.in_tool_call,
    )
