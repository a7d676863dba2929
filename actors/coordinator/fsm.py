"""The lifecycle state machine of the runtime, as one declared transition table. Pure Python.

Owns: which lifecycle command is legal in which state, and the state after it. Must not touch:
sockets, engines, clocks — the coordinator actor (actors/coordinator/actor.py) asks `check`
before forwarding a command and calls `apply` only once every engine has acknowledged it, so a
refused or failed command leaves the state as it was.

    RUNNING -pause-> PAUSED -suspend-> SUSPENDED -resume-> PAUSED -unpause-> RUNNING
    stop from PAUSED or SUSPENDED -> STOPPED; update_weights only in SUSPENDED (stays there).

States and commands are the enums of messages/lifecycle.py, shared with the engines (which keep
their own copy of the state) and validated when a message is decoded.
"""

from __future__ import annotations

from taipan.messages.lifecycle import ControlCommand as Command
from taipan.messages.lifecycle import LifecycleState as State

# (state, command) -> state after it. Every pair not listed is illegal.
TRANSITIONS: dict[tuple[State, Command], State] = {
    (State.RUNNING, Command.PAUSE): State.PAUSED,
    (State.PAUSED, Command.UNPAUSE): State.RUNNING,
    (State.PAUSED, Command.SUSPEND): State.SUSPENDED,
    (State.PAUSED, Command.STOP): State.STOPPED,
    (State.SUSPENDED, Command.RESUME): State.PAUSED,
    (State.SUSPENDED, Command.UPDATE_WEIGHTS): State.SUSPENDED,
    (State.SUSPENDED, Command.STOP): State.STOPPED,
}


class IllegalTransition(RuntimeError):
    """A command the current state does not allow; the message names both and what is legal."""

    def __init__(self, state: State, command: Command):
        self.state, self.command = state, command
        legal = ", ".join(legal_commands(state)) or "none (the runtime has stopped)"
        super().__init__(f"{command} is illegal while {state}; legal: {legal}")


def legal_commands(state: State) -> list[Command]:
    """The commands `state` allows, in declaration order."""
    return [c for c in Command if (state, c) in TRANSITIONS]


class LifecycleFSM:
    """The current lifecycle state. Only the coordinator actor mutates it, through `apply`."""

    def __init__(self, state: State = State.RUNNING):
        self.state = state

    def check(self, command: Command) -> State:
        """The state `command` would lead to; raises IllegalTransition and changes nothing."""
        try:
            command = Command(command)
        except ValueError:
            known = ", ".join(Command)
            raise ValueError(f"unknown lifecycle command {command!r}; known: {known}") from None
        target = TRANSITIONS.get((self.state, command))
        if target is None:
            raise IllegalTransition(self.state, command)
        return target

    def apply(self, command: Command) -> State:
        """Take the transition (after every engine acknowledged it); returns the new state."""
        self.state = self.check(command)
        return self.state
