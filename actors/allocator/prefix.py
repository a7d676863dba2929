"""The KV block pool (DESIGN.md §5), with prefix caching: shared complete blocks found by hash.
Policy None is the pool with caching off (nothing is ever registered, so every block is free or
held, handed out lowest id first): the one pool the allocator uses either way.

Owns: the free list, per-block ref counts, the owner map (request id -> block ids in block-table
order), the hash map (block hash <-> block id, a bijection on registered blocks), each registered
block's parent hash and child count, the cached-idle set with its logical recency, and the
"added"/"evicted" hash events not yet taken. Must not touch: sockets, messages (it takes only
the policy enum and hash constants from messages/), torch, clocks. Plain ints, lists, dicts and
numpy only. Only the allocator actor (`AllocatorService`) holds one.

States: every block is in exactly one of
  free         on the free min-heap, ref 0, no hash;
  held         ref >= 1 (one per request holding it), with or without a hash;
  cached-idle  ref 0 with a hash, kept for reuse and evictable ("lru" policy only).

Rules:
  - Pin before allocate: `allocate` first gives the matched prefix ref+1 each (an idle block
    becomes held again), then takes the fresh blocks. All or nothing: when the fresh blocks
    cannot be found, AllocatorError and nothing changed, the pins included.
  - A block is registered only when it is complete and its parent is the same request's previous
    block, itself registered under `parent_hash` (or it is block 0 with parent NO_HASH). So every
    registered block's parent is registered, and a block's holders also hold its ancestors.
    A hash already registered elsewhere keeps its first block; the later copy stays private.
  - `free_request` drops references in reverse block order, so a prefix's deeper blocks reach
    ref 0 (and, under "lru", get lower recency) before their ancestors. At ref 0 an unhashed block
    is free; a hashed one is unregistered and freed ("ref_zero") or becomes cached-idle ("lru").
  - Eviction ("lru"): only cached-idle *leaves* (no registered child) go, least recently used
    first, ties by lowest block id; evicting a leaf may make its parent one. A cached child always
    has cached ancestors.
  - Every registration records an "added" hash, every unregistration an "evicted" one;
    `take_events` hands both over (the allocator puts them in each BlockOpsReply).

Determinism: the lowest-numbered free block is always handed out first (a min-heap) and free
blocks go before evictions; recency is a logical counter advanced by this pool's own pins and
releases, never a clock. The same sequence of calls gives the same block ids and the same events,
which is what `taipan replay --check` relies on.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence

import numpy as np

from taipan.actors.allocator.core import AllocatorError, check_free_and_refs
from taipan.messages.allocator import PrefixCachingEvictionPolicy as Policy
from taipan.messages.block_hash import MAX_HASH, NO_HASH


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool | np.bool_):
        raise AllocatorError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise AllocatorError(f"{name} must be an int, got {value!r}") from None


def _policy(policy: Policy | str | None) -> Policy | None:
    if policy is None:
        return None
    try:
        return Policy(policy)
    except ValueError:
        choices = tuple(p.value for p in Policy)
        raise AllocatorError(f"policy {policy!r} is not one of {choices} (or None: off)") from None


class PrefixBlockPool:
    def __init__(self, num_blocks: int, policy: Policy | str | None):
        """`policy`: "ref_zero" or "lru" (see above), or None: prefix caching off."""
        if num_blocks < 1:
            raise AllocatorError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        self.policy = _policy(policy)
        # list(range(n)) is already a valid min-heap: no heapify needed.
        self._free: list[int] = list(range(num_blocks))
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        # Dict order is insertion order, so iterating owners is deterministic.
        self._owned: dict[int, list[int]] = {}
        self._hash = np.zeros(num_blocks, dtype=np.int64)  # NO_HASH when unregistered
        self._parent = np.zeros(num_blocks, dtype=np.int64)  # parent hash of a registered block
        self._kids = np.zeros(num_blocks, dtype=np.int32)  # registered children of a block
        self._block_of: dict[int, int] = {}
        self._idle: dict[int, int] = {}  # cached-idle block -> recency
        # (recency, block) of cached-idle leaves; stale entries are skipped when popped.
        self._lru: list[tuple[int, int]] = []
        self._clock = 0
        self._added: list[int] = []
        self._evicted: list[int] = []

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free) - len(self._idle)

    @property
    def num_hashed(self) -> int:
        return len(self._block_of)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free, or cached and idle (every idle block is
        evictable, see `pin_and_allocate`)."""
        return len(self._free) + len(self._idle)

    def blocks_of(self, request_id: int) -> list[int]:
        """A copy of the request's blocks in block-table order ([] for an unknown request)."""
        return list(self._owned.get(int(request_id), ()))

    def ref_count(self, block_id: int) -> int:
        return int(self._refs[block_id])

    def block_of_hash(self, block_hash: int) -> int | None:
        return self._block_of.get(int(block_hash))

    def hash_of(self, block_id: int) -> int:
        """The block's registered hash, or NO_HASH."""
        return int(self._hash[block_id])

    def requests(self) -> list[int]:
        """Ids of the requests that hold blocks, in the order they first got one."""
        return list(self._owned)

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest registered run hashes[0], hashes[1], ...; no side effects.

        The run also stops where a registered block's parent is not the previous hash (only a
        caller passing a foreign chain can see that).
        """
        out: list[int] = []
        parent = NO_HASH
        for h in hashes:
            h = int(h)
            b = self._block_of.get(h)
            if b is None or int(self._parent[b]) != parent:
                break
            out.append(b)
            parent = h
        return out

    # --- mutations ------------------------------------------------------------------------------

    def allocate(
        self, request_id: int, hashes: Sequence[int], num_new: int
    ) -> tuple[list[int], list[int]]:
        """Pin the matched prefix of `hashes`, then take `num_new` fresh blocks. All or nothing.

        Returns (matched ids, new ids); both are appended to the request's table in that order.
        Fresh blocks come from the free heap, lowest id first, then ("lru") from evicting
        cached-idle leaves. A request that already holds blocks may only grow: `hashes` must be
        empty then. Raises AllocatorError, with nothing changed, when the blocks are not there.
        """
        rid = _as_int("request_id", request_id)
        num_new = _as_int("num_new", num_new)
        if num_new < 0:
            raise AllocatorError(f"request {rid}: block count {num_new} is negative")
        if rid in self._owned and len(hashes):
            raise AllocatorError(
                f"request {rid} already holds blocks; it may only grow (no hashes)"
            )
        matched = self.match(hashes)
        from_free = min(num_new, len(self._free))
        victims = self._pick_victims(rid, num_new - from_free, set(matched))
        # Nothing has changed up to here; from now on nothing can fail.
        for b in matched:
            self._clock += 1
            self._idle.pop(b, None)  # its (now stale) _lru entry is skipped when popped
            self._refs[b] += 1
        new = [heapq.heappop(self._free) for _ in range(from_free)]
        for b in victims:
            del self._idle[b]
            self._unregister(b)
        new.extend(victims)
        self._refs[new] += 1
        if matched or new:
            self._owned.setdefault(rid, []).extend(matched + new)
        return matched, new

    def pin_and_allocate(
        self, pins: Sequence[tuple[int, Sequence[int]]], allocs: Sequence[tuple[int, int]]
    ) -> list[int]:
        """One step's pins and allocations, all or nothing: every pin first (each request's
        hashes must match in full, and the request must hold nothing yet), then the fresh
        blocks, request after request. Returns the fresh ids in order. AllocatorError, with
        nothing changed, when a pin does not match or the blocks are not there.

        Pinning every prefix of the step before taking any fresh block means a fresh block is
        never found by evicting a block that a later request of the same step shares. Every
        idle block is evictable (a holder of a block holds its ancestors, so an idle block has
        no held child), so the capacity check below is exact.
        """
        seen: set[int] = set()
        pinned: set[int] = set()
        for rid, hashes in pins:
            rid = _as_int("request_id", rid)
            if rid in seen or rid in self._owned:
                raise AllocatorError(f"request {rid} pins a prefix twice or already holds blocks")
            seen.add(rid)
            matched = self.match(hashes)
            if len(matched) != len(hashes):
                raise AllocatorError(
                    f"request {rid}: {len(hashes)} prefix blocks to pin but only "
                    f"{len(matched)} are cached"
                )
            pinned.update(matched)
        need = 0
        for rid, n in allocs:
            n = _as_int("num_new", n)
            if n < 0:
                raise AllocatorError(f"request {rid}: block count {n} is negative")
            need += n
        available = len(self._free) + len(self._idle) - len(pinned.intersection(self._idle))
        if need > available:
            if self.policy is None:  # (nothing is ever evictable)
                raise AllocatorError(
                    f"asked for {need} blocks but only {available} of {self.num_blocks} are free"
                )
            raise AllocatorError(
                f"asked for {need} blocks but only {available} of {self.num_blocks} are free "
                f"or evictable (policy {self.policy})"
            )
        for rid, hashes in pins:
            self.allocate(rid, hashes, 0)
        out: list[int] = []
        for rid, n in allocs:
            out.extend(self.allocate(rid, (), n)[1])
        return out

    def drop_hashes(self) -> int:
        """Forget every block hash (the KV they name is gone or stale). Held blocks stay held
        (now private); idle ones become free. Returns how many hashes were dropped; each is
        recorded as an "evicted" event, in registration order."""
        dropped = list(self._block_of)
        for b in self._block_of.values():
            self._hash[b] = self._parent[b] = NO_HASH
            self._kids[b] = 0
        for b in self._idle:
            heapq.heappush(self._free, b)
        self._block_of.clear()
        self._idle.clear()
        self._lru.clear()
        self._evicted.extend(dropped)
        return len(dropped)

    def register(self, request_id: int, index: int, block_hash: int, parent_hash: int) -> bool:
        """Block `index` of the request is complete and has `block_hash`; True if now registered.

        `parent_hash` is the hash of the request's block `index - 1` (NO_HASH for index 0).
        Returns False, registering nothing, when the hash already names another block (the first
        stays) or the previous block is private (not registered). Registering a block again with
        its own hash is a no-op returning False. AllocatorError for an unknown request, an index
        out of range, a hash outside [1, 2**63 - 1], a parent that contradicts the previous
        block's hash, or a block that already carries a different hash.
        """
        if self.policy is None:
            raise AllocatorError("prefix caching is off in this pool: nothing is registered")
        rid = _as_int("request_id", request_id)
        index = _as_int("index", index)
        block_hash = _as_int("block_hash", block_hash)
        parent_hash = _as_int("parent_hash", parent_hash)
        blocks = self._owned.get(rid)
        if blocks is None:
            raise AllocatorError(f"request {rid} holds no blocks")
        if not 0 <= index < len(blocks):
            raise AllocatorError(f"request {rid}: index {index} not in [0, {len(blocks)})")
        if not 1 <= block_hash <= MAX_HASH:
            raise AllocatorError(f"block hash {block_hash} not in [1, {MAX_HASH}]")
        if not 0 <= parent_hash <= MAX_HASH:
            raise AllocatorError(f"parent hash {parent_hash} not in [0, {MAX_HASH}]")
        b = blocks[index]
        current = int(self._hash[b])
        if current == block_hash:
            return False
        if current != NO_HASH:
            raise AllocatorError(f"block {b} already carries hash {current}, not {block_hash}")
        prev = NO_HASH if index == 0 else int(self._hash[blocks[index - 1]])
        if index == 0 and parent_hash != NO_HASH:
            raise AllocatorError(f"request {rid}: block 0 has parent {parent_hash}, not NO_HASH")
        if index > 0 and prev == NO_HASH:
            return False  # the previous block is a private copy: this one stays private too
        if prev != parent_hash:
            raise AllocatorError(
                f"request {rid}: block {index} has parent {parent_hash} but block {index - 1} "
                f"carries {prev}"
            )
        if block_hash in self._block_of:
            return False
        self._block_of[block_hash] = b
        self._hash[b] = block_hash
        self._parent[b] = parent_hash
        if parent_hash != NO_HASH:
            self._kids[self._block_of[parent_hash]] += 1
        self._added.append(block_hash)
        return True

    def free_request(self, request_id: int) -> list[int]:
        """Drop every reference `request_id` holds (deepest block first); returns the freed ids.

        A hashed block reaching ref 0 is unregistered and freed ("ref_zero") or becomes
        cached-idle ("lru"); only blocks that went back to the free heap are returned. An unknown
        id is a no-op returning [] (a request aborted before it got a block).
        """
        blocks = self._owned.pop(int(request_id), None)
        if not blocks:
            return []
        freed: list[int] = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if self._hash[b] != NO_HASH and self.policy is Policy.LRU:
                self._clock += 1
                self._idle[b] = self._clock
                if self._kids[b] == 0:
                    self._push_lru(self._clock, b)
                continue
            if self._hash[b] != NO_HASH:
                self._unregister(b)
            heapq.heappush(self._free, b)
            freed.append(b)
        return freed

    def take_events(self) -> tuple[list[int], list[int]]:
        """(added hashes, evicted hashes) since the last call, in the order they happened."""
        added, evicted = self._added, self._evicted
        self._added, self._evicted = [], []
        return added, evicted

    # --- internals ------------------------------------------------------------------------------

    def _pick_victims(self, rid: int, need: int, pinned: set[int]) -> list[int]:
        """The `need` cached-idle leaves to evict, in eviction order; changes no block state.

        Runs the eviction on the side (pinned blocks are not idle, a picked leaf's parent may
        become a leaf). On failure every popped entry goes back and AllocatorError is raised.
        """
        if need == 0:
            return []
        victims: list[int] = []
        popped: list[tuple[int, int]] = []
        gone: set[int] = set()
        lost_kids: dict[int, int] = {}
        while len(victims) < need and self._lru:
            entry = heapq.heappop(self._lru)
            popped.append(entry)
            recency, b = entry
            if b in pinned or b in gone or self._idle.get(b) != recency:
                continue  # stale, or about to be pinned
            if self._kids[b] - lost_kids.get(b, 0) > 0:
                continue  # not a leaf; pushed again when its last child goes
            victims.append(b)
            gone.add(b)
            parent = int(self._parent[b])
            if parent == NO_HASH:
                continue
            p = self._block_of[parent]
            lost_kids[p] = lost_kids.get(p, 0) + 1
            if self._kids[p] == lost_kids[p] and p in self._idle and p not in pinned:
                heapq.heappush(self._lru, (self._idle[p], p))
        if len(victims) < need:
            # Extra entries pushed above are only ever stale or duplicates: harmless.
            for entry in popped:
                heapq.heappush(self._lru, entry)
            raise AllocatorError(
                f"request {rid}: asked for {len(self._free) + need} new blocks but only "
                f"{len(self._free)} are free and {len(victims)} cached-idle blocks can be "
                f"evicted (policy {self.policy}, {self.num_blocks} blocks)"
            )
        return victims

    def _unregister(self, b: int) -> None:
        """Forget block `b`'s hash (it has no registered child) and record the event."""
        h = int(self._hash[b])
        del self._block_of[h]
        parent = int(self._parent[b])
        if parent != NO_HASH:
            self._kids[self._block_of[parent]] -= 1
        self._hash[b] = NO_HASH
        self._parent[b] = NO_HASH
        self._evicted.append(h)

    def _push_lru(self, recency: int, b: int) -> None:
        heapq.heappush(self._lru, (recency, b))
        if len(self._lru) > 2 * self.num_blocks + 16:
            # Pins leave stale entries behind; rebuild from the live leaves so memory stays bounded.
            self._lru = [(r, x) for x, r in self._idle.items() if self._kids[x] == 0]
            heapq.heapify(self._lru)

    # --- checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests and debugging only)."""
        n = self.num_blocks
        free_set = check_free_and_refs(self._free, self._refs, self._owned)
        if self.policy is not Policy.LRU and self._idle:
            raise AssertionError(f"policy {self.policy} has cached-idle blocks")
        for b in range(n):
            ref, h = int(self._refs[b]), int(self._hash[b])
            states = (b in free_set) + (ref > 0) + (b in self._idle)
            if states != 1:
                raise AssertionError(f"block {b} is in {states} states (ref {ref})")
            if b in free_set and h != NO_HASH:
                raise AssertionError(f"free block {b} carries hash {h}")
            if b in self._idle and h == NO_HASH:
                raise AssertionError(f"cached-idle block {b} has no hash")
            if h == NO_HASH:
                if self._parent[b] != NO_HASH or self._kids[b] != 0:
                    raise AssertionError(f"unregistered block {b} has a parent or children")
                continue
            if self._block_of.get(h) != b:
                raise AssertionError(f"block {b} carries {h} but the hash map says otherwise")
        registered = int(np.count_nonzero(self._hash))
        if registered != len(self._block_of):
            raise AssertionError(f"{len(self._block_of)} hashes map to {registered} blocks")
        kids = np.zeros(n, dtype=np.int64)
        for h, b in self._block_of.items():
            if not 1 <= h <= MAX_HASH or int(self._hash[b]) != h:
                raise AssertionError(f"hash {h} -> block {b} is not a valid registered pair")
            parent = int(self._parent[b])
            if parent == NO_HASH:
                continue
            p = self._block_of.get(parent)
            if p is None:
                raise AssertionError(f"block {b} (hash {h}) has unregistered parent {parent}")
            kids[p] += 1
        if not np.array_equal(kids, self._kids):
            bad = int(np.flatnonzero(kids != self._kids)[0])
            raise AssertionError(f"block {bad}: child count {self._kids[bad]}, really {kids[bad]}")
        entries = set(self._lru)
        for b, recency in self._idle.items():
            if not 0 < recency <= self._clock:
                raise AssertionError(f"cached-idle block {b} has recency {recency}")
            if self._kids[b] == 0 and (recency, b) not in entries:
                raise AssertionError(f"cached-idle leaf {b} cannot be evicted (no LRU entry)")
