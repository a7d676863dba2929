"""Client and AsyncClient: talk to a running taipan runtime (coordinator address).

Owns the connection, requests and stats. The client tokenizes (the tokenizer travels from the
engine in ModelInfo, so no model files are needed here), submits token ids, detokenizes
incrementally and matches stop strings on the text (ops/stop_strings.py: the engine matches
token ids only; on a match it aborts the request). SamplingParams travel in their wire form
(`for_wire`: a logit_bias keyed by ints, as vLLM's, goes as decimal strings). The lifecycle
controls (pause, suspend, update_weights, resume, unpause, stop, and the weight transfer from
a trainer's processes) are runtime/control.py's, the classes' bases; they carry the runtime's
control token (runtime/auth.py: found by address for the user who started the runtime, or given
as `control_token=` / TAIPAN_CONTROL_TOKEN).
`timeout` is how long the runtime may stay silent before a waiting call fails with
`RuntimeUnreachable` (a busy runtime still answers; see actors/client/actor.py); `connect_timeout`
bounds the wait for an engine to load its model. `curve`: the client's Curve keys for a
runtime served over tcp beyond loopback (`load_client_keys(DIR)`, actors/curve.py; in direct
mode, where the client binds, the server's: `load_server_keys(DIR)`). No torch is imported.

With `direct=DirectEndpoint(...)` the client binds `address` and is the coordinator of the one
engine rank that connects to it (direct mode, actors/client/direct.py: what `LLM(...,
use_coordinator=False)` uses); the lifecycle methods then raise RuntimeError, and
`stop_engine` ends the engine. What a request gives back (Completion, Delta, RequestError) is
runtime/outputs.py's, re-exported here.

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
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

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
from taipan.actors.client.direct import ENGINE_TIMEOUT_S, DirectActor, DirectEndpoint
from taipan.actors.curve import CurveClient, CurveServer
from taipan.control import AsyncClientControls, ClientControls
from taipan.messages.block_hash import block_hashes
from taipan.messages.lifecycle import ControlAck
from taipan.messages.requests import FinishReason, ModelInfo, SamplingParams
from taipan.messages.stats import Stats
from taipan.ops.stop_strings import StoppingDetokenizer
from taipan.ops.tokenizer import Tokenizer
from taipan.outputs import (
    Completion,
    Delta,
    RequestDetails,
    RequestError,
    TopN,
    join_versions,
    make_delta,
)

Prompt = str | Sequence[int] | Sequence[dict]

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "ControlAck",
    "ControlError",
    "Delta",
    "DirectEndpoint",
    "RequestError",
    "RuntimeUnreachable",
]


class AsyncClient(AsyncClientControls):
    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
        direct: DirectEndpoint | None = None,
        curve: CurveClient | CurveServer | None = None,
    ):
        self.address = address
        self.direct = direct
        self.curve = curve
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S if direct is None else ENGINE_TIMEOUT_S
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
        # No receive limit: past it the coordinator's ROUTER would drop this client's outputs
        # (silently: a request could lose tokens or never end) while it is slow to read them.
        self._ctx.setsockopt(zmq.RCVHWM, 0)
        if self.direct is None:
            channel = make_socket(
                self._ctx,
                zmq.DEALER,
                self.address,
                bind=False,
                name="coordinator",
                curve=self.curve,
            )
            self._actor = ClientActor(channel, address=self.address, timeout=self.timeout)
        else:
            channel = make_socket(
                self._ctx,
                zmq.ROUTER,
                self.address,
                bind=True,
                name="engine",
                watch_peers=True,
                curve=self.curve,
            )
            self._actor = DirectActor(channel, self.direct, timeout=self.timeout)
        self._task = asyncio.create_task(self._actor.run())  # owned here; awaited in close()
        try:
            info = await asyncio.wait_for(self._actor.model_info(), self.connect_timeout)
        except BaseException:
            await self.close()
            raise
        self.info, self.model = info, info.model
        self._salt = info.weight_version
        self.tokenizer = Tokenizer.from_wire(json.loads(info.tokenizer))

    async def stop_engine(self, timeout: float = 30.0) -> bool:
        """Direct mode only: tell the engine to abort every request (each gets its terminal
        output) and exit; True once it acknowledged within `timeout` seconds."""
        if not isinstance(self._actor, DirectActor):
            raise RuntimeError("stop_engine is for a direct-mode client; use stop() otherwise")
        return await self._actor.stop_engine("its direct client asked to stop", timeout)

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
        texts: list[str] = []
        tokens: list[int] = []
        log_probs: list[float] | None = [] if sampling.return_log_probs else None
        top_n: TopN | None = [] if sampling.top_n_logprobs else None
        versions: list[tuple[int, int]] = []
        async for last in self._deltas(ids, sampling, stream=False):
            texts.append(last.text)
            tokens.extend(last.token_ids)
            versions = join_versions(versions, last.weight_versions)
            if log_probs is not None:
                log_probs.extend(last.log_probs)
            if top_n is not None:
                top_n.extend(last.top_n_logprobs)
        details = {f.name: getattr(last, f.name) for f in dataclasses.fields(RequestDetails)}
        details.update(log_probs=log_probs, top_n_logprobs=top_n, weight_versions=versions)
        return Completion(
            prompt=text,
            prompt_token_ids=ids.tolist(),
            text="".join(texts),
            token_ids=tokens,
            finish_reason=last.finish_reason,
            error=last.error,
            stop_reason=last.stop_reason,
            **details,
        )

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as tokens arrive; the last delta has `finished` set. Text that may
        still become a stop string is held back until it is known not to."""
        _, ids = self._encode(prompt, chat)
        async for delta in self._deltas(ids, sampling or SamplingParams(), stream=True):
            yield delta

    async def _deltas(
        self, ids: np.ndarray, sampling: SamplingParams, stream: bool
    ) -> AsyncIterator[Delta]:
        """The request's output as one Delta per RequestOutput, the last one `finished`. A
        stream with stop strings is read ahead of its caller (`_read_ahead`), so the match, and
        the abort that stops the engine, comes as the tokens arrive, not when a slow reader
        gets to them."""
        deltas = self._matched(ids, sampling, stream)
        if stream and sampling.stop:
            deltas = _read_ahead(deltas)
        async for delta in deltas:
            yield delta

    async def _matched(
        self, ids: np.ndarray, sampling: SamplingParams, stream: bool
    ) -> AsyncIterator[Delta]:
        """The request's output as one Delta per RequestOutput, the last one `finished`.

        Stop strings are matched here, on the detokenized text, so a request with any is
        streamed from the engine even when the caller does not stream (`streaming_interval`
        still applies). On a match the text ends at the stop string, the engine is told to
        abort the request at once, and its terminal output (awaited: the abort may race a few
        more tokens) gives the final fields; tokens past the one that completed the stop string
        are dropped. The token that ended the request as a stop token (EOS, one of
        `stop_token_ids`) stays in the token ids but not in the text, unless
        `include_stop_word` (vLLM's rule; its text shows only with skip_special_tokens=False
        or for a stop token that is not special).
        """
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        sampling = sampling.for_wire()  # (stop as a tuple, logit_bias keyed by strings)
        stops = sampling.stop
        reader = StoppingDetokenizer(
            self.tokenizer, ids.tolist(), stops, sampling.include_stop_word, sampling.min_tokens,
            sampling.skip_special_tokens,
        )  # fmt: skip
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        num_tokens = len(ids)  # prompt + output tokens so far
        request_id, queue = await self._submit(ids, sampling, stream or bool(stops))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                new = out.new_token_ids.tolist()
                hidden = finished and _ends_on_stop_token(out, new, sampling, stop_ids)
                text, keep = reader.feed(new[:-1] if hidden else new)
                keep += hidden and reader.stop_reason is None  # (its id stays in the output)
                if finished and reader.stop_reason is None:
                    text += reader.flush()
                end = out if finished else None
                if reader.stop_reason is not None and not finished:
                    await self._actor.abort(request_id)  # the engine need not go on
                    while not finished:
                        end = await queue.get()
                        finished = end.finished
                num_tokens += keep
                yield make_delta(out, end, sampling, new[:keep], text, reader, num_tokens)
                if reader.stop_reason is not None:
                    return
        finally:
            if not finished and self._actor is not None:
                await self._actor.abort(request_id)  # the caller stopped listening

    async def _submit(self, ids: np.ndarray, sampling: SamplingParams, stream: bool):
        """Send one request; (its id, the queue its outputs arrive in)."""
        hashes = None
        info = self.info
        if info is not None and info.prefix_caching and info.block_size:
            # Hashed here, where the tokens are (the coordinator routes by them); a stale salt
            # (weights updated by another client) only makes the coordinator hash again.
            hashes = block_hashes(ids, info.block_size, self._salt)
        return await self._actor.submit(ids, sampling, stream, hashes, self._salt)

    async def stats(self, fresh: bool = True) -> Stats:
        """The lifecycle state and every rank's latest counters (messages/stats.py); `fresh`
        False: the coordinator's latest reports, without asking the engines (one hop)."""
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        return await self._actor.stats(fresh)


class Client(ClientControls):
    """The blocking twin of AsyncClient (same arguments): its own event loop runs in a background
    thread; the controls' twins come from ClientControls (runtime/control.py)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
        direct: DirectEndpoint | None = None,
        curve: CurveClient | CurveServer | None = None,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            address,
            timeout=timeout,
            connect_timeout=connect_timeout,
            control_token=control_token,
            direct=direct,
            curve=curve,
        )
        try:
            self._run(self._async.connect())
        except BaseException:
            self._shutdown_loop()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, coro):
        """Run a coroutine that uses `aio` on this client's loop and return its result (what
        LLM builds its batch calls on)."""
        return self._run(coro)

    @property
    def aio(self) -> AsyncClient:
        """The AsyncClient underneath: use it only through `run` (it lives on that loop)."""
        return self._async

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

    def stats(self, fresh: bool = True) -> Stats:
        return self._run(self._async.stats(fresh))

    def stop_engine(self, timeout: float = 30.0) -> bool:
        return self._run(self._async.stop_engine(timeout))

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


_END = object()


async def _read_ahead(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Yield what `deltas` yields, read by a task of its own as fast as it comes: the reader
    may be slow (a blocking Client's thread, a busy consumer) without the stop-string match
    waiting for it. Closing this generator cancels the task, and `deltas`' own cleanup (the
    abort of a request nobody listens to) runs there."""
    ahead: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for delta in deltas:
                ahead.put_nowait(delta)
        except Exception as e:  # (a cancel is not put: the reader is gone)
            ahead.put_nowait(e)
        else:
            ahead.put_nowait(_END)

    task = asyncio.create_task(pump())
    try:
        while (item := await ahead.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _ends_on_stop_token(out, new: list[int], sampling: SamplingParams, stop_ids: set) -> bool:
    """Whether the terminal output `out` (its new ids `new`) ended on a stop token whose text
    the output leaves out (`_stream`)."""
    return (
        bool(new)
        and out.finish_reason == FinishReason.STOP
        and not sampling.include_stop_word
        and new[-1] in stop_ids
    )
