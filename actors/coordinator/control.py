"""The lifecycle as the coordinator drives it: who may send a command (the runtime's control
token), whether the FSM (fsm.py, over messages/lifecycle.py's one transition table) allows it
now, the one command in flight and its round of engine answers, and the answer its client gets.

Owns the weight version the engines last acknowledged (the hash salt) and the round in flight.
Must not touch sockets: the coordinator actor (actor.py) asks `refusal`, opens the round with
`open`, forwards the command to every engine, feeds their answers to `answer` (an engine that
dies answers with its death) and sends what `close` returns. A command that is refused, fails or
times out on any engine leaves the state as it was; one that every engine acknowledged moves the
FSM. The round's waiter sleeps on an asyncio.Event; nothing here reads a clock.

A pause is all or none across the data-parallel ranks (an expert-parallel group agrees inside,
actors/engine/ep.py): its round ends at the first engine that refuses it or dies, or at its
`timeout` (mode wait can take as long as the longest request in flight), and `undo_round` then
sends an unpause to every engine that paused or is still pausing (which withdraws it there), so
that no rank stays paused while the runtime says RUNNING. The pause's error names the ranks.
(Mode abort: requests a rank already aborted stay ended, each with its terminal output.)

A weight update that stages (from a path or a state dict, or a transfer with `stage`) is all or
none across the data-parallel ranks too: with more than one engine it goes out with `hold`
(`holds`), each engine stages it and acknowledges, and only when every one did does a second
round (`decision_round`) send WeightsDecision(commit) to all; otherwise the engines that staged
it drop it (WeightsDecision(discard)) and the error names the ranks that failed. An in-place
transfer (`stage` False) cannot be taken back: a rank that fails it part way refuses to unpause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import math
from collections.abc import Callable, Iterable

from taipan.actors.coordinator.fsm import IllegalTransition, LifecycleFSM
from taipan.messages.common import ErrorReply
from taipan.messages.errors import ErrorCode
from taipan.messages.lifecycle import (
    WEIGHT_DTYPES,
    ControlAck,
    ControlCommand,
    InitWeightTransfer,
    Pause,
    UpdateWeights,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromIpc,
)

STOP_TIMEOUT_S = 30.0
# Suspend, resume and update_weights move or load every weight and KV tensor: allow minutes.
CONTROL_TIMEOUT_S = 300.0
UNDO_TIMEOUT_S = 30.0  # an unpause taking back a failed pause is answered at once
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
    asked: frozenset[bytes] = frozenset()  # every engine it went to
    failed: set[bytes] = dataclasses.field(default_factory=set)  # those that answered an error
    codes: set[ErrorCode] = dataclasses.field(default_factory=set)  # their errors' codes
    timeout: float | None = None  # None: the command's default
    fail_fast: bool = False  # done at the first error (a pause: the others are undone)
    hold: bool = False  # a weight update staged on every engine, swapped in by a second round
    in_flight: bool = False  # a weight update sent `in_flight` (legal while RUNNING)
    note: str = ""  # added to a timeout's error

    @property
    def done(self) -> bool:
        return not self.waiting or (self.fail_fast and bool(self.errors))

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
        code: ErrorCode | None = None,
    ) -> bool:
        """Record `engine`'s answer (`name` labels it in error texts; `code`: an error reply's).
        False, changing nothing, when that engine owes no answer (a duplicate, or a late answer
        to an older round)."""
        if engine not in self.waiting:
            return False
        self.waiting.discard(engine)
        if error is not None:
            self.errors.append(f"{name}: {error}")
            self.failed.add(engine)
            self.codes.add(code if code is not None else ErrorCode.CONTROL_FAILED)
        if weight_version is not None:
            self.weight_versions.append(weight_version)
        return True

    def time_out(self, names: list[str], timeout: float) -> None:
        """Give up on the engines still waited for (`names`, in a stable order)."""
        text = f"{', '.join(names)} did not answer {self.command} within {timeout:g} s"
        self.errors.append(text + self.note)
        self.codes.add(ErrorCode.CONTROL_FAILED)
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
        updates = UpdateWeights | UpdateWeightsFromDistributed | UpdateWeightsFromIpc
        if isinstance(msg, updates) and not has_engines:
            return ErrorCode.BAD_REQUEST, "no engine is connected to load the weights"
        try:
            self.fsm.check(command, bool(getattr(msg, "in_flight", False)))
        except IllegalTransition as e:
            text = str(e)
            if command == ControlCommand.FLUSH_CACHE:
                text += " (running requests hold the cached blocks: pause first, or pause with "
                text += "clear_cache)"
            if command == ControlCommand.UPDATE_WEIGHTS and self.fsm.state == "RUNNING":
                text += (" (pause first, or send the update in_flight=True: the requests keep "
                         "running and take the new weights from the next step)")  # fmt: skip
            return ErrorCode.ILLEGAL_TRANSITION, text
        if self.round is not None:
            return ErrorCode.BUSY, (
                f"{command} refused: {self.round.command} is still waiting for the engines; "
                "send it again once that one is answered"
            )
        return None

    def open(
        self,
        command: ControlCommand,
        client: bytes,
        engines: Iterable[bytes],
        *,
        timeout: float | None = None,
        note: str = "",
        hold: bool = False,
        in_flight: bool = False,
    ) -> ControlRound:
        """The round of a command about to be forwarded to `engines` (`timeout`: None, the
        command's default; `note`: added to a timeout's error; `hold`: a weight update that
        only stages, see `decision_round`). A pause's round ends at its first error
        (`undo_round` then takes it back)."""
        engines = list(engines)
        fail_fast = command == ControlCommand.PAUSE
        self.round = ControlRound(
            command, client, set(engines), asked=frozenset(engines), timeout=timeout,
            fail_fast=fail_fast, note=note, hold=hold, in_flight=in_flight,
        )  # fmt: skip
        self.answered.clear()
        return self.round

    def undo_round(self, failed: ControlRound, live: Iterable[bytes]) -> ControlRound | None:
        """After a failed pause, the round of the unpause that takes it back on every `live`
        engine it went to that did not refuse or fail it (it paused, or is still pausing: an
        unpause withdraws that); None when there is none. The FSM never left RUNNING."""
        targets = [i for i in live if i in failed.asked and i not in failed.failed]
        if not targets:
            return None
        timeout = min(self.control_timeout, UNDO_TIMEOUT_S)
        return self.open(ControlCommand.UNPAUSE, failed.client, targets, timeout=timeout)

    def decision_round(
        self, staged: ControlRound, commit: bool, live: Iterable[bytes]
    ) -> ControlRound | None:
        """After a held update's round: the round that commits it on every engine (all
        staged it) or drops it on every `live` engine that did not fail it (it staged, or may
        still be staging: the decision runs after that there); None when there is none."""
        targets = [i for i in live if i in staged.asked and i not in staged.failed]
        if not targets:
            return None
        timeout = None if commit else min(self.control_timeout, UNDO_TIMEOUT_S)
        return self.open(
            ControlCommand.UPDATE_WEIGHTS, staged.client, targets, timeout=timeout,
            in_flight=staged.in_flight,
        )  # fmt: skip

    async def close_staged(
        self, round_: ControlRound, name: Callable[[bytes], str], log
    ) -> ErrorReply | None:
        """Wait for every engine's answer to a held update: None when every one staged it
        (nothing moved yet), else the client's error."""
        await self._wait(round_, name)
        return None if round_.ok else self._outcome(round_, log)

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
        await self._wait(round_, name)
        return self._outcome(round_, log)

    async def close_undo(
        self,
        round_: ControlRound,
        name: Callable[[bytes], str],
        failed: ErrorReply,
        log,
        undone: str = "every rank that had paused or was pausing runs again",
    ) -> ErrorReply:
        """Wait for the answers to a round that takes a failed command back (`undo_round`'s
        unpause, `decision_round`'s discard); the failed command's reply `failed`, saying
        whether it was `undone` everywhere."""
        await self._wait(round_, name)
        if round_.ok:
            text = f"{failed.text}; {undone}"
        else:
            text = f"{failed.text}; undoing it failed too: {'; '.join(round_.errors)}"
            log.error("undoing a failed control failed", errors=round_.errors)
        return ErrorReply(failed.code, text, None)

    async def _wait(self, round_: ControlRound, name: Callable[[bytes], str]) -> None:
        if round_.timeout is not None:
            timeout = round_.timeout
        elif round_.command == ControlCommand.STOP:
            timeout = self.stop_timeout
        else:
            timeout = self.control_timeout
        if not round_.done:
            try:
                await asyncio.wait_for(self.answered.wait(), timeout)
            except TimeoutError:
                round_.time_out(sorted(name(i) for i in round_.waiting), timeout)
        self.round = None

    def _outcome(self, round_: ControlRound, log) -> ControlAck | ErrorReply:
        command, sender = str(round_.command), peer_name(round_.client)
        if not round_.ok:
            text = f"{command} failed; the state stays {self.fsm.state}: "
            text += "; ".join(round_.errors)
            if round_.command == ControlCommand.STOP:
                text += " (the coordinator exits anyway)"
            log.warning("control failed", command=command, sender=sender, errors=round_.errors)
            # Every engine refused the request itself (a bad request): the client's error.
            bad = round_.codes == {ErrorCode.BAD_REQUEST}
            return ErrorReply(
                ErrorCode.BAD_REQUEST if bad else ErrorCode.CONTROL_FAILED, text, None
            )
        versions = set(round_.weight_versions)
        if len(versions) > 1:
            log.warning("engines disagree on the weight version", versions=sorted(versions))
        self.weight_version = max(versions, default=self.weight_version)
        state = self.fsm.apply(round_.command, round_.in_flight)
        log.info("control done", command=command, sender=sender, state=str(state))
        return ControlAck(round_.command, state, self.weight_version)


def holds(msg, engines: int) -> bool:
    """Whether an update goes out with `hold`: it stages (a path or state dict always does, a
    transfer with `stage`) and more than one engine must agree."""
    if engines < 2:
        return False
    if isinstance(msg, UpdateWeights):
        return True
    return isinstance(msg, UpdateWeightsFromDistributed | UpdateWeightsFromIpc) and msg.stage


def peer_name(identity: bytes | None) -> str:
    """A routing identity as a log field: printable ASCII as is, else hex."""
    if identity is None:
        return "-"
    if identity.isascii() and identity.decode("ascii").isprintable():
        return identity.decode("ascii")
    return identity.hex()


def _bad_fields(msg) -> str | None:
    """What makes a control unusable whatever the state, or None."""
    if isinstance(msg, UpdateWeights) and (msg.path is None) == (msg.state is None):
        return "update_weights needs exactly one of path and state"
    updates = (UpdateWeights, UpdateWeightsFromDistributed, UpdateWeightsFromIpc)
    if isinstance(msg, updates) and msg.draft and msg.weight_version is not None:
        return "a draft's weight update (draft=True) takes no weight_version (the target's stays)"
    if isinstance(msg, UpdateWeightsFromDistributed) and not any(msg.buckets):
        return "update_weights_from_distributed needs at least one non-empty bucket"
    if isinstance(msg, UpdateWeightsFromIpc):
        return _ipc_problem(msg)
    if isinstance(msg, Pause) and msg.timeout is not None and not 0 < msg.timeout < math.inf:
        return f"pause: timeout {msg.timeout} is not a positive number of seconds"
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


def _ipc_problem(msg: UpdateWeightsFromIpc) -> str | None:
    """What makes an update from IPC records unusable (names, dtypes, ranks; the gpu processes
    check the rest against the model, and each record against its storage)."""
    if not msg.tensors:
        return "update_weights_from_ipc needs at least one tensor"
    names = [t.name for t in msg.tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        return f"update_weights_from_ipc names a tensor twice: {twice[:5]}"
    for t in msg.tensors:
        if t.dtype not in WEIGHT_DTYPES:
            return (
                f"update_weights_from_ipc: {t.name}: dtype {t.dtype!r} is not one of "
                f"{', '.join(WEIGHT_DTYPES)}"
            )
        if len(t.shape) != len(t.stride) or min((*t.shape, *t.stride), default=0) < 0:
            return (
                f"update_weights_from_ipc: {t.name}: shape {list(t.shape)} and stride "
                f"{list(t.stride)} do not describe a tensor"
            )
    return None
