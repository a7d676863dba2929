"""The client actor: one DEALER connection to the coordinator, shared by all of a client's requests.

Owns request numbering for this connection, the per-request output queues, and the one
lifecycle command this connection may have in flight. `AsyncClient` (runtime/client.py) is the
public face; this shell only moves messages. Every request it submits gets exactly one terminal
output in its queue: from the runtime, or made up here if the connection closes first.

Control replies carry no id, so a connection sends one command at a time (`control` holds a
lock): the next `ControlAck`, or `ErrorReply` naming no request, answers it.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.messages.common import ErrorReply
from taipan.messages.lifecycle import ControlAck
from taipan.messages.requests import (
    AbortRequest,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, Stats


class ControlError(RuntimeError):
    """The runtime refused or failed a lifecycle command. `code` is the ErrorReply code
    ("illegal_transition", "busy", "control_failed", "bad_request", ...), `text` says why."""

    def __init__(self, command: str, code: str, text: str):
        super().__init__(f"{code}: {text}")
        self.command, self.code, self.text = command, code, text


class ClientActor(Actor):
    def __init__(self, channel: Channel):
        super().__init__("client")
        self.channel = channel
        self.queues: dict[int, asyncio.Queue[RequestOutput]] = {}
        self.ids = itertools.count(1)
        self.info_waiters: list[asyncio.Future] = []
        self.stats_waiters: list[asyncio.Future] = []  # FIFO: one Stats answers each GetStats
        self.control_lock = asyncio.Lock()
        self.control_waiter: tuple[str, asyncio.Future] | None = None  # (command, answer)
        self.serve(channel)
        self.on(RequestOutput, self.on_output)
        self.on(ModelInfo, self.on_info)
        self.on(ErrorReply, self.on_error)
        self.on(ControlAck, self.on_control_ack)
        self.on(Stats, self.on_stats)

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

    async def stats(self) -> Stats:
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        await self.channel.send(GetStats())
        return await fut

    async def control(self, command: str, msg) -> ControlAck:
        """Send one lifecycle command (`command` is its ControlAck name) and wait for the
        answer; raises ControlError when the runtime refuses or fails it."""
        async with self.control_lock:
            fut = asyncio.get_running_loop().create_future()
            self.control_waiter = (command, fut)
            try:
                await self.channel.send(msg)
                return await fut
            finally:
                self.control_waiter = None

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

    async def on_stats(self, env: Envelope, msg: Stats) -> None:
        if self.stats_waiters:
            self.stats_waiters.pop(0).set_result(msg)

    async def on_control_ack(self, env: Envelope, msg: ControlAck) -> None:
        waiter = self.control_waiter
        if waiter is None or waiter[0] != msg.command or waiter[1].done():
            self.log.warning("stray control ack", command=msg.command, state=msg.state)
            return
        waiter[1].set_result(msg)

    async def on_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code == "load_failed" and self.info_waiters:
            self._resolve(self.info_waiters, RuntimeError(f"model load failed: {msg.text}"))
            return
        waiter = self.control_waiter
        if msg.request_id is None and waiter is not None and not waiter[1].done():
            waiter[1].set_exception(ControlError(waiter[0], msg.code, msg.text))
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
        self._resolve(self.stats_waiters, ConnectionError("the client closed"))
        if self.control_waiter is not None:
            self._resolve([self.control_waiter[1]], ConnectionError("the client closed"))
