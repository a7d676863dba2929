"""The engine's index of the allocator's cached prefix blocks (DESIGN.md §5), for planning.

Owns: the hash -> block map of every block the allocator has registered, as of its last reply
(`block_of`), how many of this engine's requests hold each block (`refs`), the hashes being
written by steps whose results have not come back (`writing`), and the prefix counters. It
turns an admission into pins (`pin`) and a planned chunk into registrations (`register`); the
scheduler decides who runs.
Must not touch: sockets, torch, the block pool (the allocator owns it and decides).

Why the engine keeps an index at all: to plan a step it must know, before the allocator hop,
how many blocks a new request shares and how many blocks that costs, and the design allows one
allocator round trip per step. The index is exact, not a guess: only this engine changes the
allocator, and every `BlockOpsReply` carries that step's hash events (evicted, then added), so
after each reply `block_of` equals the allocator's hash map. Within a step the engine plans
against the state before it, and the allocator applies the step's pins before any allocation
(`PrefixBlockPool.pin_and_allocate`), so a pinned block is never evicted to make room.
Accounting: a block no engine request holds (`refs` 0) but still registered is cached and idle
under "lru" (pinning it takes one available block) and about to be freed under "ref_zero" (not
matchable). The allocator's `num_free` counts free plus idle blocks, so releasing a request
gives back exactly the blocks whose `refs` reach 0.

Sharing rule: a block becomes shareable once the step that writes it has returned its result
(`writing` until then). A request whose next prompt block is still being written by another
request waits (same-step dedupe: it never recomputes a block another request is computing, and
it never reads KV a failed step may have left unwritten).

Determinism: plain dicts and numpy, a function of the scheduler's calls and the replies.
"""

# How the scheduler plans with prefix caching (`prefix_policy`; DESIGN.md §5; the contract that
# actors/engine/scheduler.py and admission.py follow): an admitted request first shares the longest
# run of cached blocks of its prompt (pinned before any block is allocated) and skips
# `min(matched * block_size, tokens - 1)` tokens, so that at least one token yields logits: a
# block-aligned full match computes only the last prompt token, whose K/V is already cached and is
# not written again (slot -1). A request that wants prompt log-probs shares nothing (it needs every
# prompt logit). Each complete prompt block a planned chunk writes is registered with the allocator
# in that step's BlockOps; it becomes shareable when that step's result is applied, and a request
# whose next block is still being written waits (FIFO). A request that wants its routed experts
# shares only the leading cached blocks whose routing it has already or the cache keeps with them
# (actors/engine/routing.py), and takes the kept routing for positions it has none of.

from __future__ import annotations

import numpy as np

from taipan.actors.engine.request import EngineRequest
from taipan.messages.allocator import BlockOpsReply, PrefixCachingEvictionPolicy


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int, policy: PrefixCachingEvictionPolicy):
        self.policy = PrefixCachingEvictionPolicy(policy)
        self.block_size = block_size
        self.block_of: dict[int, int] = {}
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self.writing: dict[int, int] = {}  # hash -> step that writes it
        # Routed experts of cached blocks, hash -> [block_size, MoE layers, top_k], kept while
        # the hash is cached, for blocks registered by a request that asked (routing.py).
        self.routing_of: dict[int, np.ndarray] = {}
        self.drop_pending = False  # the next BlockOps tells the allocator to drop every hash
        # Counters (stats): prompt tokens of admitted requests, of which skipped (cached), and
        # prefill tokens computed; the allocator's counts after its last reply.
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0
        self.num_hashed = 0
        self.num_idle = 0

    def match(self, hashes: np.ndarray) -> tuple[list[int], bool]:
        """(blocks of the longest shareable cached run of `hashes`, whether the request must
        wait because its next block is being written by a step in flight)."""
        out: list[int] = []
        for h in hashes.tolist():
            b = self.block_of.get(h)
            if b is None or (
                self.policy is PrefixCachingEvictionPolicy.REF_ZERO and self.refs[b] == 0
            ):
                return out, h in self.writing
            if h in self.writing:
                return out, True
            out.append(b)
        return out, False

    def pin(self, req: EngineRequest, blocks: list[int], pins: list, released: int = 0) -> None:
        """`req` is admitted sharing `blocks` (its leading cached blocks): hold them (but the
        leading `released` ones, behind its sliding window: they only fill its table), add the
        pin to the step's `pins`, and count its prompt and cached tokens at first admission."""
        m = len(blocks)
        req.shared_until = m * self.block_size
        req.num_registered = m
        if m:
            self.hold(blocks[released:])
            pins.append((req.request_id, req.hashes[:m]))
        if req.admissions == 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.prompt_tokens += len(req.prompt)
            self.cached_tokens += req.num_computed_tokens
        # (admission.py counts the admission: `admissions` is 0 here at the first one)

    def register(self, r: EngineRequest, num_new_tokens: int, step: int, regs: list) -> None:
        """`r` runs a chunk of `num_new_tokens` from its computed tokens (not yet advanced) in
        step `step`: add the complete prompt blocks it writes to `regs` (as being written by
        that step) and count its prefill tokens."""
        stop = r.num_computed_tokens + num_new_tokens
        if num_new_tokens > 1 or stop <= len(r.prompt):
            self.prefill_tokens += num_new_tokens
        end = min(stop // self.block_size, len(r.hashes))
        i = r.num_registered
        while i < end:
            h = int(r.hashes[i])
            if h in self.block_of or h in self.writing:
                # Cached from another request (this one could not share it): its copy and
                # every block after it stay private.
                i = len(r.hashes)
                break
            parent = int(r.hashes[i - 1]) if i else 0
            regs.append((r.request_id, i, h, parent))
            self.writing[h] = step
            i += 1
        r.num_registered = max(r.num_registered, i)

    def cost(self, blocks: list[int]) -> int:
        """Available blocks that pinning `blocks` takes: the idle ones."""
        return int(np.count_nonzero(self.refs[blocks] == 0)) if blocks else 0

    def hold(self, blocks) -> None:
        np.add.at(self.refs, np.asarray(blocks, dtype=np.int64), 1)

    def release(self, blocks: list[int]) -> int:
        """Drop one hold on each block; returns how many are held by no request now."""
        if not blocks:
            return 0
        idx = np.asarray(blocks, dtype=np.int64)
        np.subtract.at(self.refs, idx, 1)
        if (self.refs[idx] < 0).any():
            raise RuntimeError(f"block refs went negative releasing {blocks[:8]}")
        return int(np.count_nonzero(self.refs[idx] == 0))

    def drop(self) -> None:
        """Every cached hash is void (KV gone or computed with other weights): nothing matches
        from now on, and the next BlockOps tells the allocator."""
        self.block_of.clear()
        self.writing.clear()
        self.routing_of.clear()
        self.drop_pending = True

    def apply(self, reply: BlockOpsReply, dropped: bool) -> None:
        """The allocator's events of one step (evictions happen before registrations);
        `dropped`: that step dropped the cache (its evictions name hashes already forgotten)."""
        for h in reply.evicted_hashes.tolist():
            self.routing_of.pop(h, None)
            if self.block_of.pop(h, None) is None and not dropped:
                raise RuntimeError(f"the allocator evicted hash {h}, which the engine never saw")
        for h, b in zip(reply.added_hashes.tolist(), reply.added_blocks.tolist(), strict=True):
            self.block_of[h] = b
        self.num_hashed, self.num_idle = reply.num_hashed, reply.num_idle

    def done_writing(self, step: int, hashes: list[int]) -> None:
        writes_done(self.writing, step, hashes)

    def stats(self) -> dict[str, int]:
        return {
            "prefix_prompt_tokens": self.prompt_tokens,
            "prefix_cached_tokens": self.cached_tokens,
            "prefill_tokens_computed": self.prefill_tokens,
            "blocks_hashed": self.num_hashed,
            "blocks_evictable": self.num_idle,
        }


def writes_done(writing: dict[int, int], step: int, hashes: list[int]) -> None:
    """`step`'s result came back: its hashes are no longer being written (`writing`: hash -> the
    step writing it; a later step that writes the same hash again keeps its entry). The prefix
    index's blocks and the Mamba mirror's snapshots follow this one rule."""
    for h in hashes:
        if writing.get(h) == step:
            del writing[h]
