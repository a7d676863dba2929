"""`POST /generate`: token ids in, token ids out (SGLang's and vLLM's token-in/token-out
endpoint), for HTTP-driven trainers: no retokenization between the turns of a rollout.

The body: `input_ids` (a list of token ids, or a list of such lists: a batch), `sampling_params`
(taipan's SamplingParams fields by name: one object for every input, or a list of one per
input) and `stream` (server-sent events, one per delta of each input, then `[DONE]`). An unknown
key, a value of the wrong type or a parameter SamplingParams refuses is a 400 naming it. Each
input answers with `output_ids`, `finish_reason` (and `error` for "error"), `weight_versions`
(spans [[version, first token index], ...]), `num_prompt_tokens`, `num_generated_tokens`,
`num_cached_tokens`, and `log_probs` (with `prompt_log_probs` unless skipped) and
`top_n_logprobs` ([[id, log-prob], ...] per token) when asked, and with `return_routed_experts`
(a MoE model) `routed_experts`: [tokens - 1][MoE layers][top_k] expert ids, one row per
position of prompt + output but the last (runtime/outputs.py RequestDetails). A request that
a `pause(mode="abort")` ends answers 200 with its partial output and finish_reason "abort"
(resubmit it as a partial rollout); one the runtime fails answers 200 with finish_reason
"error" and its `error`. An input alone answers with one object, a batch with a list in input
order.

Like the lifecycle controls, it is served only with the server's `--api-key` (403 without one;
the app's key check answers 401 without the key). Registers its route only; the app wires it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import typing
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from pydantic import TypeAdapter, ValidationError

from taipan.client import AsyncClient, Completion, Delta
from taipan.messages.requests import SamplingParams
from taipan.server.admission import Admission
from taipan.server.metrics import Metrics
from taipan.server.schemas import APIError, json_log_prob, json_log_probs
from taipan.server.streaming import Done, held_stream, merge, sse, until_disconnected

GENERATE_PATH = "/generate"
_KEYS = ("input_ids", "sampling_params", "stream")
_MAX_ID = 2**31  # token ids travel as int32


@dataclasses.dataclass
class GenerateJob:
    """One /generate body, checked: the inputs, their SamplingParams, how to answer."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    batch: bool  # input_ids was a list of lists: answer with a list
    stream: bool


def add_generate_route(
    app: FastAPI, client: AsyncClient, admission: Admission, metrics: Metrics, enabled: bool
) -> None:
    """Register POST /generate over `client`; refused (403) unless `enabled` (an API key)."""

    @app.post(GENERATE_PATH)
    async def generate(request: Request):
        if not enabled:
            raise APIError(403, "/generate needs the server's --api-key")
        job = parse_job(await _body(request), client.info.max_sequence_length)
        k = len(job.prompts)
        await _admit(request, admission, metrics, k)
        if job.stream:
            events = _stream(client, metrics, job)
            return held_stream(events, release=lambda: admission.release(k))
        try:
            timers = [metrics.timer() for _ in job.prompts]
            coros = [client.generate(p, s, raise_on_error=False) for p, s in _pairs(job)]
            results = await until_disconnected(request, coros)
        finally:
            admission.release(k)
        outs = []
        for (c,), s, timer in zip(results, job.params, timers, strict=True):
            timer.finish(c, len(c.prompt_token_ids), len(c.token_ids))
            outs.append(_result(c, s))
        return outs if job.batch else outs[0]


def _pairs(job: GenerateJob) -> list[tuple[list[int], SamplingParams]]:
    return list(zip(job.prompts, job.params, strict=True))


async def _admit(request: Request, admission: Admission, metrics: Metrics, k: int) -> None:
    """Take k slots of the server's bounded queue (a client that hangs up while it waits
    leaves)."""
    try:
        await until_disconnected(request, [admission.acquire(k)])
    except APIError as e:
        if e.status == 503:
            metrics.refused.inc()
        raise


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


# --- the body ----------------------------------------------------------------------------------


def parse_job(body: dict, max_sequence_length: int) -> GenerateJob:
    """The checked job of a /generate body; APIError 400 naming what is wrong."""
    unknown = sorted(set(body) - set(_KEYS))
    if unknown:
        raise APIError(
            400, f"unknown key {unknown[0]!r}; /generate takes {list(_KEYS)}", unknown[0]
        )
    if "input_ids" not in body:
        raise APIError(400, "input_ids is required", "input_ids")
    prompts, batch = _prompts(body["input_ids"])
    params = _all_params(body.get("sampling_params"), len(prompts))
    for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
        if len(p) + s.max_tokens > max_sequence_length:
            raise APIError(
                400,
                f"input {i}: {len(p)} prompt tokens + max_tokens {s.max_tokens} exceed the "
                f"model's maximum context length ({max_sequence_length} tokens)",
                "input_ids",
                "context_length_exceeded",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {stream!r}", "stream")
    return GenerateJob(prompts, params, batch, stream)


def _prompts(ids) -> tuple[list[list[int]], bool]:
    """(the prompts, whether a batch) of `input_ids`."""
    what = "input_ids must be a non-empty list of token ids, or a list of such lists"
    if not isinstance(ids, list) or not ids:
        raise APIError(400, what, "input_ids")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise APIError(400, what, "input_ids")
        if not all(type(t) is int and 0 <= t < _MAX_ID for t in p):
            raise APIError(400, f"token ids must be integers in [0, {_MAX_ID})", "input_ids")
    return prompts, batch


def _all_params(raw, n: int) -> list[SamplingParams]:
    """One SamplingParams per input: from one object for all, or a list of one per input."""
    if raw is None:
        return [SamplingParams()] * n
    if isinstance(raw, dict):
        return [sampling_params(raw)] * n
    if isinstance(raw, list) and len(raw) == n:
        return [sampling_params(r) for r in raw]
    raise APIError(
        400,
        f"sampling_params must be an object, or a list of {n} objects (one per input)",
        "sampling_params",
    )


@functools.cache
def _field_adapters() -> dict[str, TypeAdapter]:
    """A validator per SamplingParams field, from its annotation (a stop string may come
    alone, as in OpenAI's API)."""
    hints = typing.get_type_hints(SamplingParams)
    adapters = {f.name: TypeAdapter(hints[f.name]) for f in dataclasses.fields(SamplingParams)}
    adapters["stop"] = TypeAdapter(str | tuple[str, ...])
    return adapters


def sampling_params(raw) -> SamplingParams:
    """SamplingParams from a JSON object of its fields by name; APIError 400 naming the key
    that is unknown or of the wrong type, or saying what SamplingParams refuses."""
    if not isinstance(raw, dict):
        raise APIError(400, "sampling_params must be an object", "sampling_params")
    adapters = _field_adapters()
    kw = {}
    for key, value in raw.items():
        adapter = adapters.get(key)
        if adapter is None:
            raise APIError(
                400,
                f"unknown sampling_params key {key!r}; taipan's SamplingParams fields are "
                f"{sorted(adapters)}",
                f"sampling_params.{key}",
            )
        if value is None:
            continue  # null means absent
        try:
            kw[key] = adapter.validate_python(value)
        except ValidationError as e:
            why = e.errors()[0]["msg"]
            raise APIError(
                400, f"sampling_params.{key}: {why} (got {value!r})", f"sampling_params.{key}"
            ) from None
    params = SamplingParams(**kw)
    problems = params.problems()
    if problems:
        raise APIError(400, "; ".join(problems), "sampling_params")
    return params


# --- the answer --------------------------------------------------------------------------------


def _result(c: Completion, s: SamplingParams) -> dict:
    """What one input answers with."""
    return {
        "output_ids": c.token_ids,
        "finish_reason": str(c.finish_reason),
        "weight_versions": [list(span) for span in c.weight_versions],
        "num_prompt_tokens": len(c.prompt_token_ids),
        "num_generated_tokens": len(c.token_ids),
        "num_cached_tokens": c.num_cached_tokens,
        **_log_probs(c, s),
        **_final(c),
    }


def _event(i: int, d: Delta, s: SamplingParams, num_prompt: int, num_generated: int) -> dict:
    """What one streamed delta of input i carries (the last one: also the counts and the
    final fields)."""
    out = {
        "index": i,
        "output_ids": d.token_ids,
        "weight_versions": [list(span) for span in d.weight_versions],
        "finished": d.finished,
        "finish_reason": None if d.finish_reason is None else str(d.finish_reason),
        **_log_probs(d, s),
    }
    if d.finished:
        out.update(
            num_prompt_tokens=num_prompt,
            num_generated_tokens=num_generated,
            num_cached_tokens=d.num_cached_tokens,
            **_final(d),
        )
    return out


def _log_probs(c: Completion | Delta, s: SamplingParams) -> dict:
    out = {}
    if s.return_log_probs:
        out["log_probs"] = json_log_probs(c.log_probs or [])  # -inf (processed): -9999
    if s.top_n_logprobs:
        out["top_n_logprobs"] = [
            [[t, json_log_prob(lp)] for t, lp in top.items()] for top in c.top_n_logprobs
        ]
    return out


def _final(c: Completion | Delta) -> dict:
    """The fields of a request's end that are there only when they say something."""
    out = {}
    if c.error is not None:
        out["error"] = c.error
    if c.stop_reason is not None:
        out["stop_reason"] = c.stop_reason
    if c.prompt_log_probs is not None:
        out["prompt_log_probs"] = c.prompt_log_probs
    if c.routed_experts is not None:  # [tokens - 1][MoE layers][top_k] expert ids
        out["routed_experts"] = c.routed_experts.tolist()
    return out


async def _stream(client: AsyncClient, metrics: Metrics, job: GenerateJob) -> AsyncIterator[str]:
    """One event per delta of each input, as they come, then [DONE]."""

    async def one(i: int, prompt: list[int], s: SamplingParams, put) -> None:
        generated = 0
        timer = metrics.timer()
        async for d in client.stream(prompt, s):
            generated += len(d.token_ids)
            timer.tokens(len(d.token_ids))
            if d.finished:
                timer.finish(d, len(prompt), generated)
            await put(i, _event(i, d, s, len(prompt), generated))

    args = [(i, p, s) for i, (p, s) in enumerate(_pairs(job))]
    async with contextlib.aclosing(merge(args, one)) as items:
        async for item in items:
            if isinstance(item, Done):
                break
            yield sse(item)
    yield "data: [DONE]\n\n"
