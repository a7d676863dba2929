"""The KV block pool (DESIGN.md §5), with prefix caching: shared complete blocks found by hash.
Policy None is the pool with caching off (nothing is ever registered, so every block is free or
held, handed out lowest id first): the one pool the allocator uses either way.

Owns: the free list, per-block ref counts, the owner map (request id -> block ids in block-table
order) with how many leading columns of each table were released (sliding window), the hash map
(block hash <-> block id, a bijection on registered blocks), each registered block's parent hash
and children, the cached-idle set with its logical recency, and the "added"/"evicted" hash
events not yet taken. Must not touch: sockets, messages (it takes only
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
    block, still held and registered under `parent_hash` (or it is block 0 with parent NO_HASH).
    So every registered block's parent is registered (a cached child always has cached
    ancestors). A hash already registered elsewhere keeps its first block; the later copy stays
    private.
  - `free_request` drops references in reverse block order, so a prefix's deeper blocks reach
    ref 0 (and, under "lru", get lower recency) before their ancestors. At ref 0 an unhashed block
    is free; a hashed one is unregistered and freed ("ref_zero") or becomes cached-idle ("lru").
  - `release` (sliding window) drops a request's references on the leading columns of its
    table, in table order, as a free would; the columns stay in the table (indices keep counting
    from the sequence's start) and a later free covers the rest. So a request may hold a block
    but not its ancestors: a released ancestor may be idle while its descendant is held.
  - Unregistering a block unregisters its registered descendants first (deepest first): a
    child whose chain is broken can never be matched again. A held descendant stays with its
    holders, private; an idle one is freed. (Only a sliding-window release can leave a block
    with registered descendants at ref 0, so only then does this unregister more than one.)
  - Eviction ("lru"): cached-idle *leaves* (no registered child) go first, least recently used
    first, ties by lowest block id; evicting a leaf may make its parent one. When no idle leaf
    is left, every idle block has a held descendant (a released ancestor): the least recently
    used idle block with a held child goes, with its descendants' hashes. So every idle block
    is evictable and `num_available` is exact.
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
        self._released: dict[int, int] = {}  # request id -> leading columns released (> 0)
        self._hash = np.zeros(num_blocks, dtype=np.int64)  # NO_HASH when unregistered
        self._parent = np.zeros(num_blocks, dtype=np.int64)  # parent hash of a registered block
        self._kids = np.zeros(num_blocks, dtype=np.int32)  # registered children of a block
        # Registered block -> its registered children (in registration order), for the blocks
        # that have any: what unregistering a block takes with it.
        self._children: dict[int, dict[int, None]] = {}
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
        """A copy of the request's block table ([] for an unknown request), released columns
        included."""
        return list(self._owned.get(int(request_id), ()))

    def num_released(self, request_id: int) -> int:
        """Leading columns of the request's table it released (sliding window); it holds the
        rest."""
        return self._released.get(int(request_id), 0)

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
        cached-idle blocks (see `_evict_one`). A request that already holds blocks may only grow:
        `hashes` must be empty then. Raises AllocatorError, with nothing changed, when the blocks
        are not there.
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
        pinned_idle = sum(1 for b in matched if b in self._idle)
        evictable = len(self._idle) - pinned_idle
        if num_new > len(self._free) + evictable:
            raise AllocatorError(
                f"request {rid}: asked for {num_new} new blocks but only {len(self._free)} are "
                f"free and {evictable} cached-idle blocks can be evicted (policy {self.policy}, "
                f"{self.num_blocks} blocks)"
            )
        # Nothing has changed up to here; from now on nothing can fail: every idle block is
        # evictable, and the pins below (a root chain, ancestors included) take none that an
        # eviction needs.
        for b in matched:
            self._clock += 1
            self._idle.pop(b, None)  # its (now stale) _lru entry is skipped when popped
            self._refs[b] += 1
        new: list[int] = []
        for _ in range(num_new):
            if not self._free:
                self._evict_one()
            new.append(heapq.heappop(self._free))
        self._refs[new] += 1
        if matched or new:
            self._owned.setdefault(rid, []).extend(matched + new)
        return matched, new

    def pin_and_allocate(
        self, pins: Sequence[tuple], allocs: Sequence[tuple[int, int]]
    ) -> list[int]:
        """One step's pins and allocations, all or nothing: every pin first (each request's
        hashes must match in full, and the request must hold nothing yet), then the fresh
        blocks, request after request. Returns the fresh ids in order. AllocatorError, with
        nothing changed, when a pin does not match or the blocks are not there.

        A pin is (request id, hashes) or (request id, hashes, released): with a sliding window
        the request's first query may already be past the leading `released` blocks, which
        then only fill its table's first columns, released at once (`release`): it takes no
        reference on them, and they cost no available block.

        Pinning every prefix of the step before taking any fresh block means a fresh block is
        never found by evicting a block that a later request of the same step shares. Every
        idle block is evictable (leaves first; one whose descendant is still held, which only a
        sliding-window release leaves, last: see `_evict_one`), so the capacity check below is
        exact.
        """
        seen: set[int] = set()
        pinned: set[int] = set()
        pins = [(pin[0], pin[1], pin[2] if len(pin) > 2 else 0) for pin in pins]
        for rid, hashes, released in pins:
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
            if not 0 <= _as_int("released", released) <= len(matched):
                raise AllocatorError(
                    f"request {rid}: releases {released} of the {len(matched)} blocks it pins"
                )
            pinned.update(matched[released:])
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
        for rid, hashes, released in pins:
            self.allocate(rid, hashes, 0)
            self.release(rid, released)
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
        self._children.clear()
        self._idle.clear()
        self._lru.clear()
        self._evicted.extend(dropped)
        return len(dropped)

    def register(self, request_id: int, index: int, block_hash: int, parent_hash: int) -> bool:
        """Block `index` of the request is complete and has `block_hash`; True if now registered.

        `parent_hash` is the hash of the request's block `index - 1` (NO_HASH for index 0).
        Returns False, registering nothing, when the hash already names another block (the first
        stays) or the previous block is private (not registered) or released (sliding window:
        this request no longer holds it, so it may be gone). Registering a block again with its
        own hash is a no-op returning False. AllocatorError for an unknown request, an index out
        of range or released, a hash outside [1, 2**63 - 1], a parent that contradicts the
        previous block's hash, or a block that already carries a different hash.
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
        released = self._released.get(rid, 0)
        if index < released:
            raise AllocatorError(f"request {rid}: block {index} is released (sliding window)")
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
        if index > 0 and (prev == NO_HASH or index - 1 < released):
            # The previous block is a private copy, or released (this very BlockOps may have
            # evicted it and handed it out): this one stays private too.
            return False
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
            p = self._block_of[parent_hash]
            self._kids[p] += 1
            self._children.setdefault(p, {})[b] = None
        self._added.append(block_hash)
        return True

    def free_request(self, request_id: int) -> list[int]:
        """Drop every reference `request_id` holds (deepest block first); returns the freed ids.

        A hashed block reaching ref 0 is unregistered and freed ("ref_zero") or becomes
        cached-idle ("lru"); only blocks that went back to the free heap are returned. An unknown
        id is a no-op returning [] (a request aborted before it got a block).
        """
        rid = int(request_id)
        blocks = self._owned.pop(rid, None)
        released = self._released.pop(rid, 0)
        if not blocks:
            return []
        freed: list[int] = []
        for b in reversed(blocks[released:]):
            self._drop_ref(b, freed)
        return freed

    def release(self, request_id: int, upto: int) -> list[int]:
        """Sliding window: no later query of the request reads the leading `upto` columns of its
        table, so it drops its reference on those it has not released yet, in table order, as
        `free_request` would; the columns stay in its table and a later free covers the rest.
        Returns the ids that went back to the free heap. AllocatorError, nothing changed, for
        an unknown request or an `upto` below what it released before or past its table."""
        rid = _as_int("request_id", request_id)
        upto = _as_int("upto", upto)
        problem = self.release_problem(rid, upto)
        if problem is not None:
            raise AllocatorError(problem)
        blocks, done = self._owned[rid], self._released.get(rid, 0)
        freed: list[int] = []
        if upto > done:
            self._released[rid] = upto
            for b in blocks[done:upto]:
                self._drop_ref(b, freed)
        return freed

    def release_problem(self, request_id: int, upto: int) -> str | None:
        """Why `release(request_id, upto)` would be refused, or None (looks, changes nothing)."""
        blocks = self._owned.get(request_id)
        if blocks is None:
            return f"request {request_id} holds no blocks to release"
        done = self._released.get(request_id, 0)
        if not done <= upto <= len(blocks):
            return (
                f"request {request_id}: release up to block {upto}, not in [{done}, "
                f"{len(blocks)}] (released so far, table length)"
            )
        return None

    def take_events(self) -> tuple[list[int], list[int]]:
        """(added hashes, evicted hashes) since the last call, in the order they happened."""
        added, evicted = self._added, self._evicted
        self._added, self._evicted = [], []
        return added, evicted

    # --- internals ------------------------------------------------------------------------------

    def _drop_ref(self, b: int, freed: list[int]) -> None:
        """One reference on `b` goes (a free or a release): at ref 0 it becomes free (added to
        `freed`), or cached-idle ("lru", hashed)."""
        self._refs[b] -= 1
        if self._refs[b] > 0:
            return
        if self._hash[b] != NO_HASH and self.policy is Policy.LRU:
            self._clock += 1
            self._idle[b] = self._clock
            if self._kids[b] == 0:
                self._push_lru(self._clock, b)
            return
        if self._hash[b] != NO_HASH:
            self._unregister(b)
        heapq.heappush(self._free, b)
        freed.append(b)

    def _evict_one(self) -> None:
        """Evict one cached-idle block onto the (empty) free heap: the least recently used idle
        leaf, or, when none is left, the least recently used idle block with a held child
        (its descendants lose their hashes: `_unregister`). The caller checked that an idle
        block is there."""
        while self._lru:
            recency, b = heapq.heappop(self._lru)
            if self._idle.get(b) == recency and self._kids[b] == 0:
                break
        else:
            # No idle leaf: every idle block has descendants, and following them down from any
            # one ends at a held block, so some idle block has a held child.
            b = min(
                (r, x)
                for x, r in self._idle.items()
                if any(self._refs[c] for c in self._children.get(x, ()))
            )[1]
        del self._idle[b]
        self._unregister(b)
        heapq.heappush(self._free, b)

    def _unregister(self, b: int) -> None:
        """Forget block `b`'s hash and, first, its registered descendants' (deepest first; a
        cached-idle one is freed, a held one stays with its holders, private), recording each
        event. A parent left without children while cached-idle becomes an evictable leaf."""
        order, stack = [], list(self._children.get(b, ()))
        while stack:  # pre-order; reversed, every block comes after its descendants
            d = stack.pop()
            order.append(d)
            stack.extend(self._children.get(d, ()))
        for d in reversed(order):
            self._forget(d)
            if self._idle.pop(d, None) is not None:
                heapq.heappush(self._free, d)
        self._forget(b)

    def _forget(self, b: int) -> None:
        """Unregister block `b`, which has no registered child."""
        h = int(self._hash[b])
        del self._block_of[h]
        parent = int(self._parent[b])
        if parent != NO_HASH:
            p = self._block_of[parent]
            self._kids[p] -= 1
            siblings = self._children[p]
            del siblings[b]
            if not siblings:
                del self._children[p]
                if p in self._idle:
                    self._push_lru(self._idle[p], p)
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
        for rid, done in self._released.items():
            if rid not in self._owned or not 0 < done <= len(self._owned[rid]):
                raise AssertionError(f"request {rid}: {done} released columns of its table")
        held = {
            rid: blocks[self._released.get(rid, 0) :]
            for rid, blocks in self._owned.items()
            if not blocks or self._released.get(rid, 0) < len(blocks)
        }
        free_set = check_free_and_refs(self._free, self._refs, held)
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
        children: dict[int, dict[int, None]] = {}
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
            children.setdefault(p, {})[b] = None
        if {p: set(c) for p, c in children.items()} != {
            p: set(c) for p, c in self._children.items()
        }:
            raise AssertionError("the children map differs from the registered parents")
        if not np.array_equal(kids, self._kids):
            bad = int(np.flatnonzero(kids != self._kids)[0])
            raise AssertionError(f"block {bad}: child count {self._kids[bad]}, really {kids[bad]}")
        entries = set(self._lru)
        for b, recency in self._idle.items():
            if not 0 < recency <= self._clock:
                raise AssertionError(f"cached-idle block {b} has recency {recency}")
            if self._kids[b] == 0 and (recency, b) not in entries:
                raise AssertionError(f"cached-idle leaf {b} cannot be evicted (no LRU entry)")
