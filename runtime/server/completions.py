"""The generating endpoints, `POST /v1/completions` and `POST /v1/chat/completions`, over one
connected AsyncClient (`OpenAIServer`; the route table calls it).

Requests map onto SamplingParams one choice at a time: `n` choices of a prompt are n requests
(choice j of a seeded request draws with seed + j), and a list of prompts is one request per
prompt and choice, choices numbered prompt-major as OpenAI does. Stop strings match the
detokenized text (the client's StoppingDetokenizer). `echo` with `logprobs` returns the prompt's
log-probs (the first token has none), and with `max_tokens` 0 only those: lm-eval's
log-likelihood requests. A bad request is refused before anything is submitted; a request the
runtime fails is a 500 (a streamed one ends with an error event); a client that disconnects
aborts its requests. Each request holds its slots of the bounded queue until its response ends.
Each choice (and each streamed chunk of one) carries taipan's extension `weight_versions`: the
weight-version spans [[version, first token index], ...] of its generated tokens (a chunk's:
those of the tokens since the choice's previous chunk).

Builds no app and registers no routes; admission and metrics are handed in.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from taipan.client import AsyncClient, Completion, Delta
from taipan.messages.requests import FinishReason
from taipan.outputs import join_versions
from taipan.server.admission import Admission
from taipan.server.metrics import Metrics
from taipan.server.schemas import (
    APIError,
    BaseBody,
    ChatBody,
    CompletionBody,
    choice_params,
    json_log_prob,
    json_log_probs,
    message_dict,
    openai_finish,
    openai_usage,
    refuse_unsupported,
    sampling_params,
)
from taipan.server.streaming import Done, held_stream, merge, sse, until_disconnected


class OpenAIServer:
    """The generating endpoints' logic over one AsyncClient (the routes call `completions`
    and `chat`); it holds the model name the server answers to and the app's admission and
    metrics."""

    def __init__(
        self, client: AsyncClient, served_model_name: str, metrics: Metrics, admission: Admission
    ):
        self.client = client
        self.model = served_model_name
        self.metrics = metrics
        self.admission = admission
        self.created = int(time.time())

    # --- shared -----------------------------------------------------------------------------

    def _check_model(self, body: BaseBody) -> None:
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
            await until_disconnected(request, [self.admission.acquire(k)])
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
        return held_stream(events, release=lambda: self.admission.release(k))

    # --- /v1/completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionBody, request: Request):
        self._check_model(body)
        refuse_unsupported(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not (body.echo and body.logprobs is not None):
            raise APIError(400, "max_tokens 0 needs echo and logprobs (prompt log-probs)")
        prompt_log_probs = body.echo and body.logprobs is not None
        top_n = -1 if body.logprobs is None else body.logprobs
        params = sampling_params(body, max(max_tokens, 1), top_n, prompt_log_probs)
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
                self.client.generate(ids, choice_params(params, j), raise_on_error=False)
                for _, j, ids in jobs
            ]
            results = await until_disconnected(request, coros)
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
            finish = "length" if max_tokens == 0 else openai_finish(c.finish_reason)
            choices.append(
                {
                    "index": k,
                    "text": (prompt_text if body.echo else "") + text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                    "weight_versions": c.weight_versions if tokens else [],  # taipan's
                }
            )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": openai_usage(prompt_tokens, completion_tokens),
        }

    def _token_str(self, t: int) -> str:
        return self.client.tokenizer.decode([t], skip_special_tokens=False)

    def _top(self, top: dict[int, float] | None) -> dict[str, float] | None:
        if top is None:
            return None
        return {self._token_str(t): json_log_prob(lp) for t, lp in top.items()}

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
            "token_logprobs": json_log_probs(lps),
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
            versions: list[tuple[int, int]] = []  # of the tokens since the last chunk sent
            async for d in self.client.stream(ids, choice_params(params, j)):
                count += len(d.token_ids) if max_tokens else 0
                versions = join_versions(versions, d.weight_versions if max_tokens else [])
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
                        "length" if not max_tokens else openai_finish(d.finish_reason)
                    )
                    chunk["stop_reason"] = d.stop_reason
                if chunk["text"] or d.finished or chunk["logprobs"]:
                    chunk["weight_versions"], versions = versions, []
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
            async with contextlib.aclosing(merge(args, one)) as items:
                async for item in items:
                    if isinstance(item, Done):
                        counts = item.results
                        break
                    yield sse(envelope(item))
            if include_usage and counts is not None:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                usage = {"id": rid, "object": "text_completion", "created": created,
                         "model": self.model, "choices": [],
                         "usage": openai_usage(prompt_tokens, sum(counts))}  # fmt: skip
                yield sse(usage)
            yield "data: [DONE]\n\n"

        return events()

    def _stream_logprobs(self, body: CompletionBody, d: Delta) -> dict:
        strs = [self._token_str(t) for t in d.token_ids]
        tops = d.top_n_logprobs or [{}] * len(strs)
        return {
            "tokens": strs,
            "token_logprobs": json_log_probs((d.log_probs or [])[: len(strs)]),
            "top_logprobs": [self._top(t) for t in tops] if body.logprobs else None,
            "text_offset": [],
        }

    # --- /v1/chat/completions ----------------------------------------------------------------

    async def chat(self, body: ChatBody, request: Request):
        self._check_model(body)
        refuse_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            if body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ", "max_tokens")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        messages = [message_dict(m) for m in body.messages]
        try:
            ids = self.client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # a template that refuses these messages: the caller's input
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e
        limit = self.client.info.max_sequence_length
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, limit - len(ids))
        self._check_fits(len(ids), max_tokens, "messages")
        top_n = (body.top_logprobs or 0) if body.logprobs else -1
        params = sampling_params(body, max_tokens, top_n, False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await self._held_stream(
                request, body.n, self._stream_chat(body, rid, ids, params)
            )
        async with self._held(request, body.n):
            coros = [
                self.client.generate(ids, choice_params(params, j), raise_on_error=False)
                for j in range(body.n)
            ]
            results = await until_disconnected(request, coros)
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
                    "finish_reason": openai_finish(c.finish_reason),
                    "stop_reason": c.stop_reason,
                    "weight_versions": c.weight_versions,  # taipan's extension
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": openai_usage(len(ids), completion_tokens),
        }

    def _chat_entry(self, t: int, lp: float) -> dict:
        s = self._token_str(t)
        return {"token": s, "logprob": json_log_prob(lp), "bytes": list(s.encode())}

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
            versions: list[tuple[int, int]] = []  # of the tokens since the last chunk sent
            async for d in self.client.stream(ids, choice_params(params, j)):
                count += len(d.token_ids)
                versions = join_versions(versions, d.weight_versions)
                chunk = {"index": j, "delta": {}, "logprobs": None, "finish_reason": None}
                if d.text:
                    chunk["delta"] = {"content": d.text}
                if body.logprobs and d.token_ids:
                    chunk["logprobs"] = self._chat_logprobs(body, d)
                if d.finished:
                    await self._observe(d)
                    if d.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        raise APIError(500, f"the request failed: {d.error or d.finish_reason}")
                    chunk["finish_reason"] = openai_finish(d.finish_reason)
                    chunk["stop_reason"] = d.stop_reason
                if d.text or d.finished or chunk["logprobs"]:
                    chunk["weight_versions"], versions = versions, []
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
            async with contextlib.aclosing(merge([(j,) for j in range(body.n)], one)) as items:
                async for item in items:
                    if isinstance(item, Done):
                        counts = item.results
                        break
                    yield sse(envelope([item]))
            if include_usage and counts is not None:
                yield sse(envelope([], openai_usage(len(ids), sum(counts))))
            yield "data: [DONE]\n\n"

        return events()
