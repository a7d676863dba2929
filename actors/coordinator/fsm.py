"""The lifecycle state machine of the runtime, over the one declared transition table
(`TRANSITIONS` in messages/lifecycle.py, which the engines check too). Pure Python.

Owns: which lifecycle command is legal in which state, and the state after it. Must not touch:
sockets, engines, clocks — the coordinator's lifecycle control (actors/coordinator/control.py)
asks `check` before the actor forwards a command and calls `apply` only once every engine has
acknowledged it, so a refused or failed command leaves the state as it was.

    RUNNING -pause-> PAUSED -suspend-> SUSPENDED -resume-> PAUSED -unpause-> RUNNING
    stop from PAUSED or SUSPENDED -> STOPPED; update_weights only in PAUSED or SUSPENDED
    (stays there); the table's other commands leave the state as it is.

States and commands are the enums of messages/lifecycle.py, shared with the engines (which keep
their own copy of the state) and validated when a message is decoded.
"""

from __future__ import annotations

from taipan.messages.lifecycle import ControlCommand as Command
from taipan.messages.lifecycle import LifecycleState as State
from taipan.messages.lifecycle import legal_commands, next_state_for


class IllegalTransition(RuntimeError):
    """A command the current state does not allow; the message names both and what is legal."""

    def __init__(self, state: State, command: Command):
        self.state, self.command = state, command
        legal = ", ".join(legal_commands(state)) or "none (the runtime has stopped)"
        super().__init__(f"{command} is illegal while {state}; legal: {legal}")


class LifecycleFSM:
    """The current lifecycle state. Only LifecycleControl (control.py) mutates it, by `apply`."""

    def __init__(self, state: State = State.RUNNING):
        self.state = state

    def check(self, command: Command, in_flight: bool = False) -> State:
        """The state `command` would lead to (`in_flight`: a weight update sent so, legal while
        RUNNING too); raises IllegalTransition and changes nothing."""
        try:
            command = Command(command)
        except ValueError:
            known = ", ".join(Command)
            raise ValueError(f"unknown lifecycle command {command!r}; known: {known}") from None
        target = next_state_for(self.state, command, in_flight)
        if target is None:
            raise IllegalTransition(self.state, command)
        return target

    def apply(self, command: Command, in_flight: bool = False) -> State:
        """Take the transition (after every engine acknowledged it); returns the new state."""
        self.state = self.check(command, in_flight)
        return self.state
