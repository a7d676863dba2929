"""The direct client actor: a client that is its engine rank's coordinator (direct mode,
`use_coordinator=False` in runtime/llm.py; the seed's "direct mode").

It binds the endpoint one engine rank connects to (a ROUTER that watches its peer) and speaks the
coordinator's side of the engine protocol for that rank alone, through the same
`EngineLinks` the coordinator uses (actors/engine_link.py): it takes the engine's Hello,
Heartbeats and ModelLoaded (and answers the ModelInfo a coordinator would), sends `EngineSubmit`
and `AbortRequest` under this client's own request ids, splits each `StepOutputs` into its
requests' queues, and asks for stats. One hop less per message than through a coordinator
process. What the coordinator would own is absent: routing (there is one rank) and the lifecycle
(`control` raises RuntimeError naming the mode); `stop_engine` only ends the engine when its
owner shuts down.

Liveness, as the coordinator watches an engine: the engine heartbeats every second, so once it
has said Hello, `timeout` seconds of silence (or its connection closing, or its process exiting:
`pid`) end every request with finish_reason "error" and fail every waiting call with
`RuntimeUnreachable`; nothing more is sent to it. Before its Hello the engine is importing and
loading, and only the caller's `connect_timeout` and the process watch bound the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from taipan.actors.channel import Channel, Envelope
from taipan.actors.client.actor import ClientActor, RuntimeUnreachable
from taipan.actors.engine_link import (
    ENGINE_TIMEOUT_S,
    EngineLinks,
    ServedModel,
    watch_process,
    watch_silence,
)
from taipan.messages.codec import decode
from taipan.messages.common import ErrorReply, Heartbeat, Hello, PeerGone
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import CONTROL_MESSAGES, ControlAck, Stop, StopAck
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    FinishReason,
    ModelInfo,
    RequestOutput,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, PrefixEvents, Stats


@dataclasses.dataclass(frozen=True)
class DirectEndpoint:
    """What a direct client needs beyond the address it binds: what a coordinator would tell
    its clients (`model_name`, `max_sequence_length`, `prefix_caching`) and the engine process
    to watch (`pid`, None: watch only its connection and heartbeats)."""

    model_name: str
    max_sequence_length: int
    prefix_caching: bool = False
    pid: int | None = None
    rank: int = 0


class DirectActor(ClientActor):
    def __init__(
        self, channel: Channel, endpoint: DirectEndpoint, *, timeout: float = ENGINE_TIMEOUT_S
    ):
        super().__init__(channel, address=f"engine rank {endpoint.rank}", timeout=timeout)
        self.endpoint = endpoint
        ep = endpoint
        served = ServedModel(ep.model_name, ep.max_sequence_length, 1, ep.prefix_caching)
        self.links = EngineLinks(served, timeout)
        self.engine: bytes | None = None  # its identity, from its first message
        self.gone: str | None = None  # why the engine is gone, once it is
        self.stop_acked = asyncio.Event()
        for msg_type, handler in [
            (Hello, self.on_hello),
            (ModelLoaded, self.on_model_loaded),
            (PeerGone, self.on_peer_gone),
            (PrefixEvents, self.on_ignored),  # routing tables are a coordinator's business
            (StopAck, self.on_stop_ack),
        ]:
            self.on(msg_type, handler)

    async def started(self) -> None:
        await super().started()
        if self.endpoint.pid is not None:
            self.spawn(self._watch_process(self.endpoint.pid))

    async def dispatch(self, env: Envelope) -> None:
        if self.engine is None and env.sender is not None and env.msg is not None:
            self.engine = env.sender
        elif env.sender != self.engine and env.sender is not None:
            self.log.warning("a second peer on a direct endpoint: ignored", peer=env.sender.hex())
            return
        self.links.heard(env.sender, env.time)
        await super().dispatch(env)

    async def _to_engine(self, msg) -> None:
        if self.engine is not None and self.gone is None:
            await self.channel.send(msg, to=self.engine)

    # --- calls (the coordinator's side of the protocol) ---------------------------------------

    def _refusal(self, msg: SubmitRequest) -> str | None:
        if self.gone is not None:
            return self.gone
        problems = msg.problems()  # the coordinator's checks: no coordinator makes them here
        if self.engine is None:
            problems.append("the engine has not connected yet")
        return "; ".join(problems) or None

    async def _send_submit(self, msg: SubmitRequest) -> None:
        # Under this client's own request id: there is no other numbering to map it to.
        prompt, hashes, salt = msg.prompt_token_ids, msg.block_hashes, msg.hash_salt
        now = time.time()
        await self._to_engine(
            EngineSubmit(msg.request_id, prompt, msg.sampling, msg.stream, now, hashes, salt)
        )

    async def _send_abort(self, request_id: int) -> None:
        await self._to_engine(AbortRequest(request_id))

    def _output_source(self) -> str:
        return f"engine rank {self.endpoint.rank}"

    async def model_info(self) -> ModelInfo:
        """As a coordinator answers GetModelInfo: once the rank has loaded its model."""
        if self.links.ready:
            return self.links.info
        if self.gone is not None:
            raise RuntimeUnreachable(self.gone)
        if self.links.load_error is not None:
            raise RuntimeError(f"model load failed: {self.links.load_error}")
        fut = asyncio.get_running_loop().create_future()
        self.info_waiters.append(fut)  # answered by the engine's ModelLoaded
        return await fut

    async def stats(self, fresh: bool = True) -> Stats:
        """The engine's stats (it always answers at once: `fresh` changes nothing here)."""
        if self.gone is not None:
            raise RuntimeUnreachable(self.gone)
        fut = asyncio.get_running_loop().create_future()
        self._expect_answer()
        self.stats_waiters.append(fut)
        await self._to_engine(GetStats())
        return await fut

    async def control(self, msg, on_sent=None) -> ControlAck:
        command = CONTROL_MESSAGES[type(msg)]
        raise RuntimeError(
            f"{command} is a lifecycle command, and in direct mode (use_coordinator=False) no "
            "coordinator owns the lifecycle; use coordinator mode for pause, unpause, suspend, "
            "resume and update_weights"
        )

    async def stop_engine(self, reason: str, timeout: float) -> bool:
        """Tell the engine to abort everything and exit (its owner is shutting down); True once
        it acknowledged within `timeout` seconds."""
        if self.engine is None or self.gone is not None:
            return False
        await self._to_engine(Stop("", reason))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_acked.wait(), timeout)
        return self.stop_acked.is_set()

    # --- liveness -----------------------------------------------------------------------------

    async def _watch_server(self) -> None:
        """Heartbeats come from the engine unasked: watch for their absence as the coordinator
        does (from the engine's Hello: before it, it imports and loads)."""
        await watch_silence(self.links, self._engine_silent)

    async def _engine_silent(self, identity: bytes, silent: float) -> None:
        self.engine_gone(f"sent nothing for {silent:.1f} s (timeout {self.timeout:g} s)")

    async def _watch_process(self, pid: int) -> None:
        reason = await watch_process(pid)
        if reason is not None:
            self.engine_gone(reason)

    def engine_gone(self, reason: str) -> None:
        """The engine is gone: every request ends with an error naming it, every waiting call
        raises, and nothing is sent to it any more."""
        self.links.gone(self.engine)  # nothing more to watch
        if self.gone is not None:
            return
        if self.stop_acked.is_set():  # it exited as told
            self.gone = f"engine rank {self.endpoint.rank} was stopped"
            return
        self.gone = f"engine rank {self.endpoint.rank} died: {reason}"
        self.log.error("engine rank died", rank=self.endpoint.rank, reason=reason)
        self._end_requests(FinishReason.ERROR, self.gone)
        self._resolve(self.info_waiters, RuntimeUnreachable(self.gone))
        self._resolve(self.stats_waiters, RuntimeUnreachable(self.gone))

    # --- inbound (the engine's side) ----------------------------------------------------------

    async def on_hello(self, env: Envelope, msg: Hello) -> None:
        if msg.name != "engine":
            self.log.warning("a Hello from a non-engine peer", name=msg.name)
        self.links.join(self.endpoint.rank, env.sender, env.time)  # its silence counts from now

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        pass  # `dispatch` noted that it is alive

    async def on_ignored(self, env: Envelope, msg) -> None:
        pass

    async def on_peer_gone(self, env: Envelope, msg: PeerGone) -> None:
        self.engine_gone(msg.reason)

    async def on_model_loaded(self, env: Envelope, msg: ModelLoaded) -> None:
        # No weight updates in direct mode: the weight version stays 0.
        refusal = self.links.loaded_model(self.endpoint.rank, msg, 0)
        if refusal is not None:  # a second report, at odds with the first
            self.log.error("model report ignored", why=refusal)
            return
        self._resolve(self.info_waiters, self.links.info)

    async def on_error(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code is ErrorCode.LOAD_FAILED:
            self.links.load_failed(msg.text)
            self._resolve(self.info_waiters, RuntimeError(f"model load failed: {msg.text}"))
            return
        self.log.warning("engine error reply", code=msg.code, text=msg.text)

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        self.stop_acked.set()

    async def greet(self) -> None:
        pass  # the engine speaks first (its Hello)

    def _entry(self, msg: StepOutputs, i: int, request_id: int) -> RequestOutput:
        """Entry i: the engine numbers requests with this client's own ids, so the frame must
        carry `request_id` (StepOutputs.relayed checks it)."""
        return decode([msg.relayed(i, request_id)])
