"""Function tools in `/v1/responses` (issue 28, item 6's tool subset) through the official
`openai` SDK's `responses.create` / `responses.stream`, over uvicorn on a socket: the tools in
the prompt, the model's calls as `function_call` items (plain and streamed, with the SDK's
event sequence), the calls and their `function_call_output` fed back as the chat template's
tool messages, tool_choice none / auto / required / named (the last two forced by the grammar
with the real model), and each misuse a 400 naming its field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_http_openai_parity import CALLS, MODEL, _CannedCalls, _served, served_wrapped

# The Responses API's flat function tool (chat nests it under "function").
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
NOOP = {
    "type": "function",
    "name": "noop",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK = "Weather in Paris and Rome?"


@pytest.fixture(scope="module")
def canned(runtime):
    """(SDK client, the canned client) over a server whose replies are CALLS."""
    with served_wrapped(runtime, _CannedCalls) as (url, client):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), client


@pytest.fixture(scope="module")
def oai(runtime):
    with _served(runtime) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def respond(oai, stream: bool, **kwargs):
    """`responses.create(**kwargs)`, or the same streamed and its final response."""
    if not stream:
        return oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as s:
        for _ in s:
            pass
        return s.get_final_response()


def _calls(output) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in output if o.type == "function_call"]


def test_calls_come_back_as_function_call_items(canned):
    oai, _ = canned
    r = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER])
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "I will check." and r.status == "completed"
    assert _calls(r.output) == [("get_weather", {"city": "Paris"}),
                                ("get_weather", {"city": "Rome"})]  # fmt: skip
    ids = [o.call_id for o in r.output[1:]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    one = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert len(_calls(one.output)) == 1
    none = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none")
    assert [o.type for o in none.output] == ["message"] and none.output_text == CALLS


def test_streamed_calls_follow_the_sdks_event_sequence(canned):
    oai, _ = canned
    with oai.responses.stream(model=MODEL, input=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-9:] == [*call_events, *call_events, "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == "I will check."
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert _calls(final.output) == [("get_weather", {"city": "Paris"}),
                                    ("get_weather", {"city": "Rome"})]  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}, {"city": "Rome"}]


def test_calls_and_their_outputs_fed_back_render_as_tool_messages(canned):
    oai, client = canned
    r = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER])
    calls = [o for o in r.output if o.type == "function_call"]
    back = [{"role": "user", "content": ASK}, *r.output]
    back += [{"type": "function_call_output", "call_id": c.call_id, "output": f"sunny {i}"}
             for i, c in enumerate(calls)]  # fmt: skip
    oai.responses.create(model=MODEL, input=back, tools=[WEATHER], instructions="Be brief.")
    prompt = client.tokenizer.decode(client.prompts[-1], skip_special_tokens=False)
    # SmolLM2's template knows no tools: the Hermes rendering (tools.fallback_messages).
    assert prompt.index("Be brief.") < prompt.index('"get_weather"')
    assert "I will check.\n<tool_call>" in prompt and '"city": "Rome"' in prompt
    assert "<tool_response>\nsunny 0\n</tool_response>" in prompt
    assert prompt.index("sunny 0") < prompt.index("sunny 1")


NAMED = {"type": "function", "name": "noop"}


def test_a_forced_tool_choice_starts_a_call_at_once(oai):
    """The grammar reaches the request (the whole call: the slow tests below)."""
    r = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER, NOOP], tool_choice=NAMED,
                             max_output_tokens=6, temperature=0.0)  # fmt: skip
    text, start = r.output_text, '<tool_call>\n{"name": "noop"'
    assert r.status == "incomplete" and text and start.startswith(text), r.output


@pytest.mark.parametrize(
    ("choice", "stream"),
    [
        pytest.param(NAMED, False, marks=pytest.mark.slow),
        pytest.param(NAMED, True, marks=pytest.mark.slow),
        pytest.param("required", False, marks=pytest.mark.slow),
        pytest.param("required", True, marks=pytest.mark.slow),
    ],
)
def test_a_forced_tool_choice_calls_with_the_real_model(oai, choice, stream):
    # (one call: the grammar then ends the reply, where several could run to the limit)
    kwargs = dict(model=MODEL, input=ASK, tools=[WEATHER, NOOP], tool_choice=choice,
                  max_output_tokens=60, temperature=0.0, parallel_tool_calls=False)  # fmt: skip
    r = respond(oai, stream, **kwargs)
    calls = _calls(r.output)
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0][0] in ("get_weather", "noop")
    if choice == NAMED:
        assert r.tool_choice.name == "noop" and calls == [("noop", {})]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "user", "content": ["x"]}]}, "input"),
        ({"input": [{"role": 3, "content": "x"}]}, "input"),
    ],
)  # fmt: skip
def test_misuse_is_a_400_naming_the_field(canned, kwargs, field):
    oai, _ = canned
    kwargs = {"input": ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, max_output_tokens=4, **kwargs)
    assert e.value.body["param"] == field, e.value.body
