"""Client and AsyncClient: talk to a running taipan runtime (coordinator address).

The client tokenizes (the tokenizer travels from the engine in ModelInfo, so no model files are
needed here), submits token ids, and detokenizes incrementally. No torch is imported.

    async with AsyncClient("ipc:///tmp/taipan.sock") as c:
        [done] = await c.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        async for delta in c.stream("Hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")
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

from actors.client.actor import ClientActor
from messages.requests import SamplingParams
from ops.tokenizer import IncrementalDetokenizer, Tokenizer
from runtime.channel import make_socket

Prompt = str | Sequence[int] | Sequence[dict]


class RequestError(RuntimeError):
    """A request ended with finish_reason "error"; the text says why."""


@dataclasses.dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None = None


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None


class AsyncClient:
    def __init__(self, address: str, *, connect_timeout: float = 600.0):
        self.address = address
        self.connect_timeout = connect_timeout
        self.tokenizer: Tokenizer | None = None
        self.model: str | None = None
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
        self._actor = ClientActor(channel)
        self._task = asyncio.create_task(self._actor.run())  # owned here; awaited in close()
        try:
            info = await asyncio.wait_for(self._actor.model_info(), self.connect_timeout)
        except BaseException:
            await self.close()
            raise
        self.model = info.model
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
                if c.finish_reason == "error":
                    raise RequestError(c.error)
        return list(done)

    async def _one(self, prompt: Prompt, sampling: SamplingParams | None, chat: bool):
        text, ids = self._encode(prompt, chat)
        tokens: list[int] = []
        last = None
        async for out in self._outputs(ids, sampling or SamplingParams(), stream=False):
            tokens.extend(int(t) for t in out.new_token_ids)
            last = out
        return Completion(
            prompt=text,
            prompt_token_ids=ids.tolist(),
            text=self.tokenizer.decode(tokens),
            token_ids=tokens,
            finish_reason=last.finish_reason,
            error=last.error,
        )

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as tokens arrive; the last delta has `finished` set."""
        _, ids = self._encode(prompt, chat)
        detok = IncrementalDetokenizer(self.tokenizer, ids.tolist())
        async for out in self._outputs(ids, sampling or SamplingParams(), stream=True):
            new = [int(t) for t in out.new_token_ids]
            text = detok.feed(new)
            if out.finished:
                text += detok.flush()
            yield Delta(text, new, out.finished, out.finish_reason, out.error)

    async def _outputs(self, ids: np.ndarray, sampling: SamplingParams, stream: bool):
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        request_id, queue = await self._actor.submit(ids, sampling, stream)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished and self._actor is not None:
                await self._actor.abort(request_id)  # the caller stopped listening

    async def stop(self) -> None:
        """Stop the whole runtime: every request is aborted, every process exits."""
        await self._actor.stop_runtime("client asked to stop")


class Client:
    """The blocking twin of AsyncClient: its own event loop runs in a background thread."""

    def __init__(self, address: str, *, connect_timeout: float = 600.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._async = AsyncClient(address, connect_timeout=connect_timeout)
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

    def stop(self) -> None:
        self._run(self._async.stop())

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
