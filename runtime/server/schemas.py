"""What the HTTP server speaks: OpenAI's error shape, the request bodies, and results mapped back
into OpenAI's fields (a body's SamplingParams are .params').

The schema is lenient where OpenAI's is and strict where the output would change
(DESIGN.md §11). `lenient()` is the one place that says how: null means absent for every
optional field; the fields of IGNORED cannot change the output and are dropped whatever their
value; the fields of NO_OP are features taipan has not built, accepted only at the value that
leaves the output unchanged; any other unknown field, or a NO_OP field set to something else, is
a 400 naming it. Every refusal is an `APIError`, which renders as `{"error": {"message",
"type", "param", "code"}}`.

Pure data and validation: no client, no event loop, no admission or metrics state.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from taipan.messages.requests import FinishReason

MAX_LOGPROBS = 20  # OpenAI's bound on `logprobs` / `top_logprobs`


class APIError(Exception):
    """A request the server refuses or fails, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        codes = {400: "invalid_request_error", 401: "invalid_api_key", 404: "not_found"}
        self.code = code or codes.get(status, "")
        self.headers = headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


# Fields that cannot change the output, accepted with any value and dropped (OpenAI's, and the
# vLLM extensions clients send): storage and billing tags, end-user ids, latency hints, the
# structured-output backend's name (taipan has one: llguidance).
IGNORED = frozenset({
    "store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prediction", "request_id", "priority", "cache_salt",
    "kv_transfer_params", "spaces_between_special_tokens", "guided_decoding_backend",
})  # fmt: skip

# Features not built yet: accepted only at the value that changes nothing (OpenAI's default);
# any other value is a 400 naming the field.
NO_OP: dict[str, Any] = {
    "suffix": "",
    "modalities": ["text"],
    "functions": [],
    "function_call": "none",
}
WHY_NOT: dict[str, str] = {}


def lenient(data: Any, kept: frozenset[str] = frozenset()) -> Any:
    """A request body as the body models take it: nulls dropped, IGNORED fields dropped (but
    those a body reads, `kept`), NO_OP fields at their no-op value dropped (else a 400 naming
    the field)."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        if value is None or (key in IGNORED and key not in kept):
            continue
        if key in NO_OP:
            if value == NO_OP[key] or value == {} or value == []:
                continue
            why = WHY_NOT.get(key, "not supported by taipan yet")
            raise APIError(400, f"{key}={shorten(value)} is not supported: {why}", key)
        out[key] = value
    return out


def shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- request bodies ------------------------------------------------------------------------


class Lenient(BaseModel):
    """A body (or part of one) read through `lenient()`; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
    KEPT: ClassVar[frozenset[str]] = frozenset()  # IGNORED fields this body reads

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: Any) -> Any:
        return lenient(data, cls.KEPT)


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk
    include_obfuscation: bool = False  # OpenAI's padding against side channels: none here


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: ToolFunction


class BaseBody(Lenient):
    """Fields both generating endpoints share. `model` missing or empty: the served one."""

    model: str = ""
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # vLLM's extension: -1 or 0 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # any int64: params.engine_seed
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    # vLLM's extension: beam search (runtime/beam_search.py), n the beam width.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    skip_special_tokens: bool = True  # vLLM's extension: False keeps their text in the output
    # vLLM's extensions: the prompt's and each choice's token ids in the answer; the prompt
    # cut to k tokens (-1: to the model's context length), its last ones or its first.
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] = "left"
    return_tokens_as_token_ids: bool = False  # vLLM's: log-probs' tokens as "token_id:N"
    # taipan's extension (SamplingParams.logprobs_mode): the returned log-probs of generated
    # tokens are of the model's distribution ("raw") or the one sampled from ("processed";
    # a token it drops has log-prob -inf, sent as -9999.0: `json_log_prob`).
    logprobs_mode: Literal["raw", "processed"] | None = None
    # vLLM's extension: each prompt token's log-prob and its top candidates (vLLM's shape).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Logit controls (SamplingParams' checks name a bad value's key).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0  # vLLM's extension
    bad_words: list[str] | None = None  # vLLM's extension: words never generated (bad_words_ids)
    allowed_token_ids: list[int] | None = None  # vLLM's extension: the only tokens sampled
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* / structured_outputs
    # (one of them): params.structured_output turns them into the engine's grammar.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # SGLang's spellings of the same: a regex, an EBNF grammar, a JSON schema as a string; and
    # `no_stop_trim`, its include_stop_str_in_output.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    no_stop_trim: bool = False


class CompletionBody(BaseBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's extension: False, no BOS before a text prompt


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A message as the chat template takes it: any role (custom ones go to the template),
    extra fields kept, null or empty ones dropped (the SDK's `message.model_dump()` of a
    reply, with its null `refusal`, `audio`, `function_call`, ..., round-trips)."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_empty(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None and v != [] or k == "content"}


class ChatBody(BaseBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's extensions: how the chat template renders the conversation.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # with --trust-request-chat-template (ChatServer)
    # vLLM's extension: the reply starts with the last message's content when that message is
    # the assistant's (with continue_final_message: the whole message, continued).
    echo: bool = False


class TokenizeBody(Lenient):
    """POST /tokenize (vLLM's): text, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # with --trust-request-chat-template (ChatServer)


class DetokenizeBody(Lenient):
    model: str | None = None
    tokens: list[int]


# What a beam search request may set besides its prompt (vLLM's BeamSearchParams and the chat
# prompt's fields). The search ranks the model's own log-probs (as vLLM's), so `temperature` is
# taken only at 0 or 1, which leave them as they are; any other value is a 400.
BEAM_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of",
    "use_beam_search", "length_penalty", "ignore_eos", "include_stop_str_in_output",
    "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs",
})  # fmt: skip


def refuse_unsupported(body: BaseBody) -> None:
    """Refuse what the body asks that taipan does not do (400 naming the field); `lenient`
    has refused the unbuilt features already."""
    if isinstance(body, CompletionBody) and body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported by taipan", "best_of")
    if body.use_beam_search:  # (a field given at its default changes nothing: allowed)
        fields = type(body).model_fields
        extra = sorted(
            f for f in body.model_fields_set - BEAM_FIELDS
            if getattr(body, f) != fields[f].default
            and not (f == "temperature" and body.temperature in (0.0, 1.0))
        )  # fmt: skip
        if extra:
            raise APIError(
                400, f"{', '.join(extra)} cannot be combined with use_beam_search", extra[0]
            )
    elif body.length_penalty != 1.0:
        raise APIError(400, "length_penalty needs use_beam_search", "length_penalty")
    if isinstance(body, ChatBody):
        refuse_tool_choice(body)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options")


def refuse_tool_choice(body: ChatBody) -> None:
    """tool_choice "none" and "auto" work with any tools (or none); "required" or a named
    function needs tools (the named one among them) and forces a call by a grammar
    (tools.tool_grammar), so it cannot be combined with another structured output."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return
    if not body.tools:
        raise APIError(400, f"tool_choice {shorten(choice)} needs tools", "tool_choice")
    if isinstance(choice, dict):
        name = forced_tool_name(choice)
        if name not in [t.function.name for t in body.tools]:
            raise APIError(
                400, f"tool_choice names the function {shorten(name)}, which is not in tools",
                "tool_choice",
            )  # fmt: skip


def forced_tool_name(choice: dict) -> str | None:
    """The function a named tool_choice ({"type": "function", "function": {"name": ...}})
    names; a 400 for any other shape."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise APIError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}', "tool_choice",
        )  # fmt: skip
    return name


# --- mapping ---------------------------------------------------------------------------------


def openai_finish(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(reason, str(reason))


def openai_usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict:
    """OpenAI's usage object; with `cached`, its `prompt_tokens_details.cached_tokens` (the
    prompt tokens whose KV came from the prefix cache, once per prompt)."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


MIN_JSON_LOG_PROB = -9999.0  # vLLM's OpenAI server's floor for a log-prob


def json_log_prob(lp: float | None) -> float | None:
    """A log-prob as JSON can carry it: -inf (a token logprobs_mode "processed" drops) becomes
    MIN_JSON_LOG_PROB, as vLLM's server does (JSON has no infinities)."""
    return None if lp is None else max(lp, MIN_JSON_LOG_PROB)


def json_log_probs(lps: list[float | None]) -> list[float | None]:
    return [json_log_prob(lp) for lp in lps]


TEXT_PARTS = ("text", "input_text", "output_text")  # chat's, and the Responses API's


def content_text(content: str | list[dict[str, Any]] | None, param: str = "messages") -> str:
    """A message's content as text: OpenAI's content parts joined (text parts only)."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise APIError(400, "content parts must be objects", param)
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type")
            raise APIError(400, f"only text content parts are supported, not {kind!r}", param)
        texts.append(part["text"])
    return "".join(texts)


def message_dict(m: ChatMessage) -> dict:
    """A chat message as the chat template takes it, as Hugging Face's templates expect it:
    text content parts joined, a tool call's JSON `arguments` as an object, extra fields kept."""
    out = {**(m.model_extra or {}), "role": m.role, "content": content_text(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    return out


def _template_tool_call(call: ToolCall) -> dict:

    args = call.function.arguments
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    function = {**(call.function.model_extra or {}), "name": call.function.name, "arguments": args}
    return {"id": call.id, "type": call.type, "function": function}


class ResponsesBody(BaseBody):
    """POST /v1/responses, the text and function-tool subset: `input` (a string, or message,
    function_call and function_call_output items), optional `instructions`, function `tools`
    (flat: {"type": "function", "name", "parameters", ...}); responses.py checks the items and
    tools and maps `text.format` to a structured output. `store` (IGNORED elsewhere) is kept:
    it says whether the Response is stored for `previous_response_id` and GET / DELETE."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None  # extra output fields: none to add for text
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default: kept for previous_response_id, GET and DELETE
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    KEPT: ClassVar[frozenset[str]] = frozenset({"store"})
