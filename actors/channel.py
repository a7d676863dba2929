"""Typed channels: the only place that touches zmq sockets and the codec.

Owns: socket creation (bind/connect, options), framing of routed sockets, recording of every
inbound and outbound message, and noticing peers that are gone. Actors only see `Envelope`s and
call `send(msg, to=...)`.

Peer watch (`watch_peers=True`, routed sockets only): when a peer's connection closes (its
process exited: the kernel closes the socket at once; or its host went silent: ZMQ's own
heartbeat gives up after `PEER_HEARTBEAT_TIMEOUT_MS`), the channel delivers a `PeerGone` from
that peer like any inbound message. ZMQ reports a closed connection by file descriptor, so the
channel remembers the descriptor each peer's messages arrive on (ZMQ_SRCFD). The kernel reuses a
closed descriptor, so disconnect reports must be applied before a newer connection's message on
that descriptor is: ZMQ queues a connection's report before it closes the descriptor, and the
channel reads every queued report (without waiting) before it notes the descriptor of each
message it receives. A report for a descriptor no known peer talks on is dropped.

Addresses are `inproc://`, `ipc://` or `tcp://`. Binding tcp beyond loopback is refused until
CurveZMQ keys are configured (control messages must not be open to whoever reaches a port).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from taipan.messages.codec import MAX_FRAME_BYTES, MessageError, decode, encode
from taipan.messages.common import PeerGone

if TYPE_CHECKING:
    from taipan.actors.record import Recorder

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
# ZMTP heartbeats on watched sockets: a peer whose host stops answering is dropped after this.
PEER_HEARTBEAT_IVL_MS = 1000
PEER_HEARTBEAT_TIMEOUT_MS = 5000


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
    `monitor` is set when the channel watches its peers (see the module docstring); then the
    owner also awaits `recv_peer_gone`.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        name: str,
        recorder: Recorder | None = None,
        monitor: zmq.asyncio.Socket | None = None,
    ):
        self.sock = sock
        self.name = name
        self.routed = sock.type == zmq.ROUTER
        self.recorder = recorder
        self.monitor = monitor
        self._fd_of: dict[bytes, int] = {}  # peer -> descriptor its messages arrive on
        self._peer_on: dict[int, bytes] = {}  # descriptor -> that peer
        self._stale = collections.Counter()  # descriptor -> disconnect reports to skip
        self._pending: collections.deque[Envelope] = collections.deque()
        # The monitor read without the event loop (non-blocking, from `recv` too); the asyncio
        # socket only waits for it to become readable.
        self._monitor_now = zmq.Socket.shadow(monitor.underlying) if monitor else None

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
        if self._pending:
            return self._pending.popleft()
        raw = await self.sock.recv_multipart(copy=False)
        now = time.time()
        frames = [f.buffer for f in raw]
        sender = None
        if self.routed:
            sender, frames = bytes(frames[0]), frames[1:]
        if self.monitor is not None and sender is not None:
            # Older connections' departures first: they may have held this descriptor.
            self._pending.extend(self._drain_reports())
            gone = self._note_descriptor(sender, raw[-1].get(zmq.SRCFD))
            if gone is not None:
                reason = "its connection closed (descriptor reused)"
                self._pending.append(self._peer_gone(gone, reason, now))
        if self.recorder is not None:
            self.recorder.write("in", self.name, sender, frames, now)
        try:
            env = Envelope(self, sender, decode(frames), None, now)
        except MessageError as e:
            env = Envelope(self, sender, None, e, now)
        if not self._pending:
            return env
        self._pending.append(env)
        return self._pending.popleft()

    def _note_descriptor(self, peer: bytes, fd: int) -> bytes | None:
        """Remember that `peer` talks on `fd` (-1: inproc, which has none). Returns the peer
        this proves gone: one still on `fd` whose report has not come (ZMQ queues it before
        closing the descriptor, so this is a safety net); that late report is then skipped."""
        if fd < 0 or self._fd_of.get(peer) == fd:
            return None
        old_fd = self._fd_of.get(peer)
        if old_fd is not None and self._peer_on.get(old_fd) == peer:
            del self._peer_on[old_fd]  # it reconnected: its old connection's report is moot
        previous = self._peer_on.get(fd)
        self._fd_of[peer], self._peer_on[fd] = fd, peer
        if previous is None or previous == peer or self._fd_of.get(previous) != fd:
            return None
        del self._fd_of[previous]
        self._stale[fd] += 1
        return previous

    def _drain_reports(self) -> list[Envelope]:
        """Apply every disconnect report ZMQ has queued, without waiting: a PeerGone envelope
        for each known peer whose connection closed."""
        gone = []
        while self._monitor_now.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self._monitor_now.recv_multipart(zmq.NOBLOCK)
            event, fd = struct.unpack("=hi", frames[0][:6])
            if event != zmq.EVENT_DISCONNECTED:
                continue
            if self._stale[fd]:
                self._stale[fd] -= 1
                continue
            peer = self._peer_on.pop(fd, None)
            if peer is not None and self._fd_of.get(peer) == fd:
                del self._fd_of[peer]
                gone.append(self._peer_gone(peer, "its connection closed", time.time()))
        return gone

    async def recv_peer_gone(self) -> Envelope:
        """Wait until a known peer's connection closes; a `PeerGone` envelope from it."""
        assert self.monitor is not None, f"channel {self.name} does not watch its peers"
        while True:
            gone = self._drain_reports()
            if gone:
                self._pending.extend(gone[1:])  # delivered by recv(), in order
                return gone[0]
            await self.monitor.poll(flags=zmq.POLLIN)

    def _peer_gone(self, peer: bytes, reason: str, now: float) -> Envelope:
        msg = PeerGone(reason)
        if self.recorder is not None:
            self.recorder.write("in", self.name, peer, encode(msg), now)
        return Envelope(self, peer, msg, None, now)

    def close(self) -> None:
        if self.sock.closed:
            return
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
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
    watch_peers: bool = False,
) -> Channel:
    """Create a socket of `kind` (zmq.ROUTER, DEALER, PAIR, ...), bind or connect it, wrap it.
    `watch_peers` (ROUTER only): deliver a `PeerGone` when a peer's connection closes."""
    if watch_peers and kind != zmq.ROUTER:
        raise ValueError("only a ROUTER channel can watch its peers")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Replies to a vanished peer are dropped rather than blocking the actor.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    monitor = None
    if watch_peers:
        sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        if bind:
            check_address(address)
            if address.startswith("ipc://"):
                os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
            sock.bind(address)
        else:
            sock.connect(address)
    except Exception:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return Channel(sock, name, recorder, monitor)
