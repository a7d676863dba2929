"""Structured outputs in `/v1/responses` through the official `openai` SDK, on the session's
runtime (the real default model) over uvicorn on a socket: `text.format` json_schema (the
SDK's `responses.parse` / `responses.stream` with a Pydantic `text_format`: the reply parses
against the schema, plain and streamed), json_object, text (the default: plain), the format
echoed on the Response, function tools beside a format as chat combines them, and each
misuse a 400 naming its field (`text.format`, or `tool_choice` for a forced call beside a
format)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_http_openai_parity import MODEL, _served
from tests.test_http_responses_tools import respond
from tests.test_http_structured import SCHEMA

pytest.importorskip("llguidance")

ASK = "Describe a cat as JSON."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def oai(runtime):
    with _served(runtime) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


class Cat(BaseModel):
    name: str = Field(max_length=12)
    legs: int


def _json_or_prefix(r) -> None:
    """A json_object reply: a JSON object when complete, the start of one when cut short."""
    text = r.output_text
    if r.status == "completed":
        assert isinstance(json.loads(text), dict), text
    else:
        assert text.lstrip().startswith("{"), text


def test_parse_with_a_pydantic_text_format(oai):
    r = oai.responses.parse(model=MODEL, input=ASK, text_format=Cat, max_output_tokens=60,
                            temperature=0.0)  # fmt: skip
    assert r.status == "completed", r.output
    assert isinstance(r.output_parsed, Cat), r.output_text
    assert Cat.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "Cat"


def test_streamed_parse_with_a_pydantic_text_format(oai):
    with oai.responses.stream(model=MODEL, input=ASK, text_format=Cat, max_output_tokens=60,
                              temperature=0.0) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed", kinds
    assert isinstance(final.output_parsed, Cat), final.output_text
    assert Cat.model_validate_json(final.output_text) == final.output_parsed


def test_json_object_and_plain_text(oai):
    r = oai.responses.create(model=MODEL, input=ASK, text={"format": {"type": "json_object"}},
                             max_output_tokens=24, temperature=0.0)  # fmt: skip
    _json_or_prefix(r)
    assert r.text.format.type == "json_object"
    plain = oai.responses.create(model=MODEL, input="Say hi.", text={"format": {"type": "text"}},
                                 max_output_tokens=8, temperature=0.0)  # fmt: skip
    bare = oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8,
                                temperature=0.0)  # fmt: skip
    assert plain.output_text and plain.output_text == bare.output_text
    assert plain.text.format.type == "text" and bare.text.format.type == "text"


def test_a_format_beside_tools_keeps_to_the_format(oai):
    # tool_choice "auto" (as chat's response_format with tools): the grammar still holds
    r = oai.responses.create(model=MODEL, input="Weather in Paris? Answer as JSON.",
                             tools=[WEATHER], text={"format": {"type": "json_object"}},
                             max_output_tokens=40, temperature=0.0)  # fmt: skip
    assert [o.type for o in r.output] == ["message"], r.output
    _json_or_prefix(r)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_always_parses_when_sampled(oai, stream):
    fmt = {"type": "json_schema", "name": "cat", "schema": SCHEMA, "strict": True}
    for seed in range(4):
        kwargs = dict(model=MODEL, input=ASK, text={"format": fmt}, max_output_tokens=80,
                      temperature=1.0, extra_body={"seed": seed})  # fmt: skip
        r = respond(oai, stream, **kwargs)
        assert r.status == "completed", r.output
        value = json.loads(r.output_text)
        assert set(value) == {"name", "legs"} and isinstance(value["legs"], int), value
        assert len(value["name"]) <= 12, value


@pytest.mark.slow
def test_parse_with_function_tools_beside_the_format(oai):
    r = oai.responses.parse(model=MODEL, input=ASK, text_format=Cat, tools=[WEATHER],
                            max_output_tokens=60, temperature=0.0)  # fmt: skip
    assert isinstance(r.output_parsed, Cat), r.output


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}},
         "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "nonsense"}}}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "json_object"}}, "extra_body": {"guided_regex": "a+"}},
         "text.format"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
          "text": {"format": {"type": "json_schema", "name": "cat", "schema": SCHEMA}}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_misuse_is_a_400_naming_the_field(oai, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=ASK, max_output_tokens=4, **kwargs)
    assert e.value.body["param"] == field, e.value.body
    if field == "text.format":
        assert "text.format" in e.value.body["message"], e.value.body
