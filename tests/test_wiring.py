"""The wiring table (runtime/wiring.py): every socket of a runtime's processes as data built from
its LaunchSpec, and each process opening its own rows. Nothing is started here."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import zmq

from taipan.actors.local import LocalChannel
from taipan.messages.common import Heartbeat
from taipan.spec import ExpertParallelSpec, LaunchSpec
from taipan.wiring import format_wiring, open_channels, open_process, wiring
from tests.test_launch_spec import a_spec

# Each bind side's partner on the connecting side.
PARTNERS = {"PAIR": "PAIR", "ROUTER": "DEALER", "XPUB": "SUB"}


def tp2_ep2_spec(base: str = "ipc://", **changes) -> LaunchSpec:
    """Two engine ranks in one expert-parallel group, each split over two tensor-parallel peers;
    every address under `base`."""
    tp = [{"plans": f"{base}/p{r}", "reports": f"{base}/r{r}", "init": f"file:///i{r}"}
          for r in range(2)]  # fmt: skip
    ep = ExpertParallelSpec(groups=[[0, 1]], inboxes=[f"{base}/e0", f"{base}/e1"], inits=["g"])
    addresses = dict(frontend=f"{base}/f", backend=f"{base}/b", tp_addresses=tp, expert_parallel=ep)
    return a_spec(**{**addresses, **changes})


RANK_0 = [
    "engine-0 engine-0.coordinator DEALER connect ipc:///b coordinator engine-0-{pid}",
    "engine-0 allocator-0.engine PAIR bind local://allocator-0 engine",
    "engine-0 engine-0.allocator PAIR connect local://allocator-0 allocator",
    "engine-0 gpu-0.engine PAIR bind local://gpu-0 engine",
    "engine-0 engine-0.gpu PAIR connect local://gpu-0 gpu",
    "engine-0 engine-0.ep ROUTER bind ipc:///e0 ep watch",
    "engine-0 engine-0.ep-1 DEALER connect ipc:///e1 ep-1 ep-0",
    "engine-0 gpu-0.plans XPUB bind ipc:///p0 followers unrecorded",
    "engine-0 gpu-0.reports ROUTER bind ipc:///r0 followers watch",
    "tp-follower-0-1 gpu-0-tp1.plans SUB connect ipc:///p0 plans",
    "tp-follower-0-1 gpu-0-tp1.reports DEALER connect ipc:///r0 reports tp-1 watch",
]

RANK_1 = [
    "engine-1 engine-1.coordinator DEALER connect ipc:///b coordinator engine-1-{pid}",
    "engine-1 allocator-1.engine PAIR bind local://allocator-1 engine",
    "engine-1 engine-1.allocator PAIR connect local://allocator-1 allocator",
    "engine-1 gpu-1.engine PAIR bind local://gpu-1 engine",
    "engine-1 engine-1.gpu PAIR connect local://gpu-1 gpu",
    "engine-1 engine-1.ep ROUTER bind ipc:///e1 ep watch",
    "engine-1 engine-1.ep-0 DEALER connect ipc:///e0 ep-0 ep-1",
    "engine-1 gpu-1.plans XPUB bind ipc:///p1 followers unrecorded",
    "engine-1 gpu-1.reports ROUTER bind ipc:///r1 followers watch",
    "tp-follower-1-1 gpu-1-tp1.plans SUB connect ipc:///p1 plans",
    "tp-follower-1-1 gpu-1-tp1.reports DEALER connect ipc:///r1 reports tp-1 watch",
]


def test_the_table_of_a_tp2_ep2_runtime():
    table = format_wiring(wiring(tp2_ep2_spec()))
    print(f"\n{table}")  # pytest -s shows it
    lines = [" ".join(line.split()) for line in table.splitlines()]
    assert lines[0] == "process actor.port kind address channel identity"
    assert lines[1:3] == [
        "coordinator coordinator.frontend ROUTER bind ipc:///f clients watch",
        "coordinator coordinator.backend ROUTER bind ipc:///b engines watch",
    ]
    assert lines[3:14] == RANK_0
    assert lines[14:] == RANK_1


def test_every_connect_finds_one_bind_of_its_kind():
    """Each address is bound once, and every connecting socket is the bound one's partner."""
    for spec in (tp2_ep2_spec(), tp2_ep2_spec(expert_parallel=None, tensor_parallel_size=1)):
        rows = wiring(spec, hybrid=True)
        bound = {w.address: w for w in rows if w.bind}
        assert len(bound) == sum(w.bind for w in rows)
        for w in rows:
            if not w.bind and w.address in bound:
                assert PARTNERS[bound[w.address].kind] == w.kind, w
        # Only the coordinator's engine link leaves the spec's processes (it binds it itself).
        assert {w.address for w in rows if not w.bind} <= set(bound)


def test_what_each_size_adds():
    """A hybrid model adds a mamba_cache actor per rank; without tensor or expert parallelism
    a rank is its engine's link and two in-process pairs; a coordinator alone (the relay bench's
    spec) still gets its table."""
    plain = wiring(tp2_ep2_spec(expert_parallel=None, tensor_parallel_size=1))
    assert [w.process for w in plain] == ["coordinator"] * 2 + ["engine-0"] * 5 + ["engine-1"] * 5
    hybrid = wiring(tp2_ep2_spec(expert_parallel=None, tensor_parallel_size=1), hybrid=True)
    mamba = [w for w in hybrid if "mamba_cache" in w.actor + w.port]
    assert [(w.actor, w.port, w.bind) for w in mamba[:2]] == [
        ("mamba_cache-0", "engine", True),
        ("engine-0", "mamba_cache", False),
    ]
    alone = LaunchSpec.for_coordinator("ipc:///f", "ipc:///b", 3, "m", a_spec().config, "/t")
    assert {w.process for w in wiring(alone)} == {"coordinator", "engine-0", "engine-1", "engine-2"}


def test_moving_an_actor_is_a_change_of_rows(tmp_path):
    """allocator-0 moved to a process of its own: its rows name that process and an ipc
    address instead of local, and the engine reaches it there with no other change."""
    spec, address = tp2_ep2_spec(f"ipc://{tmp_path}"), f"ipc://{tmp_path}/allocator-0"

    def move(w):
        if w.address != "local://allocator-0":
            return w
        process = "allocator-0" if w.actor == "allocator-0" else w.process
        return dataclasses.replace(w, process=process, address=address)

    moved = [move(w) for w in wiring(spec)]
    rows_of = {p: [w for w in moved if w.process == p] for p in ("engine-0", "allocator-0")}
    assert [w.actor for w in rows_of["allocator-0"]] == ["allocator-0"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved[0].address = "ipc:///elsewhere"  # a process never rewrites its table

    async def main():
        # Two opens, as two processes have: a local pair could not cross between them.
        with open_channels(spec, rows_of["allocator-0"]) as allocator:
            with open_channels(spec, rows_of["engine-0"]) as engine:
                await engine["engine-0", "allocator"].send(Heartbeat(2.0))
                got = await asyncio.wait_for(allocator["allocator-0", "engine"].recv(), 5)
                assert got.msg == Heartbeat(2.0)

    asyncio.run(main())


def test_a_process_opens_its_own_rows(tmp_path):
    """engine-0's channels, bound and connected as its rows say (identity with this pid), talk
    over their in-process pair (the message handed over as it was sent), and are closed when
    the process is done with them."""
    spec = tp2_ep2_spec(f"ipc://{tmp_path}")

    async def main():
        with open_process(spec, "engine-0") as channels:
            assert sorted(channels) == sorted(
                (w.actor, w.port) for w in wiring(spec) if w.process == "engine-0"
            )
            identity = channels["engine-0", "coordinator"].sock.getsockopt(zmq.IDENTITY)
            assert identity == f"engine-0-{os.getpid()}".encode()
            sent = Heartbeat(1.5)
            await channels["engine-0", "allocator"].send(sent)
            got = await asyncio.wait_for(channels["allocator-0", "engine"].recv(), 5)
            assert got.msg is sent and got.channel.name == "engine"
        assert all(
            c.closed if isinstance(c, LocalChannel) else c.sock.closed for c in channels.values()
        )

    asyncio.run(main())
