"""The coordinator's prefix routing (DESIGN.md §7): which rank holds which block hashes, and which
rank a new request goes to.

Owns: `RoutingTable`, per rank the set of block hashes its allocator has registered, kept from the
allocator's "added"/"evicted" events, so it is true (what the allocators hold), not an optimistic
shadow; and `RankPicker`, the four routing policies with their tie rules. Must not touch: sockets,
clocks, torch, asyncio, the allocator package. Hashes, ranks and loads arrive as plain ints; the
coordinator actor feeds the events, its in-flight counts and the ranks' capacities.

Determinism: no randomness, no clock. The table is a function of the events applied, and a
router's choices are a function of its own sequence of `pick` calls (its round-robin cursor is
its only state), so replaying the coordinator's inbound messages makes every choice again.
Scores are exact fractions (alpha as the decimal it prints as), so scores equal on paper tie.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from fractions import Fraction

from taipan.actors.config import PrefixCachingCoordinatorPolicy as Policy
from taipan.messages.block_hash import MAX_HASH


class RoutingError(ValueError):
    """A rank's events contradict the table: events were lost, duplicated or reordered."""


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


class RoutingTable:
    """Per rank, the block hashes its allocator has registered; filled only by `apply`."""

    def __init__(self):
        self._by_rank: dict[int, set[int]] = {}  # rank -> its registered hashes
        self._holders: dict[int, set[int]] = {}  # hash -> the ranks that registered it

    def apply(self, rank: int, added: Sequence[int], evicted: Sequence[int]) -> None:
        """Apply one batch of `rank`'s events (one `take_events()`): evictions, then additions.

        The allocator evicts at free/allocate time and registers last, so a batch normally reads
        "evict, then add" (a hash evicted and registered again is in both lists). Since the two
        lists lose their interleaving, any order consistent with the table is accepted: per hash,
        additions and evictions alternate, so a hash registered before must be evicted as often
        as it is added, or once more; an unregistered one added as often as evicted, or once
        more. Anything else (an add of a registered hash, an eviction of an absent one) raises
        RoutingError naming the rank and the hash, with the table unchanged.
        """
        rank = _as_int("rank", rank)
        held = self._by_rank.get(rank, set())
        counts: dict[int, list[int]] = {}  # hash -> [times added, times evicted]
        for i, hs in ((1, evicted), (0, added)):
            for h in hs:
                h = _as_int("block hash", h)
                if not 1 <= h <= MAX_HASH:
                    raise RoutingError(f"rank {rank}: block hash {h} not in [1, {MAX_HASH}]")
                counts.setdefault(h, [0, 0])[i] += 1
        # Validate everything first; only then mutate, so an error leaves the table unchanged.
        now_held: dict[int, bool] = {}
        for h, (a, e) in counts.items():
            was = h in held
            if (was and e not in (a, a + 1)) or (not was and a not in (e, e + 1)):
                raise RoutingError(_inconsistency(rank, h, was, a, e))
            now_held[h] = (e == a) if was else (a == e + 1)
        for h, now in now_held.items():
            if now == (h in held):
                continue
            if now:
                self._by_rank.setdefault(rank, set()).add(h)
                self._holders.setdefault(h, set()).add(rank)
            else:
                self._forget(rank, h)

    def drop_rank(self, rank: int) -> None:
        """The rank died or was reset: forget every hash it held."""
        for h in self._by_rank.pop(rank, set()):
            holders = self._holders[h]
            holders.discard(rank)
            if not holders:
                del self._holders[h]

    def hashes(self, rank: int) -> frozenset[int]:
        return frozenset(self._by_rank.get(rank, ()))

    def num_hashes(self, rank: int) -> int:
        return len(self._by_rank.get(rank, ()))

    def ranks_holding(self, block_hash: int) -> tuple[int, ...]:
        """The ranks that hold `block_hash`, sorted."""
        return tuple(sorted(self._holders.get(int(block_hash), ())))

    def match(self, rank: int, hashes: Sequence[int]) -> int:
        """How many leading hashes of the chain `rank` holds (stops at the first absent one)."""
        held = self._by_rank.get(rank)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if int(h) not in held:
                break
            n += 1
        return n

    def _forget(self, rank: int, h: int) -> None:
        held = self._by_rank[rank]
        held.discard(h)
        if not held:
            del self._by_rank[rank]
        holders = self._holders[h]
        holders.discard(rank)
        if not holders:
            del self._holders[h]


def _inconsistency(rank: int, h: int, was: bool, added: int, evicted: int) -> str:
    state = "registered" if was else "not registered"
    if (added, evicted) == (1, 0):
        return f"rank {rank}: hash {h} added but it is already registered (a lost eviction?)"
    if (added, evicted) == (0, 1):
        return f"rank {rank}: hash {h} evicted but it is not registered (a lost addition?)"
    return (
        f"rank {rank}: hash {h} is {state}, and one batch adds it {added} time(s) and evicts it "
        f"{evicted} time(s): no order of those events fits (lost or duplicated events?)"
    )


class RankPicker:
    """Picks a rank for each new request by `policy` (a PrefixCachingCoordinatorPolicy).

    free(r) = max(0, 1 - load[r] / capacity[r]), the rank's normalized free capacity.
      round_robin         every ready rank ties; the cursor cycles over them.
      load_balanced       the highest free(r).
      first_prefix_block  the highest free(r) among the ranks that hold hashes[0]; load_balanced
                          over all ranks when none does (or the request has no complete block).
      longest_prefix      the highest alpha * match(r) / len(hashes) + (1 - alpha) * free(r);
                          load_balanced when the request has no complete block.
    Tie rules, in order: the higher free(r); the fewer requests in flight; then round-robin
    order: the first tied rank at or after the cursor in `ranks` order, cyclically. The cursor
    then moves just past the chosen rank, so repeated ties rotate.

    After each `pick`, `last_match` is the number of leading hashes of the request that the
    chosen rank holds (whatever the policy), the hit the coordinator can expect; with
    `block_size` given, `last_match_tokens` is the same in tokens.
    """

    def __init__(self, policy: Policy | str, alpha: float, block_size: int | None = None):
        try:
            self.policy = Policy(policy)
        except ValueError:
            choices = tuple(p.value for p in Policy)
            raise ValueError(f"routing policy {policy!r} is not one of {choices}") from None
        if not 0 <= alpha <= 1:  # NaN fails too
            raise ValueError(f"routing alpha ({alpha}) must be in [0, 1]")
        if block_size is not None and _as_int("block_size", block_size) < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        self.alpha = float(alpha)
        self.block_size = block_size
        # The decimal alpha prints as (0.1 is 1/10), so scores equal on paper tie exactly.
        self._alpha = Fraction(repr(self.alpha))
        self._cursor = 0
        self.last_match = 0

    @property
    def last_match_tokens(self) -> int | None:
        return None if self.block_size is None else self.last_match * self.block_size

    def pick(
        self,
        ranks: Sequence[int],
        hashes: Sequence[int],
        load: Mapping[int, int],
        capacity: Mapping[int, int],
        table: RoutingTable,
    ) -> int:
        """The rank for a request whose complete blocks hash to `hashes`; moves the cursor.

        `ranks`: the ready ranks in registration order. `load[r]`: the coordinator's requests in
        flight on r (a missing rank has none). `capacity[r]` (>= 1): how many requests r runs
        at once. ValueError for no ranks, a repeated rank, or a missing or bad capacity/load.
        """
        ranks = [_as_int("rank", r) for r in ranks]
        if not ranks:
            raise ValueError("no ready rank to route to")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks {ranks} name a rank twice")
        in_flight = {r: self._load(r, load) for r in ranks}
        free = {r: self._free(r, in_flight[r], capacity) for r in ranks}
        matches: dict[int, int] = {}
        if self.policy is Policy.ROUND_ROBIN:
            keys: dict[int, tuple] = {r: () for r in ranks}
        elif self.policy is Policy.LONGEST_PREFIX and len(hashes):
            matches = {r: table.match(r, hashes) for r in ranks}
            a, n = self._alpha, len(hashes)
            keys = {
                r: (a * Fraction(matches[r], n) + (1 - a) * free[r], free[r], -in_flight[r])
                for r in ranks
            }
        else:
            candidates = ranks
            if self.policy is Policy.FIRST_PREFIX_BLOCK and len(hashes):
                holders = set(table.ranks_holding(hashes[0]))
                candidates = [r for r in ranks if r in holders] or ranks
            keys = {r: (free[r], -in_flight[r]) for r in candidates}
        rank = self._choose(ranks, keys)
        self.last_match = matches[rank] if matches else table.match(rank, hashes)
        return rank

    def _choose(self, ranks: list[int], keys: dict[int, tuple]) -> int:
        """The first rank with the best key at or after the cursor; the cursor moves past it."""
        best = max(keys.values())
        n = len(ranks)
        for i in range(n):
            idx = (self._cursor + i) % n
            if keys.get(ranks[idx]) == best:
                self._cursor = idx + 1
                return ranks[idx]
        raise AssertionError("unreachable: the best key belongs to a ranked candidate")

    @staticmethod
    def _load(rank: int, load: Mapping[int, int]) -> int:
        n = _as_int(f"load of rank {rank}", load.get(rank, 0))
        if n < 0:
            raise ValueError(f"load of rank {rank} ({n}) must be >= 0")
        return n

    @staticmethod
    def _free(rank: int, in_flight: int, capacity: Mapping[int, int]) -> Fraction:
        if rank not in capacity:
            raise ValueError(f"capacity of rank {rank} is unknown")
        cap = _as_int(f"capacity of rank {rank}", capacity[rank])
        if cap < 1:
            raise ValueError(f"capacity of rank {rank} ({cap}) must be >= 1")
        return Fraction(max(0, cap - in_flight), cap)
