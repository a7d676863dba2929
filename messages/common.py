"""Connection family (tags 0-19): greetings, heartbeats and error replies between any two actors."""

from __future__ import annotations

from taipan.messages.codec import message
from taipan.messages.errors import ErrorCode


@message(0)
class Hello:
    """First message on a connection: who the sender is. `rank` is -1 for non-engine actors."""

    name: str
    rank: int


@message(1)
class Heartbeat:
    """ "I am alive". Engines send one to the coordinator every second; a client waiting for an
    answer sends one when the coordinator has been quiet, and the coordinator answers it with one
    (so a client tells a silent server from a busy one)."""

    time: float


@message(2)
class ErrorReply:
    """The answer to a message that could not be handled. The sender's actor keeps running.

    `code` says why, machine-readable (messages/errors.py lists every code and when it is sent;
    decoding refuses any other); `request_id` names the client request when the error concerns
    one.
    """

    code: ErrorCode
    text: str
    request_id: int | None


@message(3)
class PeerGone:
    """The connection of the peer named by the envelope's sender has closed: its process exited,
    or ZMQ's heartbeat found it unreachable. A routed channel that watches its peers makes this
    up itself from ZMQ's disconnect notification (actors/channel.py) and delivers it like any
    inbound message (so it is recorded and replayed); no peer sends it."""

    reason: str


@message(4)
class RankGone:
    """Never sent: the coordinator records it in its log, on its engines channel, at the moment
    it declares engine rank `rank` dead (its connection closed, or it sent nothing for the engine
    timeout) and stops routing to it. That timeout runs on the coordinator's clock, which no log
    holds, so `taipan replay --check` removes the rank where this is recorded
    (actors/coordinator/check.py). `reason`: as the coordinator logged it."""

    rank: int
    reason: str
