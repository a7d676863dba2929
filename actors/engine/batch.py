"""What one planned step holds (`StepBatch`, its `Chunk`s) and the step while it is being
planned (`Draft`). Plain data: the scheduler and its parts (actors/engine/admission.py,
actors/engine/batch_arrays.py) fill them; the engine's step (actors/engine/step.py) carries a
StepBatch from planning to its result. No sockets, no torch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.actors.engine.request import EngineRequest


@dataclasses.dataclass(slots=True)  # (made for every row of every step)
class Chunk:
    request: EngineRequest
    num_new_tokens: int
    new_blocks: int
    # Set when the step is planned (schedule() advances the request right after):
    start: int = 0  # the first position this chunk computes
    samples: bool = False  # it reaches the end of the tokens, so its last logit samples a token
    gen_index: int = 0  # the index in `generated` of the token it samples (seeded sampling)
    num_prompt_targets: int = 0  # prompt log-probs this chunk computes (set by plan_arrays)
    # Hybrids: the snapshot slot its initial Mamba state is read from (a restored prefix);
    # None: its own live slot, or zeros from position 0.
    mamba_init: int | None = None
    # Speculative decoding: the draft tokens this row verifies after its last known token
    # (its query is that token and these, 1 + len(drafts) tokens); None: not a verify row.
    drafts: np.ndarray | None = None
    # The drafts are placeholders a draft model on the gpu fills (StepPlan.draft_prev).
    gpu_drafts: bool = False
    # A chained verify row (StepPlan.chain_steps): the most tokens it may gain; 0: not one.
    chain_limit: int = 0


@dataclasses.dataclass
class StepBatch:
    step: int
    chunks: list[Chunk]
    free_ids: list[int]
    ended: list[EngineRequest]  # aborted before this step: report them now
    # Prefix caching: (request id, hashes of the cached blocks it pins), registrations
    # (request id, block index, hash, parent hash), and whether the allocator drops every hash.
    pins: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    regs: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    drop_cache: bool = False
    # Sliding window: (request id, leading columns of its table released in all), sent with
    # the step's BlockOps before its frees and allocations (actors/engine/scheduler.py).
    releases: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # The weights it runs with (the scheduler's `salt` when planned): the version of the tokens
    # it samples. Weights change only between steps, with none in flight.
    weight_version: int = 0
    # Hybrids (the step's MambaOps, messages/mamba_cache.py): requests that take a live slot,
    # snapshots read (hashes) and written ((request, hash, tokens into its chunk); their slots
    # come with the reply),
    # and the frees, invalidations and drop waiting in the mirror when the step was planned.
    mamba_live: list[EngineRequest] = dataclasses.field(default_factory=list)
    mamba_restore: list[int] = dataclasses.field(default_factory=list)
    mamba_snaps: list[tuple[EngineRequest, int, int]] = dataclasses.field(default_factory=list)
    mamba_snap_slots: list[int] = dataclasses.field(default_factory=list)
    mamba_free: list[int] = dataclasses.field(default_factory=list)
    mamba_invalidate: list[int] = dataclasses.field(default_factory=list)
    mamba_drop: bool = False
    # Per-layer-group KV with prefix caching (actors/engine/local_kv.py): windowed keys copied
    # from cached blocks into rings before the forward, and saved from rings after it (src, dst).
    local_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    local_saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Whether its speculating requests speculate (Draft.speculate): an MTP head drafts for
    # them only then.
    speculate: bool = True

    @property
    def has_mamba_ops(self) -> bool:
        return bool(self.mamba_live or self.mamba_restore or self.mamba_snaps)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_step(self) -> bool:
        """Whether it does anything (an empty plan is not a step and sends nothing)."""
        return bool(self.chunks or self.free_ids or self.drop_cache)


@dataclasses.dataclass
class Draft:
    """The step being planned: what is left of its token budget and of the free blocks, and
    what it holds so far (chunks, prefix pins and registrations, Mamba slots to hand out)."""

    budget: int
    free: int
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    pins: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    regs: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    claimed: int = 0  # chunks whose prompt blocks are registered (later admissions wait)
    mamba_live: list[EngineRequest] = dataclasses.field(default_factory=list)
    mamba_restore: list[int] = dataclasses.field(default_factory=list)
    local_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Whether the requests that speculate do this step (Speculation.active: not above
    # speculative_disable_by_batch_size); False plans them as plain, overlapped rows.
    speculate: bool = True

    def take(self, req: EngineRequest, n: int, need: int, cost: int = 0) -> None:
        """`req` runs n tokens this step, on `need` new blocks (and `cost` to pin its prefix)."""
        self.budget -= n
        self.free -= need + cost
        self.chunks.append(Chunk(req, n, need))
