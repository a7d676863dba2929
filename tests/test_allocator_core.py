"""The block pool with prefix caching off (PrefixBlockPool, policy None), the allocator's pure
core when no prefix policy is set: invariants under random use, all or nothing, lowest ids
first (the determinism replay relies on), and no registration ever."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool


def plain(num_blocks: int) -> PrefixBlockPool:
    return PrefixBlockPool(num_blocks, None)


def take(pool: PrefixBlockPool, rid: int, n: int) -> list[int]:
    return pool.pin_and_allocate([], [(rid, n)])


def test_lowest_free_blocks_first_and_reused_after_free():
    pool = plain(8)
    assert take(pool, 1, 3) == [0, 1, 2]
    assert take(pool, 2, 2) == [3, 4]
    assert pool.free_request(1) == [2, 1, 0]  # (deepest block first)
    # Freed low blocks come back before the untouched high ones: same calls, same ids.
    assert take(pool, 3, 4) == [0, 1, 2, 5]
    assert pool.blocks_of(3) == [0, 1, 2, 5]
    assert pool.num_free == pool.num_available == 8 - 6
    pool.check()


def test_allocate_appends_to_the_request_table():
    pool = plain(4)
    take(pool, 7, 1)
    take(pool, 7, 2)
    assert pool.blocks_of(7) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]


def test_unknown_request_free_is_a_noop():
    pool = plain(4)
    assert pool.free_request(99) == []
    assert pool.num_free == 4
    assert pool.blocks_of(99) == []


def test_too_many_blocks_says_how_many():
    pool = plain(4)
    take(pool, 1, 3)
    with pytest.raises(AllocatorError, match=r"asked for 2 blocks but only 1 of 4 are free$"):
        take(pool, 2, 2)
    assert pool.num_free == 1
    assert pool.blocks_of(2) == []


def test_a_step_is_all_or_nothing():
    pool = plain(5)
    with pytest.raises(AllocatorError):
        pool.pin_and_allocate([], [(1, 2), (2, 2), (3, 2)])
    assert pool.num_free == 5 and pool.requests() == []
    assert pool.pin_and_allocate([], [(1, 2), (2, 0), (3, 3)]) == [0, 1, 2, 3, 4]
    assert pool.blocks_of(2) == []
    pool.check()


def test_negative_counts_and_registrations_are_refused():
    pool = plain(4)
    with pytest.raises(AllocatorError, match="block count -1 is negative"):
        pool.pin_and_allocate([], [(1, -1)])
    take(pool, 1, 1)
    with pytest.raises(AllocatorError, match="prefix caching is off"):
        pool.register(1, 0, 12345, 0)
    assert pool.num_hashed == 0 and pool.take_events() == ([], [])


def test_pool_needs_a_block_and_a_known_policy():
    with pytest.raises(AllocatorError, match="num_blocks"):
        plain(0)
    with pytest.raises(AllocatorError, match="or None: off"):
        PrefixBlockPool(4, "fifo")


def test_invariant_checker_catches_corruption():
    pool = plain(4)
    take(pool, 1, 2)
    pool._free.append(0)  # block 0 is held by request 1
    with pytest.raises(AssertionError):
        pool.check()


# A step: free some requests (by index into the ids seen so far), then allocate a batch.
ops = st.lists(
    st.tuples(
        st.lists(st.integers(0, 30), max_size=4),
        st.lists(
            st.tuples(st.integers(0, 30), st.integers(0, 6)), max_size=4, unique_by=lambda a: a[0]
        ),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 40), steps=ops)
def test_random_steps_keep_invariants(num_blocks, steps):
    pool = plain(num_blocks)
    model: dict[int, list[int]] = {}  # what every request should hold
    for frees, allocs in steps:
        for rid in frees:
            assert sorted(pool.free_request(rid)) == sorted(model.pop(rid, []))
        before = pool.num_free
        if sum(n for _, n in allocs) > before:
            with pytest.raises(AllocatorError):
                pool.pin_and_allocate([], allocs)
            assert pool.num_free == before  # nothing moved
        else:
            got = pool.pin_and_allocate([], allocs)
            assert len(got) == sum(n for _, n in allocs) == before - pool.num_free
            pos = 0
            for rid, n in allocs:
                model.setdefault(rid, []).extend(got[pos : pos + n])
                pos += n
            model = {rid: b for rid, b in model.items() if b}
        pool.check()
        assert {rid: pool.blocks_of(rid) for rid in pool.requests()} == model
        held = sum(len(b) for b in model.values())
        assert pool.num_free == num_blocks - held


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_same_calls_same_blocks(counts):
    """Determinism that replay --check relies on: two pools fed alike hand out the same ids."""
    a, b = plain(64), plain(64)
    for i, n in enumerate(counts):
        if i % 3 == 2:
            a.free_request(i - 2)
            b.free_request(i - 2)
        if n <= a.num_free:
            assert take(a, i, n) == take(b, i, n)
