"""The libraries people put on top of the SDKs, on their default paths against a disaggregated
cluster: openai-agents (its default model class speaks the Responses API) with a function tool
and an output type, pydantic-ai's Responses model with an output type, and LangChain's
ChatOpenAI with `use_responses_api=True`."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIResponsesModel as PydanticResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.integration.harness import MODEL, Cluster


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("disaggregated")


class Forecast(BaseModel):
    city: str
    summary: str


def test_an_openai_agents_agent_calls_its_tool_once_and_returns_its_output_type(cluster) -> None:
    """tool_choice required: one call (one unless parallel_tool_calls is true), so the tool runs
    once and, with stop_on_first_tool, its result is the answer. The agent's required
    tool_choice beside its output type's format in one request is the seed's 400 (a forced call
    leaves no text for the format to shape): the SDK raises it."""
    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "4 C and rain"

    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="x", max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = ModelSettings(tool_choice="required", max_tokens=64, temperature=0)
    agent = Agent(name="forecaster", instructions="Answer with the weather.", model=model,
                  tools=[get_weather], model_settings=settings,
                  tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = Runner.run_sync(agent, "What's the weather in Oslo?", max_turns=4)
    assert len(calls) == 1 and result.final_output == "4 C and rain"
    typed = agent.clone(output_type=Forecast)
    with pytest.raises(openai.BadRequestError, match="forced tool_choice"):
        Runner.run_sync(typed, "What's the weather in Oslo?", max_turns=4)
    # run_sync ran on the thread's default event loop and keeps it open: the client closes there
    asyncio.get_event_loop_policy().get_event_loop().run_until_complete(client.close())


def test_a_pydantic_ai_agent_on_the_responses_api_returns_its_output_type(cluster) -> None:
    """pydantic-ai's default structured output is a `final_result` tool that the model must call
    (tool_choice required): the forced call's arguments follow the output type's schema."""
    provider = OpenAIProvider(base_url=cluster.base_url, api_key="x")
    agent = PydanticAgent(
        PydanticResponsesModel(MODEL, provider=provider),
        output_type=Forecast,
        instructions="Answer with the weather.",
    )
    result = agent.run_sync(
        "What's the weather in Oslo?", model_settings={"max_tokens": 64, "temperature": 0}
    )
    assert isinstance(result.output, Forecast)
    assert result.usage.output_tokens >= 1


def chat_openai(cluster: Cluster, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=cluster.base_url, api_key="x", max_retries=0,
                      use_responses_api=True, temperature=0, max_tokens=max_tokens)  # fmt: skip


def test_langchain_chat_openai_on_the_responses_api(cluster) -> None:
    llm = chat_openai(cluster, max_tokens=16)
    message = llm.invoke("Where do rivers go?")
    assert message.text and message.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.text for chunk in llm.stream("Where do rivers go?"))
    assert streamed == message.text  # greedy: the same answer, streamed

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "rain"

    with_tools = chat_openai(cluster, max_tokens=64).bind_tools(
        [get_weather], tool_choice="get_weather"
    )
    (call,) = with_tools.invoke("Weather in Oslo?").tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
