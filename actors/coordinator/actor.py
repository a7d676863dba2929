"""The coordinator actor: clients on one ROUTER, engines on another; a thin shell over its cores.

Validates submissions, assigns global ids and routes each to a rank (core.py), relays the
engines' outputs back (relay.py: one StepOutputs per engine step per client that said
Hello("client"), a RequestOutput per output for any other), answers model-info queries once the
runtime is ready, merges the ranks' stats (stats.py), and drives the lifecycle (control.py): a
control command from a client that presents the runtime's control token is checked against the
FSM (fsm.py), forwarded to every engine, and answered with one `ControlAck` once every engine has
acknowledged it — or with an `ErrorReply` ("not_authorized", "bad_request",
"illegal_transition", "busy", "control_failed"), leaving the state as it was. Every control is
logged at info with its sender and outcome. One command is in flight at a time; while it waits
for engine answers, submissions and outputs keep flowing (the wait is a task of its own). A
pause that fails on any rank is undone on the others (control.py) before its client hears.

The engines' side (actors/engine_link.py, shared with the direct client): an engine says Hello
with its rank, heartbeats every second and reports ModelLoaded. The runtime is ready (model info
answered) once all `num_ranks` ranks have loaded their model; a rank that dies or fails to load
before that fails the start. Liveness: both ROUTERs watch their peers (actors/channel.py). An
engine whose connection closes, or that sends nothing for `engine_timeout`, is dead: every
request on it ends with finish_reason "error" naming the rank, nothing more is routed to it (the
other ranks keep serving; a request with no live rank is refused at once), and `Stats` shows it
dead. A client whose connection closes has all its requests aborted, so their blocks come back.
A client's Heartbeat is answered with one.

A bad submission gets a terminal `RequestOutput` with finish_reason "error"; a malformed frame
gets an `ErrorReply` (actors/base.py); a malformed output fails its request (the client gets its
terminal output, the engine an abort and a "bad_message" error). The coordinator keeps serving.
After STOP it exits.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.actors.config import HASHING_POLICIES, PrefixCachingCoordinatorPolicy
from taipan.actors.coordinator.control import (
    CONTROL_TIMEOUT_S,
    STOP_TIMEOUT_S,
    ControlRound,
    LifecycleControl,
    holds,
    peer_name,
)
from taipan.actors.coordinator.core import CoordinatorCore, NoRankError, Route, routing_hashes
from taipan.actors.coordinator.fsm import LifecycleFSM, State
from taipan.actors.coordinator.relay import relay_outputs
from taipan.actors.coordinator.routing import RoutingError
from taipan.actors.coordinator.stats import STATS_TIMEOUT_S, StatsBook
from taipan.actors.engine_link import ENGINE_TIMEOUT_S, EngineLinks, ServedModel, watch_silence
from taipan.messages.common import ErrorReply, Heartbeat, Hello, PeerGone, RankGone
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import (
    CONTROL_MESSAGES,
    ControlAck,
    ControlCommand,
    Pause,
    PauseMode,
    StopAck,
    Unpause,
    WeightsDecision,
)
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    FinishReason,
    GetModelInfo,
    RequestOutput,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, PrefixEvents, Stats

NO_TOKENS = np.zeros(0, dtype=np.int32)
# What each side may send; anything else is refused before any handler sees it.
FROM_CLIENTS = frozenset(
    {SubmitRequest, AbortRequest, GetModelInfo, GetStats, Heartbeat, PeerGone, *CONTROL_MESSAGES}
)
FROM_ENGINES = frozenset(
    {Hello, Heartbeat, PeerGone, ModelLoaded, StepOutputs, ControlAck, StopAck, Stats}
    | {ErrorReply, PrefixEvents}
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
        self.fsm = LifecycleFSM()
        self.lifecycle = LifecycleControl(
            self.fsm,
            control_token,
            control_timeout=control_timeout,
            stop_timeout=stop_timeout,
        )
        self.frontend, self.backend = frontend, backend
        served = ServedModel(model_name, max_sequence_length, num_ranks, prefix_caching)
        self.links = EngineLinks(served, engine_timeout)
        self.core = CoordinatorCore(routing_policy, routing_alpha, rank_capacity)
        # Hash prompts here only when the policy reads them or the engines cache by them.
        self.hashing = prefix_caching or self.core.router.policy in HASHING_POLICIES
        self.stats = StatsBook(stats_timeout)
        self.batch_clients: set[bytes] = set()  # clients that take StepOutputs (their Hello)
        self.info_waiters: list[bytes] = []  # clients asking for model info before it is ready
        self.serve(frontend)
        self.serve(backend)
        handlers = {
            SubmitRequest: self.on_submit,
            AbortRequest: self.on_abort,
            GetModelInfo: self.on_get_info,
            GetStats: self.on_get_stats,
            Heartbeat: self.on_heartbeat,
            PeerGone: self.on_peer_gone,
            Hello: self.on_hello,
            ModelLoaded: self.on_model_loaded,
            PrefixEvents: self.on_prefix_events,
            StepOutputs: self.on_step_outputs,
            Stats: self.on_stats,
            ControlAck: self.on_control_ack,
            StopAck: self.on_stop_ack,
            ErrorReply: self.on_engine_error,
        }
        handlers.update(dict.fromkeys(CONTROL_MESSAGES, self.on_control))
        for msg_type, handler in handlers.items():
            self.on(msg_type, handler)

    async def started(self) -> None:
        self.spawn(watch_silence(self.links, self._engine_silent))

    async def dispatch(self, env: Envelope) -> None:
        if env.channel is self.backend:
            self.links.heard(env.sender, env.time)  # any message proves a live engine alive
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

    async def on_submit(self, env: Envelope, msg: SubmitRequest) -> None:
        prompt = msg.prompt_token_ids  # int32[P]: the codec checked dtype and rank
        problems = msg.problems()
        if self.lifecycle.stopping:
            # The engines are aborting everything and exiting: a request forwarded now could
            # be lost without its terminal output.
            problems.append("the runtime is stopping")
        if problems:
            await self._fail(env, msg.request_id, "; ".join(problems), int(prompt.size))
            return
        block_size = self.links.block_size if self.hashing else 0
        version = self.lifecycle.weight_version
        hashes, salt = routing_hashes(prompt, msg.block_hashes, msg.hash_salt, block_size, version)
        try:
            gid, rank = self.core.admit(env.sender, msg.request_id, hashes.tolist())
        except (ValueError, NoRankError) as e:
            await self._fail(env, msg.request_id, str(e), len(prompt))
            return
        # While PAUSED or SUSPENDED the engine queues it until UNPAUSE. The engine checks the
        # hashes against the tokens before it caches anything under them.
        out = EngineSubmit(gid, prompt, msg.sampling, msg.stream, env.time, hashes, salt)
        await self.backend.send(out, to=self.links.engines[rank])

    async def _fail(self, env: Envelope, request_id: int, text: str, prompt_len: int) -> None:
        out = RequestOutput(request_id, NO_TOKENS, True, FinishReason.ERROR, text, prompt_len, 0)
        await env.reply(out)

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        found = self.core.lookup(env.sender, msg.request_id)
        if found is not None:
            gid, route = found
            await self.backend.send(AbortRequest(gid), to=self.links.engines[route.rank])

    async def on_get_info(self, env: Envelope, msg: GetModelInfo) -> None:
        if self.links.ready:
            await env.reply(self.links.info)
        elif self.links.load_error is not None:
            await env.reply(ErrorReply(ErrorCode.LOAD_FAILED, self.links.load_error, None))
        else:
            self.info_waiters.append(env.sender)

    async def _flush_info_waiters(self, reply) -> None:
        waiters, self.info_waiters = self.info_waiters, []
        for client in waiters:
            await self.frontend.send(reply, to=client)

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        # A client checking that we are alive, or a live engine (an engine on another host
        # watches the coordinator by these answers: actors/engine/actor.py).
        if env.channel is self.frontend or self.links.is_live(env.sender):
            await env.reply(Heartbeat(time.time()))

    async def on_peer_gone(self, env: Envelope, msg: PeerGone) -> None:
        if env.channel is self.backend:
            await self._engine_gone(env.sender, msg.reason)
            return
        # A client vanished: abort its requests so that their blocks come back. Their terminal
        # outputs still come through on_step_outputs (and are dropped by the socket).
        routes = self.core.routes_of_client(env.sender)
        self.batch_clients.discard(env.sender)
        self.stats.client_gone(env.sender)
        if routes:
            self.log.info("client gone: aborting its requests", requests=len(routes))
        for gid, route in routes:
            await self.backend.send(AbortRequest(gid), to=self.links.engines[route.rank])

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        """Ask every engine for fresh stats; answer with every rank's latest once they have
        answered (or after the stats timeout). A client asking while a query is out shares it."""
        if not msg.fresh and not self.stats.waiters:
            _, stats = self.stats.answer(self.fsm.state)  # (the latest reports, no query)
            await self.frontend.send(stats, to=env.sender)
            return
        if not self.stats.ask(env.sender):
            return
        engines = list(self.links.engines.values())
        self.stats.query(engines)
        for identity in engines:
            await self.backend.send(GetStats(), to=identity)
        self.spawn(self._complete_stats())

    async def _complete_stats(self) -> None:
        late = await self.stats.wait()
        if late:
            names = sorted(self.links.name(i) for i in late)
            self.log.warning("stats answered from older reports", late=names)
        waiters, stats = self.stats.answer(self.fsm.state)
        for client in waiters:
            await self.frontend.send(stats, to=client)

    # --- lifecycle control --------------------------------------------------------------------

    async def on_control(self, env: Envelope, msg) -> None:
        """A client's Pause/Unpause/Suspend/Resume/UpdateWeights/Stop: check the token, the
        fields and the FSM, forward to every engine, leave the answer to `_complete_control`."""
        command = CONTROL_MESSAGES[type(msg)]
        sender = peer_name(env.sender)
        refusal = self.lifecycle.refusal(command, msg, bool(self.links.engines))
        if refusal is not None:
            code, text = refusal
            log = self.log.warning if code is ErrorCode.NOT_AUTHORIZED else self.log.info
            log("control refused", command=str(command), sender=sender, outcome=code, why=text)
            await env.reply(ErrorReply(code, text, None))
            return
        self.log.info("control", command=str(command), sender=sender, state=str(self.fsm.state))
        engines = list(self.links.engines.values())
        # The round and its timeout exist before the first send: an engine may answer before
        # the last send, and a failed send must not leave the round open (every later one busy).
        timeout, note = None, ""
        if isinstance(msg, Pause):
            timeout = msg.timeout
            if msg.mode == PauseMode.WAIT:
                note = " (pause mode wait: requests that had started were still running)"
        hold = holds(msg, len(engines))
        in_flight = bool(getattr(msg, "in_flight", False))
        round_ = self.lifecycle.open(
            command, env.sender, engines, timeout=timeout, note=note, hold=hold,
            in_flight=in_flight,
        )  # fmt: skip
        self.spawn(self._complete_control(round_))
        forwarded = dataclasses.replace(msg, token="")  # engine sockets are private
        if command is ControlCommand.UPDATE_WEIGHTS:
            forwarded = dataclasses.replace(forwarded, hold=hold)  # (whatever the client said)
        for identity in engines:
            await self.backend.send(forwarded, to=identity)

    async def _complete_control(self, round_: ControlRound) -> None:
        """Wait for every engine's answer (or the timeout), then move the FSM and reply."""
        if round_.hold:
            reply = await self._decide_weights(round_)
        else:
            reply = await self.lifecycle.close(round_, self.links.name, self.log)
        if round_.command == ControlCommand.PAUSE and isinstance(reply, ErrorReply):
            reply = await self._undo_pause(round_, reply)
        self.links.set_weight_version(self.lifecycle.weight_version)
        try:
            await self.frontend.send(reply, to=round_.client)
        except Exception:  # the client is gone or the socket closed: the FSM still moved
            self.log.exception("could not answer a control", command=str(round_.command))
        if round_.command == ControlCommand.STOP:
            self.stop()  # stop means exit, even when an engine did not acknowledge it

    async def _undo_pause(self, failed: ControlRound, reply: ErrorReply) -> ErrorReply:
        """All or none: a pause that failed on some rank (refused there, its engine dead, or
        not done within its timeout) is taken back on every other live rank with an unpause
        (a rank still pausing withdraws its pause), before the client hears of it."""
        undo = self.lifecycle.undo_round(failed, self.links.engines.values())
        if undo is None:
            return reply
        self.log.warning("undoing a failed pause", engines=sorted(map(self.links.name, undo.asked)))
        for identity in sorted(undo.asked):
            await self.backend.send(Unpause(""), to=identity)
        return await self.lifecycle.close_undo(undo, self.links.name, reply, self.log)

    async def _decide_weights(self, staged: ControlRound) -> ControlAck | ErrorReply:
        """All or none over the ranks: once every engine staged a held update, commit it on
        all of them; else drop it wherever it was staged, before the client hears of it."""
        failed = await self.lifecycle.close_staged(staged, self.links.name, self.log)
        commit = failed is None
        decision = self.lifecycle.decision_round(staged, commit, self.links.engines.values())
        if decision is None:  # (nothing was staged anywhere, or every engine that staged it died)
            gone = "update_weights failed: every engine that staged it is gone"
            return failed or ErrorReply(ErrorCode.CONTROL_FAILED, gone, None)
        self.log.info("weights decision", commit=commit, engines=len(decision.asked))
        for identity in sorted(decision.asked):
            await self.backend.send(WeightsDecision("", commit), to=identity)
        if commit:
            return await self.lifecycle.close(decision, self.links.name, self.log)
        undone = "the ranks that had staged the weights dropped them: the old ones stay"
        return await self.lifecycle.close_undo(decision, self.links.name, failed, self.log, undone)

    async def on_control_ack(self, env: Envelope, msg: ControlAck) -> None:
        name, version = self.links.name(env.sender), msg.weight_version
        if not self.lifecycle.answer(env.sender, name, msg.command, weight_version=version):
            self.log.warning("stray control ack", command=str(msg.command), state=str(msg.state))

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        if not self.lifecycle.answer(env.sender, self.links.name(env.sender), ControlCommand.STOP):
            self.log.warning("stray stop ack", name=msg.name)

    # --- engines ------------------------------------------------------------------------------

    async def on_hello(self, env: Envelope, msg: Hello) -> None:
        if env.channel is self.frontend:  # a client: it takes its outputs in StepOutputs
            self.batch_clients.add(env.sender)
            return
        if msg.name != "engine":
            return
        links = self.links
        refusal = self.core.rank_refusal(
            msg.rank, env.sender, links.engines, links.served.num_ranks
        )
        if refusal is not None:
            self.log.error("engine refused", rank=msg.rank, why=refusal)
            await env.reply(ErrorReply(ErrorCode.RANK_REFUSED, refusal, None))
            return
        links.join(msg.rank, env.sender, env.time)
        if self.fsm.state is not State.RUNNING:
            # Engines start RUNNING; a late joiner is not brought into the current state.
            self.log.warning("engine joined while not running", state=str(self.fsm.state))

    async def on_model_loaded(self, env: Envelope, msg: ModelLoaded) -> None:
        rank = self.links.rank_of(env.sender)
        if rank is None:
            return
        refusal = self.links.loaded_model(rank, msg, self.lifecycle.weight_version)
        if refusal is not None:
            await env.reply(ErrorReply(ErrorCode.RANK_REFUSED, refusal, None))
            await self._engine_gone(env.sender, refusal)
            return
        self.core.add_rank(rank)
        self.log.info(
            "engine ready",
            rank=rank,
            kv_blocks=msg.num_blocks,
            kv_tokens=msg.num_blocks * msg.block_size,
            kv_bytes=msg.num_blocks * msg.block_bytes,
        )
        if self.links.ready:
            await self._flush_info_waiters(self.links.info)

    async def on_prefix_events(self, env: Envelope, msg: PrefixEvents) -> None:
        rank = self.links.rank_of(env.sender)
        if rank is None:
            return
        try:
            self.core.table.apply(rank, msg.added.tolist(), msg.evicted.tolist())
        except RoutingError as e:
            # The table can no longer be trusted for this rank: forget it rather than route by
            # hashes the rank may not hold (the next events rebuild it from what they add).
            self.log.error("prefix events contradict the routing table", rank=rank, error=str(e))
            self.core.table.drop_rank(rank)

    async def on_stats(self, env: Envelope, msg: Stats) -> None:
        """An engine's report: periodic (logging_step_interval) or the answer to GetStats."""
        self.stats.report(env.sender, self.links.rank_of(env.sender), msg)

    async def on_engine_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code is ErrorCode.LOAD_FAILED:
            self.links.load_failed(msg.text)
            await self._flush_info_waiters(ErrorReply(ErrorCode.LOAD_FAILED, msg.text, None))
            return
        # An engine that refuses a command answers it with an ErrorReply naming no request.
        round_ = self.lifecycle.round
        if msg.request_id is None and round_ is not None:
            name, error = self.links.name(env.sender), f"{msg.code}: {msg.text}"
            if self.lifecycle.answer(env.sender, name, round_.command, error=error, code=msg.code):
                return
        self.log.warning("error reply", code=msg.code, text=msg.text)

    async def on_step_outputs(self, env: Envelope, msg: StepOutputs) -> None:
        """Relay an engine step's outputs to the clients that own their requests, in order
        (relay.py). A terminal output forgets its route; an output whose route is gone (its
        client left, or it was already failed) is dropped."""
        relay = relay_outputs(msg, self.core, self.batch_clients)
        for client, frame in relay.singles:
            await self.frontend.send_frames([frame], to=client)
        for client, out in relay.batches:
            await self.frontend.send(out, to=client)
        if relay.lost:
            await self._bad_outputs(env, relay.lost, relay.why)

    async def _bad_outputs(self, env: Envelope, lost: list[tuple[int, Route]], why: str) -> None:
        """An engine sent outputs that cannot be relayed: log it, tell the engine, end each
        request it concerns with an error (its one terminal output; its route is already gone)
        and ask the engine to abort it, so that its blocks come back."""
        engine = self.links.name(env.sender)
        self.log.error("malformed outputs", engine=engine, requests_failed=len(lost), error=why)
        await self._reply_error(env, ErrorCode.BAD_MESSAGE, f"malformed StepOutputs: {why}")
        text = f"{engine} sent a malformed output for this request: {why}"
        for gid, route in lost:
            out = RequestOutput(
                route.client_request_id, NO_TOKENS, True, FinishReason.ERROR, text[:2000], 0, 0
            )
            await self.frontend.send(out, to=route.client)
            if route.rank in self.links.engines:
                await self.backend.send(AbortRequest(gid), to=self.links.engines[route.rank])

    # --- engine liveness ----------------------------------------------------------------------

    async def _engine_silent(self, identity: bytes, silent: float) -> None:
        await self._engine_gone(identity, f"sent nothing for {self.links.timeout:g} s")

    async def _engine_gone(self, identity: bytes, reason: str) -> None:
        """Forget a dead engine rank and fail every request that was on it (each gets its one
        terminal output, naming the rank); a control or stats query stops waiting for it."""
        rank = self.links.gone(identity)
        if rank is None:
            return
        self.backend.record_only(RankGone(rank, reason))  # for replay: timeouts are in no log
        version = self.lifecycle.weight_version
        self.stats.rank_died(rank, identity, reason, self.fsm.state, version)
        lost = self.core.remove_rank(rank, f"died: {reason}")
        if self.lifecycle.stopping and not lost:  # it acknowledged STOP (or is about to)
            self.log.info("engine rank exited", rank=rank, reason=reason)
        else:
            self.log.error("engine rank died", rank=rank, reason=reason, requests_lost=len(lost))
        self.lifecycle.answer(identity, f"engine {rank}", error=reason)
        text = f"engine rank {rank} died ({reason}); the request was lost with it"
        for _, route in lost:
            out = RequestOutput(
                route.client_request_id, NO_TOKENS, True, FinishReason.ERROR, text, 0, 0
            )
            await self.frontend.send(out, to=route.client)
        failure = self.links.start_failure(rank, reason)
        if failure is not None:  # the launcher reports it
            await self._flush_info_waiters(ErrorReply(ErrorCode.LOAD_FAILED, failure, None))
