"""messages/block_hash.py: the chained KV-block hash for prefix caching (DESIGN.md §5)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.messages.block_hash import MAX_HASH, MAX_TOKEN_ID, NO_HASH, RESERVED, block_hashes

# Pinned: a change of H, of the byte encoding or of the fold changes these, and every cached
# hash with them. Change them only on purpose.
GOLDEN_ARANGE32_BS16 = [6105153716639429441, 8546853968277303893]
GOLDEN_ARANGE32_BS16_SALT1 = [9114112325986160314, 4655966015222215511]
GOLDEN_SALT7_PARENT = [3267263049988760795, 4423211951154557282]


def reference(tokens: list[int], block_size: int, salt: int = 0, parent: int = 0) -> list[int]:
    """The formula of the module docstring, written out one token at a time."""
    out, h = [], parent
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = h.to_bytes(8, "little") + salt.to_bytes(8, "little")
        data += b"".join(t.to_bytes(4, "little") for t in block)
        h = (int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & MAX_HASH) or 1
        out.append(h)
    return out


def test_golden_values():
    assert block_hashes(np.arange(32), 16).tolist() == GOLDEN_ARANGE32_BS16
    assert block_hashes(np.arange(32), 16, salt=1).tolist() == GOLDEN_ARANGE32_BS16_SALT1
    assert block_hashes([1, 2, 3, 4, 5], 2, salt=7, parent=12345).tolist() == GOLDEN_SALT7_PARENT


def test_matches_the_formula():
    tokens = np.random.default_rng(1).integers(0, 200_000, 1000).tolist()
    for block_size, salt, parent in [(1, 0, 0), (16, 3, 0), (7, MAX_HASH, MAX_HASH), (256, 9, 1)]:
        got = block_hashes(tokens, block_size, salt=salt, parent=parent).tolist()
        assert got == reference(tokens, block_size, salt, parent)


def test_equal_across_processes():
    code = (
        "import numpy as np; from taipan.messages.block_hash import block_hashes; "
        "print(block_hashes(np.arange(1000) * 7 % 50000, 16, salt=42).tolist())"
    )
    # A fresh interpreter with its own hash() seed must agree.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    expected = block_hashes(np.arange(1000) * 7 % 50000, 16, salt=42).tolist()
    assert done.stdout.strip() == str(expected)


def test_dtype_and_shape():
    out = block_hashes(np.arange(100), 16)
    assert out.dtype == np.int64 and out.shape == (6,)
    assert block_hashes([], 4).shape == (0,) and block_hashes([], 4).dtype == np.int64


def test_prefix_property():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 32000, 10 * 16)
    b = a.copy()
    b[3 * 16 + 5] += 1  # inside block 3: blocks 0-2 are shared, 3 onwards differ
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert (ha[:3] == hb[:3]).all()
    assert (ha[3:] != hb[3:]).all()


def test_a_block_hash_names_its_prefix():
    # The same block after different prefixes hashes differently.
    block = [5] * 8
    assert block_hashes([1] * 8 + block, 8)[1] != block_hashes([2] * 8 + block, 8)[1]


def test_split_with_parent_equals_whole():
    tokens = np.random.default_rng(3).integers(0, 32000, 1000)
    whole = block_hashes(tokens, 16, salt=5)
    for k in (0, 1, 30, 62):
        head = block_hashes(tokens[: k * 16], 16, salt=5)
        parent = int(head[-1]) if k else NO_HASH
        tail = block_hashes(tokens[k * 16 :], 16, salt=5, parent=parent)
        assert np.concatenate([head, tail]).tolist() == whole.tolist()


def test_trailing_partial_block_is_not_hashed():
    tokens = list(range(50))
    assert len(block_hashes(tokens, 16)) == 3
    assert block_hashes(tokens, 16).tolist() == block_hashes(tokens[:48], 16).tolist()
    assert len(block_hashes(tokens[:15], 16)) == 0
    assert block_hashes(tokens, 16).tolist() == block_hashes(tokens[:48] + [9, 9], 16).tolist()


def test_salt_changes_every_hash():
    tokens = np.random.default_rng(4).integers(0, 32000, 64 * 16)
    h0, h1 = block_hashes(tokens, 16, salt=0), block_hashes(tokens, 16, salt=1)
    assert (h0 != h1).all()
    assert not set(h0.tolist()) & set(h1.tolist())


def test_range():
    tokens = np.random.default_rng(5).integers(0, MAX_TOKEN_ID, 4096, endpoint=True)
    for block_size in (1, 3, 16):
        for salt, parent in [(0, 0), (MAX_HASH, MAX_HASH)]:
            out = block_hashes(tokens, block_size, salt=salt, parent=parent)
            assert out.min() >= 1 and out.max() <= MAX_HASH
            assert not set(out.tolist()) & set(RESERVED)


def test_input_types_agree():
    ids = [0, 1, 17, 31999, 128_255, MAX_TOKEN_ID] * 8
    expected = block_hashes(ids, 4).tolist()
    for dtype in (np.int32, np.int64, np.uint32, np.uint64, ">i4", ">i8"):
        assert block_hashes(np.array(ids, dtype=dtype), 4).tolist() == expected, dtype
    assert block_hashes(ids, np.int64(4), salt=np.int32(0)).tolist() == expected


def test_non_contiguous_view():
    ids = np.arange(200, dtype=np.int64)
    assert block_hashes(ids[::2], 8).tolist() == block_hashes(ids[::2].copy(), 8).tolist()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -3}, "block_size"),
        ({"block_size": 2.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"salt": -1}, "salt"),
        ({"salt": MAX_HASH + 1}, "salt"),
        ({"salt": 1.5}, "salt"),
        ({"parent": -1}, "parent"),
        ({"parent": MAX_HASH + 1}, "parent"),
        ({"parent": "1"}, "parent"),
        ({"token_ids": [[1, 2], [3, 4]]}, "token_ids"),
        ({"token_ids": 7}, "token_ids"),
        ({"token_ids": [1.0, 2.0]}, "token_ids"),
        ({"token_ids": [True, False]}, "token_ids"),
        ({"token_ids": ["a", "b"]}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": np.array([5, -2], dtype=np.int32)}, "token_ids"),
        ({"token_ids": [MAX_TOKEN_ID + 1]}, "token_ids"),
        ({"token_ids": np.array([2**40], dtype=np.uint64)}, "token_ids"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = {"token_ids": [1, 2, 3, 4], "block_size": 2} | kwargs
    with pytest.raises(ValueError, match=name):
        block_hashes(**args)


token_arrays = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=0, max_size=300)


@settings(max_examples=100, deadline=None)
@given(
    tokens=token_arrays,
    block_size=st.integers(1, 40),
    salt=st.integers(0, MAX_HASH),
    split=st.integers(0, 20),
    change=st.integers(0, 299),
)
def test_prefix_and_split_properties(tokens, block_size, salt, split, change):
    whole = block_hashes(np.array(tokens, dtype=np.int64), block_size, salt=salt)
    assert len(whole) == len(tokens) // block_size
    # Split after `k` complete blocks, chain the rest through `parent`.
    k = min(split, len(whole))
    head = block_hashes(tokens[: k * block_size], block_size, salt=salt)
    parent = int(head[-1]) if k else NO_HASH
    tail = block_hashes(tokens[k * block_size :], block_size, salt=salt, parent=parent)
    assert np.concatenate([head, tail]).tolist() == whole.tolist()
    # Change one token: hashes before its block stay, from its block on they all change.
    if tokens:
        i = change % len(tokens)
        other = list(tokens)
        other[i] = (other[i] + 1) % (MAX_TOKEN_ID + 1)
        changed = block_hashes(other, block_size, salt=salt)
        j = i // block_size
        assert changed[:j].tolist() == whole[:j].tolist()
        assert (changed[j:] != whole[j:]).all()
