"""The OpenAI-compatible HTTP front end (DESIGN.md §11): the `http` actor's process.

`build_app(client, ...)` is a FastAPI app over one connected `AsyncClient` (the process's
client actor): `POST /v1/completions`, `POST /v1/chat/completions` (JSON or server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), and vLLM's `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` (lm-eval's remote tokenizer). `http_main(spec)`
runs it under uvicorn in its own process (`taipan serve --http-port`); `serve(...)` runs it in
the caller's event loop (`AsyncLLM.serve`). Never imports torch: a tokenizer, msgpack and
sockets only.

Requests map onto SamplingParams one choice at a time: `n` choices of a prompt are n requests
(choice j of a seeded request draws with seed + j), and a list of prompts is one request per
prompt and choice, choices numbered prompt-major as OpenAI does. Stop strings match the
detokenized text (the client's StoppingDetokenizer). `echo` with `logprobs` returns the prompt's
log-probs (the first token has none), and with `max_tokens` 0 only those: lm-eval's
log-likelihood requests.

Errors: every bad request (malformed JSON, an unknown or unsupported parameter, a value out of
range, an unknown model, a prompt that does not fit `max_sequence_length`) is a 4xx in OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, before anything is submitted; a
request the runtime fails is a 500 of the same shape (a streamed one ends with an error event).
A client that disconnects aborts its requests (their KV blocks come back).

A bounded queue (`Admission`): at most `max_queued` choices are in flight through the server (a
request holds one per prompt and choice from admission until its response ends, however it
ends). One that finds no room waits up to `queue_timeout` seconds, first come first served,
then gets a 503 with `Retry-After`; one that could never fit is a 400 at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from taipan.auth import curve_keys
from taipan.client import AsyncClient, Completion, Delta
from taipan.messages.requests import FinishReason, SamplingParams

MAX_LOGPROBS = 20  # OpenAI's bound on `logprobs` / `top_logprobs`
GUARDED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # behind --api-key
DEFAULT_MAX_QUEUED = 1024  # choices in flight through the server (`--max-queued`)
DEFAULT_QUEUE_TIMEOUT_S = 10.0  # how long a request waits for room (`--queue-timeout`)
RETRY_AFTER_S = 1  # a refused request's Retry-After: room comes back as requests end


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


class _Body(BaseModel):
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: recorded nowhere, changes nothing


class CompletionBody(_Body):
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


class ChatBody(_Body):
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


def _unsupported(body: _Body) -> None:
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


def _sampling(body: _Body, max_tokens: int, top_n: int, prompt_log_probs: bool) -> SamplingParams:
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
    )
    problems = params.problems()
    if problems:
        raise APIError(400, "; ".join(problems))
    return params


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own draws when seeded (the same seed would repeat choice 0)."""
    if params.seed is None or j == 0:
        return params
    return SamplingParams(**{**_fields(params), "seed": (params.seed + j) % 2**63})


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def _finish(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(reason, str(reason))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- the bounded queue ------------------------------------------------------------------------


class Admission:
    """At most `max_queued` choices in flight through the server. `acquire(k)` takes k slots,
    waiting first come first served (a large request at the head is not overtaken) up to
    `timeout` seconds (0: not at all), else raises a 503 with Retry-After; k above the bound is
    a 400 at once. The caller owns `release(k)` once the response has ended, however it ended.
    One event loop's state: no locks."""

    def __init__(self, max_queued: int, timeout: float) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if not 0 <= timeout < math.inf:
            raise ValueError(f"queue_timeout must be finite seconds >= 0, got {timeout}")
        self.limit, self.timeout = max_queued, timeout
        self.in_flight = 0  # slots held by admitted requests
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Choices of the requests waiting for room."""
        return sum(k for k, _ in self._waiters)

    async def acquire(self, k: int) -> None:
        if k > self.limit:
            raise APIError(
                400,
                f"this request has {k} choices (prompts x n), more than the server holds in "
                f"flight ({self.limit}, --max-queued); send fewer prompts or a smaller n",
                "n",
            )
        if not self._waiters and self.in_flight + k <= self.limit:
            self.in_flight += k
            return
        if self.timeout == 0:
            raise self._busy()
        entry = (k, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), self.timeout)
        except BaseException as e:  # timed out, or the caller was cancelled (client gone)
            if entry[1].done():  # room came as the wait ended: the slots are held
                if isinstance(e, TimeoutError):
                    return
                self.release(k)
                raise
            entry[1].cancel()
            self._waiters.remove(entry)
            self._admit_waiters()  # a large request that leaves may make room for the next
            if isinstance(e, TimeoutError):
                raise self._busy() from None
            raise

    def release(self, k: int) -> None:
        self.in_flight -= k
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters and self.in_flight + self._waiters[0][0] <= self.limit:
            k, future = self._waiters.popleft()
            self.in_flight += k
            future.set_result(None)

    def _busy(self) -> APIError:
        return APIError(
            503,
            f"the server is at capacity ({self.limit} choices in flight, --max-queued) and "
            f"no room came within {self.timeout:g} s (--queue-timeout); retry later",
            code="server_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Metrics:
    """The server's Prometheus metrics (one registry per app): requests by finish reason,
    TTFT and TPOT histograms, the bounded queue (choices in flight and waiting, requests
    refused), and at scrape time the runtime's gauges from `client.stats()`."""

    def __init__(self, admission: Admission) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        queue = (
            ("http_in_flight", "Choices admitted by the HTTP server, not yet ended", "in_flight"),
            ("http_waiting", "Choices of HTTP requests waiting for room", "waiting"),
            ("http_max_queued", "The bound on choices in flight (--max-queued)", "limit"),
        )
        for name, help_, attr in queue:
            gauge = prom.Gauge(f"taipan_{name}", help_, registry=r)
            gauge.set_function(lambda attr=attr: getattr(admission, attr))
        self.refused = prom.Counter(
            "taipan_http_refused",
            "HTTP requests refused for want of room within --queue-timeout (503)",
            registry=r,
        )
        self.requests = prom.Counter(
            "taipan_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = prom.Histogram(
            "taipan_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=r
        )
        self.tpot = prom.Histogram(
            "taipan_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.http_errors = prom.Counter(
            "taipan_http_errors", "Refused or failed HTTP requests", ["status"], registry=r
        )
        self.gauges = {
            name: prom.Gauge(f"taipan_{name}", help_, registry=r)
            for name, help_ in (
                ("requests_running", "Requests running on the engines"),
                ("requests_waiting", "Requests waiting to be admitted"),
                ("requests_paused", "Requests paused (their KV kept)"),
                ("kv_blocks_used", "KV cache blocks in use"),
                ("kv_blocks_total", "KV cache blocks"),
                ("prefix_cache_hit_rate", "Prompt tokens taken from the prefix cache, share"),
                ("engine_ranks_alive", "Engine ranks serving (a dead one is routed around)"),
            )
        }

    def observe(self, reason: FinishReason | None, ttft: float | None, tpot: float | None):
        self.requests.labels(finish_reason=_finish(reason) or "unknown").inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    async def render(self, client: AsyncClient) -> bytes:
        stats = await client.stats()
        merged = stats.merged()  # every rank's counters summed
        values = {
            "requests_running": merged.running,
            "requests_waiting": merged.waiting,
            "requests_paused": merged.paused,
            "kv_blocks_used": merged.blocks_used,
            "kv_blocks_total": merged.num_blocks,
            "prefix_cache_hit_rate": merged.prefix_hit_rate,
            "engine_ranks_alive": sum(r.alive for r in stats.ranks),
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        return prom.generate_latest(self.registry)


class OpenAIServer:
    """The endpoints' logic over one AsyncClient (FastAPI routes call these)."""

    def __init__(
        self, client: AsyncClient, served_model_name: str, metrics: Metrics, admission: Admission
    ):
        self.client = client
        self.model = served_model_name
        self.metrics = metrics
        self.admission = admission
        self.created = int(time.time())

    # --- shared -----------------------------------------------------------------------------

    def _check_model(self, body: _Body) -> None:
        if body.model != self.model:
            raise APIError(
                404, f"the model {body.model!r} does not exist", "model", "model_not_found"
            )

    def _check_fits(self, prompt_len: int, max_tokens: int, param: str) -> None:
        limit = self.client.info.max_sequence_length
        if prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens and {max_tokens} more were asked for",
                param,
                "context_length_exceeded",
            )
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param)

    def _encode_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        tok = self.client.tokenizer
        vocab = tok.vocab_size
        if isinstance(prompt, str):
            prompts: Sequence = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, tok.encode(p)))
            else:
                if any(not 0 <= t < vocab for t in p):
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
                out.append((None, list(p)))
        return out

    async def _observe(self, c: Completion | Delta) -> None:
        self.metrics.observe(c.finish_reason, c.ttft, c.tpot)

    async def _admit(self, request: Request, k: int) -> None:
        """Take k slots of the bounded queue (a client that hangs up while it waits leaves)."""
        try:
            await _until_disconnected(request, [self.admission.acquire(k)])
        except APIError as e:
            if e.status == 503:
                self.metrics.refused.inc()
            raise

    @contextlib.asynccontextmanager
    async def _held(self, request: Request, k: int):
        await self._admit(request, k)
        try:
            yield
        finally:
            self.admission.release(k)

    async def _held_stream(self, request: Request, k: int, events) -> StreamingResponse:
        """The SSE response of `events`, holding k slots until it ends."""
        await self._admit(request, k)
        return _HeldStream(_guard(events), release=lambda: self.admission.release(k))

    # --- /v1/completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionBody, request: Request):
        self._check_model(body)
        _unsupported(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not (body.echo and body.logprobs is not None):
            raise APIError(400, "max_tokens 0 needs echo and logprobs (prompt log-probs)")
        prompt_log_probs = body.echo and body.logprobs is not None
        top_n = -1 if body.logprobs is None else body.logprobs
        params = _sampling(body, max(max_tokens, 1), top_n, prompt_log_probs)
        prompts = self._encode_prompts(body.prompt)
        for _, ids in prompts:
            self._check_fits(len(ids), max(max_tokens, 1), "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [(i, j, ids) for i, (_, ids) in enumerate(prompts) for j in range(body.n)]
        if body.stream:
            events = self._stream_completions(body, rid, prompts, jobs, params, max_tokens)
            return await self._held_stream(request, len(jobs), events)
        async with self._held(request, len(jobs)):
            coros = [
                self.client.generate(ids, _choice_params(params, j), raise_on_error=False)
                for _, j, ids in jobs
            ]
            results = await _until_disconnected(request, coros)
        choices = []
        completion_tokens = 0
        for k, ((i, _, ids), res) in enumerate(zip(jobs, results, strict=True)):
            c = res[0]
            await self._observe(c)
            if c.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise APIError(500, f"the request failed: {c.error or c.finish_reason}")
            tokens, text = c.token_ids, c.text
            if max_tokens == 0:  # prompt log-probs only: drop the one token generated
                tokens, text = [], ""
            completion_tokens += len(tokens)
            prompt_text = prompts[i][0]
            if body.echo and prompt_text is None:
                prompt_text = self.client.tokenizer.decode(ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = self._completion_logprobs(body, ids, c, len(tokens))
            choices.append(
                {
                    "index": k,
                    "text": (prompt_text if body.echo else "") + text,
                    "logprobs": logprobs,
                    "finish_reason": "length" if max_tokens == 0 else _finish(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def _token_str(self, t: int) -> str:
        return self.client.tokenizer.decode([t], skip_special_tokens=False)

    def _top(self, top: dict[int, float] | None) -> dict[str, float] | None:
        if top is None:
            return None
        return {self._token_str(t): lp for t, lp in top.items()}

    def _completion_logprobs(self, body: CompletionBody, ids, c, n: int) -> dict:
        tokens: list[int] = []
        lps: list[float | None] = []
        tops: list[dict | None] = []
        if body.echo:
            tokens += ids
            lps += [None, *(c.prompt_log_probs or [])]
            prompt_top = c.prompt_top_n_logprobs or [{}] * (len(ids) - 1)
            tops += [None, *(self._top(t) if body.logprobs else None for t in prompt_top)]
        tokens += c.token_ids[:n]
        lps += (c.log_probs or [])[:n]
        gen_top = (c.top_n_logprobs or [{}] * n)[:n]
        tops += [self._top(t) if body.logprobs else None for t in gen_top]
        strs = [self._token_str(t) for t in tokens]
        offsets, pos = [], 0
        for s in strs:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": strs,
            "token_logprobs": lps,
            "top_logprobs": tops if body.logprobs else None,
            "text_offset": offsets,
        }

    def _stream_completions(self, body, rid, prompts, jobs, params, max_tokens):
        created = int(time.time())
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def one(k: int, i: int, j: int, ids: list[int], put) -> None:
            prompt_text = prompts[i][0]
            if body.echo:
                text = prompt_text if prompt_text is not None else self.client.tokenizer.decode(ids)
                await put(k, {"index": k, "text": text, "logprobs": None, "finish_reason": None})
            count = 0
            async for d in self.client.stream(ids, _choice_params(params, j)):
                count += len(d.token_ids) if max_tokens else 0
                chunk = {
                    "index": k,
                    "text": d.text if max_tokens else "",
                    "logprobs": None,
                    "finish_reason": None,
                }
                if body.logprobs is not None and max_tokens:
                    chunk["logprobs"] = self._stream_logprobs(body, d)
                if d.finished:
                    await self._observe(d)
                    if d.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        raise APIError(500, f"the request failed: {d.error or d.finish_reason}")
                    chunk["finish_reason"] = (
                        "length" if not max_tokens else _finish(d.finish_reason)
                    )
                    chunk["stop_reason"] = d.stop_reason
                if chunk["text"] or d.finished or chunk["logprobs"]:
                    await put(k, chunk)
            return count

        def envelope(choice):
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model,
                "choices": [choice],
            }

        async def events() -> AsyncIterator[str]:
            counts = None
            args = [(k, i, j, ids) for k, (i, j, ids) in enumerate(jobs)]
            async with contextlib.aclosing(_merge(args, one)) as items:
                async for item in items:
                    if isinstance(item, _Done):
                        counts = item.results
                        break
                    yield _sse(envelope(item))
            if include_usage and counts is not None:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                usage = {"id": rid, "object": "text_completion", "created": created,
                         "model": self.model, "choices": [],
                         "usage": _usage(prompt_tokens, sum(counts))}  # fmt: skip
                yield _sse(usage)
            yield "data: [DONE]\n\n"

        return events()

    def _stream_logprobs(self, body: CompletionBody, d: Delta) -> dict:
        strs = [self._token_str(t) for t in d.token_ids]
        tops = d.top_n_logprobs or [{}] * len(strs)
        return {
            "tokens": strs,
            "token_logprobs": (d.log_probs or [])[: len(strs)],
            "top_logprobs": [self._top(t) for t in tops] if body.logprobs else None,
            "text_offset": [],
        }

    # --- /v1/chat/completions ----------------------------------------------------------------

    async def chat(self, body: ChatBody, request: Request):
        self._check_model(body)
        _unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            if body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ", "max_tokens")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        messages = [_message_dict(m) for m in body.messages]
        try:
            ids = self.client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # a template that refuses these messages: the caller's input
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e
        limit = self.client.info.max_sequence_length
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, limit - len(ids))
        self._check_fits(len(ids), max_tokens, "messages")
        top_n = (body.top_logprobs or 0) if body.logprobs else -1
        params = _sampling(body, max_tokens, top_n, False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await self._held_stream(
                request, body.n, self._stream_chat(body, rid, ids, params)
            )
        async with self._held(request, body.n):
            coros = [
                self.client.generate(ids, _choice_params(params, j), raise_on_error=False)
                for j in range(body.n)
            ]
            results = await _until_disconnected(request, coros)
        choices, completion_tokens = [], 0
        for j, res in enumerate(results):
            c = res[0]
            await self._observe(c)
            if c.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise APIError(500, f"the request failed: {c.error or c.finish_reason}")
            completion_tokens += len(c.token_ids)
            choices.append(
                {
                    "index": j,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(body, c) if body.logprobs else None,
                    "finish_reason": _finish(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": _usage(len(ids), completion_tokens),
        }

    def _chat_entry(self, t: int, lp: float) -> dict:
        s = self._token_str(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    def _chat_logprobs(self, body: ChatBody, c) -> dict:
        n = len(c.token_ids)
        tops = (c.top_n_logprobs or [{}] * n)[:n]
        content = []
        for t, lp, top in zip(c.token_ids, (c.log_probs or [])[:n], tops, strict=True):
            entry = self._chat_entry(t, lp)
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[: body.top_logprobs or 0]
            entry["top_logprobs"] = [self._chat_entry(i, v) for i, v in ranked]
            content.append(entry)
        return {"content": content}

    def _stream_chat(self, body: ChatBody, rid: str, ids: list[int], params):
        created = int(time.time())
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def one(j: int, put) -> int:
            await put(j, {"index": j, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None})  # fmt: skip
            count = 0
            async for d in self.client.stream(ids, _choice_params(params, j)):
                count += len(d.token_ids)
                chunk = {"index": j, "delta": {}, "logprobs": None, "finish_reason": None}
                if d.text:
                    chunk["delta"] = {"content": d.text}
                if body.logprobs and d.token_ids:
                    chunk["logprobs"] = self._chat_logprobs(body, d)
                if d.finished:
                    await self._observe(d)
                    if d.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        raise APIError(500, f"the request failed: {d.error or d.finish_reason}")
                    chunk["finish_reason"] = _finish(d.finish_reason)
                    chunk["stop_reason"] = d.stop_reason
                if d.text or d.finished or chunk["logprobs"]:
                    await put(j, chunk)
            return count

        def envelope(choices, usage=None):
            out = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": self.model, "choices": choices}  # fmt: skip
            if usage is not None:
                out["usage"] = usage
            return out

        async def events() -> AsyncIterator[str]:
            counts = None
            async with contextlib.aclosing(_merge([(j,) for j in range(body.n)], one)) as items:
                async for item in items:
                    if isinstance(item, _Done):
                        counts = item.results
                        break
                    yield _sse(envelope([item]))
            if include_usage and counts is not None:
                yield _sse(envelope([], _usage(len(ids), sum(counts))))
            yield "data: [DONE]\n\n"

        return events()


def _message_dict(m: ChatMessage) -> dict:
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


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Done:
    """The end of a merge: every producer's return value, in producer order."""

    def __init__(self, results: list) -> None:
        self.results = results


async def _merge(args: list[tuple], producer) -> AsyncGenerator[Any, None]:
    """Run `producer(*a, put)` for each a concurrently and yield what they put, as it comes;
    then a _Done with their results. A producer's exception is raised here; leaving early
    (the HTTP client went away) cancels them all, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def put(_key, item) -> None:
        await queue.put(item)

    tasks = [asyncio.ensure_future(producer(*a, put)) for a in args]
    finished = asyncio.ensure_future(asyncio.gather(*tasks))
    getter = None
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield _Done(finished.result())  # raises a producer's exception
            return
    finally:
        # Cancel and await everything (a gather or queue read left behind would be logged as
        # an exception never retrieved or a task destroyed while pending).
        pending = [*tasks, finished, *([getter] if getter is not None else [])]
        for t in pending:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pending, return_exceptions=True)


async def _guard(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream that fails after its 200 went out ends with an OpenAI error event. Closing
    this closes `events` at once (so its requests are aborted then, not when collected)."""
    try:
        async with contextlib.aclosing(events):
            async for e in events:
                yield e
    except APIError as e:
        yield _sse({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        yield "data: [DONE]\n\n"
    except Exception as e:  # the runtime went away mid-stream: say so, then end the stream
        yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
        yield "data: [DONE]\n\n"


class _HeldStream(StreamingResponse):
    """A streamed answer that gives its slots of the bounded queue back when it ends, however
    it ends: finished, failed, cancelled, or the client gone (then starlette leaves the body
    iterator open, so it is closed here first: its requests are aborted before the release)."""

    def __init__(self, content: AsyncGenerator[str, None], release) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._release()


async def _until_disconnected(request: Request, coros: list) -> list:
    """Await the coroutines together; if the HTTP client disconnects first, cancel them (the
    AsyncClient aborts each request it stops listening to) and raise CancelledError."""
    work = asyncio.ensure_future(asyncio.gather(*coros))
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.25)
            if done:
                return work.result()
            if await request.is_disconnected():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
                raise asyncio.CancelledError("the HTTP client disconnected")
    finally:
        if not work.done():
            work.cancel()


class _KeyCheck:
    """`--api-key`: a 401 for a GUARDED path without `Authorization: Bearer KEY`, before the
    body is read. Plain ASGI (not BaseHTTPMiddleware, which hides a client's disconnect from
    `request.is_disconnected()`, and so from the aborts)."""

    def __init__(self, app, key: str, metrics: Metrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                self.metrics.http_errors.labels(status="401").inc()
                error = APIError(401, "a valid API key is required (Authorization: Bearer)")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- the app ---------------------------------------------------------------------------------


def build_app(
    client: AsyncClient,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S,
) -> FastAPI:
    """The OpenAI-compatible app over a connected client; at most `max_queued` choices in
    flight, a request waiting up to `queue_timeout` seconds for room (module docstring)."""
    admission = Admission(max_queued, queue_timeout)
    metrics = Metrics(admission)
    server = OpenAIServer(client, served_model_name or client.model, metrics, admission)
    app = FastAPI(title="taipan", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        metrics.http_errors.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        # FastAPI's own refusals (a body it cannot parse, an unknown path or method).
        metrics.http_errors.labels(status=str(e.status_code)).inc()
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        parts = []
        param = None
        for err in e.errors()[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        metrics.http_errors.labels(status="400").inc()
        return APIError(400, "; ".join(parts) or "invalid request body", param).response()

    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        """200 while the runtime answers (a stats round trip within 5 s), else 503."""
        try:
            await asyncio.wait_for(client.stats(), 5.0)
        except Exception as e:  # unreachable, closed, timed out: all mean "not healthy"
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "taipan",
                    "max_model_len": client.info.max_sequence_length,
                }
            ],
        }

    # vLLM's tokenizer endpoints (lm-eval's "remote" tokenizer backend uses them, so that it
    # needs no tokenizer files of its own).
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = client.tokenizer
        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        return {
            "tokenizer_class": "taipan",
            "eos_token": None if eos is None else tok.id_to_token(eos),
            "bos_token": None if tok.bos_token_id is None else tok.id_to_token(tok.bos_token_id),
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": client.info.max_sequence_length,
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tok = client.tokenizer
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [_message_dict(m) for m in body.messages]
            try:
                ids = tok.apply_chat_template(messages, body.add_generation_prompt)
            except Exception as e:  # a template that refuses these messages
                raise APIError(400, f"the chat template refused the messages: {e}") from e
        limit = client.info.max_sequence_length
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        vocab = client.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must lie in [0, {vocab})", "tokens")
        return {"prompt": client.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics_():
        """The metrics, with the runtime's gauges read fresh (a stats round trip within 5 s);
        503 while the runtime does not answer, so that a scrape marks it down."""
        try:
            body = await asyncio.wait_for(metrics.render(client), 5.0)
        except Exception as e:  # unreachable, closed, timed out: no fresh gauges to give
            text = f"the runtime does not answer: {e}\n"
            return Response(text, status_code=503, media_type="text/plain")
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await server.chat(body, request)

    return app


async def serve(
    client: AsyncClient,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S,
    log_level: str = "warning",
    started: asyncio.Event | None = None,
) -> None:
    """Serve the app on host:port in the running event loop until cancelled."""
    import uvicorn

    app = build_app(
        client,
        served_model_name=served_model_name,
        api_key=api_key,
        max_queued=max_queued,
        queue_timeout=queue_timeout,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the process owner decides about signals
    task = asyncio.ensure_future(server.serve())
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if task.done():
            task.result()  # e.g. the port is taken
            raise OSError(f"the HTTP server on {host}:{port} stopped at start")
        if started is not None:
            started.set()
        await task
    finally:
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)


async def http_main(spec: dict) -> None:
    """The `http` process: connect to the runtime's frontend and serve until the runtime (or
    SIGTERM) ends it."""
    http = spec["http"]
    queue = {k: http[k] for k in ("max_queued", "queue_timeout") if http.get(k) is not None}
    keys = curve_keys(spec["frontend"], spec.get("keys_dir"), server=False)
    client = AsyncClient(spec["frontend"], curve=keys)
    await client.connect()
    try:
        await serve(
            client,
            http["host"],
            http["port"],
            served_model_name=http.get("served_model_name"),
            api_key=http.get("api_key"),
            log_level=http.get("log_level") or "warning",
            **queue,
        )
    finally:
        await client.close()
