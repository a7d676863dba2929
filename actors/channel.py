"""Typed channels: the only place that touches zmq sockets and the codec.

Owns: socket creation (bind/connect, options), framing of routed sockets, recording of every
inbound and outbound message, and noticing peers that are gone. Actors only see `Envelope`s and
call `send(msg, to=...)` (or `send_frames` to relay a message encoded elsewhere).

Peer watch (`watch_peers=True`, on a ROUTER or a DEALER): when a peer's connection closes (its
process exited: the kernel closes the socket at once; or its host went silent: ZMQ's own
heartbeat gives up after `PEER_HEARTBEAT_TIMEOUT_MS`), the channel delivers a `PeerGone` from
that peer like any inbound message, after every message that peer sent before it went. ZMQ
reports a closed connection by file descriptor, so the channel remembers the descriptor each
peer's messages arrive on (ZMQ_SRCFD). Order matters both ways, and ZMQ gives it: a connection's
messages are queued before its disconnect report, and the report before its descriptor is closed
(and can be reused by a later connection). So the channel reads every queued report before it
takes a message that puts a peer on a new descriptor, applies the reports on that descriptor
first (they concern older connections), and applies the others after the messages ready with
them (which their peers sent before going). A report for a descriptor no known peer talks on is
dropped; a descriptor that turns up under a new peer while an old one still holds it proves the
old one gone. A watched DEALER connects to one peer (whose address it names) and needs none of
this: each closed connection is a `PeerGone` with no sender, after the messages that came before
it. (A connection that never opened, its peer not yet bound, is not a closed one: ZMQ retries.)

Addresses are `inproc://`, `ipc://` or `tcp://`. The bind rule (`check_bind`): binding tcp beyond
loopback needs a Curve server's keys (actors/curve.py), since control messages must not be open to
whoever reaches a port. `make_socket(..., curve=...)` makes a Curve server (it admits only the
authorized client keys) or a Curve client (it knows the server's public key) of any socket.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from taipan.actors.curve import CurveClient, CurveServer, ZapGuard, apply_curve
from taipan.messages.codec import MAX_FRAME_BYTES, MessageError, decode, encode
from taipan.messages.common import PeerGone

if TYPE_CHECKING:
    from taipan.actors.record import Recorder

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


def inbound(channel, sender: bytes | None, frames: list) -> Envelope:
    """Received `frames` as an Envelope of `channel` (a Channel or an actors/local.py
    LocalChannel): recorded as they came (with the channel's recorder), then decoded; a
    message that does not decode is the Envelope's `error`."""
    now = time.time()
    if channel.recorder is not None:
        channel.recorder.write("in", channel.name, sender, frames, now)
    try:
        return Envelope(channel, sender, decode(frames), None, now)
    except MessageError as e:
        return Envelope(channel, sender, None, e, now)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (bracketed or not); False for `*`, 0.0.0.0, an
    interface name or any other address."""
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: str, curve: CurveServer | CurveClient | None = None) -> None:
    """The bind rule, checked before every bind: `inproc://`, `ipc://` and loopback tcp need no
    keys; tcp on any other host (0.0.0.0, `*`, a host's address or interface) needs `curve` to
    be a Curve server's keys, so that only authorized clients get through."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("inproc", "ipc", "tcp"):
        raise AddressError(f"address {address!r} must start with inproc://, ipc:// or tcp://")
    if scheme != "tcp":
        return
    host, _, port = rest.rpartition(":")
    if not host or not port:
        raise AddressError(f"tcp address {address!r} needs host:port")
    if is_loopback(host) or isinstance(curve, CurveServer):
        return
    got = "client keys, not the server's" if curve is not None else "no keys"
    raise AddressError(
        f"binding {address!r} opens it beyond this host, which needs CurveZMQ server keys "
        f"(got {got}): write a key set with `taipan keys DIR` and pass DIR to the server; "
        "or bind tcp://127.0.0.1:PORT or ipc://PATH"
    )


class Channel:
    """A typed endpoint over one zmq socket.

    Routed sockets (ROUTER) carry the peer identity as frame 0: `recv` returns it as
    `Envelope.sender` and `send(msg, to=identity)` routes back. Other sockets ignore `to`.
    `monitor` is set when the channel watches its peers (see the module docstring); `recv`
    then also returns the `PeerGone`s. PUB/XPUB channels only send; SUB channels take every
    message (no topics).
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        name: str,
        recorder: Recorder | None = None,
        monitor: zmq.asyncio.Socket | None = None,
        zap: ZapGuard | None = None,
    ):
        self.sock = sock
        self.name = name
        self.routed = sock.type == zmq.ROUTER
        self.recorder = recorder
        self.monitor = monitor
        self._zap = zap  # a Curve server's hold on the ZAP handler: released after the socket
        self._fd_of: dict[bytes, int] = {}  # peer -> descriptor its messages arrive on
        self._peer_on: dict[int, bytes] = {}  # descriptor -> that peer
        self._stale = collections.Counter()  # descriptor -> disconnect reports to skip
        self._reports: list[int] = []  # descriptors of reports read but not applied, in order
        self._pending: collections.deque[Envelope] = collections.deque()
        self._subscribed = 0  # XPUB: subscriptions seen (wait_subscribers)
        if monitor is not None:
            # Watched: wait until either is ready, then read both without waiting (shadows).
            self._ready = zmq.asyncio.Poller()
            self._ready.register(sock, zmq.POLLIN)
            self._ready.register(monitor, zmq.POLLIN)
            self._sock_now = zmq.Socket.shadow(sock.underlying)
            self._monitor_now = zmq.Socket.shadow(monitor.underlying)

    async def send(self, msg, to: bytes | None = None) -> None:
        await self.send_frames(encode(msg), to)

    async def send_frames(self, frames: list, to: bytes | None = None) -> None:
        """Send a message already encoded: `encode(msg)`, or a frame relayed unread (see
        `replace_first_field` in messages/codec.py). Recorded like any other send."""
        if self.recorder is not None:
            self.recorder.write("out", self.name, to, frames, time.time())
        if self.routed:
            if to is None:
                raise ValueError(f"channel {self.name}: a routed send needs a destination")
            frames = [to, *frames]
        await self.sock.send_multipart(frames, copy=len(frames) < 3)

    def record_only(self, msg) -> None:
        """Record `msg` as sent on this channel without sending it: a decision the log must
        show though no peer needs it (the engine's empty plans, messages.gpu.NoStep)."""
        if self.recorder is not None:
            self.recorder.write("out", self.name, None, encode(msg), time.time())

    async def recv(self) -> Envelope:
        if self.monitor is None:
            return self._envelope(await self.sock.recv_multipart(copy=False))
        while not self._pending:
            await self._ready.poll()
            self._take_ready()
        return self._pending.popleft()

    def recv_now(self, timeout: float) -> Envelope | None:
        """The next message without the event loop: a blocking wait of at most `timeout`
        seconds (None: nothing came). For a caller that must not yield (a synchronous
        collective); the actor's own receive loop may be waiting on the same channel, which
        is fine: whichever reads a message takes it, in order."""
        if self.monitor is None:
            now = zmq.Socket.shadow(self.sock.underlying)  # blocking calls, same socket
            if now.poll(int(timeout * 1000)) & zmq.POLLIN:
                return self._envelope(now.recv_multipart(zmq.NOBLOCK, copy=False))
            return None
        if not self._pending:
            poller = zmq.Poller()
            poller.register(self._sock_now, zmq.POLLIN)
            poller.register(self._monitor_now, zmq.POLLIN)
            if poller.poll(int(timeout * 1000)):
                self._take_ready()
        return self._pending.popleft() if self._pending else None

    def _take_ready(self) -> None:
        """Queue what is ready, in the order the module docstring explains."""
        self._read_reports()
        while self._sock_now.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            raw = self._sock_now.recv_multipart(zmq.NOBLOCK, copy=False)
            env = self._envelope(raw)
            fd = raw[-1].get(zmq.SRCFD) if self.routed else -1  # (a DEALER: one peer)
            if fd >= 0 and self._fd_of.get(env.sender) != fd:  # a peer on a new descriptor
                self._read_reports()
                self._apply_reports(fd)
                gone = self._note_descriptor(env.sender, fd)
                if gone is not None:
                    reason = "its connection closed (descriptor reused)"
                    self._pending.append(self._peer_gone(gone, reason, env.time))
            self._pending.append(env)
        self._apply_reports()

    def _envelope(self, raw: list) -> Envelope:
        frames = [f.buffer for f in raw]
        sender = None
        if self.routed:
            sender, frames = bytes(frames[0]), frames[1:]
        return inbound(self, sender, frames)

    def _note_descriptor(self, peer: bytes, fd: int) -> bytes | None:
        """Remember that `peer` talks on `fd`. Returns the peer this proves gone: one still on
        `fd` whose report has not come (ZMQ queues it before closing the descriptor, so this is
        a safety net); that late report is then skipped."""
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

    def _read_reports(self) -> None:
        """Take every disconnect report ZMQ has queued, without waiting."""
        while self._monitor_now.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self._monitor_now.recv_multipart(zmq.NOBLOCK)
            event, fd = struct.unpack("=hi", frames[0][:6])
            if event == zmq.EVENT_DISCONNECTED:
                self._reports.append(fd)

    def _apply_reports(self, only_fd: int | None = None) -> None:
        """Queue a PeerGone for each known peer whose connection a report closed (the reports on
        `only_fd`, or all)."""
        keep = []
        for fd in self._reports:
            if not self.routed:  # a DEALER's one peer: every closed connection is its
                self._pending.append(self._peer_gone(None, "its connection closed", time.time()))
            elif only_fd is not None and fd != only_fd:
                keep.append(fd)
            elif self._stale[fd]:
                self._stale[fd] -= 1
            else:
                peer = self._peer_on.pop(fd, None)
                if peer is not None and self._fd_of.get(peer) == fd:
                    del self._fd_of[peer]
                    self._pending.append(
                        self._peer_gone(peer, "its connection closed", time.time())
                    )
        self._reports = keep

    def _peer_gone(self, peer: bytes | None, reason: str, now: float) -> Envelope:
        msg = PeerGone(reason)
        if self.recorder is not None:
            self.recorder.write("in", self.name, peer, encode(msg), now)
        return Envelope(self, peer, msg, None, now)

    async def wait_subscribers(self, count: int) -> None:
        """An XPUB channel (make_socket sets XPUB_VERBOSE): return once `count` subscriptions
        have come (one per subscriber that connected), so that nothing published after is lost
        to a slow joiner. The caller bounds the wait; nothing else may read this socket."""
        if self.sock.type != zmq.XPUB:
            raise ValueError(f"channel {self.name}: only an XPUB channel counts subscribers")
        while self._subscribed < count:
            frame = await self.sock.recv()
            if frame[:1] == b"\x01":
                self._subscribed += 1
            elif frame[:1] == b"\x00":  # a subscriber went away
                self._subscribed -= 1

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; `linger_ms`: how long what it still holds (a goodbye just sent)
        may take to go out."""
        if self.sock.closed:
            return
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
        if self._zap is not None:
            self._zap.release()


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
    curve: CurveServer | CurveClient | None = None,
) -> Channel:
    """Create a socket of `kind` (zmq.ROUTER, DEALER, PAIR, ...), bind or connect it, wrap it.
    `watch_peers` (ROUTER, or a DEALER connected to one peer): deliver a `PeerGone` when a
    peer's connection closes (with ZMQ heartbeats, so a silent host's closes too).
    `curve`: a Curve server (admits only its authorized client keys; must be made on the event
    loop that runs the actor, which answers the ZAP checks) or client (actors/curve.py)."""
    if watch_peers and kind not in (zmq.ROUTER, zmq.DEALER):
        raise ValueError("only a ROUTER or DEALER channel can watch its peers")
    if bind:
        check_bind(address, curve)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Replies to a vanished peer are dropped rather than blocking the actor; those to a
        # slow one queue without limit: at the default limit (1,000 messages) a ROUTER drops
        # silently, and a client that fell behind lost outputs, terminal ones too (the relay
        # bench saw it, tests/perf/NOTES.md).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind in (zmq.PUB, zmq.XPUB, zmq.SUB):
        # A publisher drops what a full subscriber queue cannot take: no limit, never a loss
        # (its subscribers keep pace some other way: tensor-parallel peers by their collectives).
        sock.setsockopt(zmq.SNDHWM if kind != zmq.SUB else zmq.RCVHWM, 0)
    if kind == zmq.XPUB:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, for wait_subscribers
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every message
    monitor = zap = None
    try:
        if curve is not None:
            zap = apply_curve(sock, curve, name)
        if watch_peers:
            sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_HEARTBEAT_TIMEOUT_MS)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if bind:
            if address.startswith("ipc://"):
                os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        if zap is not None:
            zap.release()
        raise
    return Channel(sock, name, recorder, monitor, zap)
