"""The lifecycle table (messages/lifecycle.py) and the coordinator's FSM over it: every
(state, command) pair, and random command sequences."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taipan.actors.coordinator.fsm import IllegalTransition, LifecycleFSM, State
from taipan.messages.lifecycle import TRANSITIONS, ControlCommand, LifecycleState, legal_commands

COMMANDS = list(ControlCommand)

R, P, S, X = State.RUNNING, State.PAUSED, State.SUSPENDED, State.STOPPED

# The lifecycle of messages/lifecycle.py, written out pair by pair (None: illegal).
EXPECTED = {
    R: {"pause": P, "unpause": None, "suspend": None, "resume": None, "update_weights": None,
        "init_weight_transfer": R, "close_weight_transfer": R, "flush_cache": None, "stop": None},
    P: {"pause": None, "unpause": R, "suspend": S, "resume": None, "update_weights": P,
        "init_weight_transfer": P, "close_weight_transfer": P, "flush_cache": P, "stop": X},
    S: {"pause": None, "unpause": None, "suspend": None, "resume": P, "update_weights": S,
        "init_weight_transfer": S, "close_weight_transfer": S, "flush_cache": S, "stop": X},
    X: dict.fromkeys(COMMANDS),
}  # fmt: skip

PAIRS = [(state, command) for state in State for command in COMMANDS]


def test_expected_covers_every_pair_and_matches_the_table():
    assert {(s, c) for s in EXPECTED for c in EXPECTED[s]} == set(PAIRS)
    assert {k: v for k, v in ((p, EXPECTED[p[0]][p[1]]) for p in PAIRS) if v} == TRANSITIONS


@pytest.mark.parametrize(("state", "command"), PAIRS, ids=[f"{s}-{c}" for s, c in PAIRS])
def test_every_pair(state, command):
    fsm = LifecycleFSM(state)
    target = EXPECTED[state][command]
    if target is not None:
        assert fsm.check(command) is target and fsm.state is state  # check changes nothing
        assert fsm.apply(command) is target and fsm.state is target
        return
    with pytest.raises(IllegalTransition) as info:
        fsm.apply(command)
    assert fsm.state is state
    text = str(info.value)
    assert text.startswith(f"{command} is illegal while {state}; legal: ")
    for legal in legal_commands(state):
        assert legal in text.split("legal: ")[1]
    assert info.value.state is state and info.value.command == command


def test_messages_name_what_is_legal():
    side = "init_weight_transfer, close_weight_transfer"
    with pytest.raises(
        IllegalTransition, match=rf"^resume is illegal while RUNNING; legal: pause, {side}$"
    ):
        LifecycleFSM().check("resume")
    with pytest.raises(
        IllegalTransition,
        match=rf"legal: unpause, suspend, update_weights, {side}, flush_cache, stop$",
    ):
        LifecycleFSM(P).check("pause")
    with pytest.raises(IllegalTransition, match=r"legal: none \(the runtime has stopped\)"):
        LifecycleFSM(X).check("pause")


def test_unknown_command_is_not_an_illegal_transition():
    with pytest.raises(ValueError, match="unknown lifecycle command 'jump'"):
        LifecycleFSM().check("jump")


def test_states_are_the_wire_names():
    assert [str(s) for s in State] == ["RUNNING", "PAUSED", "SUSPENDED", "STOPPED"]
    assert State is LifecycleState  # one enum: the engines and the messages use it too
    assert [str(c) for c in COMMANDS] == [
        "pause", "unpause", "suspend", "resume", "update_weights", "init_weight_transfer",
        "close_weight_transfer", "flush_cache", "stop"
    ]  # fmt: skip


@given(st.lists(st.sampled_from(COMMANDS), max_size=40))
def test_random_sequences_follow_the_table(commands):
    fsm = LifecycleFSM()
    reachable = {R} | set(TRANSITIONS.values())
    for command in commands:
        before = fsm.state
        try:
            after = fsm.apply(command)
        except IllegalTransition:
            assert (before, command) not in TRANSITIONS
            assert fsm.state is before  # an illegal command leaves the state unchanged
        else:
            assert after is TRANSITIONS[(before, command)] and fsm.state is after
        assert fsm.state in reachable
