"""How the coordinator splits one engine step's `StepOutputs` among its clients: routed by the
arrays alone (`request_ids`, `finished`), in entry order, every terminal output forgetting its
route. The coordinator actor sends what `relay_outputs` returns; the replay check
(actors/coordinator/check.py) calls the same function, so a route ends at the same entry in both.

A client that said `Hello("client")` (a "batch client": actors/client/actor.py) gets one
StepOutputs per engine step holding its entries, under its own request ids, each output frame
as the engine encoded it: per entry the coordinator touches no byte, and sends one message per
client per step, not one per request (tests/perf/NOTES.md, "Coordinator relay capacity"). Any
other client gets each output as a RequestOutput of its own, renumbered (`StepOutputs.relayed`,
which checks the frame). An entry that cannot be relayed, or a StepOutputs whose arrays differ
in length, is `lost`: its route is gone and the actor fails the request and aborts it.

Pure: no sockets; the core's routes are the only state it changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.actors.coordinator.core import CoordinatorCore, Route
from taipan.messages.codec import MessageError
from taipan.messages.requests import StepOutputs


@dataclasses.dataclass
class Relay:
    """What one engine StepOutputs becomes, in the order the actor sends it."""

    singles: list[tuple[bytes, bytes]]  # (client, RequestOutput frame) for other clients
    batches: list[tuple[bytes, StepOutputs]]  # (batch client, its entries)
    lost: list[tuple[int, Route]]  # (global id, route) of entries that cannot be relayed
    why: str = ""  # what was wrong with them


def relay_outputs(msg: StepOutputs, core: CoordinatorCore, batch_clients: set[bytes]) -> Relay:
    """Split `msg` by client. An output whose route is gone (its client left, or it was already
    failed) is dropped."""
    problem = msg.problem()
    if problem is not None:
        lost = [(gid, core.route_of(gid, True)) for gid in msg.request_ids.tolist()]
        return Relay([], [], [(g, r) for g, r in lost if r is not None], problem)
    relay = Relay([], [], [])
    batches: dict[bytes, tuple[list[int], list[int]]] = {}  # client -> (entries, its ids)
    errors: list[str] = []
    entries = zip(msg.request_ids.tolist(), msg.finished.tolist(), strict=True)
    for i, (gid, finished) in enumerate(entries):
        route = core.route_of(gid, finished)
        if route is None:
            continue
        if route.client in batch_clients:
            picked, ids = batches.setdefault(route.client, ([], []))
            picked.append(i)
            ids.append(route.client_request_id)
            continue
        try:
            relay.singles.append((route.client, msg.relayed(i, route.client_request_id)))
        except MessageError as e:
            core.route_of(gid, True)  # it ends here, with the error the actor sends
            relay.lost.append((gid, route))
            errors.append(str(e))
    for client, (picked, ids) in batches.items():
        outputs = tuple(msg.outputs[i] for i in picked)
        relay.batches.append(
            (client, StepOutputs(np.array(ids, np.int64), msg.finished[picked], outputs))
        )
    relay.why = "; ".join(errors[:3])
    return relay
