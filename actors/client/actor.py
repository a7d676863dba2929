"""The client actor: one DEALER connection to the coordinator, shared by all of a client's requests.

Owns request numbering for this connection and the per-request output queues. `AsyncClient`
(runtime/client.py) is the public face; this shell only moves messages. Every request it
submits gets exactly one terminal output in its queue: from the runtime, or made up here if the
connection closes first.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from messages.common import ErrorReply
from messages.lifecycle import Stop, StopAck
from messages.requests import (
    AbortRequest,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    SubmitRequest,
)
from runtime.actor import Actor
from runtime.channel import Channel, Envelope


class ClientActor(Actor):
    def __init__(self, channel: Channel):
        super().__init__("client")
        self.channel = channel
        self.queues: dict[int, asyncio.Queue[RequestOutput]] = {}
        self.ids = itertools.count(1)
        self.info_waiters: list[asyncio.Future] = []
        self.stop_waiters: list[asyncio.Future] = []
        self.serve(channel)
        self.on(RequestOutput, self.on_output)
        self.on(ModelInfo, self.on_info)
        self.on(ErrorReply, self.on_error)
        self.on(StopAck, self.on_stop_ack)

    async def submit(self, prompt: np.ndarray, sampling: SamplingParams, stream: bool):
        request_id = next(self.ids)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[request_id] = queue
        await self.channel.send(SubmitRequest(request_id, prompt, sampling, stream))
        return request_id, queue

    async def abort(self, request_id: int) -> None:
        if request_id in self.queues:
            await self.channel.send(AbortRequest(request_id))

    async def model_info(self) -> ModelInfo:
        fut = asyncio.get_running_loop().create_future()
        self.info_waiters.append(fut)
        await self.channel.send(GetModelInfo())
        return await fut

    async def stop_runtime(self, reason: str) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.stop_waiters.append(fut)
        await self.channel.send(Stop(reason))
        await fut

    # --- inbound ------------------------------------------------------------------------------

    async def on_output(self, env: Envelope, msg: RequestOutput) -> None:
        queue = self.queues.get(msg.request_id)
        if queue is None:
            return
        if msg.finished:
            del self.queues[msg.request_id]
        queue.put_nowait(msg)

    async def on_info(self, env: Envelope, msg: ModelInfo) -> None:
        self._resolve(self.info_waiters, msg)

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        self._resolve(self.stop_waiters, msg)

    async def on_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code == "load_failed" and self.info_waiters:
            self._resolve(self.info_waiters, RuntimeError(f"model load failed: {msg.text}"))
            return
        self.log.warning("runtime error reply", code=msg.code, text=msg.text)

    @staticmethod
    def _resolve(waiters: list[asyncio.Future], value) -> None:
        for fut in waiters:
            if not fut.done():
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
        waiters.clear()

    async def stopping(self) -> None:
        # The connection is closing: every open request still gets its one terminal output.
        for request_id, queue in self.queues.items():
            queue.put_nowait(
                RequestOutput(
                    request_id, np.zeros(0, np.int32), True, "abort", "the client closed", 0, 0
                )
            )
        self.queues.clear()
        self._resolve(self.info_waiters, ConnectionError("the client closed"))
        self._resolve(self.stop_waiters, ConnectionError("the client closed"))
