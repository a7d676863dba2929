"""The lifecycle as the coordinator drives it: who may send a command (the runtime's control
token), whether the FSM (fsm.py, over messages/lifecycle.py's one transition table) allows it
now, the one command in flight and its round of engine answers, and the answer its client gets.

Owns the weight version the engines last acknowledged (the hash salt) and the round in flight.
Must not touch sockets: the coordinator actor (actor.py) asks `refusal`, opens the round with
`open`, forwards the command to every engine, feeds their answers to `answer` (an engine that
dies answers with its death) and sends what `close` returns. A command that is refused, fails or
times out on any engine leaves the state as it was; one that every engine acknowledged moves the
FSM. The round's waiter sleeps on an asyncio.Event; nothing here reads a clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import Callable, Iterable

from taipan.actors.coordinator.fsm import IllegalTransition, LifecycleFSM
from taipan.messages.common import ErrorReply
from taipan.messages.errors import ErrorCode
from taipan.messages.lifecycle import (
    ControlAck,
    ControlCommand,
    InitWeightTransfer,
    Pause,
    PauseMode,
    UpdateWeights,
    UpdateWeightsFromDistributed,
)

STOP_TIMEOUT_S = 30.0
# Suspend, resume and update_weights move or load every weight and KV tensor: allow minutes.
CONTROL_TIMEOUT_S = 300.0
NOT_AUTHORIZED = (
    "{command} needs the runtime's control token. A client run by the same user on the same "
    "machine finds it by the runtime's address; otherwise pass control_token= or set "
    "TAIPAN_CONTROL_TOKEN"
)


@dataclasses.dataclass
class ControlRound:
    """One lifecycle command in flight: which engines still owe an answer, and what they said.

    Opened when the command is forwarded; each engine's answer (`ControlAck`/`StopAck`, or
    `ErrorReply`) is recorded with `answer`; closed when `done` or on a timeout (`time_out`).
    The round succeeded only if every engine acknowledged it.
    """

    command: str
    client: bytes  # who asked; gets the one reply
    waiting: set[bytes]  # engine identities that have not answered yet
    errors: list[str] = dataclasses.field(default_factory=list)
    weight_versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.waiting

    @property
    def ok(self) -> bool:
        return self.done and not self.errors

    def answer(
        self,
        engine: bytes,
        name: str,
        *,
        error: str | None = None,
        weight_version: int | None = None,
    ) -> bool:
        """Record `engine`'s answer (`name` labels it in error texts). False, changing nothing,
        when that engine owes no answer (a duplicate, or a late answer to an older round)."""
        if engine not in self.waiting:
            return False
        self.waiting.discard(engine)
        if error is not None:
            self.errors.append(f"{name}: {error}")
        if weight_version is not None:
            self.weight_versions.append(weight_version)
        return True

    def time_out(self, names: list[str], timeout: float) -> None:
        """Give up on the engines still waited for (`names`, in a stable order)."""
        self.errors.append(f"{', '.join(names)} did not answer {self.command} within {timeout:g} s")
        self.waiting.clear()


class LifecycleControl:
    """The FSM's driver; only the coordinator actor calls it, one command at a time."""

    def __init__(
        self,
        fsm: LifecycleFSM,
        token: str,
        *,
        control_timeout: float = CONTROL_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
    ):
        if not token:
            raise ValueError("the coordinator needs a non-empty control token")
        self.fsm = fsm
        self.token = token.encode()
        self.control_timeout, self.stop_timeout = control_timeout, stop_timeout
        self.weight_version = 0  # as the engines last acknowledged it
        self.round: ControlRound | None = None  # the command in flight, if any
        self.answered = asyncio.Event()  # set when every engine answered it

    @property
    def stopping(self) -> bool:
        """Whether a STOP is in flight: the engines are aborting everything and exiting."""
        return self.round is not None and self.round.command == ControlCommand.STOP

    def refusal(
        self, command: ControlCommand, msg, has_engines: bool
    ) -> tuple[ErrorCode, str] | None:
        """(code, text) when the coordinator must refuse this control now, else None."""
        if not msg.token or not hmac.compare_digest(msg.token.encode(), self.token):
            return ErrorCode.NOT_AUTHORIZED, NOT_AUTHORIZED.format(command=command)
        problem = _bad_fields(msg)
        if problem is not None:
            return ErrorCode.BAD_REQUEST, problem
        if isinstance(msg, UpdateWeights | UpdateWeightsFromDistributed) and not has_engines:
            return ErrorCode.BAD_REQUEST, "no engine is connected to load the weights"
        try:
            self.fsm.check(command)
        except IllegalTransition as e:
            return ErrorCode.ILLEGAL_TRANSITION, str(e)
        if self.round is not None:
            return ErrorCode.BUSY, (
                f"{command} refused: {self.round.command} is still waiting for the engines; "
                "send it again once that one is answered"
            )
        return None

    def open(
        self, command: ControlCommand, client: bytes, engines: Iterable[bytes]
    ) -> ControlRound:
        """The round of a command about to be forwarded to `engines`."""
        self.round = ControlRound(command, client, set(engines))
        self.answered.clear()
        return self.round

    def answer(self, engine: bytes, name: str, command: str | None = None, **said) -> bool:
        """Record an engine's answer to the round in flight (to `command`; None: whatever it
        is, as a death answers it; `said`: its error or weight version, as `ControlRound.answer`
        takes them); False if it answers nothing."""
        round_ = self.round
        if round_ is None or (command is not None and round_.command != command):
            return False
        if not round_.answer(engine, name, **said):
            return False
        if round_.done:
            self.answered.set()
        return True

    async def close(
        self, round_: ControlRound, name: Callable[[bytes], str], log
    ) -> ControlAck | ErrorReply:
        """Wait for every engine's answer (or the timeout; `name` names the late ones), end the
        round, and return the client's answer, having moved the FSM if every engine agreed (the
        outcome is logged to `log`)."""
        timeout = (
            self.stop_timeout if round_.command == ControlCommand.STOP else self.control_timeout
        )
        if not round_.done:
            try:
                await asyncio.wait_for(self.answered.wait(), timeout)
            except TimeoutError:
                round_.time_out(sorted(name(i) for i in round_.waiting), timeout)
        self.round = None
        return self._outcome(round_, log)

    def _outcome(self, round_: ControlRound, log) -> ControlAck | ErrorReply:
        command, sender = str(round_.command), peer_name(round_.client)
        if not round_.ok:
            text = f"{command} failed; the state stays {self.fsm.state}: "
            text += "; ".join(round_.errors)
            if round_.command == ControlCommand.STOP:
                text += " (the coordinator exits anyway)"
            log.warning("control failed", command=command, sender=sender, errors=round_.errors)
            return ErrorReply(ErrorCode.CONTROL_FAILED, text, None)
        versions = set(round_.weight_versions)
        if len(versions) > 1:
            log.warning("engines disagree on the weight version", versions=sorted(versions))
        self.weight_version = max(versions, default=self.weight_version)
        state = self.fsm.apply(round_.command)
        log.info("control done", command=command, sender=sender, state=str(state))
        return ControlAck(round_.command, state, self.weight_version)


def peer_name(identity: bytes | None) -> str:
    """A routing identity as a log field: printable ASCII as is, else hex."""
    if identity is None:
        return "-"
    if identity.isascii() and identity.decode("ascii").isprintable():
        return identity.decode("ascii")
    return identity.hex()


def _bad_fields(msg) -> str | None:
    """What makes a weight control unusable whatever the state, or None."""
    if isinstance(msg, UpdateWeights) and (msg.path is None) == (msg.state is None):
        return "update_weights needs exactly one of path and state"
    if isinstance(msg, UpdateWeightsFromDistributed) and not any(msg.buckets):
        return "update_weights_from_distributed needs at least one non-empty bucket"
    if isinstance(msg, Pause) and msg.mode == PauseMode.WAIT:
        return "pause mode wait is not built yet (keep and abort are)"
    if isinstance(msg, Pause) and msg.clear_cache:
        return "pause(clear_cache=True) is not built yet"
    if isinstance(msg, InitWeightTransfer):
        g = msg.group
        if not 0 < g.master_port < 65536:
            return f"init_weight_transfer: master_port {g.master_port} is not a port"
        if g.rank_offset < 1 or g.world_size <= g.rank_offset:
            return (
                f"init_weight_transfer: rank_offset {g.rank_offset} must be >= 1 (the trainer's "
                f"senders) and below world_size {g.world_size}"
            )
        if g.backend not in ("", "nccl", "gloo"):
            return f"init_weight_transfer: backend {g.backend!r} is not nccl or gloo"
    return None
