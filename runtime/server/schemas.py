"""What the HTTP server speaks: OpenAI's error shape, the request bodies, and the mapping of a
body onto SamplingParams and of results back into OpenAI's fields.

The schema is lenient where OpenAI's is (null means absent; fields that cannot change the output
are accepted) and strict where the output would change: an unknown field, or an OpenAI field
taipan does not implement set to something other than its no-op value, is a 400 naming the field.
Every refusal is an `APIError`, which renders as `{"error": {"message", "type", "param",
"code"}}`.

Pure data and validation: no client, no event loop, no admission or metrics state.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from taipan.messages.requests import FinishReason, SamplingParams

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


# --- request bodies ------------------------------------------------------------------------


class BaseBody(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (no option is silently ignored);
    OpenAI fields taipan does not implement are accepted only at their no-op values."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # vLLM's extension: -1 or 0 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension
    # taipan's extension (SamplingParams.logprobs_mode): the returned log-probs of generated
    # tokens are of the model's distribution ("raw") or the one sampled from ("processed";
    # a token it drops has log-prob -inf, sent as -9999.0: `json_log_prob`).
    logprobs_mode: Literal["raw", "processed"] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: recorded nowhere, changes nothing


class CompletionBody(BaseBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatBody(BaseBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeBody(BaseModel):
    """POST /tokenize (vLLM's): text, or chat messages through the template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def refuse_unsupported(body: BaseBody) -> None:
    """Refuse the OpenAI fields taipan does not implement, when set to something that would
    change the output (400 naming the field)."""
    checks = {
        "frequency_penalty": body.frequency_penalty != 0,
        "presence_penalty": body.presence_penalty != 0,
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, CompletionBody):
        checks["best_of"] = body.best_of not in (None, body.n)
        checks["suffix"] = bool(body.suffix)
    if isinstance(body, ChatBody):
        checks["tools"] = bool(body.tools)
        checks["tool_choice"] = body.tool_choice not in (None, "none")
        checks["response_format"] = bool(body.response_format) and body.response_format != {
            "type": "text"
        }
    for name, bad in checks.items():
        if bad:
            raise APIError(400, f"{name} is not supported by taipan yet", name)
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "stream_options needs stream=true", "stream_options")
        unknown = set(body.stream_options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise APIError(400, f"unknown stream_options: {sorted(unknown)}", "stream_options")


# --- mapping ---------------------------------------------------------------------------------


def sampling_params(
    body: BaseBody, max_tokens: int, top_n: int, prompt_log_probs: bool
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", "stop")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop=tuple(stop),
        return_log_probs=top_n >= 0 or prompt_log_probs,
        skip_prompt_log_probs=not prompt_log_probs,
        top_n_logprobs=max(top_n, 0),
        return_prompt_top_n_logprobs=prompt_log_probs and top_n > 0,
        logprobs_mode=body.logprobs_mode or "raw",
    )
    problems = params.problems()
    if problems:
        raise APIError(400, "; ".join(problems))
    return params


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own draws when seeded (the same seed would repeat choice 0)."""
    if params.seed is None or j == 0:
        return params
    return SamplingParams(**{**_fields(params), "seed": (params.seed + j) % 2**63})


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def openai_finish(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(reason, str(reason))


def openai_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


MIN_JSON_LOG_PROB = -9999.0  # vLLM's OpenAI server's floor for a log-prob


def json_log_prob(lp: float | None) -> float | None:
    """A log-prob as JSON can carry it: -inf (a token logprobs_mode "processed" drops) becomes
    MIN_JSON_LOG_PROB, as vLLM's server does (JSON has no infinities)."""
    return None if lp is None else max(lp, MIN_JSON_LOG_PROB)


def json_log_probs(lps: list[float | None]) -> list[float | None]:
    return [json_log_prob(lp) for lp in lps]


def message_dict(m: ChatMessage) -> dict:
    """A chat message as the chat template takes it (text content parts joined)."""
    content = m.content
    if isinstance(content, list):  # OpenAI's content parts: text only
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    out = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out
