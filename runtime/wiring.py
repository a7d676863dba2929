"""The wiring table: every socket of a runtime's processes, as rows of data built from its
LaunchSpec (runtime/spec.py) in one function, `wiring`.

A row (`Wire`) says which process opens a socket, for which actor and under which port (the
name that actor is handed it by), its ZMQ type, whether it binds or connects, its address, and
the channel's name (what it connects to, as the actor's logs and records call it). Each process
(runtime/procs.py) opens only its own rows (`open_process`) and hands the channels to its actors
(which actors a process runs is procs.py's). Where a socket goes is data: moving an actor to
another process changes its rows (their process, and an ipc or tcp address instead of
local), not the code that opens them (DESIGN.md §2). The rows, by process:

- coordinator: the clients' ROUTER (`frontend`) and the engines' ROUTER (`backend`);
- engine-R: the engine's DEALER to the coordinator; an in-process pair (`local://`, objects
  handed over unencoded: actors/local.py) with each of allocator-R, gpu-R and (hybrid models
  only) mamba_cache-R, the served side binding; with
  expert parallelism, the engine's consensus inbox (a ROUTER) and a DEALER to each group peer's
  inbox (actors/engine/ep.py); with tensor parallelism, the leader gpu-R's XPUB for plans and
  ROUTER for its followers' reports (actors/gpu/peers.py);
- tp-follower-R-K: follower gpu-R-tpK's SUB to its leader's plans and DEALER to its reports.

The binding side of a tcp socket is a Curve server and the connecting side a Curve client when
the spec names a key directory (runtime/auth.py `curve_keys`). The table itself is plain data;
only `open_channels` touches zmq, and channels are made through actors/channel.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import zmq
import zmq.asyncio

from taipan.actors.channel import Channel, make_socket
from taipan.actors.engine.ep import ep_identity
from taipan.actors.gpu.peers import follower_identity
from taipan.actors.local import SCHEME as LOCAL
from taipan.actors.local import LocalChannel, LocalPairs
from taipan.auth import curve_keys
from taipan.spec import LaunchSpec

KINDS = {"PAIR": zmq.PAIR, "DEALER": zmq.DEALER, "ROUTER": zmq.ROUTER, "XPUB": zmq.XPUB,
         "SUB": zmq.SUB}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Wire:
    """One socket: `actor` (named as its record log is, e.g. "gpu-0") uses it as `port`, in the
    OS process `process`. `identity`: a routed socket's own name at its peer; "{pid}" in it is
    the opening process's id (unique: the coordinator refuses a second engine of one rank, and
    a restarted one must not be taken for the old). `watch_peers`: the channel reports a peer's
    closed connection (actors/channel.py). `recorded`: with --record, its messages go to the
    actor's log."""

    process: str
    actor: str
    port: str
    kind: str  # a key of KINDS
    bind: bool
    address: str
    channel: str
    identity: str | None = None
    watch_peers: bool = False
    recorded: bool = True


def wiring(spec: LaunchSpec, *, hybrid: bool = False) -> list[Wire]:
    """Every socket of every process `spec` describes: the coordinator, each engine rank and
    each tensor-parallel follower. `hybrid`: the model has Mamba layers (a mamba_cache actor
    per rank)."""
    rows = [
        Wire("coordinator", "coordinator", "frontend", "ROUTER", True, spec.frontend, "clients",
             watch_peers=True),
        Wire("coordinator", "coordinator", "backend", "ROUTER", True, spec.backend, "engines",
             watch_peers=True),
    ]  # fmt: skip
    for rank in range(spec.num_ranks):
        rows += _engine_rank(spec, rank, hybrid)
        rows += _expert_parallel(spec, rank)
        rows += _tensor_parallel(spec, rank)
    return rows


def _engine_rank(spec: LaunchSpec, rank: int, hybrid: bool) -> list[Wire]:
    """Engine rank `rank`'s process: the engine's link to the coordinator, and an in-process
    pair with each actor it drives (the served side binds, the engine connects)."""
    process = engine = f"engine-{rank}"
    rows = [
        Wire(process, engine, "coordinator", "DEALER", False, spec.backend, "coordinator",
             identity=f"engine-{rank}-{{pid}}"),
    ]  # fmt: skip
    for served in ("allocator", "gpu") + (("mamba_cache",) if hybrid else ()):
        actor, address = f"{served}-{rank}", f"{LOCAL}{served}-{rank}"
        rows.append(Wire(process, actor, "engine", "PAIR", True, address, "engine"))
        rows.append(Wire(process, engine, served, "PAIR", False, address, served))
    return rows


def _expert_parallel(spec: LaunchSpec, rank: int) -> list[Wire]:
    """Engine rank `rank`'s consensus inbox, watching its group peers, and a DEALER to each
    peer's inbox (none without expert parallelism)."""
    ep = spec.expert_parallel
    if ep is None:
        return []
    process = engine = f"engine-{rank}"
    _, group = ep.group_of(rank)
    rows = [Wire(process, engine, "ep", "ROUTER", True, ep.inboxes[rank], "ep", watch_peers=True)]
    identity = ep_identity(rank).decode()
    for peer in group:
        if peer != rank:
            rows.append(Wire(process, engine, f"ep-{peer}", "DEALER", False, ep.inboxes[peer],
                             f"ep-{peer}", identity=identity))  # fmt: skip
    return rows


def _tensor_parallel(spec: LaunchSpec, rank: int) -> list[Wire]:
    """Rank `rank`'s leader (its gpu actor) publishes plans and gathers reports; each follower
    subscribes to the one and reports over the other (none without tensor parallelism)."""
    if spec.tensor_parallel_size == 1:
        return []
    addresses, leader = spec.tp_addresses[rank], f"gpu-{rank}"
    plans, reports = addresses["plans"], addresses["reports"]
    rows = [
        # Not recorded: it publishes, unchanged, what gpu-R got from the engine (in its log).
        Wire(f"engine-{rank}", leader, "plans", "XPUB", True, plans, "followers",
             recorded=False),
        Wire(f"engine-{rank}", leader, "reports", "ROUTER", True, reports, "followers",
             watch_peers=True),
    ]  # fmt: skip
    for k in range(1, spec.tensor_parallel_size):
        process, follower = f"tp-follower-{rank}-{k}", f"gpu-{rank}-tp{k}"
        rows += [
            Wire(process, follower, "plans", "SUB", False, plans, "plans"),
            Wire(process, follower, "reports", "DEALER", False, reports, "reports",
                 identity=follower_identity(k).decode(), watch_peers=True),
        ]  # fmt: skip
    return rows


def format_wiring(rows: list[Wire]) -> str:
    """The table as aligned text, one row per line (for logs and tests)."""
    cells = [("process", "actor.port", "kind", "", "address", "channel", "identity", "")]
    for w in rows:
        how = "bind" if w.bind else "connect"
        notes = ["watch"] * w.watch_peers + ["unrecorded"] * (not w.recorded)
        cells.append((w.process, f"{w.actor}.{w.port}", w.kind, how, w.address, w.channel,
                      w.identity or "", " ".join(notes)))  # fmt: skip
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def open_process(spec: LaunchSpec, process: str, *, hybrid: bool = False):
    """`open_channels` over `process`'s rows of the table."""
    rows = [w for w in wiring(spec, hybrid=hybrid) if w.process == process]
    return open_channels(spec, rows)


@contextlib.contextmanager
def open_channels(
    spec: LaunchSpec, rows: list[Wire]
) -> Iterator[dict[tuple[str, str], Channel | LocalChannel]]:
    """Open `rows` (binds first: a local or inproc connect needs its bind) in one zmq context
    and yield their channels by (actor, port); on exit close them, then the context, then the
    recorders (--record: one log per actor, named as the row's actor). Call it on the event loop
    that runs the actors (a Curve server answers its ZAP checks there; both ends of a `local://`
    pair run there)."""
    ctx = zmq.asyncio.Context()
    pairs = LocalPairs()
    recorders = {w.actor: _recorder(spec.record_dir, w.actor) for w in rows if w.recorded}
    channels: dict[tuple[str, str], Channel | LocalChannel] = {}
    try:
        for w in sorted(rows, key=lambda w: not w.bind):
            recorder = recorders.get(w.actor)
            if w.address.startswith(LOCAL):
                channels[w.actor, w.port] = pairs.open(
                    w.address, bind=w.bind, name=w.channel, recorder=recorder
                )
            else:
                channels[w.actor, w.port] = _open(ctx, w, spec, recorder)
        yield channels
    finally:
        for channel in channels.values():
            channel.close()
        ctx.term()
        for rec in recorders.values():
            if rec is not None:
                rec.close()


def _open(ctx: zmq.asyncio.Context, w: Wire, spec: LaunchSpec, recorder) -> Channel:
    identity = None if w.identity is None else w.identity.format(pid=os.getpid()).encode()
    keys = curve_keys(w.address, spec.keys_dir, server=w.bind, key_name=spec.key_name)
    return make_socket(ctx, KINDS[w.kind], w.address, bind=w.bind, name=w.channel,
                       identity=identity, recorder=recorder, watch_peers=w.watch_peers,
                       curve=keys)  # fmt: skip


def _recorder(record_dir: str | None, actor: str):
    if not record_dir:
        return None
    from taipan.actors.record import Recorder

    return Recorder(record_dir, actor)
