"""The expert-parallel consensus core (actors/engine/consensus.py), pure: the reduction of a
round's votes, the schedule of rounds (idle ranks consult every step, busy ones every interval),
the lockstep every rank of a simulated group keeps, and the round book's protocol checks; the
consensus messages round-trip and reject malformed input."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.actors.engine.consensus import (
    Action,
    Agreement,
    ConsensusSchedule,
    ProtocolError,
    RoundBook,
    agree,
)
from taipan.messages.codec import MessageError, decode, encode
from taipan.messages.consensus import (
    BarrierPoint,
    EpBarrier,
    EpBye,
    EpHello,
    EpOutcome,
    EpVote,
)
from taipan.messages.lifecycle import ControlCommand

votes = st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=8)


@given(votes)
def test_agree_is_the_max_of_work_and_all_of_the_pause_flags(vs):
    a = agree([EpVote(3, r, w, p) for r, (w, p) in enumerate(vs)])
    assert a.round == 3
    assert a.max_work == max(w for w, _ in vs) and a.min_work == min(w for w, _ in vs)
    assert a.all_pausing == all(p for _, p in vs)
    assert a.any_pausing == any(p for _, p in vs)
    # Order of the votes does not matter: every rank computes the same agreement.
    assert agree([EpVote(3, r, w, p) for r, (w, p) in reversed(list(enumerate(vs)))]) == a


def _agreement(max_work=0, min_work=0, all_pausing=False, any_pausing=False) -> Agreement:
    return Agreement(0, max_work, min_work, all_pausing, any_pausing)


def test_busy_ranks_consult_every_interval_steps_idle_ones_every_step():
    s = ConsensusSchedule(interval=4)
    assert s.due()  # nothing agreed yet
    s.agreed(_agreement(max_work=3, min_work=2))
    due = []
    for _ in range(9):
        due.append(s.due())
        if due[-1]:
            s.agreed(_agreement(max_work=3, min_work=2))
        assert s.action(2) is Action.STEP
        s.stepped()
    assert due == [False, False, False, False, True, False, False, False, True]
    s.agreed(_agreement(max_work=3, min_work=0))  # a peer is idle: every step
    s.stepped()
    assert s.due() and s.action(0) is Action.DUMMY and s.action(1) is Action.STEP
    s.agreed(_agreement())
    assert s.idle and s.due() and s.action(5) is Action.IDLE
    s.agreed(_agreement(max_work=1, min_work=1, any_pausing=True))  # a pause pending: every step
    s.stepped()
    assert s.due()
    s.agreed(_agreement(max_work=1, min_work=1, all_pausing=True, any_pausing=True))
    assert s.action(1) is Action.PAUSE
    s.reset()
    assert s.due() and s.last is None


def test_with_consensus_disabled_ranks_always_step_and_vote_only_for_pauses():
    s = ConsensusSchedule(interval=3, disabled=True)
    s.agreed(_agreement())  # no work anywhere: still no idling
    assert not s.idle and s.action(0) is Action.DUMMY and s.action(2) is Action.STEP
    due = []
    for _ in range(7):
        due.append(s.due())
        if due[-1]:
            s.agreed(_agreement())
        s.stepped()
    assert due == [False, False, False, True, False, False, True]
    s.agreed(_agreement(all_pausing=True, any_pausing=True))
    assert s.action(3) is Action.PAUSE


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(2, 4),
    interval=st.integers(1, 6),
    disabled=st.booleans(),
    # work[t][r]: rank r's pending work at iteration t; pause_at[r]: when rank r asks to pause
    work=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=1, max_size=60),
    pause_at=st.lists(st.integers(0, 80), min_size=4, max_size=4),
)
def test_a_simulated_group_keeps_lockstep_and_pauses_together(
    size, interval, disabled, work, pause_at
):
    """Every rank runs the driver's loop on its own local work: all vote in the same
    iterations, take the same kind of action (a forward, nothing, or the pause), and no rank
    with work stays idle: the group steps or pauses whenever any rank votes work."""
    ranks = range(size)
    schedules = [ConsensusSchedule(interval, disabled) for _ in ranks]
    for t in range(len(work) + 100):
        local = [work[t][r] if t < len(work) else 0 for r in ranks]
        pausing = [t >= pause_at[r] for r in ranks]
        due = {s.due() for s in schedules}
        assert len(due) == 1, f"iteration {t}: ranks disagree on voting"
        if due.pop():
            a = agree([EpVote(t, r, local[r], pausing[r]) for r in ranks])
            for s in schedules:
                s.agreed(a)
            if a.max_work > 0 and not a.all_pausing:
                assert all(
                    s.action(w) is not Action.IDLE for s, w in zip(schedules, local, strict=True)
                )
        actions = [s.action(local[r]) for r, s in enumerate(schedules)]
        kinds = {"forward" if a in (Action.STEP, Action.DUMMY) else a for a in actions}
        assert len(kinds) == 1, f"iteration {t}: {actions}"
        kind = kinds.pop()
        if kind == Action.PAUSE:
            assert all(pausing)
            return
        if kind == "forward":
            for s in schedules:
                s.stepped()
        for r in ranks:
            if actions[r] is Action.STEP:
                assert local[r] > 0
    # Everyone asked to pause within the horizon, so the group must have paused.
    assert max(pause_at[:size]) > len(work) + 99 - interval - 1


def test_round_book_collects_rounds_and_refuses_what_breaks_the_protocol():
    book = RoundBook(1, (0, 1, 2))
    book.add(EpVote(0, 2, 1, False))  # a peer may open the round before this rank
    assert book.opened()
    book.own(EpVote(0, 1, 0, False))
    assert not book.opened() and book.complete(0) is None and book.missing(0) == [0]
    book.add(EpVote(0, 0, 5, True))
    assert [v.rank for v in book.complete(0)] == [0, 1, 2]
    assert book.complete(0) is None  # handed over once
    book.add(EpVote(1, 0, 1, False))  # peer 0 is a round ahead: fine
    with pytest.raises(ProtocolError, match="twice"):
        book.add(EpVote(1, 0, 1, False))
    with pytest.raises(ProtocolError, match="round 3"):
        book.add(EpVote(3, 2, 1, False))  # two rounds ahead
    with pytest.raises(ProtocolError, match="not a peer"):
        book.add(EpVote(1, 7, 1, False))
    with pytest.raises(ProtocolError, match="negative"):
        book.add(EpVote(1, 2, -1, False))
    book.own(EpBarrier(1, 1, BarrierPoint.PAUSED))
    book.add(EpBarrier(1, 2, BarrierPoint.PAUSED))
    with pytest.raises(ProtocolError, match="mixes"):
        book.complete(1)  # rank 0 voted where the others met at a barrier
    with pytest.raises(ValueError):
        book.own(EpVote(5, 1, 0, False))  # own messages come in round order


def test_outcome_rounds_must_be_about_the_same_command():
    book = RoundBook(0, (0, 1))
    book.own(EpOutcome(0, 0, ControlCommand.SUSPEND, None))
    book.add(EpOutcome(0, 1, ControlCommand.RESUME, None))
    with pytest.raises(ProtocolError, match="suspend"):
        book.complete(0)


@pytest.mark.parametrize(
    "msg",
    [
        EpHello(0, 1, (0, 1)),
        EpVote(4, 1, 3, True),
        EpBarrier(5, 0, BarrierPoint.PAUSED),
        EpOutcome(6, 1, ControlCommand.UPDATE_WEIGHTS, "engine 1: shape (2, 3), expected (3, 2)"),
        EpOutcome(6, 1, ControlCommand.RESUME, None),
        EpBye(1, "stopped"),
    ],
)
def test_consensus_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "fields, why",
    [
        ([61, 1, 0, 1, "3", False], "EpVote.work"),
        ([61, 1, 0, 1, 3], "takes 4 fields"),
        ([62, 1, 0, 1, "nowhere"], "BarrierPoint"),
        ([63, 1, 0, 1, "explode", None], "ControlCommand"),
        ([60, 2, 0, 1, [0, 1]], "version"),
        ([60, 1, 0, 1, ["a"]], "EpHello.group"),
    ],
)
def test_malformed_consensus_messages_are_refused_at_decode(fields, why):
    with pytest.raises(MessageError, match=why):
        decode([msgpack.packb(fields)])


def test_expert_parallel_groups_are_consecutive_ranks():
    from taipan.actors.engine.ep import ep_groups

    assert ep_groups(4, 2) == [(0, 1), (2, 3)]
    assert ep_groups(3, 3) == [(0, 1, 2)] and ep_groups(2, 1) == [(0,), (1,)]
    with pytest.raises(ValueError, match="must divide data_parallel_size"):
        ep_groups(4, 3)
