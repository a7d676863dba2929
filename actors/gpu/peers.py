"""Tensor-parallel peers of one rank's gpu actor (DESIGN.md §2: gpu[r] └─ gpu[r, tp]).

A rank at tensor-parallel size T is T processes: the leader (the gpu actor in the engine's
process, TP rank 0) and T-1 followers (`python -m taipan.procs tp-follower`, TP ranks 1..T-1):
children of the engine's process, or, across hosts, processes of their own (`taipan serve --role
tp-follower`) that connect to the leader's tcp addresses. Each holds its shard of the weights and
of the kv heads (ops/sharding.py) and joins the rank's torch.distributed group (ops/parallel.py)
when LoadModel comes. The forward's collectives pair up by call order, so every peer must make
the same calls in the same order; this module is how they do:

- The leader publishes every LoadModel, StepPlan and GpuControl the engine sends it, unchanged,
  on one XPUB socket before running it itself; the followers (SUB) run each in arrival order
  through the same launch/collect pipeline as the leader (`FollowerActor` is a GpuActor whose
  answers go to the leader, not to an engine).
- Followers answer loads and controls (`PeerOutcome`) over one DEALER (identity `tp-<K>`,
  `follower_identity`) to the leader's ROUTER, never steps: one message per step goes out,
  nothing comes back, and the collectives keep the peers in step.
- Before its first publication the leader waits (bounded) for every follower's `PeerHello` and
  for as many subscriptions on its XPUB: nothing published is lost to a slow joiner.
- A load or control answers the engine once every peer has: a load that fails on any peer fails
  the rank's load (naming that peer, as soon as it does); peers that disagree on a control (one
  applied it, another refused) would run different steps, so the rank ends (FatalError). A
  weight update is staged on every peer first and committed only where all staged it
  (actors/gpu/actor.py), so a peer that cannot read it fails the update, not the rank.
- A step that raises on any peer ends the rank (actors/gpu/actor.py): the peers can no longer be
  known to issue the same collectives.
- Liveness both ways over the DEALER-ROUTER connection, which both sides watch (ZMQ heartbeats:
  actors/channel.py): a follower whose connection closes ends the rank (`PeerGoneError`; the
  engine process exits with EXIT_PEER_DIED, and also watches the followers it started itself:
  runtime/procs.py); a leader that stops cleanly sends each follower a `PeerBye` on it first, and
  a follower whose leader's connection closes without one ends (`PeerGoneError`) within seconds.

With Curve keys the leader's XPUB and ROUTER are Curve servers and the followers Curve clients.
torch.distributed's own traffic (the TCPStore rendezvous at `TPSetup.init_method`, gloo or NCCL)
is not authenticated by Curve: keep those ports inside a trusted network.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from taipan.actors.base import FatalError
from taipan.actors.channel import Channel, Envelope
from taipan.actors.log import get_logger
from taipan.messages.common import PeerGone
from taipan.messages.gpu import GpuControlReply, PeerBye, PeerHello, PeerOutcome, StepResult

# Followers import torch and connect within this (a loaded 2-core box needs ~20 s for four).
FOLLOWER_START_TIMEOUT_S = 120.0
# After the leader's own load or control is done, its followers answer within this.
PEER_ANSWER_TIMEOUT_S = 120.0
# A follower's load failed: the leader's own gets this long to fail too (then it says why).
OWN_FAILURE_GRACE_S = 2.0
# A step failed: a follower's closed connection, if that is why, is seen within this.
PEER_GONE_GRACE_S = 1.0


class PeerError(RuntimeError):
    """A follower failed, or did not answer in time; the message names it."""


class PeerGoneError(FatalError):
    """A peer of this rank (a follower, or a follower's leader) is gone: the process ends with
    runtime/procs.py's EXIT_PEER_DIED."""


def follower_identity(tp_rank: int) -> bytes:
    """The identity of follower `tp_rank`'s DEALER toward its leader's ROUTER."""
    return f"tp-{tp_rank}".encode()


@dataclasses.dataclass(frozen=True)
class TPSetup:
    """How one peer joins its rank's group: its TP rank, the group size, the rendezvous (every
    peer of the rank the same `init_method`: a file:// path or tcp://HOST:PORT)."""

    tp_rank: int
    size: int
    init_method: str
    timeout_s: float = 120.0

    def join(self, device: str):
        """Join the group (blocks until every peer has, at most `timeout_s`): a TPGroup."""
        from taipan.ops.parallel import init_tp

        return init_tp(
            self.tp_rank, self.size, self.init_method, device=device, timeout_s=self.timeout_s
        )


@dataclasses.dataclass
class _Expected:
    """The answers the leader waits for: the `index`-th load or control it published."""

    index: int
    command: str
    early: bool  # resolve at the first error (a load), or only once every peer answered
    answers: asyncio.Future  # -> {tp_rank: error or None}
    got: dict[int, str | None] = dataclasses.field(default_factory=dict)


class Followers:
    """The leader's side: publishes to its followers and gathers their answers. `reports` (a
    ROUTER watching its peers) is served by the leader's gpu actor, which hands PeerHello,
    PeerOutcome and PeerGone to `on_hello`, `on_outcome` and `gone`; `plans` (XPUB) only
    sends."""

    def __init__(
        self,
        plans: Channel,
        reports: Channel,
        size: int,
        rank: int,
        start_timeout: float | None = None,
    ):
        """`start_timeout`: how long the first load waits for every follower (None:
        FOLLOWER_START_TIMEOUT_S; followers on other hosts may be started by hand)."""
        self.plans, self.reports, self.size = plans, reports, size
        self.start_timeout = start_timeout
        self.peers = tuple(range(1, size))
        self.log = get_logger(actor=f"gpu-{rank}", tp_size=size)
        self.pids: dict[int, int] = {}  # follower TP rank -> pid, from its hello
        self.lost: str | None = None  # why a follower is gone (then the rank ends)
        self.lost_event = asyncio.Event()
        self.leaving = False  # our goodbye is out: connections closing now are expected
        self._all_here = asyncio.Event()
        self._ready = False
        self._published = 0  # loads and controls published (PeerOutcome.index counts them too)
        self._expected: _Expected | None = None

    async def on_hello(self, env: Envelope, msg: PeerHello) -> None:
        if msg.tp_rank not in self.peers or env.sender != follower_identity(msg.tp_rank):
            self.log.warning(
                "hello from an unknown peer", tp_rank=msg.tp_rank, pid=msg.pid, sender=env.sender
            )
            return
        self.pids[msg.tp_rank] = msg.pid
        self.log.info("tensor-parallel follower up", tp_rank=msg.tp_rank, pid=msg.pid)
        if len(self.pids) == len(self.peers):
            self._all_here.set()

    async def on_outcome(self, env: Envelope, msg: PeerOutcome) -> None:
        exp = self._expected
        if exp is None or msg.index != exp.index or msg.tp_rank not in self.peers:
            self.log.warning(
                "an answer nothing waits for", tp_rank=msg.tp_rank, index=msg.index,
                command=msg.command, error=msg.error,
            )  # fmt: skip
            return
        if msg.command != exp.command:  # the same index for another command: a broken peer
            msg = dataclasses.replace(
                msg, error=f"answered {msg.command!r} to {exp.command!r} ({msg.error})"
            )
        exp.got[msg.tp_rank] = msg.error
        if exp.answers.done():
            return
        if len(exp.got) == len(self.peers) or (exp.early and msg.error is not None):
            exp.answers.set_result(dict(exp.got))

    def gone(self, env: Envelope, msg: PeerGone) -> str | None:
        """A follower's connection closed: why the rank must end (None: nothing to end, as
        after our goodbye, or for a peer that never said hello)."""
        tp_rank = next((k for k in self.pids if follower_identity(k) == env.sender), None)
        if tp_rank is None or self.leaving:
            return None
        self.lost = self.lost or (
            f"tensor-parallel follower {tp_rank} (pid {self.pids[tp_rank]}) is gone ({msg.reason})"
        )
        self.lost_event.set()
        return self.lost

    async def why_step_failed(self) -> str | None:
        """After a failed step: a follower gone, if its closed connection shows within
        PEER_GONE_GRACE_S (the collective often notices first), else None."""
        try:
            await asyncio.wait_for(self.lost_event.wait(), PEER_GONE_GRACE_S)
        except TimeoutError:
            return None
        return self.lost

    async def bye(self, reason: str) -> None:
        """Tell every follower that said hello to exit cleanly (the rank stops). The caller
        closes `reports` with a linger, so that the goodbyes go out."""
        self.leaving = True
        for tp_rank in self.pids:
            await self.reports.send(PeerBye(reason), to=follower_identity(tp_rank))

    async def _wait_ready(self) -> None:
        """Until every follower said hello and subscribed (bounded: PeerError)."""
        if self._ready:
            return
        timeout = self.start_timeout or FOLLOWER_START_TIMEOUT_S
        try:
            async with asyncio.timeout(timeout):
                await self._all_here.wait()
                await self.plans.wait_subscribers(len(self.peers))
        except TimeoutError:
            missing = [k for k in self.peers if k not in self.pids]
            what = (
                f"followers {missing} never said hello" if missing else "followers never subscribed"
            )
            raise PeerError(f"tensor-parallel {what} within {timeout:g} s") from None
        self._ready = True

    async def publish(self, msg) -> None:
        """A step: sent to every follower, no answer."""
        await self.plans.send(msg)

    async def publish_expecting(self, msg, command: str, *, early: bool) -> asyncio.Future:
        """A load or control: sent to every follower (once they are all here); the future gets
        {tp_rank: error or None} once every follower answered (`early`: or one failed)."""
        await self._wait_ready()
        self._published += 1
        answers = asyncio.get_running_loop().create_future()
        self._expected = _Expected(self._published, command, early, answers)
        await self.plans.send(msg)
        return answers

    async def gather(self, answers: asyncio.Future, command: str) -> dict[int, str | None]:
        """The followers' answers to the last publication (PeerError when one is late)."""
        try:
            return await asyncio.wait_for(answers, PEER_ANSWER_TIMEOUT_S)
        except TimeoutError:
            got = self._expected.got if self._expected else {}
            late = [k for k in self.peers if k not in got]
            raise PeerError(
                f"tensor-parallel followers {late} did not answer {command} within "
                f"{PEER_ANSWER_TIMEOUT_S:g} s"
            ) from None


LEADER = 0  # the leader's tensor-parallel rank (its followers are 1 .. T - 1)


def first_failure(errors: dict[int, str | None]) -> str | None:
    """The leader's own error if it failed (`LEADER`), else 'tensor-parallel peer K: why' for
    the lowest follower that failed, or None."""
    failed = sorted(k for k, e in errors.items() if e is not None)
    if not failed:
        return None
    if failed[0] == LEADER:
        return errors[LEADER]
    return f"tensor-parallel peer {failed[0]}: {errors[failed[0]]}"


def outcome_of(reply) -> tuple[str, str | None] | None:
    """(command, error or None) of a control's reply; None for a step's result."""
    if isinstance(reply, StepResult):
        return None
    if isinstance(reply, GpuControlReply):
        return str(reply.command), reply.error
    raise TypeError(f"not a step's or control's reply: {type(reply).__name__}")


def hello(tp_rank: int) -> PeerHello:
    return PeerHello(tp_rank, os.getpid())
