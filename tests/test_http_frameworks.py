"""The OpenAI server under the agent frameworks issue 28 names, over uvicorn on a socket with the
real default model: LangChain's `ChatOpenAI` (plain, streamed, `bind_tools` with a forced
call, `with_structured_output`, and its Responses API mode) and LiteLLM's `completion`
(plain, streamed, tools). The forced calls and schemas run the grammar on every token, which
is slow on the CPU: those tests are marked slow."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.test_http_openai_parity import MODEL, _served

pytest.importorskip("llguidance")
langchain_openai = pytest.importorskip("langchain_openai")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
litellm = pytest.importorskip("litellm")

ASK = "What is the weather in Paris?"


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    # (no other keys: SmolLM2 would otherwise write made-up ones until max_tokens)
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12, description="The city")


class Colour(BaseModel):
    """A colour."""

    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def url(runtime):
    with _served(runtime) as base:
        yield f"{base}/v1"


def _chat(url: str, **kw):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="x", max_retries=0,
                                       timeout=120, temperature=0, **kw)  # fmt: skip


def test_langchain_chat_openai_invokes_and_streams(url):
    llm = _chat(url, max_tokens=3)
    reply = llm.invoke(ASK)
    assert reply.content and reply.usage_metadata["output_tokens"] == 3
    streamed = "".join(chunk.content for chunk in llm.stream(ASK))
    assert streamed == reply.content


@pytest.mark.slow
@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_bind_tools_with_a_forced_call(url, responses_api):
    llm = _chat(url, max_tokens=60, use_responses_api=responses_api)
    reply = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(ASK)
    assert len(reply.tool_calls) == 1, reply
    [call] = reply.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    assert call["id"]


@pytest.mark.slow
def test_langchain_with_structured_output(url):
    llm = _chat(url, max_tokens=30)
    got = llm.with_structured_output(Colour, method="json_schema").invoke("Name a colour.")
    assert isinstance(got, Colour)
    raw = llm.with_structured_output(Colour, method="json_mode", include_raw=True).invoke(
        "Name a colour as JSON with the key colour."
    )
    assert raw["raw"].content.lstrip().startswith("{")


def _litellm(url: str, **kw):
    return litellm.completion(model=f"openai/{MODEL}", api_base=url, api_key="x", temperature=0,
                              num_retries=0, timeout=120, **kw)  # fmt: skip


def test_litellm_completion_plain_and_streamed(url):
    messages = [{"role": "user", "content": ASK}]
    r = _litellm(url, messages=messages, max_tokens=3)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens == 3
    chunks = list(_litellm(url, messages=messages, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


@pytest.mark.slow
def test_litellm_tools(url):
    tool = {"type": "function", "function": {"name": "GetWeather",
            "parameters": GetWeather.model_json_schema()}}  # fmt: skip
    r = _litellm(url, messages=[{"role": "user", "content": ASK}], max_tokens=60, tools=[tool],
                 tool_choice={"type": "function", "function": {"name": "GetWeather"}})  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and r.choices[0].finish_reason == "tool_calls"
