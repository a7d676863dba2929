"""Issue 28 items 1-3 over HTTP with the official `openai` SDK, on the session's runtime (the
real default model): response_format json_schema / json_object and vLLM's guided_* enforced
while sampling (every reply parses), tool_choice "required" and a named function forced by a
grammar (the reply always is a call of the right function), the logit controls mapped
(penalties, logit_bias, min_tokens), and each misuse a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.test_http_openai_parity import MODEL, _served

pytest.importorskip("llguidance")

ASK = [{"role": "user", "content": "Describe a cat as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer"}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


@pytest.fixture(scope="module")
def served(runtime):
    with _served(runtime) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(served):
    return served[1]


def test_response_format_json_schema_always_parses(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=80, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"name", "legs"} and isinstance(value["legs"], int), value


def test_json_object_and_guided_choice_and_regex(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=60,
        extra_body={"guided_regex": None},
    )  # fmt: skip
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert text.lstrip().startswith("{"), text
    r = oai.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=5,
        extra_body={"guided_choice": ["blue", "red"]},
    )
    assert r.choices[0].text in ("blue", "red")
    r = oai.completions.create(
        model=MODEL, prompt="A number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{4}", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "noop"}}])
def test_a_forced_tool_choice_always_gives_a_call(oai, choice):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, NOOP], tool_choice=choice, max_tokens=80, temperature=0.0,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0].message
    names = {c.function.name for c in calls}
    assert names <= {"get_weather", "noop"} and all(json.loads(c.function.arguments) is not None
                                                     for c in calls)  # fmt: skip
    if isinstance(choice, dict):
        assert names == {"noop"}


def test_logit_controls_reach_the_sampler(served):
    # A +100 bias on one token: it is the whole reply (SmolLM2's " the" is a token).
    url, oai = served
    body = {"prompt": " the", "add_special_tokens": False}
    [the] = httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]
    r = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, logit_bias={str(the): 100}, temperature=0.0
    )
    assert r.choices[0].text == " the" * 4
    r = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0.0, presence_penalty=1.5,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.3, "min_tokens": 6},
    )  # fmt: skip
    assert r.usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
         "guided_choice"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"extra_body": {"structured_outputs": {"regex": {"1": "Python"}}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"choice": [1, 2]}}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_misuse_is_a_400_naming_the_field(oai, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert e.value.body["param"] == field, e.value.body


SQL_EBNF = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 \""""


def test_sglang_spellings_and_ebnf_grammars(oai):
    """SGLang's `regex`, `ebnf` and `json_schema` (a string) request the same grammars as
    vLLM's guided_* fields; a grammar may be GBNF / EBNF (`::=`, as vLLM's and SGLang's users
    write it: llguidance converts it to Lark); `no_stop_trim` keeps the stop string."""
    ask = [{"role": "user", "content": "Answer."}]

    def content(**extra) -> str:
        r = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=24, extra_body=extra)
        return r.choices[0].message.content

    assert re.fullmatch(r"[0-9]{2,4}", content(regex="[0-9]{2,4}"))
    assert content(ebnf='root ::= "yes" | "no"') in ("yes", "no")
    assert re.fullmatch(
        r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ",
        content(guided_grammar=SQL_EBNF),
    )
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    # (greedy: a sampled object may pad itself with whitespace past max_tokens, unfinished)
    text = content(json_schema=json.dumps(schema), temperature=0)
    try:
        assert json.loads(text)["a"] in (1, 2, 3), text
    except json.JSONDecodeError:
        pytest.fail(f"not JSON: {text!r}")
    r = oai.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, stop=[" 5"],
        extra_body={"no_stop_trim": True},
    )  # fmt: skip
    plain = oai.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, stop=[" 5"]
    )
    assert r.choices[0].text == plain.choices[0].text + " 5"
    for extra, field in (
        ({"ebnf": "root ::= missing_rule"}, "ebnf"),
        ({"regex": "[0-9]", "guided_regex": "[a-z]"}, "regex"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            content(**extra)
        assert e.value.body["param"] == field, e.value.body
