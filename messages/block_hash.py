"""Chained KV-block hashes for prefix caching (DESIGN.md §5): one 63-bit id per complete block.

Owns: the hash function, the byte encoding it hashes and the reserved values. Two requests whose
prompts agree on their first k complete blocks (and were hashed with the same salt) get the same
first k hashes, and a block's hash names its whole prefix, not only its own tokens. The client
computes the hashes once per request; the allocator and the coordinator only compare them.
Must not touch: torch, sockets, actors. Standard library and numpy only; no state.

Formula, for complete block i (0-based) of `block_size` tokens:

    h_i = fold(SHA-256(le64(h_{i-1}) || le64(salt) || le32(tokens of block i)))
    h_{-1} = parent (NO_HASH = 0 when the blocks start the prompt)
    fold(d) = (int.from_bytes(d[:8], "little") & (2**63 - 1)) or 1

le64/le32 are little-endian int64/int32, fixed whatever the machine, so every process and every
host gets the same values (Python's built-in `hash()` is salted per process and is never used).
Token ids must lie in [0, 2**31 - 1]; no vocabulary comes near. A trailing partial block has no
hash: its contents are not final (decode appends to it), so it is never shared.

Reserved values: 0 (NO_HASH: "no parent", "no hash") and -1 never come out; every hash is in
[1, 2**63 - 1], so it fits a signed int64 and a msgpack int. The fold adds no collision class
worth the name: masking the top bit makes every 63-bit value the image of two 64-bit digest
prefixes, and `or 1` gives the value 1 two more (the two that mask to 0), so a block hashes to 1
with probability 2**-62 instead of 2**-63. (A 63-bit hash meets a random collision after about
2**31.5 distinct blocks anyway; a pool holds millions at most.)
The salt carries the weight version: after a weight update every hash changes, so KV computed
with the old weights can never match. A salt or parent outside [0, 2**63 - 1] is an error.
"""

# Design notes (kept out of the docstring):
# Why SHA-256: the prompt is chained, so the cost is one hashlib call per block plus the Python
# loop around it, and the candidates differ only in what the call costs. tests/perf/hash_bench.py,
# 32768 tokens, Python 3.11.7 / OpenSSL 3.0, x86-64 with SHA-NI (2 cores, busy; best of 7),
# microseconds per block (per 1k tokens):
#
#     H                      block_size 16   block_size 256
#     loop only (no hash)     0.30 (18.8)     0.41 (1.6)
#     sha256                  0.78 (48.7)     1.47 (5.7)
#     sha1                    0.79 (49.3)     1.45 (5.6)
#     blake2b digest_size=8   0.84 (52.5)     2.09 (8.2)
#     md5                     0.90 (56.0)     2.31 (9.0)
#     blake2s digest_size=8   0.93 (58.0)     2.90 (11.3)
#     sha512                  0.97 (60.9)     2.28 (8.9)
#     sha3_256                1.06 (66.3)     3.07 (12.0)
#     block_hashes itself     0.85 (53.2)     1.62 (6.3)
#
# At 16-token blocks the per-call overhead dominates and all are within 30%; at 256 (the default
# `block_size_tokens`) SHA-256 runs on the CPU's SHA extensions and is 1.4x faster than BLAKE2b
# (CPython 3.11's own C code). SHA-1 ties it but is broken; SHA-256 is in every hashlib and every
# FIPS build. Either way a 32k-token prompt costs 0.2 ms (256) to 1.7 ms (16) once per request. On
# a CPU without SHA extensions SHA-256 would be about BLAKE2b's speed or slower; changing H changes
# every hash (tests/test_block_hash.py pins golden values), so it is a deliberate, versioned change.
#
# Chaining through the data (parent as the first 8 bytes hashed) keeps `parent` an ordinary
# argument: hashing a prompt in two pieces, the second with parent = the first's last hash, gives
# the hashes of the whole prompt.

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import numpy as np

NO_HASH = 0
"""Reserved: "no parent" (the `parent` of a prompt's first block) or "no hash"; never returned."""
RESERVED = (0, -1)
"""Values no block hash takes; callers may use them as markers."""
MAX_HASH = (1 << 63) - 1
"""2**63 - 1. Hashes lie in [1, MAX_HASH]; `salt` and `parent` in [0, MAX_HASH]."""
MAX_TOKEN_ID = (1 << 31) - 1
"""Token ids are hashed as little-endian int32."""

_TOKEN_DTYPE = np.dtype("<i4")


def _check_int(name: str, value: object, low: int, high: int | None) -> int:
    if isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if high is None and value < low:
        raise ValueError(f"{name} ({value}) must be >= {low}")
    if high is not None and not low <= value <= high:
        raise ValueError(f"{name} ({value}) must be in [{low}, {high}]")
    return value


def _tokens(token_ids: object) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise ValueError(f"token_ids must be >= 0, got {low}")
    if high > MAX_TOKEN_ID:
        raise ValueError(f"token_ids must be <= {MAX_TOKEN_ID} (int32), got {high}")
    return arr


def block_hashes(
    token_ids: np.ndarray | Sequence[int], block_size: int, salt: int = 0, parent: int = NO_HASH
) -> np.ndarray:
    """The chained hash of each complete block of `token_ids`: int64 [len // block_size].

    `token_ids`: a 1-D integer array or list of ids in [0, 2**31 - 1]. `salt`: the weight version
    (or any [0, 2**63 - 1] value that must separate caches). `parent`: the hash of the block just
    before `token_ids[0]`, or NO_HASH when `token_ids` starts the prompt. Tokens after the last
    complete block are ignored. Raises ValueError naming the first bad argument.
    """
    block_size = _check_int("block_size", block_size, 1, None)
    salt = _check_int("salt", salt, 0, MAX_HASH)
    parent = _check_int("parent", parent, 0, MAX_HASH)
    tokens = _tokens(token_ids)
    num_blocks = len(tokens) // block_size
    if num_blocks == 0:
        return np.empty(0, dtype=np.int64)
    # One copy into the hashed encoding, then each block is a slice of one bytes object.
    data = np.ascontiguousarray(tokens[: num_blocks * block_size], dtype=_TOKEN_DTYPE).tobytes()
    step = block_size * _TOKEN_DTYPE.itemsize
    salt_bytes = salt.to_bytes(8, "little")
    sha256 = hashlib.sha256
    out = []
    h = parent
    for start in range(0, len(data), step):
        digest = sha256(h.to_bytes(8, "little") + salt_bytes + data[start : start + step]).digest()
        h = (int.from_bytes(digest[:8], "little") & MAX_HASH) or 1
        out.append(h)
    return np.array(out, dtype=np.int64)
