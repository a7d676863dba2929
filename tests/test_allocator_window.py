"""The block pool's sliding-window releases (actors/allocator/prefix.py `release`, BlockOps
`release_ids` / `release_upto`): a request lets go of the leading columns of its table as a
free would (a decref: under "lru" a hashed block stays cached, matchable); its table keeps the
columns and a later free covers only the rest. A released parent may then be idle while its
child is held: leaf-first eviction never takes it (a cached child keeps its cached ancestors),
yet it is evictable last, its descendants' hashes with it, so `num_available` stays exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from taipan.actors.allocator.actor import AllocatorService
from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool
from taipan.messages.allocator import AllocatorInit, BlockOps, BlockOpsReply
from taipan.messages.block_hash import NO_HASH, block_hashes
from taipan.messages.common import ErrorReply
from tests.test_allocator_prefix import PROMPT_A, PROMPT_B, admit, hashes_of


def state(pool: PrefixBlockPool):
    owners = {rid: (pool.blocks_of(rid), pool.num_released(rid)) for rid in pool.requests()}
    blocks = [(pool.ref_count(b), pool.hash_of(b)) for b in range(pool.num_blocks)]
    return owners, blocks, pool.num_free, pool.num_cached_idle


@pytest.mark.parametrize("policy", [None, "ref_zero", "lru"])
def test_a_release_keeps_the_table_and_a_free_covers_the_rest(policy):
    pool = PrefixBlockPool(6, policy)
    pool.allocate(1, [], 4)
    assert pool.release(1, 2) == [0, 1]
    assert pool.blocks_of(1) == [0, 1, 2, 3] and pool.num_released(1) == 2
    assert pool.release(1, 2) == []  # the same count again: nothing more
    assert pool.ref_count(0) == 0 and pool.num_free == 4 and pool.num_held == 2
    pool.allocate(1, [], 1)  # it grows at the end of its table
    assert pool.blocks_of(1) == [0, 1, 2, 3, 0]
    pool.check()
    assert pool.free_request(1) == [0, 3, 2]
    assert pool.num_free == 6 and pool.requests() == [] and pool.num_released(1) == 0
    pool.check()


def test_a_request_may_release_every_block_it_has():
    pool = PrefixBlockPool(4, None)
    pool.allocate(1, [], 2)
    assert pool.release(1, 2) == [0, 1] and pool.requests() == [1]  # still its table
    pool.check()
    assert pool.free_request(1) == [] and pool.requests() == []
    pool.check()


def test_bad_releases_change_nothing():
    pool = PrefixBlockPool(6, "lru")
    admit(pool, 1, PROMPT_A)
    pool.release(1, 1)
    before = state(pool)
    for rid, upto, text in [(9, 1, "holds no blocks"), (1, 0, r"not in \[1, 4\]"), (1, 5, "4]")]:
        with pytest.raises(AllocatorError, match=text):
            pool.release(rid, upto)
        assert state(pool) == before
    with pytest.raises(AllocatorError, match="released"):
        pool.register(1, 0, hashes_of(PROMPT_A)[0], NO_HASH)


def test_lru_keeps_a_released_parent_cached_while_its_child_is_held():
    pool = PrefixBlockPool(5, "lru")
    admit(pool, 1, PROMPT_A[:12])  # blocks 0 <- 1 <- 2, registered
    h = hashes_of(PROMPT_A[:12])
    pool.take_events()
    assert pool.release(1, 2) == []  # decrefs: 0 and 1 stay cached, idle
    assert pool.num_cached_idle == 2 and pool.num_available == 4
    assert pool.match(h) == [0, 1, 2]  # still matchable, the held child too
    pool.check()
    # Leaf-first: the free blocks go first; 0 and 1 have a held child, so no leaf is idle.
    assert pool.allocate(2, [], 2) == ([], [3, 4])
    # Then the least recently used idle block with a held child: 1, and with it its
    # descendants' hashes (2, still request 1's, now private); 0 is a leaf after that.
    assert pool.allocate(2, [], 1) == ([], [1])
    assert pool.take_events() == ([], [h[2], h[1]])
    assert pool.hash_of(2) == NO_HASH and pool.ref_count(2) == 1
    pool.check()
    assert pool.allocate(3, [], 1) == ([], [0])
    assert pool.take_events() == ([], [h[0]])
    with pytest.raises(AllocatorError, match="new blocks"):
        pool.allocate(3, [], 1)
    pool.check()


def test_a_cached_child_keeps_its_cached_parent_while_leaves_are_evicted():
    pool = PrefixBlockPool(6, "lru")
    admit(pool, 1, PROMPT_A[:8])  # 0 <- 1
    admit(pool, 2, list(range(50, 58)))  # 2 <- 3
    pool.release(1, 1)  # 0 idle, its child 1 held
    pool.free_request(2)  # 3 then 2 idle: a leaf chain
    pool.take_events()
    assert pool.allocate(3, [], 4) == ([], [4, 5, 3, 2])  # the leaves first, then their parent
    assert pool.hash_of(0) != NO_HASH and pool.hash_of(1) != NO_HASH
    pool.check()


@pytest.mark.parametrize("shared", [False, True])
def test_ref_zero_frees_a_released_root_and_unregisters_its_chain(shared):
    pool = PrefixBlockPool(8, "ref_zero")
    admit(pool, 1, PROMPT_A)  # 0 <- 1 <- 2, and 3
    if shared:
        admit(pool, 2, PROMPT_B)  # shares 0 and 1
    pool.take_events()
    h = hashes_of(PROMPT_A)
    freed = pool.release(1, 1)
    if shared:  # request 2 still holds block 0: nothing changes but the ref
        assert freed == [] and pool.take_events() == ([], []) and pool.ref_count(0) == 1
    else:  # a chain without its root is never matched: its held blocks go private
        assert freed == [0] and pool.take_events() == ([], [h[2], h[1], h[0]])
        assert pool.match(h) == [] and pool.ref_count(1) == 1
    pool.check()
    pool.free_request(1)
    pool.free_request(2)
    assert pool.num_free == 8 and pool.num_hashed == 0
    pool.check()


def test_registration_after_a_released_parent_is_declined():
    pool = PrefixBlockPool(6, "lru")
    pool.allocate(1, [], 3)
    h = hashes_of(PROMPT_A[:12])
    assert pool.register(1, 0, h[0], NO_HASH)
    pool.release(1, 1)
    # (A window shorter than a block may pass the parent before its child is complete; the
    # parent may even be evicted and handed out in the very BlockOps that registers it.)
    assert not pool.register(1, 1, h[1], h[0])
    assert pool.hash_of(1) == NO_HASH
    pool.check()


def test_a_pin_releases_the_blocks_its_first_query_is_past():
    pool = PrefixBlockPool(6, "lru")
    admit(pool, 1, PROMPT_A)
    pool.free_request(1)  # 0 <- 1 <- 2 cached idle; 3, 4, 5 free
    h = hashes_of(PROMPT_A)
    # Pinning the chain with its first two blocks released takes one available block.
    assert pool.pin_and_allocate([(2, h[:3], 2)], []) == []
    assert pool.blocks_of(2) == [0, 1, 2] and pool.num_released(2) == 2
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [0, 0, 1] and pool.num_available == 5
    pool.check()
    # All five can be taken: the free ones, then 1 (idle, its child held: 2 goes private),
    # then 0. (The request gets back ids its released columns still name: never read.)
    assert pool.pin_and_allocate([], [(2, 5)]) == [3, 4, 5, 1, 0]
    assert pool.hash_of(2) == NO_HASH and pool.num_available == 0
    pool.check()


def test_a_pin_that_releases_past_its_blocks_is_refused():
    pool = PrefixBlockPool(6, "lru")
    admit(pool, 1, PROMPT_A)
    pool.free_request(1)
    before = state(pool)
    with pytest.raises(AllocatorError, match="releases 4 of the 3"):
        pool.pin_and_allocate([(2, hashes_of(PROMPT_A), 4)], [])
    assert state(pool) == before


# --- the allocator's service ------------------------------------------------------------------


def ops(step, free=(), allocs=(), pins=(), releases=()):
    i64 = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    i32 = lambda xs: np.asarray(xs, np.int32)  # noqa: E731
    return BlockOps(
        step,
        i64(free),
        i64([r for r, _ in allocs]),
        i32([n for _, n in allocs]),
        i64([r for r, _ in pins]),
        i32([len(h) for _, h in pins]),
        i64([x for _, h in pins for x in h]),
        release_ids=i64([r for r, _ in releases]),
        release_upto=i32([u for _, u in releases]),
    )


def test_the_service_releases_before_frees_and_with_pins():
    svc = AllocatorService()
    svc.handle(AllocatorInit(6, 4, "lru"))
    reply = svc.handle(ops(1, allocs=[(1, 3)]))
    assert isinstance(reply, BlockOpsReply) and reply.ok and reply.num_free == 3
    # Request 1 lets go of its first block and ends in the same step.
    reply = svc.handle(ops(2, free=[1], releases=[(1, 1)], allocs=[(2, 4)]))
    assert reply.ok and svc.pool.requests() == [2] and reply.num_free == 2
    svc.pool.check()
    # A bad release is refused whole: nothing changes.
    before = state(svc.pool)
    reply = svc.handle(ops(3, releases=[(2, 5)], allocs=[(3, 1)]))
    assert isinstance(reply, ErrorReply) and "release up to block 5" in reply.text
    reply = svc.handle(ops(3, releases=[(2, 1), (2, 2)]))
    assert isinstance(reply, ErrorReply) and "more than once" in reply.text
    assert state(svc.pool) == before


def test_the_service_pins_a_prefix_with_its_released_blocks():
    svc = AllocatorService()
    svc.handle(AllocatorInit(5, 4, "lru"))
    h = [int(x) for x in block_hashes(PROMPT_A, 4)]
    svc.handle(ops(1, allocs=[(1, 4)]))
    pool = svc.pool
    for i in range(3):
        pool.register(1, i, h[i], h[i - 1] if i else NO_HASH)
    svc.handle(ops(2, free=[1]))  # 0 <- 1 <- 2 cached idle, 3 and 4 free
    # Request 2 pins all three, released up to 2 (its first query is past them), and takes
    # 3 blocks: 2 free + 1 more, which only the release of its pin's first blocks leaves.
    reply = svc.handle(ops(3, pins=[(2, h[:3])], releases=[(2, 2)], allocs=[(2, 3)]))
    assert isinstance(reply, BlockOpsReply) and reply.ok, reply
    assert pool.blocks_of(2)[:3] == [0, 1, 2] and pool.num_released(2) == 2
    pool.check()
    reply = svc.handle(ops(4, pins=[(3, h[:1])], releases=[(3, 2)]))
    assert isinstance(reply, ErrorReply) and "releases 2 of the 1" in reply.text


# --- random sequences ---------------------------------------------------------------------------

NUM_BLOCKS = 10
BS = 2
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]
tokens = st.integers(0, 3)


class WindowPoolMachine(RuleBasedStateMachine):
    """Admit (pinning a cached prefix, maybe releasing part of it at once), extend and register,
    slide windows, free; the model tracks tokens and the published hashes."""

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.pool = PrefixBlockPool(NUM_BLOCKS, self.policy)
        self.tokens: dict[int, list[int]] = {}
        self.tried: dict[int, int] = {}
        self.parent_of: dict[int, int] = {}
        self.registered: set[int] = set()
        self.next_id = 0

    def events(self) -> None:
        added, evicted = self.pool.take_events()
        assert not self.registered.intersection(added)
        self.registered -= set(evicted)
        self.registered.update(added)

    def register_complete(self, rid):
        hs = [int(h) for h in block_hashes(self.tokens[rid], BS)]
        for i in range(max(self.tried[rid], self.pool.num_released(rid)), len(hs)):
            parent = hs[i - 1] if i else NO_HASH
            if self.pool.register(rid, i, hs[i], parent):
                self.parent_of[hs[i]] = parent
        self.tried[rid] = len(hs)
        self.events()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(tokens, min_size=1, max_size=5),
        release=st.integers(0, 4),
    )
    def admit(self, prefix, suffix, release):
        rid, self.next_id = self.next_id, self.next_id + 1
        prompt = prefix + suffix
        hs = [int(h) for h in block_hashes(prompt, BS)]
        matched = self.pool.match(hs)
        release = min(release, len(matched))
        need = -(-len(prompt) // BS) - len(matched)
        pins = [(rid, hs[: len(matched)], release)] if matched else []
        idle = sum(1 for b in matched[release:] if b in self.pool._idle)
        fits = need <= self.pool.num_available - idle
        try:
            self.pool.pin_and_allocate(pins, [(rid, need)])
        except AllocatorError:
            assert not fits, "the pool refused what num_available promised"
            return
        assert fits
        self.tokens[rid], self.tried[rid] = prompt, len(matched)
        self.events()
        self.register_complete(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(tokens, min_size=BS, max_size=BS))
    def extend(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        fits = self.pool.num_available >= 1
        try:
            self.pool.allocate(rid, [], 1)
        except AllocatorError:
            assert not fits
            return
        self.tokens[rid] = self.tokens[rid] + more
        self.events()
        self.register_complete(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def slide(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        done, size = self.pool.num_released(rid), len(self.pool.blocks_of(rid))
        available = self.pool.num_available
        upto = data.draw(st.integers(done, size))
        freed = self.pool.release(rid, upto)
        assert self.pool.num_available >= available
        for b in freed:
            assert self.pool.ref_count(b) == 0 and self.pool.hash_of(b) == NO_HASH
        self.events()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free_request(rid)
        del self.tokens[rid], self.tried[rid]
        self.events()

    @rule()
    def take_everything(self):
        """Every available block can be taken (the count is exact), then given back."""
        pool = self.pool
        n = pool.num_available
        rid, self.next_id = self.next_id, self.next_id + 1
        pool.allocate(rid, [], n)
        assert pool.num_available == 0 and pool.num_free == 0
        self.events()
        pool.free_request(rid)
        assert pool.num_available == n

    @invariant()
    def pool_is_consistent(self):
        pool = self.pool
        pool.check()
        assert pool.num_available == pool.num_free + pool.num_cached_idle
        assert pool.num_free + pool.num_cached_idle + pool.num_held == NUM_BLOCKS
        on_blocks = {pool.hash_of(b) for b in range(NUM_BLOCKS)} - {NO_HASH}
        assert on_blocks == self.registered  # the events tell the truth
        for h in self.registered:  # a cached child always has its parent cached
            assert self.parent_of[h] == NO_HASH or self.parent_of[h] in self.registered
        for rid, toks in self.tokens.items():
            assert len(pool.blocks_of(rid)) == -(-len(toks) // BS)


class LruWindowMachine(WindowPoolMachine):
    policy = "lru"


class RefZeroWindowMachine(WindowPoolMachine):
    policy = "ref_zero"


class PlainWindowMachine(WindowPoolMachine):
    policy = None

    def register_complete(self, rid):
        self.tried[rid] = 0


_settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestLruWindowRandom = LruWindowMachine.TestCase
TestLruWindowRandom.settings = _settings
TestRefZeroWindowRandom = RefZeroWindowMachine.TestCase
TestRefZeroWindowRandom.settings = _settings
TestPlainWindowRandom = PlainWindowMachine.TestCase
TestPlainWindowRandom.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
