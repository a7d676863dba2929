"""Which H for the chained KV-block hash (messages/block_hash.py); a timing script, not a test.

Usage: python tests/perf/hash_bench.py [TOKENS] (default 32768).
Every candidate runs the same chained loop as `block_hashes`: one call per complete block over
parent (8 bytes) || salt (8 bytes) || the block's tokens as little-endian int32, then the first 8
bytes of the digest folded to 63 bits. "loop only" hashes nothing (a constant digest): the floor
that the Python loop, the slicing and the fold cost on their own. Two other framings follow
(sha256, the chosen H, fed in three updates over a memoryview; blake2b with parent and salt in
its salt parameter), then `block_hashes` itself, argument checks and int32 copy included. Each
row is the best of 7 runs, in microseconds per block and per 1k tokens.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from collections.abc import Callable

import numpy as np

from taipan.messages.block_hash import block_hashes

MASK = (1 << 63) - 1
REPEATS = 7


def chained(new: Callable[[bytes], object]) -> Callable[[bytes, int, bytes], list[int]]:
    """The block_hashes loop with `new(data)` (a hashlib constructor) as H."""

    def run(data: bytes, step: int, salt: bytes) -> list[int]:
        out = []
        h = 0
        for start in range(0, len(data), step):
            d = new(h.to_bytes(8, "little") + salt + data[start : start + step]).digest()
            h = (int.from_bytes(d[:8], "little") & MASK) or 1
            out.append(h)
        return out

    return run


def loop_only(data: bytes, step: int, salt: bytes) -> list[int]:
    out = []
    h = 0
    digest = b"\x01" * 8
    for start in range(0, len(data), step):
        _ = h.to_bytes(8, "little") + salt + data[start : start + step]
        h = (int.from_bytes(digest, "little") & MASK) or 1
        out.append(h)
    return out


def sha256_updates(data: bytes, step: int, salt: bytes) -> list[int]:
    """Three update calls instead of one concatenation, over a memoryview (no slice copy)."""
    out = []
    h = 0
    view = memoryview(data)
    for start in range(0, len(data), step):
        hasher = hashlib.sha256(h.to_bytes(8, "little"))
        hasher.update(salt)
        hasher.update(view[start : start + step])
        h = (int.from_bytes(hasher.digest()[:8], "little") & MASK) or 1
        out.append(h)
    return out


def blake2b_param(data: bytes, step: int, salt: bytes) -> list[int]:
    """Parent and salt in BLAKE2b's 16-byte salt parameter, the tokens as the only data."""
    out = []
    h = 0
    for start in range(0, len(data), step):
        d = hashlib.blake2b(
            data[start : start + step], digest_size=8, salt=h.to_bytes(8, "little") + salt
        ).digest()
        h = (int.from_bytes(d, "little") & MASK) or 1
        out.append(h)
    return out


CANDIDATES: dict[str, Callable[[bytes, int, bytes], list[int]]] = {
    "loop only (no hash)": loop_only,
    "blake2b digest_size=8": chained(lambda b: hashlib.blake2b(b, digest_size=8)),
    "blake2s digest_size=8": chained(lambda b: hashlib.blake2s(b, digest_size=8)),
    "sha256": chained(hashlib.sha256),
    "sha1": chained(hashlib.sha1),
    "md5": chained(hashlib.md5),
    "sha512": chained(hashlib.sha512),
    "sha3_256": chained(hashlib.sha3_256),
    "sha256, 3 updates + memoryview": sha256_updates,
    "blake2b, salt= parameter": blake2b_param,
}


def best_of(fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    num_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    tokens = np.random.default_rng(0).integers(0, 128_256, num_tokens, dtype=np.int64)
    salt = (7).to_bytes(8, "little")
    print(f"python {platform.python_version()}, {platform.machine()}, {num_tokens} tokens")
    for block_size in (16, 256):
        blocks = num_tokens // block_size
        data = tokens[: blocks * block_size].astype("<i4").tobytes()
        step = 4 * block_size
        rows = {
            name: (lambda f=f, data=data, step=step: f(data, step, salt))
            for name, f in CANDIDATES.items()
        }
        rows["block_hashes (int64 array in)"] = lambda bs=block_size: block_hashes(tokens, bs, 7)
        print(f"\nblock_size {block_size}: {blocks} blocks")
        print(f"  {'candidate':34s} {'us/block':>9s} {'us/1k tok':>10s} {'ms total':>9s}")
        for name, fn in rows.items():
            seconds = best_of(fn)
            per_block = seconds / blocks * 1e6
            per_1k = seconds / num_tokens * 1e9
            print(f"  {name:34s} {per_block:9.3f} {per_1k:10.1f} {seconds * 1e3:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
