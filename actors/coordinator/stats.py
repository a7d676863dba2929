"""The ranks' stats as the coordinator merges them (messages/stats.py): each rank's latest
report, the one `GetStats` query in flight (the clients waiting for it, the engines that still
owe it an answer) and how a dead rank shows.

Must not touch sockets: the coordinator actor sends the query to every live engine and the
answer to the waiting clients. An engine busy in a long control answers late: after `timeout`
the clients get the latest reports known. The query's waiter sleeps on an asyncio.Event; nothing
here reads a clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

from taipan.messages.lifecycle import LifecycleState
from taipan.messages.stats import RankStats, Stats

STATS_TIMEOUT_S = 5.0
# A dead rank's gauges (what it held at the time) drop to zero; its running totals stay.
DEAD_RANK_ZEROS = (
    "running",
    "waiting",
    "paused",
    "num_blocks",
    "blocks_free",
    "blocks_used",
    "tokens_last_step",
    "blocks_hashed",
    "blocks_evictable",
    "mamba_live_free",
    "mamba_snapshots",
)


class StatsBook:
    """Only the coordinator actor mutates it, once per inbound message or query timeout."""

    def __init__(self, timeout: float = STATS_TIMEOUT_S):
        self.timeout = timeout
        self.ranks: dict[int, RankStats] = {}  # each rank's latest report
        self.waiters: list[bytes] = []  # clients waiting for the query in flight
        self.pending: set[bytes] = set()  # engines that owe that query an answer
        self.answered = asyncio.Event()

    def ask(self, client: bytes) -> bool:
        """`client` asks for stats; True when a query must go out to the engines (False: one is
        out already, and `client` shares its answer)."""
        self.waiters.append(client)
        return len(self.waiters) == 1

    def query(self, engines: Iterable[bytes]) -> None:
        """The query goes out to `engines` now."""
        self.pending = set(engines)
        self.answered.clear()

    async def wait(self) -> set[bytes]:
        """Until every engine asked has answered, or `timeout`: the engines that did not."""
        if self.pending:
            try:
                await asyncio.wait_for(self.answered.wait(), self.timeout)
            except TimeoutError:
                return set(self.pending)
        return set()

    def answer(self, state: LifecycleState) -> tuple[list[bytes], Stats]:
        """The query's end: the clients that asked, and the answer each gets."""
        waiters, self.waiters = self.waiters, []
        return waiters, Stats(state, tuple(self.ranks[r] for r in sorted(self.ranks)))

    def report(self, engine: bytes, rank: int | None, msg: Stats) -> None:
        """An engine's report (periodic, or the answer to the query); `rank`: the engine's."""
        for stats in msg.ranks:
            if stats.rank == rank:  # an engine reports itself only (never a dead rank)
                self.ranks[stats.rank] = stats
        self.answered_by(engine)

    def answered_by(self, engine: bytes) -> None:
        self.pending.discard(engine)
        if not self.pending:
            self.answered.set()

    def client_gone(self, client: bytes) -> None:
        self.waiters = [c for c in self.waiters if c != client]

    def rank_died(
        self, rank: int, engine: bytes, reason: str, state: LifecycleState, weight_version: int
    ) -> None:
        """A dead rank shows its last cumulative counters, nothing running or held (its memory
        is gone), `alive` False with the reason; the query in flight stops waiting for it."""
        last = self.ranks.get(rank) or RankStats(
            rank, state, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, weight_version
        )
        gone = dict.fromkeys(DEAD_RANK_ZEROS, 0)
        self.ranks[rank] = dataclasses.replace(last, **gone, alive=False, dead_reason=reason[:500])
        if engine in self.pending:
            self.answered_by(engine)
