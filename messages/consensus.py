"""Consensus family (tags 60-79): the engines of one expert-parallel group agreeing between
steps.

The E engine ranks of a group (actors/engine/ep.py) exchange these over ZMQ, every rank sending
each message to every peer (no leader). An exchange is a numbered `round`: every rank sends
exactly one message of the same type in each round, in the same order of rounds, and a round is
complete once a rank holds its own and every peer's message of it. Rounds follow one another
strictly (round r+1 starts only after r is complete on the sender), so a rank can receive at
most one round ahead of its own.

- `EpHello` (round 0): after the model is loaded; names the group, so a miswired peer is caught.
- `EpVote`: before a step when the consensus schedule says so (actors/engine/consensus.py):
  each rank's pending work and pause flag; every rank reduces the E votes to the same
  `Agreement` (max work, min work, all pausing) and acts on it.
- `EpBarrier`: every rank has reached the same point (e.g. "paused": the group stopped in the
  same step and has no step in flight).
- `EpOutcome`: each rank's result of a lifecycle control (suspend, resume, update_weights),
  so that the group applies it on every rank or on none.
- `EpBye`: not a round; a rank that exits on purpose (STOP) says so, so that its peers do not
  take its closed connection for a crash.

Values are checked on arrival by the pure core (a rank outside the group, a round out of
order, a negative work count), types and enums by the codec.
"""

from __future__ import annotations

import enum

from taipan.messages.codec import message
from taipan.messages.lifecycle import ControlCommand


class BarrierPoint(enum.StrEnum):
    """Where the group meets in an `EpBarrier`."""

    PAUSED = "paused"  # every rank stopped after the same step, no step in flight


@message(60)
class EpHello:
    """Round 0. `group`: the global engine ranks of the sender's group, in order."""

    round: int
    rank: int
    group: tuple[int, ...]


@message(61)
class EpVote:
    """`work`: the sender's pending requests (0: nothing it could step); `pausing`: it has been
    asked to pause."""

    round: int
    rank: int
    work: int
    pausing: bool


@message(62)
class EpBarrier:
    round: int
    rank: int
    point: BarrierPoint


@message(63)
class EpOutcome:
    """The sender's result of `command` (error None: it succeeded and can commit or keep it)."""

    round: int
    rank: int
    command: ControlCommand
    error: str | None


@message(64)
class EpBye:
    """The sender is leaving the group on purpose (`reason`); its connection closes next."""

    rank: int
    reason: str


ROUND_MESSAGES = (EpHello, EpVote, EpBarrier, EpOutcome)
