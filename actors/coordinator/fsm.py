"""The lifecycle state machine of the runtime, as one declared transition table. Pure Python.

Owns: which lifecycle command is legal in which state, and the state after it. Must not touch:
sockets, engines, clocks — the coordinator actor (actors/coordinator/actor.py) asks `check`
before forwarding a command and calls `apply` only once every engine has acknowledged it, so a
refused or failed command leaves the state as it was.

    RUNNING -pause-> PAUSED -suspend-> SUSPENDED -resume-> PAUSED -unpause-> RUNNING
    stop from PAUSED or SUSPENDED -> STOPPED; update_weights only in SUSPENDED (stays there).

Command names are the `ControlAck.command` strings of messages/lifecycle.py; state names are the
`ControlAck.state` strings.
"""

from __future__ import annotations

import enum


class State(enum.StrEnum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"


COMMANDS = ("pause", "unpause", "suspend", "resume", "update_weights", "stop")

# (state, command) -> state after it. Every pair not listed is illegal.
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.RUNNING, "pause"): State.PAUSED,
    (State.PAUSED, "unpause"): State.RUNNING,
    (State.PAUSED, "suspend"): State.SUSPENDED,
    (State.PAUSED, "stop"): State.STOPPED,
    (State.SUSPENDED, "resume"): State.PAUSED,
    (State.SUSPENDED, "update_weights"): State.SUSPENDED,
    (State.SUSPENDED, "stop"): State.STOPPED,
}


class IllegalTransition(RuntimeError):
    """A command the current state does not allow; the message names both and what is legal."""

    def __init__(self, state: State, command: str):
        self.state, self.command = state, command
        legal = ", ".join(legal_commands(state)) or "none (the runtime has stopped)"
        super().__init__(f"{command} is illegal while {state}; legal: {legal}")


def legal_commands(state: State) -> list[str]:
    """The commands `state` allows, in COMMANDS order."""
    return [c for c in COMMANDS if (state, c) in TRANSITIONS]


class LifecycleFSM:
    """The current lifecycle state. Only the coordinator actor mutates it, through `apply`."""

    def __init__(self, state: State = State.RUNNING):
        self.state = state

    def check(self, command: str) -> State:
        """The state `command` would lead to; raises IllegalTransition and changes nothing."""
        if command not in COMMANDS:
            raise ValueError(f"unknown lifecycle command {command!r}; known: {', '.join(COMMANDS)}")
        target = TRANSITIONS.get((self.state, command))
        if target is None:
            raise IllegalTransition(self.state, command)
        return target

    def apply(self, command: str) -> State:
        """Take the transition (after every engine acknowledged it); returns the new state."""
        self.state = self.check(command)
        return self.state
