"""Typed channels: the only place that touches zmq sockets and the codec.

Owns: socket creation (bind/connect, options), framing of routed sockets, recording of every
inbound and outbound message. Actors only see `Envelope`s and call `send(msg, to=...)`.

Addresses are `inproc://`, `ipc://` or `tcp://`. Binding tcp beyond loopback is refused until
CurveZMQ keys are configured (control messages must not be open to whoever reaches a port).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from taipan.messages.codec import MAX_FRAME_BYTES, MessageError, decode, encode

if TYPE_CHECKING:
    from taipan.actors.record import Recorder

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class AddressError(ValueError):
    pass


@dataclasses.dataclass(slots=True)
class Envelope:
    """One received message. `msg` is None when decoding failed; then `error` says why."""

    channel: Channel
    sender: bytes | None
    msg: Any
    error: MessageError | None
    time: float

    async def reply(self, msg) -> None:
        await self.channel.send(msg, to=self.sender)


def check_address(address: str) -> None:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("inproc", "ipc", "tcp"):
        raise AddressError(f"address {address!r} must start with inproc://, ipc:// or tcp://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port:
            raise AddressError(f"tcp address {address!r} needs host:port")
        if host not in LOOPBACK_HOSTS:
            raise AddressError(
                f"binding {address!r} beyond loopback needs CurveZMQ keys, which taipan does "
                "not configure yet; use tcp://127.0.0.1:PORT or ipc://"
            )


class Channel:
    """A typed endpoint over one zmq socket.

    Routed sockets (ROUTER) carry the peer identity as frame 0: `recv` returns it as
    `Envelope.sender` and `send(msg, to=identity)` routes back. Other sockets ignore `to`.
    """

    def __init__(self, sock: zmq.asyncio.Socket, name: str, recorder: Recorder | None = None):
        self.sock = sock
        self.name = name
        self.routed = sock.type == zmq.ROUTER
        self.recorder = recorder

    async def send(self, msg, to: bytes | None = None) -> None:
        frames = encode(msg)
        if self.recorder is not None:
            self.recorder.write("out", self.name, to, frames, time.time())
        if self.routed:
            if to is None:
                raise ValueError(f"channel {self.name}: a routed send needs a destination")
            frames = [to, *frames]
        await self.sock.send_multipart(frames, copy=len(frames) < 3)

    async def recv(self) -> Envelope:
        raw = await self.sock.recv_multipart(copy=False)
        now = time.time()
        frames = [f.buffer for f in raw]
        sender = None
        if self.routed:
            sender, frames = bytes(frames[0]), frames[1:]
        if self.recorder is not None:
            self.recorder.write("in", self.name, sender, frames, now)
        try:
            return Envelope(self, sender, decode(frames), None, now)
        except MessageError as e:
            return Envelope(self, sender, None, e, now)

    def close(self) -> None:
        self.sock.close(linger=0)


def make_socket(
    ctx: zmq.asyncio.Context,
    kind: int,
    address: str,
    *,
    bind: bool,
    name: str,
    identity: bytes | None = None,
    recorder: Recorder | None = None,
) -> Channel:
    """Create a socket of `kind` (zmq.ROUTER, DEALER, PAIR, ...), bind or connect it, wrap it."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Replies to a vanished peer are dropped rather than blocking the actor.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    try:
        if bind:
            check_address(address)
            if address.startswith("ipc://"):
                os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
            sock.bind(address)
        else:
            sock.connect(address)
    except Exception:
        sock.close(linger=0)
        raise
    return Channel(sock, name, recorder)
