"""RoutingTable and RankPicker: the table follows real pools' events; each policy, tie, error."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool
from taipan.actors.config import PrefixCachingCoordinatorPolicy
from taipan.actors.coordinator.routing import RankPicker, RoutingError, RoutingTable
from taipan.messages.block_hash import NO_HASH, block_hashes

CHAIN = [11, 12, 13, 14]  # synthetic hashes of one prompt's four complete blocks


def table_of(held: dict[int, list[int]]) -> RoutingTable:
    table = RoutingTable()
    for rank, hashes in held.items():
        table.apply(rank, hashes, [])
    return table


def snapshot(table: RoutingTable, ranks=range(4), hashes=range(1, 40)):
    return (
        [table.hashes(r) for r in ranks],
        [table.num_hashes(r) for r in ranks],
        [table.ranks_holding(h) for h in hashes],
    )


# --- RoutingTable -------------------------------------------------------------------------------


def test_table_queries():
    table = table_of({0: CHAIN[:2], 1: CHAIN, 2: [CHAIN[0], 30], 3: []})
    assert table.hashes(1) == frozenset(CHAIN) and table.num_hashes(2) == 2
    assert table.hashes(7) == frozenset() and table.num_hashes(7) == 0
    assert table.ranks_holding(11) == (0, 1, 2) and table.ranks_holding(14) == (1,)
    assert table.ranks_holding(99) == ()
    assert [table.match(r, CHAIN) for r in range(5)] == [2, 4, 1, 0, 0]
    assert table.match(2, [30, 11]) == 2 and table.match(2, [12, 11]) == 0
    assert table.match(1, []) == 0
    table.drop_rank(1)
    assert table.hashes(1) == frozenset() and table.ranks_holding(11) == (0, 2)
    assert table.ranks_holding(14) == ()
    table.drop_rank(1)  # again: nothing to forget


def test_table_applies_evictions_before_additions():
    table = table_of({0: [1, 2, 3]})
    table.apply(0, [4, 3], [3, 2])  # 3 evicted and registered again in one step
    assert table.hashes(0) == {1, 3, 4}
    table.apply(0, [], [4])
    assert table.hashes(0) == {1, 3} and table.ranks_holding(4) == ()


def test_table_accepts_an_add_then_evict_in_one_batch():
    # The two lists lose their interleaving; "added then evicted" is the only order that fits.
    table = table_of({0: [1]})
    table.apply(0, [5, 6], [5])
    assert table.hashes(0) == {1, 6} and table.ranks_holding(5) == ()
    table.apply(0, [1, 5], [1, 1, 5])  # 1: evict, add, evict; 5: add, evict
    assert table.hashes(0) == {6}


@pytest.mark.parametrize(
    ("added", "evicted", "message"),
    [
        ([2], [], "rank 0: hash 2 added but it is already registered"),
        ([], [9], "rank 0: hash 9 evicted but it is not registered"),
        ([9, 9], [], "rank 0: hash 9 is not registered"),
        ([], [2, 2], "rank 0: hash 2 is registered"),
        ([2, 2], [2], "rank 0: hash 2 is registered"),
        ([7], [1, 1], "rank 0: hash 1"),  # 7 is fine; 1 still fails the batch
        ([0], [], "block hash 0"),
        ([2**63], [], "block hash"),
    ],
)
def test_routing_error_leaves_the_table_unchanged(added, evicted, message):
    table = table_of({0: [1, 2, 3], 1: [2, 20]})
    before = snapshot(table)
    with pytest.raises(RoutingError, match=message):
        table.apply(0, added, evicted)
    assert snapshot(table) == before
    assert issubclass(RoutingError, ValueError)


def test_table_takes_numpy_hashes():
    hashes = block_hashes(list(range(8)), 2)
    table = RoutingTable()
    table.apply(3, hashes, [])
    assert table.match(3, hashes) == 4 and table.ranks_holding(hashes[0]) == (3,)
    assert all(type(h) is int for h in table.hashes(3))


# --- RankPicker -----------------------------------------------------------------------------------

RANKS = [0, 1, 2, 3]
CAP = {0: 4, 1: 8, 2: 2, 3: 4}


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'random' is not one of"):
        RankPicker("random", 0.5)
    for alpha in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="alpha"):
            RankPicker("longest_prefix", alpha)
    with pytest.raises(ValueError, match="block_size"):
        RankPicker("longest_prefix", 0.5, block_size=0)
    router, table = RankPicker("load_balanced", 0.5), RoutingTable()
    with pytest.raises(ValueError, match="no ready rank"):
        router.pick([], CHAIN, {}, CAP, table)
    with pytest.raises(ValueError, match="twice"):
        router.pick([0, 1, 0], CHAIN, {}, CAP, table)
    with pytest.raises(ValueError, match="capacity of rank 5 is unknown"):
        router.pick([0, 5], CHAIN, {}, CAP, table)
    with pytest.raises(ValueError, match="capacity of rank 0"):
        router.pick([0], CHAIN, {}, {0: 0}, table)
    with pytest.raises(ValueError, match="load of rank 1"):
        router.pick([0, 1], CHAIN, {1: -1}, CAP, table)
    policies = {"round_robin", "load_balanced", "first_prefix_block", "longest_prefix"}
    assert set(PrefixCachingCoordinatorPolicy) == policies
    assert RankPicker("longest_prefix", 0.5).policy is PrefixCachingCoordinatorPolicy.LONGEST_PREFIX


def test_round_robin_cycles_whatever_the_load_and_table():
    router, table = RankPicker("round_robin", 0.5), table_of({2: CHAIN})
    load = {0: 4, 1: 0, 2: 2, 3: 0}
    assert [router.pick(RANKS, CHAIN, load, CAP, table) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert router.pick([2, 3], CHAIN, load, CAP, table) == 2  # cursor 2 wraps to index 0
    assert router.last_match == 4


def test_load_balanced_picks_the_most_free_capacity():
    router, table = RankPicker("load_balanced", 1.0), table_of({0: CHAIN})
    # free: 1/2, 3/4, 1, 0
    assert router.pick(RANKS, CHAIN, {0: 2, 1: 2, 2: 0, 3: 4}, CAP, table) == 2
    assert router.last_match == 0  # it ignores the table, but reports the chosen rank's hit
    # Overloaded ranks clamp at 0 free: rank 3 (0) ties rank 2 (0) on free, has fewer in flight.
    assert router.pick([2, 3], CHAIN, {2: 5, 3: 4}, CAP, table) == 3


def test_load_balanced_ties_fewest_in_flight_then_round_robin():
    router, table = RankPicker("load_balanced", 0.5), RoutingTable()
    # free 1/2 for both 0 (2 of 4) and 1 (4 of 8): the fewer in flight wins.
    assert router.pick([1, 0], [], {0: 2, 1: 4}, CAP, table) == 0
    # Ranks 1, 2 and 3 tie completely (idle, same capacity); 0 is busy: 1, 2, 3 take turns.
    cap = {0: 4, 1: 4, 2: 4, 3: 4}
    load = {0: 1}
    router = RankPicker("load_balanced", 0.5)
    picks = [router.pick(RANKS, [], load, cap, table) for _ in range(5)]
    assert picks == [1, 2, 3, 1, 2]
    again = RankPicker("load_balanced", 0.5)  # deterministic: the same calls give the same picks
    assert [again.pick(RANKS, [], load, cap, table) for _ in range(5)] == picks


def test_first_prefix_block_prefers_the_freest_holder():
    table = table_of({0: CHAIN, 1: CHAIN[:1], 3: CHAIN[:2], 2: [50]})
    router = RankPicker("first_prefix_block", 0.5, block_size=16)
    load = {0: 3, 1: 2, 2: 0, 3: 1}  # free: 1/4, 3/4, 1, 3/4
    # Holders of 11: 0, 1, 3. Rank 2 is idle but lacks the block; 1 and 3 tie on free, 3 has
    # fewer in flight.
    assert router.pick(RANKS, CHAIN, load, CAP, table) == 3
    assert router.last_match == 2 and router.last_match_tokens == 32
    # A holder that is not ready does not count.
    assert router.pick([1, 2], CHAIN, load, CAP, table) == 1
    assert router.last_match == 1


def test_first_prefix_block_falls_back_to_load_balanced():
    table = table_of({0: CHAIN})
    router = RankPicker("first_prefix_block", 0.5)
    load = {0: 0, 1: 1, 2: 0, 3: 1}  # free: 1, 7/8, 1, 3/4
    assert router.pick(RANKS, [77, 78], load, CAP, table) == 0  # nobody holds 77
    assert router.pick(RANKS, [], load, CAP, table) == 2  # no complete block; tie rotates
    assert router.pick([1, 2, 3], CHAIN, load, CAP, table) == 2  # holder 0 not ready
    assert router.last_match == 0 and router.last_match_tokens is None


def test_longest_prefix_trades_match_against_free_capacity():
    table = table_of({0: CHAIN, 1: CHAIN[:3], 2: CHAIN[:1]})
    load = {0: 3, 1: 2, 2: 0, 3: 0}  # free: 1/4, 3/4, 1, 1; match: 4, 3, 1, 0 of 4
    pick = {a: RankPicker("longest_prefix", a).pick(RANKS, CHAIN, load, CAP, table) for a in (0, 1)}
    assert pick == {0: 2, 1: 0}  # alpha 0: pure load (2 and 3 tie, 2 first); 1: pure match
    router = RankPicker("longest_prefix", 0.5)
    # 0.5 * match/4 + 0.5 * free: 5/8, 6/8, 5/8, 4/8
    assert router.pick(RANKS, CHAIN, load, CAP, table) == 1 and router.last_match == 3
    # No complete block: load_balanced.
    assert router.pick(RANKS, [], load, CAP, table) == 2 and router.last_match == 0


def test_longest_prefix_ties():
    table = table_of({0: CHAIN, 1: CHAIN, 2: CHAIN[:2]})
    router = RankPicker("longest_prefix", 1.0)
    # alpha 1: 0 and 1 match all four; the freer one wins (1/2 of 8 > 1/4 of 4).
    assert router.pick(RANKS, CHAIN, {0: 3, 1: 4}, CAP, table) == 1
    # Same match and free: fewer in flight (0 has 2 of 4, 1 has 4 of 8).
    assert router.pick(RANKS, CHAIN, {0: 2, 1: 4}, CAP, table) == 0
    # Scores equal on paper tie exactly although 0.1 is not a binary fraction:
    # rank 2: 0.1 * 2/4 + 0.9 * 0 = 1/20; rank 3: 0.1 * 0 + 0.9 * 1/18 = 1/20 (in floats,
    # 0.05 > 0.04999...). Free capacity decides.
    router = RankPicker("longest_prefix", 0.1)
    load, cap = {2: 4, 3: 17}, {2: 4, 3: 18}
    assert router.pick([2, 3], CHAIN, load, cap, table) == 3
    # A full tie (alpha 1, two holders, same load): round-robin order from the cursor.
    router = RankPicker("longest_prefix", 1.0)
    picks = [router.pick([2, 0, 1], CHAIN, {}, CAP | {1: 4}, table) for _ in range(3)]
    assert picks == [0, 1, 0]


# --- the table follows real pools ---------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9]]
tokens = st.integers(0, 3)
CAPACITY = 3


class TableFollowsPoolsMachine(RuleBasedStateMachine):
    """Random admits, extensions, releases and resets on real pools; each batch of events goes
    into one RoutingTable, which must then hold exactly what each pool has registered."""

    policies: tuple[str, ...] = ("lru", "ref_zero", "lru")
    sizes: tuple[int, ...] = (6, 8, 10)
    block_size = 2

    def __init__(self):
        super().__init__()
        self.pools = [PrefixBlockPool(n, p) for n, p in zip(self.sizes, self.policies, strict=True)]
        self.tokens: list[dict[int, list[int]]] = [{} for _ in self.pools]
        self.tried: list[dict[int, int]] = [{} for _ in self.pools]
        self.table = RoutingTable()
        self.chains: set[tuple[int, ...]] = set()
        self.next_id = 0

    def hashes(self, prompt: list[int]) -> list[int]:
        return [int(h) for h in block_hashes(prompt, self.block_size)]

    def publish(self, ranks=None):
        for rank in range(len(self.pools)) if ranks is None else ranks:
            added, evicted = self.pools[rank].take_events()
            self.table.apply(rank, added, evicted)

    # --- the operations an allocator performs ---

    def do_admit(self, rank: int, prompt: list[int], register: bool) -> None:
        pool, rid = self.pools[rank], self.next_id
        self.next_id += 1
        hs = self.hashes(prompt)
        self.chains.add(tuple(hs))
        matched = pool.match(hs)
        try:
            pool.allocate(rid, hs, -(-len(prompt) // self.block_size) - len(matched))
        except AllocatorError:
            return
        self.tokens[rank][rid], self.tried[rank][rid] = prompt, len(matched)
        if register:
            self.register_complete(rank, rid)

    def register_complete(self, rank: int, rid: int) -> None:
        hs = self.hashes(self.tokens[rank][rid])
        for i in range(self.tried[rank][rid], len(hs)):
            self.pools[rank].register(rid, i, hs[i], hs[i - 1] if i else NO_HASH)
        self.tried[rank][rid] = len(hs)

    def do_extend(self, rank: int, rid: int, more: list[int]) -> None:
        try:
            self.pools[rank].allocate(rid, [], 1)
        except AllocatorError:
            return
        self.tokens[rank][rid] = self.tokens[rank][rid] + more
        self.chains.add(tuple(self.hashes(self.tokens[rank][rid])))
        self.register_complete(rank, rid)

    def do_release(self, rank: int, rid: int) -> None:
        self.pools[rank].free_request(rid)
        del self.tokens[rank][rid], self.tried[rank][rid]

    def live(self) -> list[tuple[int, int]]:
        return [(rank, rid) for rank, reqs in enumerate(self.tokens) for rid in sorted(reqs)]

    # --- rules ---

    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(tokens, min_size=1, max_size=5),
        register=st.booleans(),
    )
    def admit(self, data, prefix, suffix, register):
        rank = data.draw(st.integers(0, len(self.pools) - 1))
        self.do_admit(rank, prefix + suffix, register)
        self.publish([rank])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def extend(self, data):
        rank, rid = data.draw(st.sampled_from(self.live()))
        more = data.draw(st.lists(tokens, min_size=self.block_size, max_size=self.block_size))
        self.do_extend(rank, rid, more)
        self.publish([rank])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def release(self, data):
        rank, rid = data.draw(st.sampled_from(self.live()))
        self.do_release(rank, rid)
        self.publish([rank])

    @rule(data=st.data(), num_ops=st.integers(2, 5))
    def step(self, data, num_ops):
        """Several operations, then one batch of events per rank (as an allocator step gives)."""
        for _ in range(num_ops):
            kind = data.draw(st.sampled_from(["admit", "extend", "release"]))
            if kind == "admit" or not self.live():
                rank = data.draw(st.integers(0, len(self.pools) - 1))
                prompt = data.draw(st.sampled_from(PREFIXES)) + data.draw(
                    st.lists(tokens, min_size=1, max_size=5)
                )
                self.do_admit(rank, prompt, data.draw(st.booleans()))
            elif kind == "extend":
                rank, rid = data.draw(st.sampled_from(self.live()))
                self.do_extend(rank, rid, [0] * self.block_size)
            else:
                self.do_release(*data.draw(st.sampled_from(self.live())))
        self.publish()

    @rule(data=st.data())
    def reset_rank(self, data):
        """The rank died and came back empty: its pool, pending events included, is gone."""
        rank = data.draw(st.integers(0, len(self.pools) - 1))
        self.pools[rank] = PrefixBlockPool(self.sizes[rank], self.policies[rank])
        self.tokens[rank], self.tried[rank] = {}, {}
        self.table.drop_rank(rank)

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def route(self, data):
        chain = list(data.draw(st.sampled_from(sorted(self.chains))))
        load = {rank: len(reqs) for rank, reqs in enumerate(self.tokens)}
        capacity = dict.fromkeys(range(len(self.pools)), CAPACITY)
        router = RankPicker("longest_prefix", 1.0)
        rank = router.pick(range(len(self.pools)), chain, load, capacity, self.table)
        best = max(len(pool.match(chain)) for pool in self.pools)
        assert router.last_match == len(self.pools[rank].match(chain)) == best

    # --- the table is true ---

    @invariant()
    def table_equals_pools(self):
        for rank, pool in enumerate(self.pools):
            pool.check()
            registered = {pool.hash_of(b) for b in range(pool.num_blocks)} - {NO_HASH}
            assert all(pool.hash_of(pool.block_of_hash(h)) == h for h in registered)
            assert self.table.hashes(rank) == registered
            assert self.table.num_hashes(rank) == len(registered)
            for h in registered:
                assert rank in self.table.ranks_holding(h)
            for chain in self.chains:
                assert self.table.match(rank, chain) == len(pool.match(chain))
        for chain in self.chains:
            for h in chain:
                holders = [
                    r for r, pool in enumerate(self.pools) if pool.block_of_hash(h) is not None
                ]
                assert self.table.ranks_holding(h) == tuple(holders)


class WideBlocksMachine(TableFollowsPoolsMachine):
    policies = ("ref_zero", "lru")
    sizes = (7, 6)
    block_size = 3


_settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestTableFollowsPools = TableFollowsPoolsMachine.TestCase
TestTableFollowsPools.settings = _settings
TestWideBlocks = WideBlocksMachine.TestCase
TestWideBlocks.settings = _settings
