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

With prefix caching the pool also caches: each complete prompt block a step computes has its
windowed layers' keys saved from the ring into a cached block of this pool after that step's
forward (StepPlan.local_save_*), under its prefix hash (actors/engine/prefix.py), usable once
that step's result is back; a later prefix hit uses only as many matched blocks as have the
windowed keys of the window before the hit cached (`usable_hit`: the key of a windowed layer at
p depends on the window before p through every layer below it, so those keys cannot be
recomputed from the window alone), and those are copied into the new ring before its first
step's forward (StepPlan.local_copy_*; all copies of a step read before any writes, so a cached
block handed out again in the same plan is still read intact). Cached blocks are evicted least
recently used first when a ring or a save needs a block, and dropped with the prefix cache.

Pure: ints and lists; no sockets, no torch. Deterministic (a replay hands out the same ids).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from taipan.actors.config import ring_blocks


class LocalPool:
    """The windowed layers' blocks: `num_blocks` ids handed out as rings, and with prefix
    caching (`caching`) the windowed keys of cached prompt blocks."""

    def __init__(
        self, num_blocks: int, window: int, block_size: int, chunk: int, caching: bool = False
    ):
        if num_blocks < 1 or window < 1:
            raise ValueError(f"a local pool needs blocks and a window, got {num_blocks}, {window}")
        self.num_blocks, self.window, self.block_size, self.chunk = (
            num_blocks, window, block_size, chunk,
        )  # fmt: skip
        self.caching = caching
        self.ring_blocks = ring_blocks(window, block_size, chunk)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids first
        self._cache: OrderedDict[int, int] = OrderedDict()  # hash -> block, oldest use first
        self.writing: dict[int, int] = {}  # hash -> the step whose forward saves it
        self.num_copied = 0  # cached blocks copied into rings (stats)

    @property
    def num_free(self) -> int:
        """Blocks a ring may take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cache)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def ring_size(self, total_tokens: int) -> int:
        """The ring of a request that may grow to `total_tokens` (prompt + max_tokens)."""
        return min(self.ring_blocks, -(-total_tokens // self.block_size))

    def wraps(self, total_tokens: int) -> bool:
        """Whether a request of `total_tokens` outgrows its ring (its chunks are then cut)."""
        return self.ring_size(total_tokens) * self.block_size < total_tokens

    def take(self, n: int) -> list[int]:
        """n blocks, the least recently used cached ones evicted if the free ones are short."""
        if n > self.num_free:
            raise RuntimeError(f"the local pool has {self.num_free} free blocks, not {n}")
        while len(self._free) < n:
            self._free.append(self._cache.popitem(last=False)[1])
        out = self._free[-n:][::-1]
        del self._free[-n:]
        return out

    def give(self, ring: list[int]) -> None:
        self._free.extend(reversed(ring))

    # --- prefix caching ------------------------------------------------------------------------

    def _window_blocks(self, start: int) -> range:
        """The blocks holding the keys a query at `start` reads before it (its window)."""
        return range(
            max(0, start - self.window + 1) // self.block_size, -(-start // self.block_size)
        )

    def usable_hit(self, hashes: np.ndarray, matched: int, planned: int) -> int:
        """The most of `matched` leading cached prompt blocks a request may skip: those whose
        window before the first computed token (min(m * block_size, planned - 1), as
        admission starts) has its windowed keys cached."""
        if not matched:
            return 0
        # missing[j]: leading blocks below j whose windowed keys are not usable (one pass, so
        # each m costs one subtraction, not a window of lookups)
        ok = [self._usable(h) for h in hashes[:matched].tolist()]
        missing = np.concatenate([[0], np.cumsum(np.logical_not(ok))])
        for m in range(matched, 0, -1):
            window = self._window_blocks(min(m * self.block_size, planned - 1))
            if missing[window.stop] == missing[window.start]:
                return m
        return 0

    def _usable(self, h: int) -> bool:
        """Cached, and saved by a step whose result came back (a failed step drops them)."""
        return h in self._cache and h not in self.writing

    def window_sources(self, hashes: np.ndarray, start: int) -> list[tuple[int, int]]:
        """(block index, cached block) of the window before `start`, each marked as just used;
        read before the hit's ring is taken (which may evict them: the copies still read them
        intact, before anything of the step writes)."""
        out = []
        for j in self._window_blocks(start):
            h = int(hashes[j])
            self._cache.move_to_end(h)
            out.append((j, self._cache[h]))
        return out

    def copies_into(self, ring: list[int], sources: list[tuple[int, int]], copies: list) -> None:
        """`window_sources` into `ring`: (src, dst) pairs."""
        copies.extend((src, ring[j % len(ring)]) for j, src in sources)
        self.num_copied += len(sources)

    def saves_of(self, chunks, step: int, saves: list) -> None:
        """Each complete prompt block a chunk of step `step` computes, from its ring after the
        forward into a cached block (src, dst), unless its hash is cached already (or no
        block can be had); usable once that step's result comes back."""
        bs = self.block_size
        for c in chunks:
            r = c.request
            if c.drafts is not None or not len(r.hashes) or not r.ring:
                continue
            stop = min((c.start + c.num_new_tokens) // bs, len(r.hashes))
            for j in range(c.start // bs, stop):  # (the blocks this chunk completes)
                h = int(r.hashes[j])
                if h in self._cache:
                    self._cache.move_to_end(h)
                    continue
                if not self.num_free:
                    return
                [dst] = self.take(1)
                self._cache[h] = dst
                self.writing[h] = step
                saves.append((r.ring[j % len(r.ring)], dst))

    def drop_cache(self) -> None:
        """Every cached block is void (the prefix cache was dropped)."""
        self._free.extend(reversed(list(self._cache.values())))
        self._cache.clear()
        self.writing.clear()


def ring_row(ring: list[int], ring_blocks: int) -> np.ndarray:
    """`ring` repeated to `ring_blocks` entries (int32): entry i % ring_blocks stands for
    block i. A shorter ring never wraps (its request never reaches block len(ring)), so its
    entries past its own are never read; one width for every row makes a step's tables one
    gather (actors/engine/request.py keeps it as `ring_row`)."""
    return np.resize(np.asarray(ring, dtype=np.int32), ring_blocks)


def local_arrays(rows: list[np.ndarray], chunks, width: int, block_size: int) -> dict:
    """The StepPlan's local_block_tables [B, width] (each row its ring repeated) and
    local_slot_mapping [T] (the chunks' positions, in step order) for the chunks' `ring_row`s
    (one length: the pool's ring_blocks)."""
    bs = block_size
    rings = np.stack(rows)
    size = rings.shape[1]
    tables = np.take(rings, np.arange(width) % size, axis=1)
    # Every token's position and row at once (one-token decode rows are most of a step).
    lens = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    owner = np.repeat(np.arange(len(rows)), lens)
    pos = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    blocks = rings[owner, (pos // bs) % size].astype(np.int64)
    return {"local_block_tables": tables, "local_slot_mapping": blocks * bs + pos % bs}


def copy_arrays(copies: list[tuple[int, int]], saves: list[tuple[int, int]]) -> dict:
    """The StepPlan's local_copy_src / _dst (cached blocks into rings, before the forward) and
    local_save_src / _dst (ring blocks into cached ones, after it); {} when there are none."""
    out = {}
    for name, pairs in (("copy", copies), ("save", saves)):
        if pairs:
            arr = np.asarray(pairs, dtype=np.int32)
            out[f"local_{name}_src"], out[f"local_{name}_dst"] = arr[:, 0], arr[:, 1]
    return out
