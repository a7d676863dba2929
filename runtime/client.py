"""Client and AsyncClient: talk to a running taipan runtime (coordinator address).

The client tokenizes (the tokenizer travels from the engine in ModelInfo, so no model files are
needed here), turns stop words into token ids, submits token ids, and detokenizes incrementally.
It also drives the lifecycle (pause, suspend, update_weights, resume, unpause, stop: see
messages/lifecycle.py) with the runtime's control token (runtime/auth.py: found by address for
the user who started the runtime, or given as `control_token=` / TAIPAN_CONTROL_TOKEN).
`timeout` is how long the runtime may stay silent before a waiting call fails with
`RuntimeUnreachable` (a busy runtime still answers; see actors/client/actor.py); `connect_timeout`
bounds the wait for an engine to load its model. No torch is imported.

    async with AsyncClient("ipc:///tmp/taipan.sock") as c:
        [done] = await c.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        async for delta in c.stream("Hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")
        await c.pause(); await c.suspend()
        await c.update_weights(path="/ckpt/step-100")
        await c.resume(); await c.unpause()
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import numpy as np
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.client.actor import (
    DEFAULT_TIMEOUT_S,
    ClientActor,
    ControlError,
    RuntimeUnreachable,
)
from taipan.auth import find_token
from taipan.messages.block_hash import block_hashes
from taipan.messages.codec import INLINE_ARRAY_BYTES, MAX_FRAMES
from taipan.messages.lifecycle import (
    ControlAck,
    KVCacheManagementMode,
    Pause,
    Resume,
    Stop,
    Suspend,
    Unpause,
    UpdateWeights,
)
from taipan.messages.requests import (
    FinishReason,
    ModelInfo,
    RequestEvent,
    RequestOutput,
    SamplingParams,
)
from taipan.messages.stats import Stats
from taipan.ops.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | Sequence[int] | Sequence[dict]
TopN = list[dict[int, float]]  # per token: {token id: log-prob} of its top-n candidates

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "ControlAck",
    "ControlError",
    "Delta",
    "RequestError",
    "RuntimeUnreachable",
]


class RequestError(RuntimeError):
    """A request ended with finish_reason "error"; the text says why."""


@dataclasses.dataclass(kw_only=True)
class RequestDetails:
    """What Completion and Delta carry beside tokens and text. Log-prob fields are None unless
    asked for in SamplingParams: `log_probs` (one per token, with `return_log_probs`),
    `top_n_logprobs` (with `top_n_logprobs` > 0), `prompt_log_probs` (one per prompt token after
    the first) and `prompt_top_n_logprobs`. `events`, `ttft` and `tpot` come from the engine
    (seconds); `policy_staleness` / `kv_cache_staleness` count, per token of prompt + generated,
    the weight updates since it was produced / since its K/V were computed (RL loops).
    `num_cached_tokens`: prompt tokens whose K/V came from the prefix cache (0 without
    prefix caching)."""

    log_probs: list[float] | None = None
    top_n_logprobs: TopN | None = None
    prompt_log_probs: list[float] | None = None
    prompt_top_n_logprobs: TopN | None = None
    events: list[RequestEvent] = dataclasses.field(default_factory=list)
    ttft: float | None = None
    tpot: float | None = None
    policy_staleness: list[int] | None = None
    kv_cache_staleness: list[int] | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class Completion(RequestDetails):
    """One finished request (see RequestDetails for the optional fields)."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None = None


@dataclasses.dataclass
class Delta(RequestDetails):
    """New text of a streamed request, with the log-probs of its tokens (None unless asked).
    The last delta (`finished`) also carries the prompt log-probs, events, timings, staleness."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None


def _top_n(ids: np.ndarray, log_probs: np.ndarray) -> TopN:
    return [
        dict(zip(i, lp, strict=True))
        for i, lp in zip(ids.tolist(), log_probs.tolist(), strict=True)
    ]


def _token_log_probs(out: RequestOutput, sampling: SamplingParams):
    """(log_probs, top_n) of the tokens in `out`, each None when the request did not ask."""
    log_probs = out.log_probs.tolist() if sampling.return_log_probs else None
    top = _top_n(out.top_n_ids, out.top_n_log_probs) if sampling.top_n_logprobs else None
    return log_probs, top


def _final_fields(out: RequestOutput, sampling: SamplingParams) -> dict:
    """What only the terminal output carries, as Completion/Delta keyword arguments."""
    fields: dict = {
        "events": list(out.events),
        "ttft": out.ttft,
        "tpot": out.tpot,
        "policy_staleness": out.policy_staleness.tolist(),
        "kv_cache_staleness": out.kv_cache_staleness.tolist(),
        "num_cached_tokens": out.num_cached_tokens,
    }
    if sampling.return_log_probs and not sampling.skip_prompt_log_probs:
        fields["prompt_log_probs"] = out.prompt_log_probs.tolist()
    if sampling.return_prompt_top_n_logprobs:
        fields["prompt_top_n_logprobs"] = _top_n(out.prompt_top_n_ids, out.prompt_top_n_log_probs)
    return fields


def _check_state_fits(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays for UpdateWeights.state; refuse, before sending, what the wire cannot carry."""
    arrays = {str(k): np.asarray(v) for k, v in state.items()}
    big = sum(1 for a in arrays.values() if a.nbytes > INLINE_ARRAY_BYTES)
    if big + 1 > MAX_FRAMES:
        raise ValueError(
            f"update_weights(state=...) has {big} arrays over {INLINE_ARRAY_BYTES} bytes but one "
            f"message carries at most {MAX_FRAMES - 1}; pass a checkpoint path instead"
        )
    return arrays


class AsyncClient:
    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._control_token = control_token
        self.tokenizer: Tokenizer | None = None
        self.model: str | None = None
        self.info: ModelInfo | None = None
        self._salt = 0  # the weight version block hashes are salted with
        self._ctx: zmq.asyncio.Context | None = None
        self._actor: ClientActor | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and fetch the model info (waits until an engine has loaded its model)."""
        self._ctx = zmq.asyncio.Context()
        channel = make_socket(self._ctx, zmq.DEALER, self.address, bind=False, name="coordinator")
        self._actor = ClientActor(channel, address=self.address, timeout=self.timeout)
        self._task = asyncio.create_task(self._actor.run())  # owned here; awaited in close()
        try:
            info = await asyncio.wait_for(self._actor.model_info(), self.connect_timeout)
        except BaseException:
            await self.close()
            raise
        self.info, self.model = info, info.model
        self._salt = info.weight_version
        self.tokenizer = Tokenizer.from_wire(json.loads(info.tokenizer))

    async def close(self) -> None:
        if self._actor is not None:
            self._actor.stop()
            await self._task
            self._actor.channel.close()
            self._actor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- requests -----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt, chat: bool) -> tuple[str | None, np.ndarray]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            if chat:
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
            else:
                ids = tok.encode(prompt)
            return prompt, np.asarray(ids, dtype=np.int32)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return None, np.asarray(tok.apply_chat_template(list(prompt)), dtype=np.int32)
        return None, np.asarray(list(prompt), dtype=np.int32).reshape(-1)

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        raise_on_error: bool = True,
    ) -> list[Completion]:
        """Generate for every prompt concurrently; completions in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        done = await asyncio.gather(*(self._one(p, sampling, chat) for p in prompts))
        if raise_on_error:
            for c in done:
                if c.finish_reason == FinishReason.ERROR:
                    raise RequestError(c.error)
        return list(done)

    async def _one(self, prompt: Prompt, sampling: SamplingParams | None, chat: bool):
        text, ids = self._encode(prompt, chat)
        sampling = sampling or SamplingParams()
        tokens: list[int] = []
        log_probs: list[float] | None = [] if sampling.return_log_probs else None
        top_n: TopN | None = [] if sampling.top_n_logprobs else None
        last = None
        async for out in self._outputs(ids, sampling, stream=False):
            tokens.extend(out.new_token_ids.tolist())
            new_log_probs, new_top_n = _token_log_probs(out, sampling)
            if log_probs is not None:
                log_probs.extend(new_log_probs)
            if top_n is not None:
                top_n.extend(new_top_n)
            last = out
        return Completion(
            prompt=text,
            prompt_token_ids=ids.tolist(),
            # A stop word the request did not want kept was already dropped by the engine.
            text=self.tokenizer.decode(tokens),
            token_ids=tokens,
            finish_reason=last.finish_reason,
            error=last.error,
            log_probs=log_probs,
            top_n_logprobs=top_n,
            **_final_fields(last, sampling),
        )

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as tokens arrive; the last delta has `finished` set."""
        _, ids = self._encode(prompt, chat)
        sampling = sampling or SamplingParams()
        detok = IncrementalDetokenizer(self.tokenizer, ids.tolist())
        async for out in self._outputs(ids, sampling, stream=True):
            new = out.new_token_ids.tolist()
            text = detok.feed(new)
            log_probs, top_n = _token_log_probs(out, sampling)
            final = {}
            if out.finished:
                text += detok.flush()
                final = _final_fields(out, sampling)
            yield Delta(
                text,
                new,
                out.finished,
                out.finish_reason,
                out.error,
                log_probs=log_probs,
                top_n_logprobs=top_n,
                **final,
            )

    def _with_stop_word_ids(self, sampling: SamplingParams) -> SamplingParams:
        """Tokenize `sampling.stop` into `stop_word_ids` (after any ids given): the engine
        matches ids only. Words are encoded alone, without special tokens, so a word whose
        tokens merge with the text before it in the output is not matched there."""
        stop = (sampling.stop,) if isinstance(sampling.stop, str) else tuple(sampling.stop)
        words = [tuple(w) for w in sampling.stop_word_ids]
        for word in stop:
            ids = tuple(self.tokenizer.encode(word, add_special_tokens=False))
            if not ids:
                raise ValueError(f"stop word {word!r} encodes to no tokens")
            if ids not in words:
                words.append(ids)
        return dataclasses.replace(sampling, stop=stop, stop_word_ids=tuple(words))

    async def _outputs(self, ids: np.ndarray, sampling: SamplingParams, stream: bool):
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        if sampling.stop:
            sampling = self._with_stop_word_ids(sampling)
        hashes = None
        info = self.info
        if info is not None and info.prefix_caching and info.block_size:
            # Hashed here, where the tokens are (the coordinator routes by them); a stale salt
            # (weights updated by another client) only makes the coordinator hash again.
            hashes = block_hashes(ids, info.block_size, self._salt)
        request_id, queue = await self._actor.submit(ids, sampling, stream, hashes, self._salt)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished and self._actor is not None:
                await self._actor.abort(request_id)  # the caller stopped listening

    async def stats(self) -> Stats:
        """The lifecycle state and every rank's latest counters (messages/stats.py)."""
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        return await self._actor.stats()

    # --- lifecycle ----------------------------------------------------------------------------
    # Each returns the runtime's ControlAck (`state` after it, `weight_version`) once every engine
    # has acknowledged, and raises ControlError when the runtime refuses (e.g. code
    # "illegal_transition": resume while RUNNING) or an engine fails it (the state stays).

    @property
    def control_token(self) -> str:
        """The token controls carry: the one given, else the one the runtime at this address
        wrote for this user (looked up at each control: the runtime may start after the client
        is made, or restart), else "" (the runtime then refuses with "not_authorized")."""
        return self._control_token or find_token(self.address) or ""

    async def _control(self, msg) -> ControlAck:
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        ack = await self._actor.control(msg)
        self._salt = ack.weight_version
        return ack

    async def pause(self) -> ControlAck:
        """RUNNING -> PAUSED: the step in flight finishes, no more run; requests keep their KV
        and new submissions queue."""
        return await self._control(Pause(self.control_token))

    async def unpause(self) -> ControlAck:
        """PAUSED -> RUNNING."""
        return await self._control(Unpause(self.control_token))

    async def suspend(self, mode: str | None = None) -> ControlAck:
        """PAUSED -> SUSPENDED: release the big tensors as `mode` says ("persist", "offload",
        "recompute"; None: the runtime's kv_cache_management_mode)."""
        if mode is not None:
            try:
                mode = KVCacheManagementMode(mode)
            except ValueError:
                choices = ", ".join(KVCacheManagementMode)
                raise ValueError(f"suspend mode {mode!r} is not one of {choices}") from None
        return await self._control(Suspend(self.control_token, mode))

    async def resume(self) -> ControlAck:
        """SUSPENDED -> PAUSED: bring back what suspend released."""
        return await self._control(Resume(self.control_token))

    async def update_weights(
        self, path: str | os.PathLike | None = None, state: Mapping | None = None
    ) -> ControlAck:
        """While SUSPENDED, load new weights from `path` (GGUF file or Hugging Face directory,
        readable by the engine processes) or from `state` (HF parameter name -> array; a subset
        is allowed). Exactly one of the two. The ack's `weight_version` is the new version."""
        if (path is None) == (state is None):
            raise ValueError("update_weights takes exactly one of path and state")
        token = self.control_token
        msg = (
            UpdateWeights(token, os.fspath(path), None)
            if path is not None
            else UpdateWeights(token, None, _check_state_fits(state))
        )
        return await self._control(msg)

    async def stop(self) -> ControlAck:
        """Stop the whole runtime (legal from PAUSED or SUSPENDED: pause first): every request is
        aborted with its terminal output, every process exits."""
        return await self._control(Stop(self.control_token, "client asked to stop"))


class Client:
    """The blocking twin of AsyncClient (same arguments): its own event loop runs in a background
    thread."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            address, timeout=timeout, connect_timeout=connect_timeout, control_token=control_token
        )
        try:
            self._run(self._async.connect())
        except BaseException:
            self._shutdown_loop()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._async.tokenizer

    def generate(self, prompts, sampling: SamplingParams | None = None, **kw) -> list[Completion]:
        return self._run(self._async.generate(prompts, sampling, **kw))

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, **kw):
        agen = self._async.stream(prompt, sampling, **kw)

        def it() -> Iterator[Delta]:
            try:
                while True:
                    try:
                        yield self._run(agen.__anext__())
                    except StopAsyncIteration:
                        return
            finally:
                self._run(agen.aclose())

        return it()

    def stats(self) -> Stats:
        return self._run(self._async.stats())

    def pause(self) -> ControlAck:
        return self._run(self._async.pause())

    def unpause(self) -> ControlAck:
        return self._run(self._async.unpause())

    def suspend(self, mode: str | None = None) -> ControlAck:
        return self._run(self._async.suspend(mode))

    def resume(self) -> ControlAck:
        return self._run(self._async.resume())

    def update_weights(
        self, path: str | os.PathLike | None = None, state: Mapping | None = None
    ) -> ControlAck:
        return self._run(self._async.update_weights(path, state))

    def stop(self) -> ControlAck:
        return self._run(self._async.stop())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
