"""Stats family (tags 140-159): engine statistics and request events."""

from __future__ import annotations

from messages.codec import message


@message(140)
class EngineStats:
    """Per-rank counters, sent by an engine every `logging_step_interval` steps."""

    rank: int
    step: int
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_free: int
    tokens_in_step: int
