"""A tensor-parallel follower: a gpu actor that takes its leader's published messages instead
of an engine's (actors/gpu/peers.py has the protocol).

It serves the SUB channel from its leader, runs every LoadModel, StepPlan and GpuControl
through the very pipeline of the leader's gpu actor (same launch/collect order, so the same
collectives), on its own device (the LoadModel's device is the leader's: the follower swaps in
its own), and answers only loads and controls, with a PeerOutcome on its PUSH channel. Step
results are dropped: the leader's are the rank's (every peer holds the same gathered logits).
"""

from __future__ import annotations

import dataclasses

from taipan.actors.channel import Channel, Envelope
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.peers import TPSetup, hello, outcome_of
from taipan.messages.gpu import LoadModel, PeerOutcome


class FollowerActor(GpuActor):
    def __init__(
        self, rank: int, plans: Channel, reports: Channel, tp: TPSetup, device: str
    ) -> None:
        super().__init__(rank, plans, tp=tp, name=f"gpu-{rank}-tp{tp.tp_rank}")
        self.reports = reports
        self.device = device
        self.answered = 0  # loads and controls taken (PeerOutcome.index)

    async def started(self) -> None:
        await super().started()
        await self.reports.send(hello(self.tp_setup.tp_rank))

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        await self.launched.join()
        error = None
        try:
            await self._in_thread(self._load, dataclasses.replace(msg, device=self.device))
        except Exception as e:
            error = str(e)
        else:
            await self._bind_threads()
        await self._report("load", error)

    async def _answer(self, env: Envelope, reply) -> None:
        outcome = outcome_of(reply)
        if outcome is not None:  # a step's result is dropped: the leader answers for the rank
            await self._report(*outcome)

    async def _report(self, command: str, error: str | None) -> None:
        self.answered += 1
        if error is not None:
            self.log.error("failed", command=command, error=error)
        await self.reports.send(PeerOutcome(self.tp_setup.tp_rank, self.answered, command, error))
