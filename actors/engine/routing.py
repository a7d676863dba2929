"""Routed experts (SamplingParams.return_routed_experts, issue 26 item 4): the top-k expert ids
each MoE layer chose for every position of a request, kept so a trainer can replay the routing.

`RoutedExperts` is one request's record: a growable int array [positions, MoE layers, top_k]
whose positions [0, filled) are known. A position is written once, the first time it is known,
and never again:
- by the forward that first computes it (a step's StepResult.routed_experts, `take_step`; for
  a speculative verify row, only up to its accepted drafts);
- or, for a prompt block the request shares from the prefix cache (no forward of its own), by
  the routing of the forward that computed that block, kept with the block by its hash
  (PrefixIndex.routing_of, actors/engine/prefix.py; dropped with the block when it is
  evicted, and with every hash at a weight update or a failed step).
So a preempted, evicted or recomputed request keeps the routing of its first computation, and
chunked prefill only appends. Rule for the prefix cache: a request that asks shares only the
leading cached blocks whose routing it has already or the cache keeps (a block registered by a
request that did not ask has none); it recomputes the rest itself (`shareable_with_routing`).

Pure: numpy only, owned by the scheduler (a StepBatch's chunks and registrations in, records
changed). No sockets, no torch.
"""

from __future__ import annotations

import numpy as np


class RoutedExperts:
    """One request's routed experts, positions [0, filled) known (module docstring)."""

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None  # [capacity, layers, k]; None until the first
        self.filled = 0

    def put(self, start: int, rows: np.ndarray) -> None:
        """The routing of positions start .. start + len(rows) - 1: those past `filled` are
        taken (earlier ones keep their first routing). Rows starting past `filled` would leave
        a gap and are not taken (planning never runs a position before the ones it follows)."""
        skip = self.filled - start
        if skip < 0 or skip >= len(rows):
            return
        new = rows[skip:]
        self._reserve(self.filled + len(new), new)
        self._rows[self.filled : self.filled + len(new)] = new
        self.filled += len(new)

    def _reserve(self, size: int, like: np.ndarray) -> None:
        rows = self._rows
        if rows is not None and rows.shape[1:] != like.shape[1:]:
            raise ValueError(
                f"routed experts of shape {like.shape[1:]} after {rows.shape[1:]} (one model?)"
            )
        if rows is None or size > len(rows):
            grown = np.empty((max(size, 2 * len(rows) if rows is not None else 64),
                              *like.shape[1:]), dtype=like.dtype)  # fmt: skip
            if rows is not None:
                grown[: self.filled] = rows[: self.filled]
            self._rows = grown

    def first(self, n: int) -> np.ndarray:
        """A copy of the routing of positions [0, min(n, filled)) (empty [0, 0, 0] int16 when
        nothing is known yet)."""
        if self._rows is None:
            return np.zeros((0, 0, 0), dtype=np.int16)
        return self._rows[: max(0, min(n, self.filled))].copy()

    def block(self, index: int, block_size: int) -> np.ndarray | None:
        """A copy of block `index`'s routing, if every position of it is known."""
        stop = (index + 1) * block_size
        if self.filled < stop:
            return None
        return self._rows[stop - block_size : stop].copy()


def take_step(batch, routed: np.ndarray, spec_tokens: np.ndarray | None = None) -> None:
    """A step's routed experts [T, layers, k] (StepResult.routed_experts, in the plan's token
    order) into the records of the requests of its chunks (`batch`, a StepBatch) that ask;
    empty: the step asked for none. A verify row (speculative decoding) keeps the routing of
    its last known token and its accepted drafts only (`spec_tokens`, StepResult's: its new
    tokens count them): a rejected draft's position is computed again, with its real token,
    by a later step, which is then its first computation. A chained verify row's routing
    (StepPlan.chain_steps) holds those positions only, over its inner steps."""
    if not len(routed):
        return
    offset = 0
    for i, c in enumerate(batch.chunks):
        record = c.request.routed
        keep = c.num_new_tokens
        if c.drafts is not None and len(c.drafts):
            if spec_tokens is None or len(spec_tokens) <= i:
                raise ValueError(f"step {batch.step}: a verify row's routing, no spec_tokens")
            keep = int((spec_tokens[i] >= 0).sum())  # 1 + the accepted drafts
        if record is not None:
            record.put(c.start, routed[offset : offset + keep])
        # (a chained row's routing holds its kept positions only: actors/gpu/chain.py)
        offset += keep if c.chain_limit else c.num_new_tokens
    if offset != len(routed):
        raise ValueError(f"step {batch.step}: {len(routed)} routed rows for {offset} positions")


def keep_block_routing(
    batch, routing_of: dict[int, np.ndarray], block_of: dict, block_size: int
) -> None:
    """The prompt blocks this step registered in the prefix cache (`batch.regs`) keep the
    routing of the request that computed them, if it asked and the block is still cached
    (`block_of`, PrefixIndex's hash -> block map)."""
    owners = {c.request.request_id: c.request for c in batch.chunks}
    for rid, index, h, _ in batch.regs:
        r = owners.get(rid)
        if r is None or r.routed is None or h not in block_of:
            continue
        rows = r.routed.block(index, block_size)
        if rows is not None:
            routing_of[h] = rows


def shareable_with_routing(r, count: int, routing_of: dict, block_size: int) -> int:
    """How many of its first `count` matched cached blocks `r` (a request that asks for its
    routed experts) may share: the leading run whose routing it has (from an earlier
    admission) or the cache keeps."""
    known = r.routed.filled // block_size
    n = 0
    while n < count and (n < known or int(r.hashes[n]) in routing_of):
        n += 1
    return n


def fill_from_cache(r, shared: int, routing_of: dict, block_size: int) -> None:
    """`r` shares its first `shared` prompt blocks from the cache: their routing, where its
    own record does not have it yet."""
    for i in range(r.routed.filled // block_size, shared):
        r.routed.put(i * block_size, routing_of[int(r.hashes[i])])
