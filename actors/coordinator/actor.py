"""The coordinator actor: clients on one ROUTER, engines on another.

Validates submissions, assigns global ids, routes to a rank, relays outputs back (an engine
sends one `StepOutputs` per step; see "Relaying outputs" below), answers model-info queries
once a rank has loaded its model, merges the ranks' stats
(messages/stats.py), and drives the lifecycle (messages/lifecycle.py): a control command from a
client that presents the runtime's control token is checked against the FSM
(actors/coordinator/fsm.py), forwarded to every engine, and answered with one `ControlAck` once
every engine has acknowledged it — or with an `ErrorReply` ("not_authorized", "bad_request",
"illegal_transition", "busy", "control_failed"), leaving the state as it was. Every control is
logged at info with its sender and outcome. One command is in flight at a time; while it waits
for engine answers, submissions and outputs keep flowing (the wait is a task of its own).

Liveness: both ROUTERs watch their peers (actors/channel.py). An engine whose connection closes,
or that sends nothing (engines send a Heartbeat every second) for `engine_timeout`, is dead:
every request on it ends with finish_reason "error" naming the rank, nothing more is routed to
it (the other ranks keep serving; a request with no live rank is refused at once), and `Stats`
shows it dead. The runtime is ready (model info answered) once all `num_ranks` ranks have loaded
their model; a rank that dies or fails to load before that fails the start. A client whose
connection closes has all its requests aborted, so their blocks come back. A client's Heartbeat
is answered with one.

Relaying outputs: an engine's StepOutputs is split by client, routed by its arrays alone
(`request_ids`, `finished`). A client that said `Hello("client")` (actors/client/actor.py does)
gets one StepOutputs per engine step holding its entries, under its own request ids, each
output frame as the engine encoded it (its own id still the engine's; the client reads it and
checks it): per entry the coordinator touches no byte, and sends one message per client per
step, not one per request (tests/perf/NOTES.md, "Coordinator relay capacity"). Any other client
gets each output as a RequestOutput of its own, renumbered (`StepOutputs.relayed`, which checks
the frame: a malformed entry fails its request, the client getting its terminal output and the
engine an abort and a "bad_message" error).

A bad submission gets a terminal `RequestOutput` with finish_reason "error"; a malformed frame
gets an `ErrorReply` (actors/base.py); the coordinator keeps serving. After STOP it exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.actors.config import HASHING_POLICIES, PrefixCachingCoordinatorPolicy
from taipan.actors.coordinator.core import (
    ControlRound,
    CoordinatorCore,
    NoRankError,
    Route,
    routing_hashes,
)
from taipan.actors.coordinator.fsm import IllegalTransition, LifecycleFSM, State
from taipan.actors.coordinator.routing import RoutingError
from taipan.messages.codec import MessageError
from taipan.messages.common import ErrorReply, Heartbeat, Hello, PeerGone, RankGone
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import (
    CONTROL_MESSAGES,
    ControlAck,
    ControlCommand,
    StopAck,
    UpdateWeights,
)
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    FinishReason,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, PrefixEvents, RankStats, Stats

NO_TOKENS = np.zeros(0, dtype=np.int32)
STOP_TIMEOUT_S = 30.0
# Suspend, resume and update_weights move or load every weight and KV tensor: allow minutes.
CONTROL_TIMEOUT_S = 300.0
# An engine busy in a long control answers stats late: the client gets the latest known then.
STATS_TIMEOUT_S = 5.0
# An engine's event loop stays free while its device works (the forward runs in a thread), so a
# silence this long means a hung process, not a long step.
ENGINE_TIMEOUT_S = 10.0
# What each side may send; anything else is refused before any handler sees it.
FROM_CLIENTS = frozenset(
    {SubmitRequest, AbortRequest, GetModelInfo, GetStats, Heartbeat, PeerGone, *CONTROL_MESSAGES}
)
FROM_ENGINES = frozenset(
    {Hello, Heartbeat, PeerGone, ModelLoaded, StepOutputs, ControlAck, StopAck, Stats}
    | {ErrorReply, PrefixEvents}
)
# A dead rank's gauges (what it held at the time) drop to zero; its running totals stay.
DEAD_RANK_ZEROS = (
    "running",
    "waiting",
    "paused",
    "num_blocks",
    "blocks_free",
    "blocks_used",
    "tokens_last_step",
    "blocks_hashed",
    "blocks_evictable",
    "mamba_live_free",
    "mamba_snapshots",
)
NOT_AUTHORIZED = (
    "{command} needs the runtime's control token. A client run by the same user on the same "
    "machine finds it by the runtime's address; otherwise pass control_token= or set "
    "TAIPAN_CONTROL_TOKEN"
)


class CoordinatorActor(Actor):
    def __init__(
        self,
        frontend: Channel,
        backend: Channel,
        num_ranks: int,
        model_name: str,
        max_sequence_length: int,
        *,
        control_token: str,
        control_timeout: float = CONTROL_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
        stats_timeout: float = STATS_TIMEOUT_S,
        engine_timeout: float = ENGINE_TIMEOUT_S,
        prefix_caching: bool = False,
        routing_policy: PrefixCachingCoordinatorPolicy = PrefixCachingCoordinatorPolicy.ROUND_ROBIN,
        routing_alpha: float = 0.5,
        rank_capacity: int = 1,
    ):
        super().__init__("coordinator")
        if not control_token:
            raise ValueError("the coordinator needs a non-empty control token")
        self.frontend, self.backend = frontend, backend
        self.num_ranks = num_ranks
        self.model_name = model_name
        self.max_sequence_length = max_sequence_length
        self.control_token = control_token.encode()
        self.core = CoordinatorCore(routing_policy, routing_alpha, rank_capacity)
        self.prefix_caching = prefix_caching
        # Hash prompts here only when the policy reads them or the engines cache by them.
        self.hashing = prefix_caching or self.core.router.policy in HASHING_POLICIES
        self.block_size = 0  # from the first ModelLoaded
        self.engines: dict[int, bytes] = {}  # rank -> engine identity, live ranks only
        self.loaded: set[int] = set()  # ranks that have loaded their model (ever)
        self.engine_heard: dict[bytes, float] = {}  # engine identity -> its last message
        self.batch_clients: set[bytes] = set()  # clients that take StepOutputs (their Hello)
        self.engine_timeout = engine_timeout
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
            (Heartbeat, self.on_heartbeat),
            (PeerGone, self.on_peer_gone),
            (ModelLoaded, self.on_model_loaded),
            (PrefixEvents, self.on_prefix_events),
            (StepOutputs, self.on_step_outputs),
            (ControlAck, self.on_control_ack),
            (StopAck, self.on_stop_ack),
            (ErrorReply, self.on_engine_error),
        ]:
            self.on(msg_type, handler)
        for msg_type in CONTROL_MESSAGES:
            self.on(msg_type, self.on_control)

    async def started(self) -> None:
        self.spawn(self._watch_engines())

    async def dispatch(self, env: Envelope) -> None:
        if env.channel is self.backend and env.sender in self.engine_heard:
            self.engine_heard[env.sender] = env.time  # any message proves the engine alive
        side = FROM_CLIENTS if env.channel is self.frontend else FROM_ENGINES
        if env.msg is not None and type(env.msg) not in side and not self._client_hello(env):
            # e.g. a client sending RequestOutput or ModelLoaded: never act on it.
            if not isinstance(env.msg, ErrorReply):  # never answer an error with an error
                who = "clients" if side is FROM_CLIENTS else "engines"
                text = f"the coordinator takes no {type(env.msg).__name__} from {who}"
                await self._reply_error(env, ErrorCode.UNEXPECTED_MESSAGE, text)
            return
        await super().dispatch(env)

    def _client_hello(self, env: Envelope) -> bool:
        """Whether `env` is a client's Hello("client"), the one Hello a client may send (it
        takes its outputs in StepOutputs)."""
        msg = env.msg
        return env.channel is self.frontend and isinstance(msg, Hello) and msg.name == "client"

    # --- clients ------------------------------------------------------------------------------

    async def _fail(self, env: Envelope, request_id: int, text: str, prompt_len: int = 0) -> None:
        out = RequestOutput(request_id, NO_TOKENS, True, FinishReason.ERROR, text, prompt_len, 0)
        await env.reply(out)

    async def on_submit(self, env: Envelope, msg: SubmitRequest) -> None:
        prompt = msg.prompt_token_ids  # int32[P]: the codec checked dtype and rank
        problems = msg.problems()
        if self.control is not None and self.control.command == ControlCommand.STOP:
            # The engines are aborting everything and exiting: a request forwarded now could
            # be lost without its terminal output.
            problems.append("the runtime is stopping")
        if problems:
            await self._fail(env, msg.request_id, "; ".join(problems), int(prompt.size))
            return
        block_size = self.block_size if self.hashing else 0
        hashes, salt = routing_hashes(
            prompt, msg.block_hashes, msg.hash_salt, block_size, self.weight_version
        )
        try:
            gid, rank = self.core.admit(env.sender, msg.request_id, hashes.tolist())
        except (ValueError, NoRankError) as e:
            await self._fail(env, msg.request_id, str(e), len(prompt))
            return
        # While PAUSED or SUSPENDED the engine queues it until UNPAUSE. The engine checks the
        # hashes against the tokens before it caches anything under them.
        out = EngineSubmit(gid, prompt, msg.sampling, msg.stream, env.time, hashes, salt)
        await self.backend.send(out, to=self.engines[rank])

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        found = self.core.lookup(env.sender, msg.request_id)
        if found is not None:
            gid, route = found
            await self.backend.send(AbortRequest(gid), to=self.engines[route.rank])

    async def on_get_info(self, env: Envelope, msg: GetModelInfo) -> None:
        if self._ready():
            await env.reply(self.info)
        elif self.load_error is not None:
            await env.reply(ErrorReply(ErrorCode.LOAD_FAILED, self.load_error, None))
        else:
            self.info_waiters.append(env.sender)

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        # A client checking that we are alive, or a live engine (an engine on another host
        # watches the coordinator by these answers: actors/engine/actor.py).
        if env.channel is self.frontend or env.sender in self.engine_heard:
            await env.reply(Heartbeat(time.time()))

    async def on_peer_gone(self, env: Envelope, msg: PeerGone) -> None:
        if env.channel is self.backend:
            await self._engine_gone(env.sender, msg.reason)
            return
        # A client vanished: abort its requests so that their blocks come back. Their terminal
        # outputs still come through on_step_outputs (and are dropped by the socket).
        routes = self.core.routes_of_client(env.sender)
        self.batch_clients.discard(env.sender)
        self.stats_waiters = [c for c in self.stats_waiters if c != env.sender]
        if routes:
            self.log.info("client gone: aborting its requests", requests=len(routes))
        for gid, route in routes:
            await self.backend.send(AbortRequest(gid), to=self.engines[route.rank])

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        """Ask every engine for fresh stats; answer with every rank's latest once they have
        answered (or after `stats_timeout`). A client asking while a query is out shares it."""
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
            await self.frontend.send(Stats(self.fsm.state, ranks), to=client)

    async def on_stats(self, env: Envelope, msg: Stats) -> None:
        """An engine's report: periodic (logging_step_interval) or the answer to GetStats."""
        sender = self._rank_of(env.sender)
        for rank in msg.ranks:
            if rank.rank == sender:  # an engine reports itself only (never a dead rank)
                self.rank_stats[rank.rank] = rank
        self._stats_answered_by(env.sender)

    def _stats_answered_by(self, engine: bytes) -> None:
        self.stats_pending.discard(engine)
        if not self.stats_pending:
            self.stats_answered.set()

    # --- lifecycle control --------------------------------------------------------------------

    async def on_control(self, env: Envelope, msg) -> None:
        """A client's Pause/Unpause/Suspend/Resume/UpdateWeights/Stop: check the token, the
        fields and the FSM, forward to every engine, leave the answer to `_complete_control`."""
        command = CONTROL_MESSAGES[type(msg)]
        sender = _peer_name(env.sender)
        refusal = self._refusal(command, msg)
        if refusal is not None:
            code, text = refusal
            log = self.log.warning if code is ErrorCode.NOT_AUTHORIZED else self.log.info
            log("control refused", command=str(command), sender=sender, outcome=code, why=text)
            await env.reply(ErrorReply(code, text, None))
            return
        self.log.info("control", command=str(command), sender=sender, state=str(self.fsm.state))
        self.control = ControlRound(command, env.sender, set(self.engines.values()))
        self.control_answered.clear()
        # The round and its timeout exist before the first send: an engine may answer before
        # the last send, and a failed send must not leave the round open (every later one busy).
        self.spawn(self._complete_control(self.control))
        forwarded = dataclasses.replace(msg, token="")  # engine sockets are private
        for identity in list(self.engines.values()):
            await self.backend.send(forwarded, to=identity)

    def _refusal(self, command: ControlCommand, msg) -> tuple[ErrorCode, str] | None:
        """(code, text) when the coordinator must refuse this control now, else None."""
        if not msg.token or not hmac.compare_digest(msg.token.encode(), self.control_token):
            return ErrorCode.NOT_AUTHORIZED, NOT_AUTHORIZED.format(command=command)
        if isinstance(msg, UpdateWeights):
            if (msg.path is None) == (msg.state is None):
                return ErrorCode.BAD_REQUEST, "update_weights needs exactly one of path and state"
            if not self.engines:
                return ErrorCode.BAD_REQUEST, "no engine is connected to load the weights"
        try:
            self.fsm.check(command)
        except IllegalTransition as e:
            return ErrorCode.ILLEGAL_TRANSITION, str(e)
        if self.control is not None:
            return ErrorCode.BUSY, (
                f"{command} refused: {self.control.command} is still waiting for the engines; "
                "send it again once that one is answered"
            )
        return None

    async def _complete_control(self, round_: ControlRound) -> None:
        """Wait for every engine's answer (or the timeout), then move the FSM and reply."""
        stopping = round_.command == ControlCommand.STOP
        timeout = self.stop_timeout if stopping else self.control_timeout
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
            self.log.exception("could not answer a control", command=str(round_.command))
        if round_.command == ControlCommand.STOP:
            self.stop()  # stop means exit, even when an engine did not acknowledge it

    def _outcome(self, round_: ControlRound) -> ControlAck | ErrorReply:
        command, sender = str(round_.command), _peer_name(round_.client)
        if not round_.ok:
            text = f"{command} failed; the state stays {self.fsm.state}: "
            text += "; ".join(round_.errors)
            if round_.command == ControlCommand.STOP:
                text += " (the coordinator exits anyway)"
            self.log.warning("control failed", command=command, sender=sender, errors=round_.errors)
            return ErrorReply(ErrorCode.CONTROL_FAILED, text, None)
        versions = set(round_.weight_versions)
        if len(versions) > 1:
            self.log.warning("engines disagree on the weight version", versions=sorted(versions))
        self.weight_version = max(versions, default=self.weight_version)
        if self.info is not None and self.info.weight_version != self.weight_version:
            self.info = dataclasses.replace(self.info, weight_version=self.weight_version)
        state = self.fsm.apply(round_.command)
        self.log.info("control done", command=command, sender=sender, state=str(state))
        return ControlAck(round_.command, state, self.weight_version)

    def _engine_answered(
        self, env: Envelope, command: ControlCommand, *, error=None, weight_version=None
    ) -> bool:
        """Record an engine's answer to the round in flight; False if it answers nothing."""
        round_ = self.control
        if round_ is None or round_.command != command:
            return False
        name = self._engine_name(env.sender)
        if not round_.answer(env.sender, name, error=error, weight_version=weight_version):
            return False
        if round_.done:
            self.control_answered.set()
        return True

    def _engine_name(self, identity: bytes | None) -> str:
        rank = self._rank_of(identity)
        return f"engine {rank}" if rank is not None else f"engine {identity!r}"

    def _rank_of(self, identity: bytes | None) -> int | None:
        return next((r for r, i in self.engines.items() if i == identity), None)

    async def on_control_ack(self, env: Envelope, msg: ControlAck) -> None:
        if not self._engine_answered(env, msg.command, weight_version=msg.weight_version):
            self.log.warning("stray control ack", command=str(msg.command), state=str(msg.state))

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        if not self._engine_answered(env, ControlCommand.STOP):
            self.log.warning("stray stop ack", name=msg.name)

    # --- engines ------------------------------------------------------------------------------

    async def on_hello(self, env: Envelope, msg: Hello) -> None:
        if env.channel is self.frontend:  # a client: it takes its outputs in StepOutputs
            self.batch_clients.add(env.sender)
            return
        if msg.name == "engine":
            refusal = self.core.rank_refusal(msg.rank, env.sender, self.engines, self.num_ranks)
            if refusal is not None:
                self.log.error("engine refused", rank=msg.rank, why=refusal)
                await env.reply(ErrorReply(ErrorCode.RANK_REFUSED, refusal, None))
                return
            self.engines[msg.rank] = env.sender
            self.engine_heard[env.sender] = env.time
            if self.fsm.state is not State.RUNNING:
                # Engines start RUNNING; a late joiner is not brought into the current state.
                self.log.warning("engine joined while not running", state=str(self.fsm.state))

    async def on_model_loaded(self, env: Envelope, msg: ModelLoaded) -> None:
        rank = self._rank_of(env.sender)
        if rank is None:
            return
        if self.info is not None and msg.block_size != self.block_size:
            why = (
                f"its block size {msg.block_size} differs from the runtime's {self.block_size} "
                "(every rank must run the same config)"
            )
            await env.reply(ErrorReply(ErrorCode.RANK_REFUSED, why, None))
            await self._engine_gone(env.sender, why)
            return
        self.core.add_rank(rank)
        self.log.info(
            "engine ready",
            rank=rank,
            kv_blocks=msg.num_blocks,
            kv_tokens=msg.num_blocks * msg.block_size,
            kv_bytes=msg.num_blocks * msg.block_bytes,
        )
        self.loaded.add(rank)
        if self.info is None:
            self.block_size = msg.block_size
            self.info = ModelInfo(
                self.model_name,
                msg.tokenizer,
                self.max_sequence_length,
                self.num_ranks,
                msg.num_blocks * msg.block_size,
                msg.num_blocks * msg.block_bytes,
                msg.block_size,
                self.prefix_caching,
                self.weight_version,
            )
        if self._ready():
            await self._flush_info_waiters(self.info)

    def _ready(self) -> bool:
        """Whether the runtime serves: every one of `num_ranks` ranks has loaded its model (as
        vLLM, a data-parallel runtime starts whole or not at all) and none failed to."""
        return self.load_error is None and len(self.loaded) >= self.num_ranks

    async def on_prefix_events(self, env: Envelope, msg: PrefixEvents) -> None:
        rank = self._rank_of(env.sender)
        if rank is None or rank not in self.engines:
            return
        try:
            self.core.table.apply(rank, msg.added.tolist(), msg.evicted.tolist())
        except RoutingError as e:
            # The table can no longer be trusted for this rank: forget it rather than route by
            # hashes the rank may not hold (the next events rebuild it from what they add).
            self.log.error("prefix events contradict the routing table", rank=rank, error=str(e))
            self.core.table.drop_rank(rank)

    async def on_engine_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code is ErrorCode.LOAD_FAILED:
            self.load_error = msg.text
            await self._flush_info_waiters(ErrorReply(ErrorCode.LOAD_FAILED, msg.text, None))
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

    async def on_step_outputs(self, env: Envelope, msg: StepOutputs) -> None:
        """Relay an engine step's outputs to the clients that own their requests, in order
        (module docstring: one StepOutputs per batch client, a RequestOutput per output for any
        other). A terminal output forgets its route; an output whose route is gone (its client
        left, or it was already failed) is dropped."""
        problem = msg.problem()
        if problem is not None:
            lost = [(gid, self.core.route_of(gid, True)) for gid in msg.request_ids.tolist()]
            await self._bad_outputs(env, [(g, r) for g, r in lost if r is not None], problem)
            return
        batches: dict[bytes, tuple[list[int], list[int]]] = {}  # client -> (entries, its ids)
        bad: list[tuple[int, Route]] = []
        errors: list[str] = []
        entries = zip(msg.request_ids.tolist(), msg.finished.tolist(), strict=True)
        for i, (gid, finished) in enumerate(entries):
            route = self.core.route_of(gid, finished)
            if route is None:
                continue
            if route.client in self.batch_clients:
                batch = batches.get(route.client)
                if batch is None:
                    batch = batches[route.client] = ([], [])
                batch[0].append(i)
                batch[1].append(route.client_request_id)
                continue
            try:
                frame = msg.relayed(i, route.client_request_id)
            except MessageError as e:
                self.core.route_of(gid, True)  # it ends here, with the error below
                bad.append((gid, route))
                errors.append(str(e))
                continue
            await self.frontend.send_frames([frame], to=route.client)
        for client, (picked, ids) in batches.items():
            outputs = tuple(msg.outputs[i] for i in picked)
            out = StepOutputs(np.array(ids, np.int64), msg.finished[picked], outputs)
            await self.frontend.send(out, to=client)
        if bad:
            await self._bad_outputs(env, bad, "; ".join(errors[:3]))

    async def _bad_outputs(self, env: Envelope, lost: list[tuple[int, Route]], why: str) -> None:
        """An engine sent outputs that cannot be relayed: log it, tell the engine, end each
        request it concerns with an error (its one terminal output; its route is already gone)
        and ask the engine to abort it, so that its blocks come back."""
        engine = self._engine_name(env.sender)
        self.log.error("malformed outputs", engine=engine, requests_failed=len(lost), error=why)
        await self._reply_error(env, ErrorCode.BAD_MESSAGE, f"malformed StepOutputs: {why}")
        text = f"{engine} sent a malformed output for this request: {why}"
        for gid, route in lost:
            out = RequestOutput(
                route.client_request_id, NO_TOKENS, True, FinishReason.ERROR, text[:2000], 0, 0
            )
            await self.frontend.send(out, to=route.client)
            if route.rank in self.engines:
                await self.backend.send(AbortRequest(gid), to=self.engines[route.rank])

    # --- engine liveness ----------------------------------------------------------------------

    async def _watch_engines(self) -> None:
        """Declare dead an engine that has sent nothing for `engine_timeout` seconds."""
        while True:
            await asyncio.sleep(self.engine_timeout / 4)
            now = time.time()
            silent = [
                i for i in self.engines.values() if now - self.engine_heard[i] > self.engine_timeout
            ]
            for identity in silent:
                await self._engine_gone(identity, f"sent nothing for {self.engine_timeout:g} s")

    async def _engine_gone(self, identity: bytes, reason: str) -> None:
        """Forget a dead engine rank and fail every request that was on it (each gets its one
        terminal output, naming the rank); a control or stats query stops waiting for it."""
        rank = self._rank_of(identity)
        if rank is None:
            return
        self.backend.record_only(RankGone(rank, reason))  # for replay: timeouts are in no log
        del self.engines[rank]
        self.engine_heard.pop(identity, None)
        self.rank_stats[rank] = self._dead_stats(rank, reason)
        lost = self.core.remove_rank(rank, f"died: {reason}")
        stopping = self.control is not None and self.control.command == ControlCommand.STOP
        if stopping and not lost:  # it acknowledged STOP (or is about to) and exited
            self.log.info("engine rank exited", rank=rank, reason=reason)
        else:
            self.log.error("engine rank died", rank=rank, reason=reason, requests_lost=len(lost))
        round_ = self.control
        if round_ is not None and round_.answer(identity, f"engine {rank}", error=reason):
            if round_.done:
                self.control_answered.set()
        if identity in self.stats_pending:
            self._stats_answered_by(identity)
        text = f"engine rank {rank} died ({reason}); the request was lost with it"
        for _, route in lost:
            out = RequestOutput(
                route.client_request_id, NO_TOKENS, True, FinishReason.ERROR, text, 0, 0
            )
            await self.frontend.send(out, to=route.client)
        if not self._ready() and self.load_error is None:
            # A runtime starts whole or not at all: one rank dead before every rank is up fails
            # the start (the launcher reports it).
            self.load_error = f"engine rank {rank} died before the runtime was ready ({reason})"
            await self._flush_info_waiters(ErrorReply(ErrorCode.LOAD_FAILED, self.load_error, None))

    def _dead_stats(self, rank: int, reason: str) -> RankStats:
        """A dead rank as `Stats` shows it: its last cumulative counters, nothing running or
        held (its memory is gone), `alive` False with the reason."""
        last = self.rank_stats.get(rank) or RankStats(
            rank, self.fsm.state, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, self.weight_version
        )
        gone = dict.fromkeys(DEAD_RANK_ZEROS, 0)
        return dataclasses.replace(last, **gone, alive=False, dead_reason=reason[:500])


def _peer_name(identity: bytes | None) -> str:
    """A routing identity as a log field: printable ASCII as is, else hex."""
    if identity is None:
        return "-"
    if identity.isascii() and identity.decode("ascii").isprintable():
        return identity.decode("ascii")
    return identity.hex()
