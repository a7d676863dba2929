"""Connection family (tags 0-19): greetings, heartbeats and error replies between any two actors."""

from __future__ import annotations

from taipan.messages.codec import message


@message(0)
class Hello:
    """First message on a connection: who the sender is. `rank` is -1 for non-engine actors."""

    name: str
    rank: int


@message(1)
class Heartbeat:
    time: float


@message(2)
class ErrorReply:
    """The answer to a message that could not be handled. The sender's actor keeps running.

    `code` is short and machine-readable (e.g. "bad_message", "bad_request", "illegal_state");
    `request_id` names the client request when the error concerns one.
    """

    code: str
    text: str
    request_id: int | None
