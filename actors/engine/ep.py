"""Expert parallelism in the engine: the group's rounds over ZMQ (`EpConsensus`) and the step loop
under consensus (`EpDriver`). The decisions are the pure core's (actors/engine/consensus.py).

Sockets: every engine of a group binds one ROUTER (`inbox`, watching its peers) and connects one
DEALER to each peer's inbox, with identity `ep-<rank>` (`ep_identity`). Every round message
goes to every peer (no leader): a round costs one hop, a DEALER queues what it sends before its
peer has bound (no lost first round, as a PUB/SUB could lose one), and every rank sees every
peer's connection close. Both sides are recorded in the engine's log, so replay sees each round.

Synchronous rounds (`use_synchronous_zmq_collectives`, the seed's option): the step rounds
(votes, barriers) wait for the peers in a blocking poll of the inbox instead of on the event
loop, for at most SYNC_WAIT_S before the loop takes over: no task switch between a peer's
message and this rank's next step, the seed's "less performance variability". The hello and the
control rounds, which can last minutes, always wait on the loop. It needs steps that do not
overlap (the config refuses both): with a step in flight, this rank's gpu actor, on the same
loop, could be the one a peer waits for.

Liveness: a peer whose connection closes without an `EpBye` (its process died) ends this engine
at once; a round that is not complete within its bound (`ROUND_TIMEOUT_S` between steps,
`CONTROL_ROUND_TIMEOUT_S` after a control, `HELLO_TIMEOUT_S` at start-up while the peers load
their model) ends it too, naming the ranks it waited for. An idle group waits without a bound:
nothing is owed then, and a dead peer is still seen by its closed connection.

`EpDriver.run` is the engine's step loop when the group has more than one rank (the engine
actor's own loop otherwise). Per iteration: vote when the schedule says so (when the group was
idle, first wait for a reason: local work or a pause, or a peer opening the next round), then
act on the agreement: a real step, a dummy step (an empty StepPlan: the gpu worker runs padding
rows through every MoE exchange), nothing, or the pause: finish the step in flight, meet the
others at the "paused" barrier, acknowledge, and wait for the unpause. Steps overlap as in the
engine's own loop (`overlap_steps`); a dummy step is in flight like any other.
"""

from __future__ import annotations

import asyncio
import time

from taipan.actors.channel import Channel
from taipan.actors.engine.consensus import (
    Action,
    Agreement,
    ConsensusSchedule,
    ProtocolError,
    RoundBook,
    agree,
)
from taipan.messages.consensus import (
    BarrierPoint,
    EpBarrier,
    EpBye,
    EpHello,
    EpOutcome,
    EpVote,
)
from taipan.messages.lifecycle import ControlCommand, LifecycleState, next_state

ROUND_TIMEOUT_S = 60.0  # peers reach a step's round within a step of each other
# use_synchronous_zmq_collectives: how long a round blocks the event loop before it waits on
# the loop again (heartbeats and submissions must not stall behind a late peer).
SYNC_WAIT_S = 1.0
CONTROL_ROUND_TIMEOUT_S = 300.0  # a peer's control may move or load every weight
HELLO_TIMEOUT_S = 600.0  # the peers load their model first
# A failed forward under expert parallelism is most often a peer's death seen first by the
# collectives: wait this long for its closed connection to name it.
PEER_GONE_GRACE_S = 1.0


class GroupError(RuntimeError):
    """The group cannot go on (a peer gone or silent, the protocol broken); the text says
    which peer and why."""


def ep_identity(rank: int) -> bytes:
    """The identity of rank `rank`'s DEALERs toward its peers' inboxes."""
    return f"ep-{rank}".encode()


def ep_groups(num_ranks: int, size: int) -> list[tuple[int, ...]]:
    """The expert-parallel groups of `num_ranks` engine ranks: consecutive runs of `size`."""
    if size < 1 or num_ranks % size:
        raise ValueError(
            f"expert_parallel_size ({size}) must divide data_parallel_size ({num_ranks})"
        )
    return [tuple(range(g, g + size)) for g in range(0, num_ranks, size)]


class EpConsensus:
    """This rank's side of its group's rounds: `exchange` sends its message of the next round
    to every peer and waits until the round is complete. The engine hands every inbound round
    message to `deliver` (and a peer's closed connection to `peer_gone`)."""

    def __init__(
        self,
        rank: int,
        group: tuple[int, ...],
        inbox: Channel,
        peers: dict[int, Channel],
        *,
        round_timeout: float = ROUND_TIMEOUT_S,
        control_timeout: float = CONTROL_ROUND_TIMEOUT_S,
        hello_timeout: float = HELLO_TIMEOUT_S,
    ):
        if set(peers) != set(group) - {rank}:
            raise ValueError(f"rank {rank} of group {list(group)} got peers {sorted(peers)}")
        self.rank, self.group = rank, group
        self.inbox, self.peers = inbox, peers
        self.book = RoundBook(rank, group)
        self.arrived = asyncio.Event()  # a peer's message (or its departure) came in
        self.left: dict[int, str] = {}  # peers that said EpBye, with their reason
        self.broken: str | None = None  # why the group cannot go on
        self.broken_event = asyncio.Event()  # set with `broken`
        self.round_timeout, self.control_timeout = round_timeout, control_timeout
        self.hello_timeout = hello_timeout
        self.rounds = 0  # rounds completed (stats)
        # Synchronous rounds (the engine sets both from its config): `take_now` takes an
        # envelope read off the inbox outside the event loop (the clock, then `deliver` or
        # `peer_gone`).
        self.synchronous = False
        self.take_now = None

    @property
    def size(self) -> int:
        return len(self.group)

    def rank_of(self, identity: bytes | None) -> int | None:
        return next((r for r in self.peers if ep_identity(r) == identity), None)

    # --- inbound ------------------------------------------------------------------------------

    def deliver(self, msg) -> None:
        """A peer's round message or EpBye. Raises GroupError on a protocol violation."""
        if isinstance(msg, EpBye):
            self.left[msg.rank] = msg.reason
        else:
            try:
                self.book.add(msg)
            except ProtocolError as e:
                self._break(str(e))
        self.arrived.set()

    def deliver_bad(self, error: str) -> None:
        """A message on the inbox that did not decode: only peers write there."""
        self._break(f"a peer sent a malformed message ({error})")

    def peer_gone(self, identity: bytes | None, reason: str) -> None:
        """A peer's connection closed: fine after its EpBye, fatal otherwise."""
        rank = self.rank_of(identity)
        if rank is None or rank in self.left:
            return
        self._break(f"peer engine {rank} is gone ({reason})")

    def _break(self, why: str) -> None:
        self.broken = self.broken or f"expert-parallel group {list(self.group)}: {why}"
        self.arrived.set()
        self.broken_event.set()
        raise GroupError(self.broken)

    # --- rounds -------------------------------------------------------------------------------

    async def exchange(self, msg, timeout: float, blocking: bool = False) -> list:
        """Send `msg` (this rank's message of round `book.next_round`) to every peer; return
        the round's messages in group order once all are in. `blocking`: wait in a blocking
        poll first (synchronous rounds, module docstring)."""
        self._check()
        self.book.own(msg)
        for peer in self.peers.values():
            await peer.send(msg)
        deadline = time.monotonic() + timeout
        if blocking and self.synchronous and self.take_now is not None:
            spin_until = time.monotonic() + min(SYNC_WAIT_S, timeout)
            while not (self.book.complete_ready(msg.round) or self.broken):
                left = spin_until - time.monotonic()
                env = self.inbox.recv_now(left) if left > 0 else None
                if env is None:
                    break
                self.take_now(env)
        while True:
            self.arrived.clear()
            self._check()
            msgs = self.book.complete(msg.round)
            if msgs is not None:
                self.rounds += 1
                return msgs
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"engine {r}" for r in self.book.missing(msg.round))
                self._break(
                    f"round {msg.round} ({type(msg).__name__}): {missing} sent "
                    f"nothing for {timeout:g} s"
                )
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                pass

    def _check(self) -> None:
        if self.broken is not None:
            raise GroupError(self.broken)
        gone = sorted(set(self.left) & set(self.peers))
        if gone:
            why = "; ".join(f"engine {r}: {self.left[r]}" for r in gone)
            self._break(f"peers left the group ({why})")

    async def why_failed(self, error: str) -> str:
        """Why a step failed, given its error: the peer that died, when its closed connection
        arrives within PEER_GONE_GRACE_S (the collectives often notice first), else `error`
        put in the group's name."""
        try:
            await asyncio.wait_for(self.broken_event.wait(), PEER_GONE_GRACE_S)
        except TimeoutError:
            return f"expert-parallel group {list(self.group)}: {error}"
        return self.broken

    async def hello(self) -> None:
        msg = EpHello(self.book.next_round, self.rank, self.group)
        for peer in await self.exchange(msg, self.hello_timeout):
            if tuple(peer.group) != self.group:
                self._break(
                    f"engine {peer.rank} is in expert-parallel group {list(peer.group)}, this "
                    f"engine in {list(self.group)}: every rank must be started with the same "
                    "data- and expert-parallel sizes"
                )

    async def vote(self, work: int, pausing: bool) -> Agreement:
        msg = EpVote(self.book.next_round, self.rank, work, pausing)
        return agree(await self.exchange(msg, self.round_timeout, blocking=True))

    async def barrier(self, point: BarrierPoint) -> None:
        msg = EpBarrier(self.book.next_round, self.rank, point)
        await self.exchange(msg, self.round_timeout, blocking=True)

    async def outcome(self, command: ControlCommand, error: str | None) -> dict[int, str]:
        """Tell the peers how `command` went here; returns the ranks where it failed, with why."""
        msg = EpOutcome(self.book.next_round, self.rank, command, error)
        outcomes = await self.exchange(msg, self.control_timeout)
        return {o.rank: o.error for o in outcomes if o.error is not None}

    async def wait_for_reason(self, local: asyncio.Event) -> None:
        """Until `local` is set or a peer opens the next round (no bound: an idle group owes
        nothing; a dead peer still breaks the wait through `peer_gone`)."""
        while not (local.is_set() or self.book.opened()):
            self.arrived.clear()
            self._check()
            waits = [asyncio.ensure_future(e.wait()) for e in (local, self.arrived)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        self._check()

    async def bye(self, reason: str) -> None:
        for peer in self.peers.values():
            await peer.send(EpBye(self.rank, reason))


class EpDriver:
    """The engine's step loop under consensus (module docstring). Owns the schedule; the
    engine owns the scheduler, the channels, the lifecycle state and its StepRunner (the
    steps in flight, dummies included)."""

    def __init__(self, engine, group: EpConsensus, interval: int, disabled: bool):
        """`engine`: the EngineActor whose loop this is (not imported: it imports this)."""
        self.engine, self.group = engine, group
        self.schedule = ConsensusSchedule(interval, disabled)
        self.stuck = False  # work that cannot run until something changes (votes 0)

    def local_work(self, take: bool = True) -> int:
        """This rank's work count. `take`: a vote includes everything up to now, so it takes
        the `work` event; the action after a vote only peeks (a submission that came while
        the round ran must wake the next round of an idle group, not be taken unvoted)."""
        e = self.engine
        if e.work.is_set():  # a submission, abort or control since: try again
            if take:
                e.work.clear()
            self.stuck = False
        return 0 if self.stuck else e.scheduler.pending()

    async def run(self) -> None:
        e = self.engine
        await self.group.hello()
        while True:
            if self.schedule.due():
                if self.schedule.idle:
                    await e.steps.collect()  # an idle group has no step in flight
                    await self._free_idle()
                    await self.group.wait_for_reason(e.work)
                pausing = e.pause_ready()  # (mode wait: once this rank has drained)
                self.schedule.agreed(await self.group.vote(self.local_work(), pausing))
            action = self.schedule.action(self.local_work(take=False))
            if action is Action.PAUSE:
                await self._pause()
            elif action is not Action.IDLE:
                async with e.device_lock:
                    await self._step(action)
                self.schedule.stepped()

    async def _step(self, action: Action) -> None:
        """One group step: this rank's own (STEP) or a dummy; with overlap the previous one is
        collected after this one is sent."""
        steps = self.engine.steps
        sent = False
        if action is Action.STEP or self.engine.scheduler.pending_free:  # (frees ride along)
            sent = await self._plan_and_dispatch()
        if not sent:  # the group steps: a forward of padding rows keeps this rank in it
            await steps.dummy()
        await steps.collect(keep=int(self.engine.overlap))

    async def _plan_and_dispatch(self) -> bool:
        """Plan this rank's step and send it; True when a forward of it is coming."""
        steps = self.engine.steps
        planned = await steps.plan()
        if planned is None:
            self.stuck = not steps.in_flight and self.engine.scheduler.pending() > 0
            return False
        return await steps.dispatch(planned)

    async def _free_idle(self) -> None:
        """An idle group: hand back the blocks of requests that ended (no forward; with no
        request left, the plan can hold nothing else)."""
        sched = self.engine.scheduler
        if sched.pending_free and not sched.pending():
            async with self.engine.device_lock:
                await self._plan_and_dispatch()

    async def _pause(self) -> None:
        """Every rank asked to pause: stop after this step, meet at the barrier, acknowledge,
        and wait for the unpause. A rank whose pause an unpause withdrew meanwhile (the
        coordinator gave up on it) goes on stepping; its peers get their unpause too."""
        e = self.engine
        await e.steps.collect()
        await self.group.barrier(BarrierPoint.PAUSED)
        if not e.pause_waiters:
            self.schedule.reset()
            self.stuck = False
            return
        e.state = next_state(e.state, ControlCommand.PAUSE)
        async with e.device_lock:  # (a flush sends the allocator a step of its own)
            await e.paused_now()  # (the pause's mode: every rank of the group alike)
        waiters, e.pause_waiters = e.pause_waiters, []
        for env in waiters:
            await e._ack(env, ControlCommand.PAUSE)
        self.schedule.reset()
        while e.state is not LifecycleState.RUNNING:
            e.work.clear()
            await e.work.wait()
        self.stuck = False
