"""Stats family (tags 140-159): what an engine rank reports about itself.

An engine sends `Stats` (with its one `RankStats`) to the coordinator every
`logging_step_interval` steps (when set) and in answer to `GetStats`. The coordinator answers a
client's `GetStats` with one `Stats` holding every rank's latest `RankStats`, dead ranks
included (`alive` False, with the reason and their last counters, nothing running); `merged()`
adds them up into one view of the whole runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.messages.codec import Array, message, struct
from taipan.messages.lifecycle import LifecycleState


@message(140, required=0)  # (`fresh` came later)
class GetStats:
    """Client -> coordinator (-> every engine). `fresh`: ask every engine now; False: the
    coordinator answers at once from the latest reports and its own lifecycle state (one hop:
    what a trainer checks before a weight push), unless a fresh query is out, whose answer it
    then shares. A direct-mode engine always answers at once."""

    fresh: bool = True


@struct
class RankStats:
    """One rank's counters. `state`: the engine's own lifecycle state; blocks_free counts
    the allocator's free list after the last step (blocks of finished requests come back with
    the next step, which an idle engine runs at once and a paused one at unpause)."""

    rank: int
    state: LifecycleState
    step: int
    running: int
    waiting: int
    paused: int
    num_blocks: int
    blocks_free: int
    blocks_used: int
    paused_total: int
    evicted_total: int
    tokens_last_step: int
    weight_version: int
    # Sums over every step since start: device time of the steps' work (GPU idle share between
    # steps = 1 - its growth / wall time), and how many steps ran from a CUDA graph.
    device_seconds_total: float = 0.0
    steps_total: int = 0
    steps_graphed: int = 0
    # Prefix caching (zeros when off): prompt tokens of admitted requests, of which taken from
    # the cache (skipped); prefill tokens computed; blocks with a hash, and of those the ones no
    # request holds (cached and evictable). Blocks hashed and held = hashed - evictable.
    prefix_prompt_tokens: int = 0
    prefix_cached_tokens: int = 0
    prefill_tokens_computed: int = 0
    blocks_hashed: int = 0
    blocks_evictable: int = 0
    # Hybrid models (zeros otherwise): live Mamba slots free, Mamba snapshots held (the engine's
    # mirror of the mamba_cache actor), prefills started from a snapshot and snapshots taken
    # since start.
    mamba_live_free: int = 0
    mamba_snapshots: int = 0
    mamba_restored: int = 0
    mamba_snapshots_taken: int = 0
    # Expert parallelism (zeros otherwise): dummy forwards this rank ran so its group's
    # collectives stay in step while it had no work (not in steps_total), and their device time
    # (not in device_seconds_total).
    dummy_steps_total: int = 0
    dummy_device_seconds_total: float = 0.0
    # The engine process's time in Python's garbage collector since start, and its collections
    # (every thread stops meanwhile: steps wait for it).
    gc_seconds_total: float = 0.0
    gc_collections_total: int = 0
    # Speculative decoding (zeros when off): draft tokens proposed and verified, of which
    # accepted, and the steps' rows that verified drafts; spec_accepted_per_position[j]: rows
    # whose draft j was accepted (j = 0..num_speculative_tokens-1), so acceptance at position j
    # = that / the rows that drafted at least j + 1 tokens (a falling drafter shows here).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_rows: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Set by the coordinator: False once the rank died (its last report, nothing running), with
    # why in `dead_reason`.
    alive: bool = True
    dead_reason: str = ""
    # Speculative decoding: times a request stopped speculating for a while, its rows having
    # gained nothing (actors/engine/speculation.py's back-off).
    spec_backoffs: int = 0
    # 1 once a weight update disabled this rank's draft model (draft_weight_policy "disable";
    # merged: the ranks where it did).
    spec_draft_disabled: int = 0
    # Steps planned as chained verify steps (InferenceConfig.speculative_chain_steps; each
    # inner step's rows count in spec_verify_rows and the acceptance counters above).
    spec_chains: int = 0
    # Steps planned with speculation off for their batch size (more requests running than
    # InferenceConfig.speculative_disable_by_batch_size).
    spec_batch_off_steps: int = 0
    # Structured outputs: decode rows voided because their input was a token the grammar check
    # then replaced (StepResult.grammar_fixed): each cost its request one step.
    grammar_void_rows: int = 0
    # Forwards that verified drafts (each inner step of a chain is one) and their device time
    # (also in device_seconds_total): a verify forward's cost beside a plain step's.
    spec_verify_steps: int = 0
    spec_verify_device_seconds: float = 0.0
    # Per-layer-group KV (the windowed layers' own pool, actors/engine/local_kv.py; 0 without
    # one): its blocks, those the requests' rings hold, those caching prompt blocks' windowed
    # keys (prefix caching), and the cached blocks copied into rings by prefix hits.
    num_local_blocks: int = 0
    local_blocks_used: int = 0
    local_blocks_cached: int = 0
    local_blocks_copied: int = 0

    @property
    def blocks_active(self) -> int:
        """Blocks with a hash that some request holds (hashed - evictable)."""
        return self.blocks_hashed - self.blocks_evictable

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of verified draft tokens accepted (0 when none was drafted)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify row gains on average (accepted drafts + the one drawn; 0: none)."""
        if not self.spec_verify_rows:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_verify_rows

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache (0 when none)."""
        return (
            self.prefix_cached_tokens / self.prefix_prompt_tokens
            if self.prefix_prompt_tokens
            else 0.0
        )


@message(141)
class Stats:
    """`state`: the coordinator's FSM state (an engine sends its own)."""

    state: LifecycleState
    ranks: tuple[RankStats, ...]

    def merged(self) -> RankStats:
        """Every rank's counters summed (rank -1, the coordinator's state; `step` is the
        furthest rank's, `weight_version` the newest; `alive`: any rank alive)."""
        fields = {
            f.name: 0
            for f in dataclasses.fields(RankStats)
            if f.type in ("int", "float") and f.name != "rank"
        }
        for r in self.ranks:
            for name in fields:
                fields[name] += getattr(r, name)
        floats = ("device_seconds_total", "dummy_device_seconds_total", "gc_seconds_total",
                  "spec_verify_device_seconds")  # fmt: skip
        for name in floats:
            fields[name] = float(fields[name])
        fields["step"] = max((r.step for r in self.ranks), default=0)
        width = max((len(r.spec_accepted_per_position) for r in self.ranks), default=0)
        per_position = [0] * width
        for r in self.ranks:
            for j, n in enumerate(r.spec_accepted_per_position):
                per_position[j] += n
        fields["spec_accepted_per_position"] = tuple(per_position)
        fields["weight_version"] = max((r.weight_version for r in self.ranks), default=0)
        return RankStats(
            **fields, rank=-1, state=self.state, alive=any(r.alive for r in self.ranks)
        )


@message(142)
class PrefixEvents:
    """Engine -> coordinator: the block hashes its allocator registered (`added`) and
    unregistered (`evicted`) in one step, as the allocator reported them (every eviction of a
    step happened before every registration). Sent only by a rank with prefix caching on, only
    for a step that changed a hash, in step order: the coordinator's routing table is the
    allocators' hash maps, not a guess."""

    added: Array[np.int64, 1]
    evicted: Array[np.int64, 1]
