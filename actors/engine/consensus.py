"""Expert-parallel consensus, the pure part: the rounds a group's engines exchange, the reduction
of their votes, and when to vote. No sockets, no clock, no torch (actors/engine/ep.py is the
shell that moves the messages; the engine actor and the replay checker both drive this).

Why a consensus: the gpu actors of an expert-parallel group exchange tokens inside every MoE
layer, so every rank must run a forward in the same step, real or dummy (padding rows only),
and none may stop stepping alone. The engines therefore decide together, between steps, from an
`Agreement` every rank computes from the same E votes:

- all ranks pausing -> PAUSE (the group stops after the same step);
- some rank has work -> each rank STEPs (its own requests) or, with none, runs a DUMMY forward;
- no rank has work -> IDLE: nobody steps; the next round starts when any rank has something to
  say (work arrived, a pause asked), without polling.

When to vote (`ConsensusSchedule.due`): every step while the last agreement saw an idle rank or a
pausing one (so the group stops dummy stepping, and pauses, as soon as it can), and every
`ep_consensus_interval` steps while every rank is busy (the round is skipped in between; a rank
whose work runs out meanwhile runs dummy forwards until the next round, and a pause waits at most
that many steps). With `disable_ep_consensus` the work is not agreed at all: every rank steps
every iteration (dummy when it has nothing), and a round every interval steps (every step while a
pause is pending) carries only the pause flags, since a group can only stop in a step it agreed
on. Every rank feeds the same agreements and counts the same steps, so every rank computes the
same `due()` and the same kind of action: the lockstep the collectives need.

Rounds (`RoundBook`): every exchange of the group is a numbered round in which each rank sends
one message (messages/consensus.py); the book collects a round's messages and hands them over
once all E are in, and refuses what breaks the protocol (`ProtocolError`: a rank outside the
group, a duplicate, a round out of order, mixed message kinds or arguments in one round).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from taipan.messages.consensus import EpBarrier, EpOutcome, EpVote


class ProtocolError(RuntimeError):
    """A peer broke the consensus protocol; the group cannot go on (the text says how)."""


class Action(enum.StrEnum):
    STEP = "step"  # run a step of this rank's requests
    DUMMY = "dummy"  # run a forward of padding rows only: a peer has work, this rank none
    IDLE = "idle"  # nobody steps; wait for a reason to vote again
    PAUSE = "pause"  # every rank asked to pause: stop here, meet at the barrier


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What a round of votes decided (the same on every rank)."""

    round: int
    max_work: int
    min_work: int
    all_pausing: bool
    any_pausing: bool


def agree(votes: Sequence[EpVote]) -> Agreement:
    """The reduction of one round's votes (all-reduce max of work and of the pause flags
    negated, as Megatron's (work, -1/0) pair; min of work besides, for "some rank is idle")."""
    if not votes:
        raise ValueError("a round needs at least one vote")
    work = [v.work for v in votes]
    return Agreement(
        votes[0].round,
        max(work),
        min(work),
        all(v.pausing for v in votes),
        any(v.pausing for v in votes),
    )


class ConsensusSchedule:
    """When this rank votes and what it does after each agreement. Feed it every agreement
    (`agreed`) and every step the group takes (`stepped`); `reset` after an unpause."""

    def __init__(self, interval: int, disabled: bool = False):
        if interval < 1:
            raise ValueError(f"ep_consensus_interval must be >= 1, got {interval}")
        self.interval = interval
        self.disabled = disabled
        self.last: Agreement | None = None
        self.steps_since = 0  # group steps since the last agreement

    def due(self) -> bool:
        """Whether the group votes before its next step."""
        last = self.last
        if last is None or last.any_pausing or self.steps_since >= self.interval:
            return True
        return not self.disabled and (last.max_work == 0 or last.min_work == 0)

    @property
    def idle(self) -> bool:
        """The last agreement saw no work anywhere: the next round waits for a reason (a local
        change, or a peer opening it)."""
        last = self.last
        return not self.disabled and last is not None and last.max_work == 0

    def agreed(self, agreement: Agreement) -> None:
        self.last = agreement
        self.steps_since = 0

    def action(self, local_work: int) -> Action:
        """What this rank does next, given the last agreement and its own pending work."""
        last = self.last
        if last is None:
            raise RuntimeError("no agreement yet: vote first")
        if last.all_pausing:
            return Action.PAUSE
        if not self.disabled and last.max_work == 0:
            return Action.IDLE
        return Action.STEP if local_work > 0 else Action.DUMMY

    def stepped(self) -> None:
        self.steps_since += 1

    def reset(self) -> None:
        """Forget the last agreement (after an unpause: the one that paused must not pause the
        group again); the next step is preceded by a round."""
        self.last = None
        self.steps_since = 0


def _signature(msg) -> tuple:
    """What every message of one round must share: its kind and what it is about."""
    if isinstance(msg, EpBarrier):
        return (EpBarrier, msg.point)
    if isinstance(msg, EpOutcome):
        return (EpOutcome, msg.command)
    return (type(msg),)


class RoundBook:
    """One rank's view of its group's rounds. `own` numbers and keeps this rank's message of
    the next round; `add` takes a peer's; `complete(r)` hands round r's E messages over (in
    group order) once they are all in.

    A peer can be at most one round ahead: it starts round r+1 only after round r is complete
    on its side, which needs this rank's round-r message. So a peer's message must belong to
    the round this rank waits for (`next_round - 1`) or the one it has not joined yet
    (`next_round`); anything else is a ProtocolError."""

    def __init__(self, rank: int, group: Sequence[int]):
        if rank not in group:
            raise ValueError(f"rank {rank} is not in its group {list(group)}")
        self.rank = rank
        self.group = tuple(group)
        self.next_round = 0  # the round of this rank's next message
        self.rounds: dict[int, dict[int, object]] = {}

    def add(self, msg) -> None:
        if msg.rank not in self.group or msg.rank == self.rank:
            raise ProtocolError(
                f"a round message from rank {msg.rank}, not a peer of rank {self.rank} in "
                f"group {list(self.group)}"
            )
        if not self.next_round - 1 <= msg.round <= self.next_round:
            raise ProtocolError(
                f"rank {msg.rank} sent {type(msg).__name__} of round {msg.round} while rank "
                f"{self.rank} is at round {self.next_round - 1}"
            )
        if isinstance(msg, EpVote) and msg.work < 0:
            raise ProtocolError(f"rank {msg.rank} voted a negative work count ({msg.work})")
        self._keep(msg)

    def own(self, msg) -> None:
        """Keep this rank's message (its round must be `next_round`) and move to the next."""
        if msg.rank != self.rank or msg.round != self.next_round:
            raise ValueError(f"own message {msg} is not rank {self.rank}'s round {self.next_round}")
        self._keep(msg)
        self.next_round += 1

    def _keep(self, msg) -> None:
        got = self.rounds.setdefault(msg.round, {})
        if msg.rank in got:
            raise ProtocolError(f"rank {msg.rank} sent round {msg.round} twice")
        got[msg.rank] = msg

    def opened(self) -> bool:
        """A peer has started a round this rank has not joined."""
        return bool(self.rounds.get(self.next_round))

    def complete_ready(self, round_: int) -> bool:
        """Whether every message of `round_` is in (without handing them over)."""
        return len(self.rounds.get(round_, {})) == len(self.group)

    def missing(self, round_: int) -> list[int]:
        """The ranks whose message of `round_` is not in yet."""
        got = self.rounds.get(round_, {})
        return [r for r in self.group if r not in got]

    def complete(self, round_: int) -> list | None:
        """Round `round_`'s messages in group order once all are in (and forget them), else
        None. ProtocolError if they are not all of one kind (the ranks disagree on what the
        round is: a bug or a miswired group)."""
        got = self.rounds.get(round_, {})
        if len(got) < len(self.group):
            return None
        del self.rounds[round_]
        msgs = [got[r] for r in self.group]
        kinds = {_signature(m) for m in msgs}
        if len(kinds) > 1:
            described = ", ".join(f"rank {m.rank}: {_describe(m)}" for m in msgs)
            raise ProtocolError(f"round {round_} mixes different exchanges ({described})")
        return msgs


def _describe(msg) -> str:
    sig = _signature(msg)
    return " ".join(str(s.__name__ if isinstance(s, type) else s) for s in sig)
