"""In-process channels: two actors of one process and one event loop hand messages over as
objects, with no encoding, no socket and no copy.

Owns the `local://NAME` address (runtime/wiring.py gives it to the engine's pairs with its
allocator, mamba_cache and gpu actors, which share the engine's process and event loop: the
step loop's hot path, where the codec and the socket were about a third of the engine's host
time per step, tests/perf/NOTES.md). Must not touch: sockets, other processes (an address that
crosses one is ipc or tcp, and the same rows then open zmq sockets: moving an actor is a change
of its address, DESIGN.md §2).

The hand-over contract: `send` runs encoding's checks on the message (a registered class, array
fields of their dtype and rank: a sender's bug is still the sender's TypeError) and makes its
array fields read-only, as decoded arrays are; the receiver gets the sender's own object, so the
sender must not change what it sent (messages are frozen dataclasses; an array it wrote again
would raise). With a recorder on either end a message is encoded once, recorded as sent and
as received from those same frames, and the receiver gets it decoded from them, as over a
socket: a recorded run acts on exactly what its logs hold (`taipan replay --check`).

A `LocalChannel` has a channel's sending and receiving calls (actors/channel.py `Channel`) for
one peer: no routing, no peer watch (an in-process peer cannot go away alone), and no
`recv_now` (a blocking wait would stall the one event loop both ends run on).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

from taipan.actors.channel import Envelope, inbound
from taipan.messages.codec import encode, hand_over

if TYPE_CHECKING:
    from taipan.actors.record import Recorder

SCHEME = "local://"


class LocalChannel:
    """One end of an in-process pair (`LocalPairs.open` makes them)."""

    routed = False
    monitor = None

    def __init__(self, name: str, recorder: Recorder | None = None):
        self.name = name
        self.recorder = recorder
        self.peer: LocalChannel | None = None
        self.closed = False
        self._inbox: collections.deque[tuple[object, list | None]] = collections.deque()
        self._waiters: list[asyncio.Future] = []  # receives waiting (each rechecks the inbox)

    async def send(self, msg, to: bytes | None = None) -> None:
        peer = self._peer()
        if self.recorder is None and peer.recorder is None:
            hand_over(msg)
            peer._deliver(msg, None)
            return
        # Bytes, not views of the sender's arrays (large ones travel as extra frames): what the
        # receiver decodes is the logged copy, as a socket's would be.
        frames = [bytes(f) for f in encode(msg)]
        if self.recorder is not None:
            self.recorder.write("out", self.name, None, frames, time.time())
        peer._deliver(None, frames)

    async def send_frames(self, frames: list, to: bytes | None = None) -> None:
        """A message already encoded (a relay): recorded and decoded as over a socket."""
        peer = self._peer()
        if self.recorder is not None:
            self.recorder.write("out", self.name, None, frames, time.time())
        peer._deliver(None, list(frames))

    def record_only(self, msg) -> None:
        """Record `msg` as sent without sending it (actors/channel.py `Channel.record_only`)."""
        if self.recorder is not None:
            self.recorder.write("out", self.name, None, encode(msg), time.time())

    async def recv(self) -> Envelope:
        while not self._inbox:
            if self.closed:
                raise ConnectionError(f"channel {self.name} is closed")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        msg, frames = self._inbox.popleft()
        if frames is None:
            return Envelope(self, None, msg, None, time.time())
        return inbound(self, None, frames)

    def close(self, linger_ms: int = 0) -> None:
        """Close this end: a receive waiting on it ends with ConnectionError; what the peer
        sends from now on is dropped, as a closed socket's would be."""
        self.closed = True
        self._wake()

    def _peer(self) -> LocalChannel:
        if self.peer is None:
            raise ConnectionError(f"channel {self.name}: its peer has not connected")
        return self.peer

    def _deliver(self, msg, frames: list | None) -> None:
        if self.closed:
            return
        self._inbox.append((msg, frames))
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class LocalPairs:
    """The `local://` addresses of one process (`runtime/wiring.py open_channels` keeps one):
    the binding end of an address waits there for the end that connects."""

    def __init__(self):
        self._bound: dict[str, LocalChannel] = {}

    def open(
        self, address: str, *, bind: bool, name: str, recorder: Recorder | None = None
    ) -> LocalChannel:
        if not address.startswith(SCHEME) or len(address) == len(SCHEME):
            raise ValueError(f"address {address!r} is not a local://NAME address")
        end = LocalChannel(name, recorder)
        if bind:
            if address in self._bound:
                raise ValueError(f"{address} is bound already")
            self._bound[address] = end
            return end
        other = self._bound.get(address)
        if other is None:
            raise ValueError(f"{address}: nothing bound there in this process (bind first)")
        if other.peer is not None:
            raise ValueError(f"{address} has its two ends already")
        end.peer, other.peer = other, end
        return end
