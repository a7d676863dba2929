"""The coordinator actor: clients on one ROUTER, engines on another.

Validates submissions, assigns global ids, routes to a rank, relays outputs back, answers
model-info queries once a rank has loaded its model, and fans STOP out to every engine. A bad
submission gets a terminal `RequestOutput` with finish_reason "error"; a malformed frame gets an
`ErrorReply` (runtime/actor.py); the coordinator keeps serving.
"""

from __future__ import annotations

import asyncio

import numpy as np

from actors.coordinator.core import CoordinatorCore, NoRankError
from messages.common import ErrorReply, Hello
from messages.gpu import ModelLoaded
from messages.lifecycle import Stop, StopAck
from messages.requests import (
    AbortRequest,
    EngineSubmit,
    GetModelInfo,
    ModelInfo,
    RequestOutput,
    SubmitRequest,
)
from runtime.actor import Actor
from runtime.channel import Channel, Envelope

NO_TOKENS = np.zeros(0, dtype=np.int32)
STOP_TIMEOUT_S = 30.0


class CoordinatorActor(Actor):
    def __init__(
        self,
        frontend: Channel,
        backend: Channel,
        num_ranks: int,
        model_name: str,
        max_sequence_length: int,
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
        self.acks: set[str] = set()
        self.all_acked = asyncio.Event()
        self.serve(frontend)
        self.serve(backend)
        for msg_type, handler in [
            (SubmitRequest, self.on_submit),
            (AbortRequest, self.on_abort),
            (GetModelInfo, self.on_get_info),
            (Stop, self.on_stop),
            (Hello, self.on_hello),
            (ModelLoaded, self.on_model_loaded),
            (RequestOutput, self.on_output),
            (StopAck, self.on_stop_ack),
            (ErrorReply, self.on_engine_error),
        ]:
            self.on(msg_type, handler)

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
        if problems:
            await self._fail(env, msg.request_id, "; ".join(problems), int(prompt.size))
            return
        try:
            gid, rank = self.core.admit(env.sender, msg.request_id)
        except (ValueError, NoRankError) as e:
            await self._fail(env, msg.request_id, str(e), len(prompt))
            return
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

    async def on_stop(self, env: Envelope, msg: Stop) -> None:
        self.log.info("stopping", reason=msg.reason, engines=len(self.engines))
        for identity in self.engines.values():
            await self.backend.send(Stop(msg.reason), to=identity)
        if self.engines:
            try:
                await asyncio.wait_for(self.all_acked.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                self.log.warning("engines did not acknowledge stop", acked=sorted(self.acks))
        await env.reply(StopAck("coordinator"))
        self.stop()

    # --- engines ------------------------------------------------------------------------------

    async def on_hello(self, env: Envelope, msg: Hello) -> None:
        if env.channel is self.backend and msg.name == "engine":
            self.engines[msg.rank] = env.sender

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
        else:
            self.log.warning("error reply", code=msg.code, text=msg.text)

    async def _flush_info_waiters(self, reply) -> None:
        waiters, self.info_waiters = self.info_waiters, []
        for client in waiters:
            await self.frontend.send(reply, to=client)

    async def on_output(self, env: Envelope, msg: RequestOutput) -> None:
        route = self.core.route_of(msg.request_id, msg.finished)
        if route is None:
            return
        relayed = RequestOutput(
            route.client_request_id,
            msg.new_token_ids,
            msg.finished,
            msg.finish_reason,
            msg.error,
            msg.num_prompt_tokens,
            msg.num_generated_tokens,
        )
        await self.frontend.send(relayed, to=route.client)

    async def on_stop_ack(self, env: Envelope, msg: StopAck) -> None:
        self.acks.add(msg.name)
        if len(self.acks) >= len(self.engines):
            self.all_acked.set()
