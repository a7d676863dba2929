"""Lifecycle family (tags 40-59): control messages the coordinator drives.

Only STOP exists so far; PAUSE / UNPAUSE / SUSPEND / RESUME arrive with the lifecycle FSM.
"""

from __future__ import annotations

from messages.codec import message


@message(40)
class Stop:
    """Shut down: abort every request (each gets its terminal output), then exit."""

    reason: str


@message(41)
class StopAck:
    name: str
