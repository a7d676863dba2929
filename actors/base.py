"""The actor base: a TaskGroup, receive loops over typed channels, a handler registry.

Owns: dispatch of inbound messages to handlers by message type, the error policy (a bad message
or a failing handler gets an `ErrorReply` and the actor keeps running), and shutdown. Subclasses
register handlers with `self.on(MsgType, coroutine)` and may start extra tasks in `started()`;
every task lives in the actor's TaskGroup, nothing is fire-and-forget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from taipan.actors.channel import Channel, Envelope
from taipan.actors.log import get_logger
from taipan.messages.codec import MessageError, decode
from taipan.messages.common import ErrorReply, PeerGone
from taipan.messages.errors import ErrorCode

Handler = Callable[[Envelope, Any], Awaitable[None]]
ERROR_TEXT_LIMIT = 2000  # an ErrorReply's text is cut here


class FatalError(Exception):
    """An actor cannot go on. Raised from one of its tasks, it ends the actor's TaskGroup and,
    through runtime/procs.py, the process, with a non-zero exit code and this message logged."""


class Actor:
    def __init__(self, name: str):
        self.name = name
        self.log = get_logger(actor=name)
        self._handlers: dict[type, Handler] = {}
        self._served: list[Channel] = []
        self._tasks: set[asyncio.Task] = set()  # live tasks only: done ones drop out
        self._tg: asyncio.TaskGroup | None = None
        self._stopped = asyncio.Event()

    # --- wiring -------------------------------------------------------------------------------

    def on(self, msg_type: type, handler: Handler) -> None:
        self._handlers[msg_type] = handler

    def serve(self, channel: Channel) -> None:
        """Dispatch every message arriving on `channel` to the registered handlers (and, when
        the channel watches its peers, a `PeerGone` for each peer whose connection closed)."""
        self._served.append(channel)
        if self._tg is not None:
            self.spawn(self._recv_loop(channel))

    def spawn(self, coro) -> asyncio.Task:
        """Start a task owned by this actor's TaskGroup (cancelled when the actor stops)."""
        assert self._tg is not None, "spawn() before run()"
        task = self._tg.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- lifecycle ----------------------------------------------------------------------------

    async def started(self) -> None:
        """Hook: runs once inside the TaskGroup, after the receive loops start."""

    async def stopping(self) -> None:
        """Hook: runs once after stop() is called, before tasks are cancelled."""

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            for ch in self._served:
                self.spawn(self._recv_loop(ch))
            await self.started()
            await self._stopped.wait()
            await self.stopping()
            for task in list(self._tasks):
                task.cancel()

    # --- dispatch -----------------------------------------------------------------------------

    async def _recv_loop(self, channel: Channel) -> None:
        while True:
            env = await channel.recv()
            await self.dispatch(env)

    async def dispatch(self, env: Envelope) -> None:
        self.log.debug("recv", channel=env.channel.name, msg=type(env.msg).__name__)
        if env.error is not None:
            self.log.warning("bad message", channel=env.channel.name, error=str(env.error))
            await self._reply_error(env, env.error.code, str(env.error))
            return
        handler = self._handlers.get(type(env.msg))
        if handler is None:
            if isinstance(env.msg, ErrorReply):
                self.log.warning("error reply", code=env.msg.code, text=env.msg.text)
                return
            if isinstance(env.msg, PeerGone):
                return  # made up by the channel: there is nobody to answer
            name = type(env.msg).__name__
            await self._reply_error(
                env, ErrorCode.UNEXPECTED_MESSAGE, f"{self.name} does not take {name}"
            )
            return
        try:
            await handler(env, env.msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.exception("handler failed", msg=type(env.msg).__name__)
            await self._reply_error(env, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    async def _reply_error(self, env: Envelope, code: ErrorCode, text: str) -> None:
        if env.channel.routed and env.sender is None:
            return
        try:
            await env.reply(ErrorReply(code, text[:ERROR_TEXT_LIMIT], None))
        except Exception:  # the peer may be gone; the error is already logged
            self.log.warning("could not send error reply", code=code)


class Service:
    """A deterministic message -> reply core (the allocator, the mamba_cache): one handler per
    message type in `handlers`, set by the subclass. Pure, so `taipan replay --check` re-drives
    it from a recording (`handle_frames`) and expects the live actor's replies byte for byte;
    its answers to what it does not take use the wording of `Actor.dispatch`."""

    name: str
    handlers: dict[type, Callable[[Any], Any]]

    def handle(self, msg):
        handler = self.handlers.get(type(msg))
        if handler is not None:
            return handler(msg)
        if isinstance(msg, ErrorReply):
            return None  # never answer an error with an error: two actors would ping-pong
        return ErrorReply(
            ErrorCode.UNEXPECTED_MESSAGE, f"{self.name} does not take {type(msg).__name__}", None
        )

    def handle_frames(self, frames):
        """What the live actor answers to these raw inbound frames (as `Actor.dispatch` does
        for undecodable input: ErrorReply(code, text), no request id)."""
        try:
            msg = decode(frames)
        except MessageError as e:
            return ErrorReply(e.code, str(e)[:ERROR_TEXT_LIMIT], None)
        return self.handle(msg)


class ServiceActor(Actor):
    """The thin shell around a `Service`: it serves one channel, every message the service
    takes goes through `service.handle` and its reply goes back (a rejection is logged). It
    holds no state of its own, so the replay checker and the live actor agree."""

    def __init__(self, name: str, channel: Channel, service: Service):
        super().__init__(name)
        self.channel = channel
        self.service = service
        for msg_type in service.handlers:
            self.on(msg_type, self._handle)
        self.serve(channel)

    async def _handle(self, env: Envelope, msg) -> None:
        reply = self.service.handle(msg)
        if isinstance(reply, ErrorReply):
            self.log.warning("rejected", msg=type(msg).__name__, code=reply.code, text=reply.text)
        if reply is not None:
            await env.reply(reply)
