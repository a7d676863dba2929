"""PrefixBlockPool: shared prefixes, both eviction policies, events, all-or-nothing, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool
from taipan.messages.block_hash import NO_HASH, block_hashes

BS = 4  # tokens per block in the examples


def hashes_of(tokens: list[int], block_size: int = BS) -> list[int]:
    return [int(h) for h in block_hashes(tokens, block_size)]


def admit(pool: PrefixBlockPool, rid: int, tokens: list[int]) -> tuple[list[int], list[int]]:
    """What the allocator will do: match, allocate the rest, register the new complete blocks."""
    hs = hashes_of(tokens)
    matched = pool.match(hs)
    total = -(-len(tokens) // BS)
    got = pool.allocate(rid, hs, total - len(matched))
    for i in range(len(matched), len(hs)):
        pool.register(rid, i, hs[i], hs[i - 1] if i else NO_HASH)
    return got


A = list(range(100, 112))  # three complete blocks
PROMPT_A = A + [7, 7]  # ... and a partial fourth
PROMPT_B = A[:8] + [1, 2, 3, 4, 5]  # shares A's first two blocks


@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_second_request_pins_the_shared_blocks(policy):
    pool = PrefixBlockPool(8, policy)
    assert admit(pool, 1, PROMPT_A) == ([], [0, 1, 2, 3])
    ha = hashes_of(PROMPT_A)
    assert pool.take_events() == (ha, [])
    assert [pool.hash_of(b) for b in range(4)] == [*ha, NO_HASH]
    assert admit(pool, 2, PROMPT_B) == ([0, 1], [4, 5])
    assert pool.blocks_of(2) == [0, 1, 4, 5]
    assert [pool.ref_count(b) for b in range(6)] == [2, 2, 1, 1, 1, 1]
    assert pool.match(hashes_of(PROMPT_B)) == [0, 1, 4]
    assert pool.take_events() == ([hashes_of(PROMPT_B)[2]], [])
    assert pool.num_held == 6 and pool.num_free == 2
    pool.check()


def test_ref_zero_unregisters_at_ref_zero():
    pool = PrefixBlockPool(8, "ref_zero")
    admit(pool, 1, PROMPT_A)
    admit(pool, 2, PROMPT_B)
    pool.take_events()
    ha = hashes_of(PROMPT_A)
    # Deepest first; blocks 0 and 1 are still held by request 2.
    assert pool.free_request(1) == [3, 2]
    assert pool.take_events() == ([], [ha[2]])
    assert pool.block_of_hash(ha[2]) is None and pool.block_of_hash(ha[1]) == 1
    assert pool.free_request(2) == [5, 4, 1, 0]
    assert pool.take_events() == ([], [hashes_of(PROMPT_B)[2], ha[1], ha[0]])
    assert pool.num_free == 8 and pool.num_cached_idle == 0
    assert pool.match(ha) == []
    pool.check()


def test_lru_keeps_hashed_blocks_for_a_later_request():
    pool = PrefixBlockPool(8, "lru")
    admit(pool, 1, PROMPT_A)
    pool.take_events()
    assert pool.free_request(1) == [3]  # only the partial, unhashed block is freed
    assert pool.take_events() == ([], [])
    assert pool.num_cached_idle == 3 and pool.num_held == 0 and pool.num_free == 5
    assert pool.ref_count(0) == 0 and pool.hash_of(0) == hashes_of(PROMPT_A)[0]
    assert admit(pool, 2, PROMPT_B) == ([0, 1], [3, 4])
    assert pool.num_cached_idle == 1  # block 2 still idle; 0 and 1 held again
    assert pool.ref_count(0) == 1
    pool.check()


def test_lru_evicts_least_recently_used_leaf_first():
    pool = PrefixBlockPool(4, "lru")
    a, b = list(range(8)), list(range(50, 58))
    admit(pool, 1, a)  # blocks 0 <- 1
    admit(pool, 2, b)  # blocks 2 <- 3
    pool.free_request(1)  # 1 then 0 become idle
    pool.free_request(2)  # 3 then 2
    pool.take_events()
    ha, hb = hashes_of(a), hashes_of(b)
    assert pool.allocate(3, [], 1) == ([], [1])
    assert pool.take_events() == ([], [ha[1]])
    assert pool.allocate(3, [], 2) == ([], [0, 3])  # 0 became a leaf when 1 went
    assert pool.take_events() == ([], [ha[0], hb[1]])
    assert pool.match(hb) == [2]
    pool.check()


def test_lru_never_evicts_a_block_whose_child_is_cached():
    pool = PrefixBlockPool(3, "lru")
    chain = list(range(12))
    admit(pool, 1, chain)  # 0 <- 1 <- 2
    pool.free_request(1)
    # Releases always leave a parent more recent than its children; make the root the oldest
    # by hand to show that the leaf rule, not recency alone, protects it.
    pool._idle = {0: 1, 1: 2, 2: 3}
    pool._lru = sorted((r, b) for b, r in pool._idle.items() if pool._kids[b] == 0)
    pool.check()
    h = hashes_of(chain)
    assert pool.allocate(2, [], 1) == ([], [2])
    assert pool.allocate(2, [], 1) == ([], [1])
    assert pool.allocate(2, [], 1) == ([], [0])
    assert pool.take_events() == (h, [h[2], h[1], h[0]])
    pool.check()


@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_failed_allocation_changes_nothing(policy):
    pool = PrefixBlockPool(5, policy)
    admit(pool, 1, PROMPT_A)  # 4 blocks
    pool.free_request(1)
    pool.take_events()
    before = [(pool.ref_count(b), pool.hash_of(b)) for b in range(5)]
    counts = (pool.num_free, pool.num_cached_idle, pool.num_held)
    # Would pin blocks 0..1 (lru) and then need more than the rest.
    with pytest.raises(AllocatorError, match="new blocks"):
        pool.allocate(2, hashes_of(PROMPT_B), 6)
    assert [(pool.ref_count(b), pool.hash_of(b)) for b in range(5)] == before
    assert (pool.num_free, pool.num_cached_idle, pool.num_held) == counts
    assert pool.blocks_of(2) == [] and pool.take_events() == ([], [])
    pool.check()
    # The same pool still serves what fits, evicting under lru.
    matched, new = pool.allocate(2, hashes_of(PROMPT_B), 3)
    assert len(matched) + len(new) == (5 if policy == "lru" else 3)
    pool.check()


def test_duplicate_registration_keeps_the_first_block():
    pool = PrefixBlockPool(8, "lru")
    pool.allocate(1, [], 2)
    pool.allocate(2, [], 2)  # computed the same prompt in the same step, no match yet
    h = hashes_of(A[:8])
    assert pool.register(1, 0, h[0], NO_HASH) and pool.register(1, 1, h[1], h[0])
    assert not pool.register(2, 0, h[0], NO_HASH)
    assert not pool.register(2, 1, h[1], h[0])  # its parent is a private copy
    assert not pool.register(1, 0, h[0], NO_HASH)  # again: a no-op
    assert pool.block_of_hash(h[0]) == 0 and pool.hash_of(2) == NO_HASH
    assert pool.take_events() == (h, [])
    assert pool.free_request(2) == [3, 2]  # private blocks go straight back
    pool.check()


def test_bad_arguments_raise():
    with pytest.raises(AllocatorError, match="'fifo'"):
        PrefixBlockPool(4, "fifo")
    with pytest.raises(AllocatorError, match="num_blocks"):
        PrefixBlockPool(0, "lru")
    pool = PrefixBlockPool(4, "lru")
    h = hashes_of(A)
    with pytest.raises(AllocatorError, match="negative"):
        pool.allocate(1, [], -1)
    pool.allocate(1, h, 2)
    with pytest.raises(AllocatorError, match="only grow"):
        pool.allocate(1, h, 1)
    with pytest.raises(AllocatorError, match="holds no blocks"):
        pool.register(9, 0, h[0], NO_HASH)
    with pytest.raises(AllocatorError, match="index 2"):
        pool.register(1, 2, h[0], NO_HASH)
    for bad in (0, -1, 2**63):
        with pytest.raises(AllocatorError, match="block hash"):
            pool.register(1, 0, bad, NO_HASH)
    with pytest.raises(AllocatorError, match="NO_HASH"):
        pool.register(1, 0, h[0], h[1])
    pool.register(1, 0, h[0], NO_HASH)
    with pytest.raises(AllocatorError, match="already carries"):
        pool.register(1, 0, h[1], NO_HASH)
    with pytest.raises(AllocatorError, match="carries"):
        pool.register(1, 1, h[1], h[2])
    assert pool.free_request(9) == []
    pool.check()


def test_check_catches_corruption():
    pool = PrefixBlockPool(4, "lru")
    admit(pool, 1, A[:8])
    pool._free.append(0)  # block 0 is held by request 1
    with pytest.raises(AssertionError):
        pool.check()


# --- random sequences ---------------------------------------------------------------------------

NUM_BLOCKS = 10
SMALL_BS = 2
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]
tokens = st.integers(0, 3)


class PrefixPoolMachine(RuleBasedStateMachine):
    """Admit, extend and release requests; the model tracks tokens and the published hashes."""

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.pool = PrefixBlockPool(NUM_BLOCKS, self.policy)
        self.tokens: dict[int, list[int]] = {}
        self.tried: dict[int, int] = {}  # blocks of each request already offered to register
        self.parent_of: dict[int, int] = {}  # hash -> its parent hash, once registered
        self.registered: set[int] = set()  # what the events say is registered
        self.next_id = 0

    def snapshot(self):
        pool = self.pool
        blocks = [(pool.ref_count(b), pool.hash_of(b)) for b in range(NUM_BLOCKS)]
        owners = {rid: pool.blocks_of(rid) for rid in pool.requests()}
        return blocks, owners, pool.num_free, pool.num_cached_idle, sorted(pool._free)

    def allocate(self, rid, hashes, num_new):
        pool = self.pool
        before = self.snapshot()
        was_block = {h: pool.block_of_hash(h) for h in self.registered}
        try:
            got = pool.allocate(rid, hashes, num_new)
        except AllocatorError:
            assert self.snapshot() == before
            assert pool.take_events() == ([], [])
            return None
        added, evicted = pool.take_events()
        assert not added
        assert not evicted or self.policy == "lru"
        self.registered -= set(evicted)
        for h in evicted:
            b = was_block[h]
            assert before[0][b][0] == 0, "evicted a held block"
            assert b in got[1], "an evicted block went to someone else"
            assert all(self.parent_of[x] != h for x in self.registered), "evicted a parent"
        return got

    def register_complete(self, rid):
        hs = [int(h) for h in block_hashes(self.tokens[rid], SMALL_BS)]
        for i in range(self.tried[rid], len(hs)):
            parent = hs[i - 1] if i else NO_HASH
            if self.pool.register(rid, i, hs[i], parent):
                self.parent_of[hs[i]] = parent
        self.tried[rid] = len(hs)
        added, evicted = self.pool.take_events()
        assert not evicted and not self.registered.intersection(added)
        self.registered.update(added)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, min_size=1, max_size=5))
    def admit(self, prefix, suffix):
        rid, self.next_id = self.next_id, self.next_id + 1
        prompt = prefix + suffix
        hs = [int(h) for h in block_hashes(prompt, SMALL_BS)]
        matched = self.pool.match(hs)
        got = self.allocate(rid, hs, -(-len(prompt) // SMALL_BS) - len(matched))
        if got is None:
            return
        assert got[0] == matched
        self.tokens[rid], self.tried[rid] = prompt, len(matched)
        self.register_complete(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(tokens, min_size=SMALL_BS, max_size=SMALL_BS))
    def extend(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.allocate(rid, [], 1) is None:
            return
        self.tokens[rid] = self.tokens[rid] + more
        self.register_complete(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        pool = self.pool
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        held = pool.blocks_of(rid)
        freed = pool.free_request(rid)
        del self.tokens[rid], self.tried[rid]
        assert set(freed) <= set(held)
        for b in freed:
            assert pool.ref_count(b) == 0 and pool.hash_of(b) == NO_HASH
        added, evicted = pool.take_events()
        assert not added and (not evicted or self.policy == "ref_zero")
        self.registered -= set(evicted)

    @invariant()
    def pool_is_consistent(self):
        pool = self.pool
        pool.check()
        refs = [pool.ref_count(b) for b in range(NUM_BLOCKS)]
        assert min(refs) >= 0
        assert all(refs[b] == 0 and pool.hash_of(b) == NO_HASH for b in pool._free)
        assert sum(r > 0 for r in refs) == pool.num_held
        assert pool.num_free + pool.num_cached_idle + pool.num_held == NUM_BLOCKS
        if self.policy == "ref_zero":
            assert pool.num_cached_idle == 0
        on_blocks = {pool.hash_of(b): b for b in range(NUM_BLOCKS) if pool.hash_of(b) != NO_HASH}
        assert set(on_blocks) == self.registered  # the events tell the truth
        for h, b in on_blocks.items():
            assert pool.block_of_hash(h) == b
        for h in self.parent_of:
            if h not in self.registered:
                assert pool.block_of_hash(h) is None
        for h in self.registered:  # a cached child always has its parent cached
            assert self.parent_of[h] == NO_HASH or self.parent_of[h] in self.registered
        for rid, toks in self.tokens.items():
            assert len(pool.blocks_of(rid)) == -(-len(toks) // SMALL_BS)


class LruMachine(PrefixPoolMachine):
    policy = "lru"


class RefZeroMachine(PrefixPoolMachine):
    policy = "ref_zero"


_settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestLruRandom = LruMachine.TestCase
TestLruRandom.settings = _settings
TestRefZeroRandom = RefZeroMachine.TestCase
TestRefZeroRandom.settings = _settings
