"""A tensor-parallel follower: a gpu actor that takes its leader's published messages instead
of an engine's (actors/gpu/peers.py has the protocol).

It serves the SUB channel from its leader, runs every LoadModel, StepPlan and GpuControl
through the very pipeline of the leader's gpu actor (same launch/collect order, so the same
collectives), on its own device and model files (the LoadModel's are the leader's: the follower
swaps in its own, which on another host may live elsewhere), and answers only loads and
controls, with a PeerOutcome on its DEALER to the leader. Step results are dropped: the
leader's are the rank's (every peer holds the same gathered logits).

Its DEALER watches the leader: a `PeerBye` there ends the follower cleanly (once its launched
steps are done); the connection closing without one, or no LoadModel within `leader_timeout`
seconds of the start (a leader that never comes), ends it with PeerGoneError (non-zero exit).
"""

from __future__ import annotations

import asyncio
import dataclasses

from taipan.actors.channel import Channel, Envelope
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.peers import PEER_GONE_GRACE_S, PeerGoneError, TPSetup, hello, outcome_of
from taipan.messages.common import PeerGone
from taipan.messages.gpu import LoadModel, PeerBye, PeerOutcome

LEADER_TIMEOUT_S = 600.0  # a follower whose leader sends no LoadModel within this gives up


class FollowerActor(GpuActor):
    def __init__(
        self,
        rank: int,
        plans: Channel,
        reports: Channel,
        tp: TPSetup,
        device: str,
        model: str,
        *,
        leader_timeout: float = LEADER_TIMEOUT_S,
    ) -> None:
        super().__init__(rank, plans, tp=tp, name=f"gpu-{rank}-tp{tp.tp_rank}")
        self.reports = reports
        self.device, self.model = device, model
        self.leader_timeout = leader_timeout
        self.answered = 0  # loads and controls taken (PeerOutcome.index)
        self.loading = asyncio.Event()  # the leader's first LoadModel came
        self.lost: str | None = None  # why the leader is gone
        self.lost_event = asyncio.Event()
        self.serve(reports)  # the leader's goodbye, and its connection's end
        self.on(PeerBye, self.on_bye)
        self.on(PeerGone, self.on_leader_gone)

    async def started(self) -> None:
        await super().started()
        await self.reports.send(hello(self.tp_setup.tp_rank))
        self.spawn(self._await_leader())

    async def _await_leader(self) -> None:
        try:
            await asyncio.wait_for(self.loading.wait(), self.leader_timeout)
        except TimeoutError:
            raise PeerGoneError(
                f"{self.name}: the leader sent no LoadModel within {self.leader_timeout:g} s "
                "(is its engine running, with this --tp-address and keys?)"
            ) from None

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        self.loading.set()
        await self.launched.join()
        error = None
        try:
            own = dataclasses.replace(msg, device=self.device, model=self.model)
            await self._in_thread(self._load, own)
        except Exception as e:
            error = str(e)
        else:
            await self._bind_threads()
        await self._report("load", error)

    async def on_bye(self, env: Envelope, msg: PeerBye) -> None:
        self.log.info("the leader stops: leaving", reason=msg.reason)
        self.lost = ""  # its connection's end is expected now
        await self.launched.join()
        self.stop()

    async def on_leader_gone(self, env: Envelope, msg: PeerGone) -> None:
        if self.lost is not None:
            return
        self.lost = (
            f"the connection to the leader closed without a goodbye ({msg.reason}: its process "
            "ended or its host is unreachable, or it refused this follower's keys)"
        )
        self.lost_event.set()
        self._fatal(self.lost, PeerGoneError)

    async def _peer_lost(self) -> str | None:
        try:
            await asyncio.wait_for(self.lost_event.wait(), PEER_GONE_GRACE_S)
        except TimeoutError:
            return None
        return self.lost

    async def _answer(self, env: Envelope, reply) -> None:
        outcome = outcome_of(reply)
        if outcome is not None:  # a step's result is dropped: the leader answers for the rank
            await self._report(*outcome)

    async def _report(self, command: str, error: str | None) -> None:
        self.answered += 1
        if error is not None:
            self.log.error("failed", command=command, error=error)
        await self.reports.send(PeerOutcome(self.tp_setup.tp_rank, self.answered, command, error))
