"""The OpenAI server's lenient schema and its pure parts (issue 28, items 4 and 5): null means
absent, the IGNORED fields are dropped, unbuilt features are a 400 naming the field, the SDK's
own `message.model_dump()` round-trips into a chat template's messages, any 64-bit seed maps
into the engine's range; tokens as byte-level strings with exact bytes and character offsets.
No server: the body models, the formatting functions and the default model's tokenizer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from taipan.server.logprobs import Offsets, TokenTexts, completion_logprobs, token_text
from taipan.server.params import engine_seed, sampling_params
from taipan.server.schemas import (
    IGNORED,
    NO_OP,
    APIError,
    ChatBody,
    CompletionBody,
    message_dict,
    refuse_unsupported,
)


def test_null_means_absent_for_every_optional_field():
    nulls = dict.fromkeys(
        ["n", "stream", "logprobs", "echo", "temperature", "top_p", "seed", "stop", "user",
         "frequency_penalty", "presence_penalty", "logit_bias", "stream_options", "best_of",
         "suffix", "max_tokens", "top_k", "min_p", "ignore_eos", "logprobs_mode"]
    )  # fmt: skip
    body = CompletionBody(model="m", prompt="x", **nulls)
    assert body.n == 1 and body.stream is False and body.logprobs is None and body.echo is False
    assert body.max_tokens == 16
    chat = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": None, "tool_choice": None,
         "top_logprobs": None, "logprobs": None, "response_format": None, "model": None}
    )  # fmt: skip
    assert chat.model == "" and chat.tools is None and chat.logprobs is False


def test_fields_that_cannot_change_the_output_are_accepted_and_ignored():
    extra = {k: {"any": "value"} for k in IGNORED}
    body = ChatBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra,
         "parallel_tool_calls": False, "stream": True,
         "stream_options": {"include_usage": True, "include_obfuscation": True}}
    )  # fmt: skip
    refuse_unsupported(body)
    # The unbuilt features at their no-op values (OpenAI's defaults) change nothing either.
    CompletionBody.model_validate({"prompt": "x", **NO_OP, "logit_bias": {}})


@pytest.mark.parametrize(
    "field, value",
    [
        ("suffix", "x"),
        ("modalities", ["audio"]),
    ],
)
def test_unbuilt_features_are_a_400_naming_the_field(field, value):
    with pytest.raises(APIError) as e:
        ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], field: value})
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_choices_pass_the_schema(choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    )
    refuse_unsupported(body)  # (chat.py forces the call with tools.tool_grammar)


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "g"}}, {"type": "function"}]
)
def test_a_forced_tool_choice_naming_no_tool_is_a_400(choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    )
    with pytest.raises(APIError) as e:
        refuse_unsupported(body)
    assert e.value.param == "tool_choice"


def test_unknown_fields_are_still_refused():
    with pytest.raises(ValidationError):
        CompletionBody.model_validate({"prompt": "x", "bogus": 1})


def test_the_sdks_model_dump_round_trips_into_the_template_messages():
    """An assistant reply as `ChatCompletionMessage.model_dump()` gives it, appended back."""
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage(role="assistant", content="Paris.", refusal=None)
    dumped = reply.model_dump()
    assert dumped["refusal"] is None and "tool_calls" in dumped
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    with_call = {**dumped, "content": None, "tool_calls": [call], "annotations": []}
    body = ChatBody.model_validate(
        {
            "messages": [
                {"role": "user", "content": "q", "extra_field": 1},
                dumped,
                with_call,
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "critic", "content": [{"type": "text", "text": "custom role"}]},
            ]
        }
    )
    msgs = [message_dict(m) for m in body.messages]
    assert msgs[0] == {"role": "user", "content": "q", "extra_field": 1}
    assert msgs[1] == {"role": "assistant", "content": "Paris."}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as HF's
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert msgs[4] == {"role": "critic", "content": "custom role"}


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 7, 2**63 - 1])
def test_any_64_bit_seed_maps_into_the_engines_range(seed):
    body = CompletionBody(prompt="x", seed=seed)
    params = sampling_params(body, 4, -1)
    assert 0 <= params.seed < 2**63 and params.seed == engine_seed(seed)
    assert engine_seed(seed) == engine_seed(seed)  # deterministic
    for outside in (-(2**63) - 1, 2**63):  # beyond int64: a 400 (as vLLM's)
        with pytest.raises(ValidationError):
            CompletionBody(prompt="x", seed=outside)


# --- tokens and offsets ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(client):
    return client.tokenizer  # (the session runtime's: no second read of the GGUF file)


def test_a_token_inside_a_multi_byte_character_is_its_exact_bytes(tok):
    text = "naïve — 日本語 😀"
    ids = tok.encode(text, add_special_tokens=False)
    texts = TokenTexts(tok)
    raw = [texts.bytes_of(t) for t in ids]
    assert b"".join(raw).decode() == text  # the bytes are exact: they join into the text
    strs = [texts.text(t) for t in ids]
    assert "\ufffd" not in "".join(strs)
    partial = [s for s in strs if s.startswith("bytes:")]
    assert partial, strs
    for s, b in zip(strs, raw, strict=True):
        assert s == token_text(b)
        if s.startswith("bytes:"):
            assert s == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
    offsets = Offsets()
    offs = [offsets.next(b) for b in raw]
    assert offs == sorted(offs) and offsets.chars == len(text)
    for t, o in zip(ids, offs, strict=True):  # a whole token's text starts at its offset
        s = texts.text(t)
        if not s.startswith("bytes:"):
            assert text[o : o + len(s)] == s


def test_completion_logprobs_with_zero_top_give_the_token_alone(tok):
    texts = TokenTexts(tok)
    ids = tok.encode("Hello world", add_special_tokens=False)
    out = completion_logprobs(texts, ids, [None, -0.5], [None, {}], Offsets(), 0)
    assert out["token_logprobs"] == [None, -0.5]
    assert out["top_logprobs"] == [None, {texts.text(ids[1]): -0.5}]
    assert out["text_offset"] == [0, len(texts.text(ids[0]))]
    assert "".join(out["tokens"]) == "Hello world"
