"""BlockPool, the pure core of the allocator: invariants under random use, all-or-nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.actors.allocator.core import AllocatorError, BlockPool


def test_lowest_free_blocks_first_and_reused_after_free():
    pool = BlockPool(8)
    assert pool.allocate(1, 3) == [0, 1, 2]
    assert pool.allocate(2, 2) == [3, 4]
    assert pool.free_request(1) == 3
    # Freed low blocks come back before the untouched high ones: same calls, same ids.
    assert pool.allocate(3, 4) == [0, 1, 2, 5]
    assert pool.blocks_of(3) == [0, 1, 2, 5]
    assert pool.num_free == 8 - 6
    pool.check_invariants()


def test_allocate_appends_to_the_request_table():
    pool = BlockPool(4)
    pool.allocate(7, 1)
    pool.allocate(7, 2)
    assert pool.blocks_of(7) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]


def test_unknown_request_free_is_a_noop():
    pool = BlockPool(4)
    assert pool.free_request(99) == 0
    assert pool.num_free == 4
    assert pool.blocks_of(99) == []


def test_too_many_blocks_says_how_many():
    pool = BlockPool(4)
    pool.allocate(1, 3)
    with pytest.raises(AllocatorError, match="asked for 2 blocks but only 1 of 4 are free"):
        pool.allocate(2, 2)
    assert pool.num_free == 1
    assert pool.blocks_of(2) == []


def test_batch_is_all_or_nothing():
    pool = BlockPool(5)
    with pytest.raises(AllocatorError):
        pool.allocate_batch([1, 2, 3], [2, 2, 2])
    assert pool.num_free == 5 and pool.requests() == []
    assert pool.allocate_batch([1, 2, 3], [2, 0, 3]) == [0, 1, 2, 3, 4]
    assert pool.blocks_of(2) == []
    pool.check_invariants()


@pytest.mark.parametrize("ids, counts", [([1], [-1]), ([1, 2], [1])])
def test_bad_batch_arguments(ids, counts):
    pool = BlockPool(4)
    with pytest.raises(AllocatorError):
        pool.allocate_batch(ids, counts)
    assert pool.num_free == 4


def test_pool_needs_a_block():
    with pytest.raises(AllocatorError, match="num_blocks"):
        BlockPool(0)


def test_invariant_checker_catches_corruption():
    pool = BlockPool(4)
    pool.allocate(1, 2)
    pool._free.append(0)  # block 0 is held by request 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


# A step: free some requests (by index into the ids seen so far), then allocate a batch.
ops = st.lists(
    st.tuples(
        st.lists(st.integers(0, 30), max_size=4),
        st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6)), max_size=4),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 40), steps=ops)
def test_random_steps_keep_invariants(num_blocks, steps):
    pool = BlockPool(num_blocks)
    model: dict[int, list[int]] = {}  # what every request should hold
    for frees, allocs in steps:
        for rid in frees:
            assert pool.free_request(rid) == len(model.pop(rid, []))
        ids = [rid for rid, _ in allocs]
        counts = [n for _, n in allocs]
        before = pool.num_free
        if sum(counts) > before:
            with pytest.raises(AllocatorError):
                pool.allocate_batch(ids, counts)
            assert pool.num_free == before  # nothing moved
        else:
            got = pool.allocate_batch(ids, counts)
            assert len(got) == sum(counts) == before - pool.num_free
            pos = 0
            for rid, n in allocs:
                model.setdefault(rid, []).extend(got[pos : pos + n])
                pos += n
            model = {rid: b for rid, b in model.items() if b}
        pool.check_invariants()
        assert {rid: pool.blocks_of(rid) for rid in pool.requests()} == model
        held = sum(len(b) for b in model.values())
        assert pool.num_free == num_blocks - held


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_same_calls_same_blocks(counts):
    """Determinism that replay --check relies on: two pools fed alike hand out the same ids."""
    a, b = BlockPool(64), BlockPool(64)
    for i, n in enumerate(counts):
        if i % 3 == 2:
            a.free_request(i - 2)
            b.free_request(i - 2)
        if n <= a.num_free:
            assert a.allocate(i, n) == b.allocate(i, n)
