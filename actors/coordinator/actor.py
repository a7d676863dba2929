"""The coordinator actor: clients on one ROUTER, engines on another.

Validates submissions, assigns global ids, routes to a rank, relays outputs back, answers
model-info queries once a rank has loaded its model, merges the ranks' stats
(messages/stats.py), and drives the lifecycle
(messages/lifecycle.py): a control command from a client is checked against the FSM
(actors/coordinator/fsm.py), forwarded to every engine, and answered with one `ControlAck` once
every engine has acknowledged it — or with an `ErrorReply` ("bad_request", "illegal_transition",
"busy", "control_failed"), leaving the state as it was. One command is in flight at a time; while
it waits for engine answers, submissions and outputs keep flowing (the wait is a task of its own).

A bad submission gets a terminal `RequestOutput` with finish_reason "error"; a malformed frame
gets an `ErrorReply` (actors/base.py); the coordinator keeps serving. After STOP it exits.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.actors.coordinator.core import ControlRound, CoordinatorCore, NoRankError
from taipan.actors.coordinator.fsm import IllegalTransition, LifecycleFSM, State
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import (
    ControlAck,
    Pause,
    Resume,
    Stop,
    StopAck,
    Suspend,
    Unpause,
    UpdateWeights,
)
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, RankStats, Stats

NO_TOKENS = np.zeros(0, dtype=np.int32)
STOP_TIMEOUT_S = 30.0
# Suspend, resume and update_weights move or load every weight and KV tensor: allow minutes.
CONTROL_TIMEOUT_S = 300.0
# An engine busy in a long control answers stats late: the client gets the latest known then.
STATS_TIMEOUT_S = 5.0
SUSPEND_MODES = ("persist", "offload", "recompute")
CONTROL_COMMANDS = {
    Pause: "pause",
    Unpause: "unpause",
    Suspend: "suspend",
    Resume: "resume",
    UpdateWeights: "update_weights",
    Stop: "stop",
}


def control_problem(msg) -> str | None:
    """What is wrong with a control message's fields (the FSM judges the state, not this)."""
    if isinstance(msg, Suspend) and msg.mode is not None and msg.mode not in SUSPEND_MODES:
        return f"suspend mode must be one of {', '.join(SUSPEND_MODES)} or None, got {msg.mode!r}"
    if isinstance(msg, UpdateWeights) and (msg.path is None) == (msg.state is None):
        return "update_weights needs exactly one of path and state"
    return None


class CoordinatorActor(Actor):
    def __init__(
        self,
        frontend: Channel,
        backend: Channel,
        num_ranks: int,
        model_name: str,
        max_sequence_length: int,
        *,
        control_timeout: float = CONTROL_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
        stats_timeout: float = STATS_TIMEOUT_S,
    ):
        super().__init__("coordinator")
        self.frontend, self.backend = frontend, backend
        self.num_ranks = num_ranks
        self.model_name = model_name
        self.max_sequence_length = max_sequence_length
        self.core = CoordinatorCore()
        self.engines: dict[int, bytes] = {}  # rank -> engine identity
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self.info_waiters: list[bytes] = []
        self.fsm = LifecycleFSM()
        self.weight_version = 0  # as the engines last acknowledged it
        self.control: ControlRound | None = None  # the command in flight, if any
        self.control_answered = asyncio.Event()  # set when every engine answered it
        self.control_timeout, self.stop_timeout = control_timeout, stop_timeout
        self.rank_stats: dict[int, RankStats] = {}  # each rank's latest report
        self.stats_waiters: list[bytes] = []  # clients waiting for the stats query in flight
        self.stats_pending: set[bytes] = set()  # engines that owe that query an answer
        self.stats_answered = asyncio.Event()
        self.stats_timeout = stats_timeout
        self.serve(frontend)
        self.serve(backend)
        for msg_type, handler in [
            (SubmitRequest, self.on_submit),
            (AbortRequest, self.on_abort),
            (GetModelInfo, self.on_get_info),
            (GetStats, self.on_get_stats),
            (Stats, self.on_stats),
            (Hello, self.on_hello),
            (ModelLoaded, self.on_model_loaded),
            (RequestOutput, self.on_output),
            (ControlAck, self.on_control_ack),
            (StopAck, self.on_stop_ack),
            (ErrorReply, self.on_engine_error),
        ]:
            self.on(msg_type, handler)
        for msg_type in CONTROL_COMMANDS:
            self.on(msg_type, self.on_control)

    # --- clients ------------------------------------------------------------------------------

    async def _fail(self, env: Envelope, request_id: int, text: str, prompt_len: int = 0) -> None:
        await env.reply(RequestOutput(request_id, NO_TOKENS, True, "error", text, prompt_len, 0))

    async def on_submit(self, env: Envelope, msg: SubmitRequest) -> None:
        if env.channel is not self.frontend:
            return
        prompt = msg.prompt_token_ids
        problems = msg.sampling.problems()
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            problems.append("prompt_token_ids must be a 1-D integer array")
        elif prompt.size == 0:
            problems.append("the prompt is empty")
        if self.control is not None and self.control.command == "stop":
            # The engines are aborting everything and exiting: a request forwarded now could
            # be lost without its terminal output.
            problems.append("the runtime is stopping")
        if problems:
            await self._fail(env, msg.request_id, "; ".join(problems), int(prompt.size))
            return
        try:
            gid, rank = self.core.admit(env.sender, msg.request_id)
        except (ValueError, NoRankError) as e:
            await self._fail(env, msg.request_id, str(e), len(prompt))
            return
        # While PAUSED or SUSPENDED the engine queues it until UNPAUSE.
        out = EngineSubmit(gid, prompt, msg.sampling, msg.stream, env.time)
        await self.backend.send(out, to=self.engines[rank])

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        found = self.core.lookup(env.sender, msg.request_id)
        if found is not None:
            gid, route = found
            await self.backend.send(AbortRequest(gid), to=self.engines[route.rank])

    async def on_get_info(self, env: Envelope, msg: GetModelInfo) -> None:
        if self.info is not None:
            await env.reply(self.info)
        elif self.load_error is not None:
            await env.reply(ErrorReply("load_failed", self.load_error, None))
        else:
            self.info_waiters.append(env.sender)

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        """Ask every engine for fresh stats; answer with every rank's latest once they have
        answered (or after `stats_timeout`). A client asking while a query is out shares it."""
        if env.channel is not self.frontend:
            return
        self.stats_waiters.append(env.sender)
        if len(self.stats_waiters) > 1:
            return
        self.stats_pending = set(self.engines.values())
        self.stats_answered.clear()
        for identity in list(self.engines.values()):
            await self.backend.send(GetStats(), to=identity)
        self.spawn(self._complete_stats())

    async def _complete_stats(self) -> None:
        if self.stats_pending:
            try:
                await asyncio.wait_for(self.stats_answered.wait(), self.stats_timeout)
            except TimeoutError:
                late = sorted(self._engine_name(i) for i in self.stats_pending)
                self.log.warning("stats answered from older reports", late=late)
        waiters, self.stats_waiters = self.stats_waiters, []
        ranks = tuple(self.rank_stats[r] for r in sorted(self.rank_stats))
        for client in waiters:
            await self.frontend.send(Stats(str(self.fsm.state), ranks), to=client)

    async def on_stats(self, env: Envelope, msg: Stats) -> None:
        """An engine's report: periodic (logging_step_interval) or the answer to GetStats."""
        if env.channel is not self.backend:
            return
        for rank in msg.ranks:
            self.rank_stats[rank.rank] = rank
        self.stats_pending.discard(env.sender)
        if not self.stats_pending:
            self.stats_answered.set()

    # --- lifecycle control --------------------------------------------------------------------

    async def on_control(self, env: Envelope, msg) -> None:
        """A client's Pause/Unpause/Suspend/Resume/UpdateWeights/Stop: validate, check the FSM,
        forward to every engine, and leave the answer to `_complete_control`."""
        if env.channel is not self.frontend:
            self.log.warning("control from an engine ignored", msg=type(msg).__name__)
            return
        command = CONTROL_COMMANDS[type(msg)]
        problem = control_problem(msg)
        if problem is None and command == "update_weights" and not self.engines:
            problem = "no engine is connected to load the weights"
        if problem is not None:
            await env.reply(ErrorReply("bad_request", problem, None))
            return
        try:
            self.fsm.check(command)
        except IllegalTransition as e:
            await env.reply(ErrorReply("illegal_transition", str(e), None))
            return
        if self.control is not None:
            text = (
                f"{command} refused: {self.control.command} is still waiting for the engines; "
                "send it again once that one is answered"
            )
            await env.reply(ErrorReply("busy", text, None))
            return
        self.log.info("control", command=command, state=str(self.fsm.state))
        self.control = ControlRound(command, env.sender, set(self.engines.values()))
        self.control_answered.clear()
        # The round and its timeout exist before the first send: an engine may answer before
        # the last send, and a failed send must not leave the round open (every later one busy).
        self.spawn(self._complete_control(self.control))
        for identity in list(self.engines.values()):
            await self.backend.send(msg, to=identity)

    async def _complete_control(self, round_: ControlRound) -> None:
        """Wait for every engine's answer (or the timeout), then move the FSM and reply."""
        timeout = self.stop_timeout if round_.command == "stop" else self.control_timeout
        if not round_.done:
            try:
                await asyncio.wait_for(self.control_answered.wait(), timeout)
            except TimeoutError:
                names = sorted(self._engine_name(i) for i in round_.waiting)
                round_.time_out(names, timeout)
        self.control = None
        try:
            await self.frontend.send(self._outcome(round_), to=round_.client)
        except Exception:  # the client is gone or the socket closed: the FSM still moved
            self.log.exception("could not answer a control", command=round_.command)
        if round_.command == "stop":
            self.stop()  # stop means exit, even when an engine did not acknowledge it

    def _outcome(self, round_: ControlRound) -> ControlAck | ErrorReply:
        if not round_.ok:
            text = f"{round_.command} failed; the state stays {self.fsm.state}: "
            text += "; ".join(round_.errors)
            if round_.command == "stop":
                text += " (the coordinator exits anyway)"
            self.log.warning("control failed", command=round_.command, errors=round_.errors)
            return ErrorReply("control_failed", text, None)
        versions = set(round_.weight_versions)
        if len(versions) > 1:
            self.log.warning("engines disagree on the weight version", versions=sorted(versions))
        self.weight_version = max(versions, default=self.weight_version)
        state = self.fsm.apply(round_.command)
        self.log.info("control done", command=round_.command, state=str(state))
        return ControlAck(round_.command, str(state), self.weight_version)

    def _engine_answered(
        self, env: Envelope, command: str, *, error=None, weight_version=None
    ) -> bool:
        """Record an engine's answer to the round in flight; False if it answers nothing."""
        round_ = self.control
        if env.channel is not self.backend or round_ is None or round_.command != command:
            return False
        name = self._engine_name(env.sender)
        if not round_.answer(env.sender, name, error=error, weight_version=weight_version):
            return False
        if round_.done:
            self.control_answered.set()
        return True

    def _engine_name(self, identity: bytes | None) -> str:
        rank = next((r for r, i in self.engines.items() if i == identity), None)
        return f"engine {rank}" if rank is not None else f"engine {identity!r}"

    async def on_control_ack(self, env: Envelope, msg: ControlAck) -> None:
        if not self._engine_answered(env, msg.command, weight_version=msg.weight_version):
            self.log.warning("stray control ack", command=msg.command, state=msg.state)

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        if not self._engine_answered(env, "stop"):
            self.log.warning("stray stop ack", name=msg.name)

    # --- engines ------------------------------------------------------------------------------

    async def on_hello(self, env: Envelope, msg: Hello) -> None:
        if env.channel is self.backend and msg.name == "engine":
            self.engines[msg.rank] = env.sender
            if self.fsm.state is not State.RUNNING:
                # Engines start RUNNING; a late joiner is not brought into the current state.
                self.log.warning("engine joined while not running", state=str(self.fsm.state))

    async def on_model_loaded(self, env: Envelope, msg: ModelLoaded) -> None:
        rank = next((r for r, i in self.engines.items() if i == env.sender), None)
        if rank is None:
            return
        self.core.add_rank(rank)
        if self.info is None:
            self.info = ModelInfo(
                self.model_name, msg.tokenizer, self.max_sequence_length, self.num_ranks
            )
        await self._flush_info_waiters(self.info)

    async def on_engine_error(self, env: Envelope, msg: ErrorReply) -> None:
        if env.channel is self.backend and msg.code == "load_failed":
            self.load_error = msg.text
            await self._flush_info_waiters(ErrorReply("load_failed", msg.text, None))
            return
        # An engine that refuses a command answers it with an ErrorReply naming no request.
        round_ = self.control
        if msg.request_id is None and round_ is not None:
            if self._engine_answered(env, round_.command, error=f"{msg.code}: {msg.text}"):
                return
        self.log.warning("error reply", code=msg.code, text=msg.text)

    async def _flush_info_waiters(self, reply) -> None:
        waiters, self.info_waiters = self.info_waiters, []
        for client in waiters:
            await self.frontend.send(reply, to=client)

    async def on_output(self, env: Envelope, msg: RequestOutput) -> None:
        route = self.core.route_of(msg.request_id, msg.finished)
        if route is None:
            return
        # Only the id changes on the way back: every other field (log-probs, events, ...) relays.
        relayed = dataclasses.replace(msg, request_id=route.client_request_id)
        await self.frontend.send(relayed, to=route.client)
