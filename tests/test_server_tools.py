"""The tool-call parser of the OpenAI server (issue 28, item 1): Hermes `<tool_call>` blocks
and Llama 3's bare JSON, whole and streamed in random pieces (the streamed parse equals the
whole one), text around calls kept as content, a block that does not parse left as content;
the prompt of a template that knows no tools. Pure: no server, no tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from taipan.server.tools import (
    ToolStream,
    fallback_messages,
    parse_tool_calls,
    tool_style,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "CET; summer"}}'


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, content, names",
    [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, ["get_weather"]),
        (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.", ["get_weather"]),
        (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>", None,
         ["get_weather", "get_time"]),
        (f"<tool_call>\n{WEATHER}", None, ["get_weather"]),  # EOS before the closing tag
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
        ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, ["f"]),
    ],
)  # fmt: skip
def test_hermes_calls_parse_whole_and_streamed_alike(text, content, names):
    got_content, calls = parse_tool_calls(text, "hermes")
    assert got_content == content
    assert [n for n, _ in _names_args(calls)] == names
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    if names and names[0] == "get_weather":
        assert _names_args(calls)[0][1] == {"city": "Paris", "unit": "C"}
    rng = random.Random(0)
    for _ in range(20):  # any split of the text into deltas parses the same
        stream, streamed, streamed_calls, i = ToolStream("hermes"), "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            more, found = stream.feed(text[i:j])
            streamed, streamed_calls, i = streamed + more, streamed_calls + found, j
        more, found = stream.end()
        streamed, streamed_calls = streamed + more, streamed_calls + found
        assert _names_args(streamed_calls) == _names_args(calls)
        if calls:  # blank lines around calls are not streamed as content
            assert streamed.rstrip() == streamed and streamed.strip() == (content or "")
        else:
            assert streamed == text


def test_content_before_a_call_streams_at_once():
    stream = ToolStream("hermes")
    assert stream.feed("Sure, ") == ("Sure,", [])  # a trailing blank waits for text
    assert stream.feed("checking <tool") == (" checking", [])  # may start a tag: held
    assert stream.feed("_call>{") == ("", [])
    content, calls = stream.feed(WEATHER[1:] + "</tool_call>")
    assert content == "" and _names_args(calls)[0][0] == "get_weather"
    assert stream.feed(" <b>done</b>\n") == ("  <b>done</b>", [])
    assert stream.end() == ("", [])  # the blank after a reply with calls is dropped


@pytest.mark.parametrize(
    "text, names",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', ["get_weather"]),
        ('<|python_tag|>{"name": "f", "arguments": {}}', ["f"]),
        ('{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}', ["a", "b"]),
        ("The answer is 4.", []),
        ('{"not": "a call"}', []),
    ],
)
def test_llama3_json_calls(text, names):
    content, calls = parse_tool_calls(text, "llama3")
    assert [n for n, _ in _names_args(calls)] == names
    assert content == (None if names else text)
    stream = ToolStream("llama3")
    pieces = [stream.feed(text[i : i + 5]) for i in range(0, len(text), 5)] + [stream.end()]
    assert [n for n, _ in _names_args([c for _, cs in pieces for c in cs])] == names
    assert "".join(p for p, _ in pieces) == ("" if names else text)


def test_the_style_follows_the_template():
    assert tool_style("{{ '<tool_call>' }} {% if tools %}") == "hermes"
    assert tool_style("<|python_tag|> ipython {% if tools %}") == "llama3"
    assert tool_style(None) == "hermes"


def test_a_template_without_tools_gets_hermes_instructions_and_history():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out = fallback_messages(msgs, tools)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    system_first = fallback_messages([{"role": "system", "content": "Be brief."}, *msgs], tools)
    assert system_first[0]["content"].startswith("Be brief.\n\n# Tools")
