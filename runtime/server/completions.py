"""`POST /v1/completions` over one connected AsyncClient, and what the generating endpoints
share (`OpenAIServer`; chat and responses build on it).

Requests map onto SamplingParams one choice at a time: `n` choices of a prompt are n requests
(choice j of a seeded request draws with seed + j), and a list of prompts is one request per
prompt and choice, choices numbered prompt-major as OpenAI does. Stop strings match the
detokenized text (the client's StoppingDetokenizer). `echo` returns the prompt before the text
(a token-id prompt as its decode, special tokens included, so text, tokens and offsets agree),
and with `logprobs` its log-probs (the first token has none); with `max_tokens` 0 only those:
lm-eval's log-likelihood requests. Streamed, echo with logprobs holds the choice's chunks back
until its end (the prompt's log-probs come with the request's last output), and vLLM's
`prompt_logprobs` (which vLLM refuses to stream) come in the choice's last chunk. A bad request is
refused before anything is submitted; a request the runtime fails is a 500 (a streamed one ends
with an error event); a client that disconnects aborts its requests. Each request holds its
slots of the bounded queue until its response ends. Each choice (and each streamed chunk of
one) carries taipan's extension `weight_versions`: the weight-version spans [[version, first
token index], ...] of its generated tokens (a chunk's: those of the tokens since the choice's
previous chunk).

Builds no app and registers no routes; admission and metrics are handed in.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from taipan.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from taipan.client import AsyncClient, Completion
from taipan.messages.requests import FinishReason, SamplingParams
from taipan.outputs import join_versions
from taipan.server.admission import Admission
from taipan.server.logprobs import (
    Offsets,
    TokenIdTexts,
    TokenTexts,
    completion_logprobs,
    prompt_logprobs,
)
from taipan.server.metrics import Metrics
from taipan.server.options import ServerOptions
from taipan.server.params import bad_words_ids, choice_params, sampling_params
from taipan.server.schemas import (
    APIError,
    BaseBody,
    CompletionBody,
    openai_finish,
    openai_usage,
    refuse_unsupported,
)
from taipan.server.streaming import Done, held_stream, merge, sse, until_disconnected


def failed(c) -> None:
    """A choice the runtime failed or aborted: a 500 (a streamed one: its error event)."""
    if c.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        raise APIError(500, f"the request failed: {c.error or c.finish_reason}")


def _or(value, default):
    return default if value is None else value


class OpenAIServer:
    """The generating endpoints' logic over one AsyncClient (the routes call `completions`;
    ChatServer adds chat): the model name the server answers to, the app's admission and
    metrics, and the checks and plumbing every endpoint shares."""

    def __init__(
        self,
        client: AsyncClient,
        served_model_name: str,
        metrics: Metrics,
        admission: Admission,
        options: ServerOptions | None = None,
    ):
        self.client = client
        self.model = served_model_name
        self.metrics = metrics
        self.admission = admission
        self.created = int(time.time())
        self.texts = TokenTexts(client.tokenizer)
        self._id_texts = TokenIdTexts(client.tokenizer)
        self.options = options or ServerOptions()

    def texts_for(self, body: BaseBody) -> TokenTexts:
        """How the body's log-probs show tokens: as text, or as "token_id:N"."""
        return self._id_texts if body.return_tokens_as_token_ids else self.texts

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        """The answer's usage object (`openai_usage`), with the cached tokens when asked."""
        details = cached if self.options.prompt_tokens_details else None
        return openai_usage(prompt_tokens, completion_tokens, details)

    # --- shared -----------------------------------------------------------------------------

    def check_model(self, body: BaseBody) -> None:
        """A missing or empty model means the served one; any other name is a 404."""
        if body.model and body.model != self.model:
            raise APIError(
                404, f"the model {body.model!r} does not exist", "model", "model_not_found"
            )

    def check_fits(self, prompt_len: int, max_tokens: int, param: str) -> None:
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

    def truncated(self, body: BaseBody, ids: list[int]) -> list[int]:
        """The prompt's ids cut to `truncate_prompt_tokens` (vLLM's; -1: to the context
        length): the last ones, or the first with `truncation_side` "right"."""
        k = body.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.client.info.max_sequence_length if k == -1 else k
        if body.truncation_side == "right":
            return ids[:k]
        return ids[max(0, len(ids) - k) :]

    def sampling_params(
        self, body: BaseBody, max_tokens: int, top_n: int, prompt_top: int = -1
    ) -> SamplingParams:
        """params.sampling_params with the body's `bad_words` tokenized as vLLM does, and a
        400 naming the field whose token ids lie outside the tokenizer's vocabulary (the engine
        would refuse the request: a failed request, a 500, rather than the client's error)."""
        tok = self.client.tokenizer
        encode = functools.partial(tok.encode, add_special_tokens=False)
        bad = bad_words_ids(body.bad_words, encode)
        params = sampling_params(body, max_tokens, top_n, prompt_top, bad)
        problems = params.token_id_problems(tok.vocab_size)
        if problems:
            field = problems[0].split(" ", 1)[0]
            raise APIError(
                400, "; ".join(problems), "bad_words" if field == "bad_words_ids" else field
            )
        return params

    def _encode_prompts(self, prompt, add_special_tokens: bool = True) -> list:
        """(the prompt's text as echoed, its ids) per prompt; a text prompt is encoded with the
        tokenizer's special tokens (BOS) unless `add_special_tokens` is false (vLLM's field); a
        token-id prompt's text is its decode with special tokens, so that it agrees with the
        echoed tokens."""
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
                out.append((p, tok.encode(p, add_special_tokens=add_special_tokens)))
            else:
                if any(not 0 <= t < vocab for t in p):
                    raise APIError(
                        400, f"prompt token ids out of vocabulary: they lie in [0, {vocab})",
                        "prompt",
                    )  # fmt: skip
                out.append((tok.decode(p, skip_special_tokens=False), list(p)))
        return out

    async def admit(self, request: Request, k: int) -> None:
        """Take k slots of the bounded queue (a client that hangs up while it waits leaves)."""
        try:
            await until_disconnected(request, [self.admission.acquire(k)])
        except APIError as e:
            if e.status == 503:
                self.metrics.refused.inc()
            raise

    @contextlib.asynccontextmanager
    async def held(self, request: Request, k: int):
        await self.admit(request, k)
        try:
            yield
        finally:
            self.admission.release(k)

    async def held_stream(self, request: Request, k: int, events) -> StreamingResponse:
        """The SSE response of `events`, holding k slots until it ends."""
        await self.admit(request, k)
        return held_stream(events, release=lambda: self.admission.release(k))

    async def generate_all(self, request: Request, jobs) -> list[Completion]:
        """Run (ids, params) jobs together, holding their slots; the metrics told of each."""
        async with self.held(request, len(jobs)):
            timers = [self.metrics.timer() for _ in jobs]
            coros = [self.client.generate(ids, p, raise_on_error=False) for ids, p in jobs]
            results = [r[0] for r in await until_disconnected(request, coros)]
        for (ids, _), c, timer in zip(jobs, results, timers, strict=True):
            timer.finish(c, len(ids), len(c.token_ids))
        return results

    async def beam_search(
        self, request: Request, prompts: list[list[int]], body: BaseBody, max_tokens: int
    ) -> list[BeamSearchOutput]:
        """vLLM's `use_beam_search` (runtime/beam_search.py): `n` beams per prompt, best
        first, holding n slots per prompt while it runs."""
        params = BeamSearchParams(
            body.n, max_tokens, body.ignore_eos, body.length_penalty,
            body.include_stop_str_in_output,
        )  # fmt: skip
        problems = params.problems()
        if problems:
            raise APIError(400, "; ".join(problems).replace("beam_width", "n"), "n")
        async with self.held(request, body.n * len(prompts)):
            [outs] = await until_disconnected(request, [beam_search(self.client, prompts, params)])
        return outs

    @staticmethod
    def beam_choices(outs: list[BeamSearchOutput], prompts: list[list[int]], text) -> tuple:
        """(the choices, in prompt order and each prompt's best first; their generated tokens)
        of a beam search; `text(seq)`: a choice's fields of its text."""
        choices, generated = [], 0
        for out, ids in zip(outs, prompts, strict=True):
            for seq in out.sequences:
                generated += len(seq.tokens) - len(ids)
                choices.append({
                    "index": len(choices), **text(seq), "logprobs": None,
                    "finish_reason": seq.finish_reason, "stop_reason": None,
                })  # fmt: skip
        return choices, generated

    # --- /v1/completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionBody, request: Request):
        self.check_model(body)
        refuse_unsupported(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not (body.echo and body.logprobs is not None):
            if body.prompt_logprobs is None:
                raise APIError(400, "max_tokens 0 needs echo and logprobs (prompt log-probs)")
        top_n = -1 if body.logprobs is None else body.logprobs
        prompt_top = max(top_n if body.echo else -1, _or(body.prompt_logprobs, -1))
        params = self.sampling_params(body, max(max_tokens, 1), top_n, prompt_top)
        prompts = self._encode_prompts(body.prompt, body.add_special_tokens)
        if body.truncate_prompt_tokens is not None:  # (the echoed text: of the ids kept)
            decode = functools.partial(self.client.tokenizer.decode, skip_special_tokens=False)
            prompts = [
                (decode(kept), kept) for kept in (self.truncated(body, p) for _, p in prompts)
            ]
        for _, ids in prompts:
            self.check_fits(len(ids), max(max_tokens, 1), "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            if body.stream:
                raise APIError(400, "stream cannot be combined with use_beam_search", "stream")
            ids_list = [ids for _, ids in prompts]
            outs = await self.beam_search(request, ids_list, body, max_tokens)
            choices, generated = self.beam_choices(outs, ids_list, lambda s: {"text": s.text})
            return {
                "id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.model, "choices": choices,
                "usage": self.usage(sum(map(len, ids_list)), generated, 0),
            }  # fmt: skip
        jobs = [(i, j, ids) for i, (_, ids) in enumerate(prompts) for j in range(body.n)]
        if body.stream:
            events = self._stream_completions(body, rid, prompts, jobs, params, max_tokens)
            return await self.held_stream(request, len(jobs), events)
        results = await self.generate_all(
            request, [(ids, choice_params(params, j)) for _, j, ids in jobs]
        )
        choices, completion_tokens = [], 0
        for k, ((i, _, ids), c) in enumerate(zip(jobs, results, strict=True)):
            failed(c)
            n = len(c.token_ids) if max_tokens else 0  # 0: prompt log-probs only
            completion_tokens += n
            prompt_text = prompts[i][0]
            logprobs = None
            if body.logprobs is not None:
                logprobs = self._logprobs(body, ids, prompt_text, c, n)
            choice = {
                "index": k,
                "text": (prompt_text if body.echo else "") + (c.text if n else ""),
                "logprobs": logprobs,
                "finish_reason": openai_finish(c.finish_reason) if n else "length",
                "stop_reason": c.stop_reason,
                "weight_versions": c.weight_versions if n else [],  # taipan's
                "prompt_logprobs": None,  # vLLM's, when asked
            }
            if body.return_token_ids:  # vLLM's
                choice.update(prompt_token_ids=ids, token_ids=c.token_ids[:n])
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(
                    self.texts_for(body), ids, c.prompt_log_probs, c.prompt_top_n_logprobs,
                    body.prompt_logprobs,
                )  # fmt: skip
            choices.append(choice)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        pairs = zip(jobs, results, strict=True)
        cached = sum(c.num_cached_tokens for (_, j, _), c in pairs if j == 0)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self.usage(prompt_tokens, completion_tokens, cached),
        }

    def _prompt_logprobs(self, body: CompletionBody, ids: list[int], c) -> dict:
        """The echoed prompt's logprobs (offsets from 0)."""
        lps = [None, *(c.prompt_log_probs or [])]
        tops = [None, *(c.prompt_top_n_logprobs or [{}] * (len(ids) - 1))]
        texts = self.texts_for(body)
        return completion_logprobs(texts, ids, lps, tops, Offsets(0), body.logprobs or 0)

    def _logprobs(self, body: CompletionBody, ids, prompt_text: str, c, n: int) -> dict:
        offsets = Offsets(len(prompt_text) if body.echo else 0)
        gen = self._generated_logprobs(body, c, n, offsets)
        if not body.echo:
            return gen
        prompt = self._prompt_logprobs(body, ids, c)
        return {key: prompt[key] + gen[key] for key in prompt}

    def _generated_logprobs(self, body: CompletionBody, c, n: int, offsets: Offsets) -> dict:
        tops = (c.top_n_logprobs or [{}] * n)[:n]
        return completion_logprobs(
            self.texts_for(body),
            c.token_ids[:n],
            (c.log_probs or [])[:n],
            tops,
            offsets,
            body.logprobs or 0,
        )

    def _stream_completions(self, body, rid, prompts, jobs, params, max_tokens):
        created = int(time.time())
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        cached: dict[int, int] = {}  # choice -> its prompt's cached tokens (first choices)

        async def one(k: int, i: int, j: int, ids: list[int], put) -> int:
            prompt_text = prompts[i][0]
            # Echo with logprobs waits for the prompt's log-probs (on the last output).
            hold = body.echo and body.logprobs is not None
            held: list[dict] = []
            first = body.return_token_ids  # (the choice's first chunk: its prompt's ids)

            async def send(chunk: dict) -> None:
                nonlocal first
                if continuous:
                    chunk["usage"] = openai_usage(len(ids), count)
                if first and not hold:
                    chunk["prompt_token_ids"], first = ids, False
                if hold:
                    held.append(chunk)
                else:
                    await put(k, chunk)

            count = 0
            if body.echo and not hold:
                await send({"index": k, "text": prompt_text, "logprobs": None,
                            "finish_reason": None})  # fmt: skip
            offsets = Offsets(len(prompt_text) if body.echo else 0)
            versions: list[tuple[int, int]] = []  # of the tokens since the last chunk sent
            timer = self.metrics.timer()
            async for d in self.client.stream(ids, choice_params(params, j)):
                n = len(d.token_ids) if max_tokens else 0
                count += n
                timer.tokens(n)
                versions = join_versions(versions, d.weight_versions if n else [])
                chunk = {"index": k, "text": d.text if n else "", "logprobs": None,
                         "finish_reason": None}  # fmt: skip
                if body.logprobs is not None and n:
                    chunk["logprobs"] = self._generated_logprobs(body, d, n, offsets)
                if body.return_token_ids:
                    chunk["token_ids"] = d.token_ids[:n]
                if d.finished:
                    timer.finish(d, len(ids), count)
                    failed(d)
                    if j == 0:  # (once per prompt)
                        cached[k] = d.num_cached_tokens
                    finish = openai_finish(d.finish_reason)
                    chunk["finish_reason"] = finish if max_tokens else "length"
                    chunk["stop_reason"] = d.stop_reason
                    if body.prompt_logprobs is not None:  # vLLM's, on the choice's last chunk
                        chunk["prompt_logprobs"] = prompt_logprobs(
                            self.texts_for(body), ids, d.prompt_log_probs,
                            d.prompt_top_n_logprobs,
                            body.prompt_logprobs,
                        )  # fmt: skip
                if chunk["text"] or d.finished or chunk["logprobs"] or chunk.get("token_ids"):
                    chunk["weight_versions"], versions = versions, []
                    await send(chunk)
                if d.finished and hold:
                    echo = {"index": k, "text": prompt_text, "finish_reason": None,
                            "logprobs": self._prompt_logprobs(body, ids, d)}  # fmt: skip
                    if body.return_token_ids:
                        echo.update(prompt_token_ids=ids, token_ids=[])
                    if continuous:
                        echo["usage"] = openai_usage(len(ids), 0)
                    for c in [echo, *held]:
                        await put(k, c)
            return count

        def envelope(choices, usage=None):
            out = {"id": rid, "object": "text_completion", "created": created,
                   "model": self.model, "choices": choices}  # fmt: skip
            if usage is not None:
                out["usage"] = usage
            return out

        async def events() -> AsyncIterator[str]:
            counts = None
            args = [(k, i, j, ids) for k, (i, j, ids) in enumerate(jobs)]
            async with contextlib.aclosing(merge(args, one)) as items:
                async for item in items:
                    if isinstance(item, Done):
                        counts = item.results
                        break
                    usage = item.pop("usage", None)
                    yield sse(envelope([item], usage))
            if include_usage and counts is not None:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                usage = self.usage(prompt_tokens, sum(counts), sum(cached.values()))
                yield sse(envelope([], usage))
            yield "data: [DONE]\n\n"

        return events()
