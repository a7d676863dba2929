"""The client actor: one DEALER connection to the coordinator, shared by all of a client's requests.

Owns request numbering for this connection, the per-request output queues, the one lifecycle
command this connection may have in flight, and knowing whether the server is there at all.
`AsyncClient` (runtime/client.py) is the public face; this shell only moves messages. Every
request it submits gets exactly one terminal output in its queue: from the runtime, or made up
here if the server goes silent or the connection closes first.

Liveness: while anything waits for an answer, a coordinator that has been quiet for a quarter of
`timeout` is sent a Heartbeat, which it answers; one that stays silent for `timeout` seconds is
taken for gone: every waiting request ends with finish_reason "error" and every waiting call
raises `RuntimeUnreachable`. A busy runtime is never silent (it answers heartbeats between
steps), so a long prefill or a paused runtime does not time out; an absent or dead one does.

Control replies carry no id, so a connection sends one command at a time (`control` holds a
lock): the next `ControlAck`, or `ErrorReply` naming no request, answers it.

Outputs: the client says `Hello("client")` first, so the coordinator relays each engine step's
outputs for this client's requests in one `StepOutputs` under this client's ids, each output
frame as the engine encoded it; it is decoded and checked here (a RequestOutput that ends when
the entry says; anything else fails its request with an error and aborts it in the engine). A
single `RequestOutput` (the coordinator's own answers: a refusal, a lost rank) is taken too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.messages.codec import MessageError, decode
from taipan.messages.common import ErrorReply, Heartbeat, Hello
from taipan.messages.errors import ErrorCode
from taipan.messages.lifecycle import CONTROL_MESSAGES, ControlAck, ControlCommand
from taipan.messages.requests import (
    AbortRequest,
    FinishReason,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, Stats

DEFAULT_TIMEOUT_S = 5.0
NO_TOKENS = np.zeros(0, dtype=np.int32)


class ControlError(RuntimeError):
    """The runtime refused or failed a lifecycle command. `code` is the ErrorReply's
    (NOT_AUTHORIZED, ILLEGAL_TRANSITION, BUSY, CONTROL_FAILED, BAD_REQUEST, ...), `text` says
    why."""

    def __init__(self, command: ControlCommand, code: ErrorCode, text: str):
        super().__init__(f"{code}: {text}")
        self.command, self.code, self.text = command, code, text


class RuntimeUnreachable(ConnectionError):
    """The runtime did not answer for the client's `timeout`: it is not running at that
    address, or it died."""


class ClientActor(Actor):
    def __init__(self, channel: Channel, *, address: str = "", timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__("client")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.channel = channel
        self.address = address
        self.timeout = timeout
        self.queues: dict[int, asyncio.Queue[RequestOutput]] = {}
        self.ids = itertools.count(1)
        self.info_waiters: list[asyncio.Future] = []
        self.stats_waiters: list[asyncio.Future] = []  # FIFO: one Stats answers each GetStats
        self.control_lock = asyncio.Lock()
        self.control_waiter: tuple[ControlCommand, asyncio.Future] | None = None
        self.heard = time.monotonic()  # the last inbound message, or when waiting began
        self.waiting = asyncio.Event()  # set while something waits for an answer
        self.serve(channel)
        self.on(RequestOutput, self.on_output)
        self.on(StepOutputs, self.on_step_outputs)
        self.on(ModelInfo, self.on_info)
        self.on(ErrorReply, self.on_error)
        self.on(ControlAck, self.on_control_ack)
        self.on(Stats, self.on_stats)
        self.on(Heartbeat, self.on_heartbeat)

    async def started(self) -> None:
        self.spawn(self._watch_server())
        await self.greet()

    async def greet(self) -> None:
        """Say who we are: a client that takes its outputs in StepOutputs."""
        await self.channel.send(Hello("client", -1))

    async def dispatch(self, env: Envelope) -> None:
        self.heard = time.monotonic()  # any message (a Heartbeat answer too) proves it alive
        await super().dispatch(env)

    # --- calls --------------------------------------------------------------------------------

    def _expect_answer(self) -> None:
        """Something now waits for the server: its silence counts from here at the latest."""
        if not self._busy():
            self.heard = time.monotonic()
        self.waiting.set()

    def _busy(self) -> bool:
        return bool(self.queues or self.info_waiters or self.stats_waiters or self.control_waiter)

    async def submit(
        self,
        prompt: np.ndarray,
        sampling: SamplingParams,
        stream: bool,
        hashes: np.ndarray | None = None,
        salt: int = 0,
    ):
        """Send one request (`hashes`: its prompt's block hashes with `salt`, or None); its
        outputs come in the queue returned, a refusal here as its one terminal output."""
        request_id = next(self.ids)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if hashes is None:
            hashes = np.zeros(0, dtype=np.int64)
        msg = SubmitRequest(request_id, prompt, sampling, stream, hashes, salt)
        refusal = self._refusal(msg)
        if refusal is not None:
            error = FinishReason.ERROR
            queue.put_nowait(
                RequestOutput(request_id, NO_TOKENS, True, error, refusal, len(prompt), 0)
            )
            return request_id, queue
        self._expect_answer()
        self.queues[request_id] = queue
        await self._send_submit(msg)
        return request_id, queue

    def _refusal(self, msg: SubmitRequest) -> str | None:
        """Why `msg` is refused without being sent, or None (the coordinator checks it)."""
        return None

    async def _send_submit(self, msg: SubmitRequest) -> None:
        await self.channel.send(msg)

    async def abort(self, request_id: int) -> None:
        if request_id in self.queues:
            await self._send_abort(request_id)

    async def _send_abort(self, request_id: int) -> None:
        await self.channel.send(AbortRequest(request_id))

    def _output_source(self) -> str:
        """Who sent this client's outputs, for the error of one that cannot be read."""
        return "the runtime"

    async def model_info(self) -> ModelInfo:
        fut = asyncio.get_running_loop().create_future()
        self._expect_answer()
        self.info_waiters.append(fut)
        await self.channel.send(GetModelInfo())
        return await fut

    async def stats(self, fresh: bool = True) -> Stats:
        fut = asyncio.get_running_loop().create_future()
        self._expect_answer()
        self.stats_waiters.append(fut)
        await self.channel.send(GetStats(fresh))
        return await fut

    async def control(self, msg, on_sent: Callable[[], None] | None = None) -> ControlAck:
        """Send one lifecycle command (a message of messages/lifecycle.py, token set) and wait
        for the answer; raises ControlError when the runtime refuses or fails it. `on_sent`:
        called once the message has left (a trainer then starts broadcasting: see
        taipan.rl.push_weights)."""
        command = CONTROL_MESSAGES[type(msg)]
        async with self.control_lock:
            fut = asyncio.get_running_loop().create_future()
            self._expect_answer()
            self.control_waiter = (command, fut)
            try:
                await self.channel.send(msg)
                if on_sent is not None:
                    on_sent()
                return await fut
            finally:
                self.control_waiter = None

    # --- liveness -----------------------------------------------------------------------------

    async def _watch_server(self) -> None:
        interval = self.timeout / 4
        pinged = 0.0
        while True:
            if not self._busy():
                self.waiting.clear()
                await self.waiting.wait()
                continue
            now = time.monotonic()
            silent = now - self.heard
            if silent >= self.timeout:
                self._server_gone(silent)
                self.heard = now  # whatever still waits gets a full timeout of its own
                continue
            if silent >= interval and now - pinged >= interval:
                pinged = now
                await self.channel.send(Heartbeat(time.time()))
            await asyncio.sleep(min(interval, self.timeout - silent))

    def _server_gone(self, silent: float) -> None:
        """Fail everything that waits: the server has not answered for `silent` seconds."""
        where = f" at {self.address}" if self.address else ""
        text = (
            f"no answer from the runtime{where} for {silent:.1f} s (timeout {self.timeout:g} s): "
            "it is not running there, or it died"
        )
        self.log.warning("runtime unreachable", address=self.address, silent=round(silent, 1))
        self._end_requests(FinishReason.ERROR, text)
        self._resolve(self.info_waiters, RuntimeUnreachable(text))
        self._resolve(self.stats_waiters, RuntimeUnreachable(text))
        if self.control_waiter is not None:
            self._resolve([self.control_waiter[1]], RuntimeUnreachable(text))

    def _end_requests(self, reason: FinishReason, text: str) -> None:
        for request_id, queue in self.queues.items():
            queue.put_nowait(RequestOutput(request_id, NO_TOKENS, True, reason, text, 0, 0))
        self.queues.clear()

    # --- inbound ------------------------------------------------------------------------------

    async def on_output(self, env: Envelope, msg: RequestOutput) -> None:
        queue = self.queues.get(msg.request_id)
        if queue is None:
            return
        if msg.finished:
            del self.queues[msg.request_id]
        queue.put_nowait(msg)

    async def on_step_outputs(self, env: Envelope, msg: StepOutputs) -> None:
        """Each output of one engine step to its request's queue. An entry that is not a
        RequestOutput ending when the entry says fails its request (`_bad_output`)."""
        problem = msg.problem()
        ids = msg.request_ids.tolist()
        for i, request_id in enumerate(ids if problem is None else []):
            try:
                out = self._entry(msg, i, request_id)
            except MessageError as e:
                await self._bad_output(request_id, str(e))
                continue
            await self.on_output(env, out)
        if problem is not None:
            for request_id in ids:
                await self._bad_output(request_id, problem)

    def _entry(self, msg: StepOutputs, i: int, request_id: int) -> RequestOutput:
        """Entry i under this client's `request_id` (its frame holds the engine's id).
        MessageError unless the frame is a RequestOutput that is finished when the entry is."""
        out = decode([msg.outputs[i]])
        finished = bool(msg.finished[i])
        if not isinstance(out, RequestOutput) or out.finished is not finished:
            raise MessageError(
                f"StepOutputs entry {i}: a {type(out).__name__} (finished "
                f"{getattr(out, 'finished', None)!r}) filed as an output (finished {finished})",
                ErrorCode.BAD_FIELD,
            )
        # (A fresh object of ours: renumbered in place. dataclasses.replace would build and
        # check all 21 fields again, ~11 us an output, 64 of them a step per client.)
        object.__setattr__(out, "request_id", request_id)
        return out

    async def _bad_output(self, request_id: int, why: str) -> None:
        """End a request whose output cannot be read with an error, and abort it in the engine
        (its blocks come back; its terminal output then finds no queue and is dropped)."""
        queue = self.queues.pop(request_id, None)
        if queue is None:
            return
        source = self._output_source()
        self.log.error("malformed output", request_id=request_id, source=source, error=why)
        text = f"{source} sent a malformed output: {why}"[:2000]
        queue.put_nowait(RequestOutput(request_id, NO_TOKENS, True, FinishReason.ERROR, text, 0, 0))
        await self._send_abort(request_id)

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        pass  # the coordinator's answer to our ping: `dispatch` already noted that it is alive

    async def on_info(self, env: Envelope, msg: ModelInfo) -> None:
        self._resolve(self.info_waiters, msg)

    async def on_stats(self, env: Envelope, msg: Stats) -> None:
        if self.stats_waiters:
            self.stats_waiters.pop(0).set_result(msg)

    async def on_control_ack(self, env: Envelope, msg: ControlAck) -> None:
        waiter = self.control_waiter
        if waiter is None or waiter[0] != msg.command or waiter[1].done():
            self.log.warning("stray control ack", command=str(msg.command), state=str(msg.state))
            return
        waiter[1].set_result(msg)

    async def on_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code is ErrorCode.LOAD_FAILED and self.info_waiters:
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
        self._end_requests(FinishReason.ABORT, "the client closed")
        self._resolve(self.info_waiters, ConnectionError("the client closed"))
        self._resolve(self.stats_waiters, ConnectionError("the client closed"))
        if self.control_waiter is not None:
            self._resolve([self.control_waiter[1]], ConnectionError("the client closed"))
