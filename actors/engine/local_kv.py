"""Per-layer-group KV (issue 27): the keys of a model's windowed layers, when other layers see the
whole context (Gemma 3's five local layers to one global), in a pool of their own that the
engine hands out itself (`LocalPool`); the StepPlan's local tables and slots (`local_arrays`).

The contract. A request holds a ring of r local blocks while it runs or is paused: taken when
it is admitted, given back when it ends or is evicted (a paused one keeps it). Position p's
key lives in ring[(p // block_size) % r] at offset p % block_size, so the plan's local block
table of the request is its ring repeated (column i is ring[i % r]). A windowed layer's query
at p reads keys p - W < k <= p, and every step writes its tokens' keys before any query reads:
the keys one chunk of c tokens writes and reads span at most W - 1 + c positions, which a
ring of `ring_blocks(W, block_size, c)` holds with no two in one slot. So r is that for
`local_chunk` tokens, or the blocks of the request's whole length when fewer (such a ring never
wraps), and a request whose ring wraps computes at most `local_chunk` tokens a step (the
scheduler's `fit` cuts its chunks; chunked prefill is on with a local pool).

The ring is never hashed or shared: with prefix caching on the engine asks for no local pool
(a cached prefix would need the windowed layers' keys of its last window too). The main pool
(the allocator's) then holds only the other layers, and a long request takes one block of it
per block_size tokens, of the global layers alone.

Pure: ints and lists; no sockets, no torch. Deterministic (a replay hands out the same ids).
"""

from __future__ import annotations

import numpy as np

from taipan.actors.config import ring_blocks


class LocalPool:
    """The windowed layers' blocks: `num_blocks` ids handed out as rings."""

    def __init__(self, num_blocks: int, window: int, block_size: int, chunk: int):
        if num_blocks < 1 or window < 1:
            raise ValueError(f"a local pool needs blocks and a window, got {num_blocks}, {window}")
        self.num_blocks, self.window, self.block_size, self.chunk = (
            num_blocks, window, block_size, chunk,
        )  # fmt: skip
        self.ring_blocks = ring_blocks(window, block_size, chunk)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ring_size(self, total_tokens: int) -> int:
        """The ring of a request that may grow to `total_tokens` (prompt + max_tokens)."""
        return min(self.ring_blocks, -(-total_tokens // self.block_size))

    def wraps(self, total_tokens: int) -> bool:
        """Whether a request of `total_tokens` outgrows its ring (its chunks are then cut)."""
        return self.ring_size(total_tokens) * self.block_size < total_tokens

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"the local pool has {len(self._free)} free blocks, not {n}")
        out = self._free[-n:][::-1]
        del self._free[-n:]
        return out

    def give(self, ring: list[int]) -> None:
        self._free.extend(reversed(ring))


def local_arrays(rings: list[list[int]], chunks, width: int, block_size: int) -> dict:
    """The StepPlan's local_block_tables [B, width] (each row its ring repeated) and
    local_slot_mapping [T] (the chunks' positions, in step order) for rows `rings`."""
    bs = block_size
    sizes = np.fromiter((len(r) for r in rings), dtype=np.int64, count=len(rings))
    padded = np.zeros((len(rings), int(sizes.max(initial=1))), dtype=np.int32)
    for i, r in enumerate(rings):
        padded[i, : len(r)] = r
    rows = np.arange(len(rings))
    cols = np.arange(width, dtype=np.int64)
    tables = padded[rows[:, None], cols[None, :] % sizes[:, None]]
    # Every token's position and row at once (one-token decode rows are most of a step).
    lens = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    owner = np.repeat(rows, lens)
    pos = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    blocks = padded[owner, (pos // bs) % sizes[owner]].astype(np.int64)
    return {"local_block_tables": tables, "local_slot_mapping": blocks * bs + pos % bs}
