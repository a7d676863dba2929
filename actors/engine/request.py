"""The engine's view of one request: its tokens, its KV progress, its blocks, its events, how it
ends, and what it has still to report.

Owned by the scheduler (actors/engine/scheduler.py); only it mutates these objects. The engine
actor reads them to build `RequestOutput`s (`take_output`).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from taipan.actors.engine.history import RequestHistory
from taipan.actors.engine.routing import RoutedExperts
from taipan.messages.requests import EventType, FinishReason, RequestEvent, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no KV (new, or evicted: its KV must be recomputed)
    RUNNING = "running"  # in the batch
    PAUSED = "paused"  # keeps its KV blocks, waits for a free block
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class EngineRequest:
    request_id: int
    prompt: np.ndarray  # int32[P]
    sampling: SamplingParams
    stream: bool
    arrival_time: float
    seed: int  # resolved: the request's own seed, or one the engine drew for it
    status: Status = Status.WAITING
    generated: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose K/V are in the cache or being written by a planned step (the scheduler
    # advances it when it plans a chunk, so the next step can be planned before this one ends).
    num_computed_tokens: int = 0
    # Tokens sampled by planned steps whose results have not come back yet (0 to 2 with one step
    # in flight while the next is planned); `row`: this request's row in the last planned step.
    num_pending: int = 0
    # Whether one of those tokens comes from a verify row (speculation: it may gain several).
    verify_in_flight: bool = False
    row: int = -1
    # Rows of it in planned steps whose token is void (their input was a token the grammar
    # check replaced: StepResult.grammar_fixed); each is dropped when its result comes.
    void_rows: int = 0
    steps_in_flight: int = 0  # planned steps holding this request whose results are not applied
    # Its block table: block i holds positions [i * block_size, (i + 1) * block_size). With a
    # sliding window the leading `num_released` columns went back to the pool (no later query
    # reads them: `blocks_behind_window`); their ids stay in the table the gpu gets, unread.
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_released: int = 0
    # Per-layer-group KV: its ring of the windowed layers' pool while it runs or is paused
    # (actors/engine/local_kv.py); empty without a local pool, or while it waits.
    ring: list[int] = dataclasses.field(default_factory=list)
    ring_row: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    # Prefix caching: the prompt's block hashes (int64, one per complete prompt block, salted
    # with the current weight version); positions below `shared_until` lie in blocks pinned
    # from the cache (never written by this request); `num_registered`: leading prompt blocks
    # of its table that are cached (matched, or registered by it); `num_cached_tokens`: prompt
    # tokens its first admission skipped.
    hashes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    shared_until: int = 0
    num_registered: int = 0
    num_cached_tokens: int = 0
    # Hybrid models: the live Mamba state slot it holds while running or paused (-1: none;
    # handed out by the mamba_cache actor when it is admitted). With Mamba snapshots: the
    # prompt positions (block boundaries, ascending) whose state its chunks still have to stop
    # at so that the state there is snapshotted (DESIGN.md §6).
    mamba_slot: int = -1
    snap_bounds: list[int] = dataclasses.field(default_factory=list)
    admissions: int = 0  # times admitted (an evicted request is admitted again)
    num_streamed: int = 0  # generated tokens already sent to the client
    aborted: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    events: list[RequestEvent] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Log-probs, aligned with `generated` (and with prompt positions 1..P-1 for the prompt).
    log_probs: list[float] = dataclasses.field(default_factory=list)
    top_n: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    prompt_log_probs: list[float] = dataclasses.field(default_factory=list)
    prompt_top_n: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    history: RequestHistory = dataclasses.field(default_factory=RequestHistory)
    # The weight version of each generated token, as spans (version, index in `generated` of
    # the first token sampled with it); a new span starts where the version changes.
    weight_versions: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Routed experts (SamplingParams.return_routed_experts), kept across preemption and
    # recompute (actors/engine/routing.py); None: not asked.
    routed: RoutedExperts | None = None
    # `blocks` as int32 for the plan's block table (actors/engine/batch_arrays.py `_table_row`):
    # (the list it was made from, the array); None until first planned.
    table_cache: tuple[list[int], np.ndarray] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    # Logit controls (SamplingParams.has_controls, read once per row and step by the plan) and
    # what their arrays reuse between steps (a control_arrays.RowControls, which imports this).
    has_controls: bool = dataclasses.field(init=False, default=False)
    controls: object | None = dataclasses.field(default=None, repr=False, compare=False)
    # Speculative decoding (actors/engine/speculation.py): whether it speculates (set when the
    # scheduler takes it in; off while it backs off), its n-gram index (an ngram.NgramIndex, made
    # at its first draft) and its back-off (a speculation.Backoff, made at its first miss).
    speculates: bool = False
    ngram: object | None = dataclasses.field(default=None, repr=False, compare=False)
    spec_backoff: object | None = dataclasses.field(default=None, repr=False, compare=False)
    # An MTP head's drafts (StepResult.next_drafts) to follow its first `mtp_at` tokens: the
    # step that computed its last token drafted them (speculation.py `take_drafts`).
    mtp_drafts: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    mtp_at: int = dataclasses.field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.has_controls = self.sampling.has_controls

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those being sampled: what the next chunk may compute up to."""
        return len(self.prompt) + len(self.generated) + self.num_pending

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may still generate: what its blocks must cover at most."""
        return len(self.prompt) + self.sampling.max_tokens

    def token_slice(self, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of prompt + generated, as int32."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        gen = np.asarray(self.generated[max(0, start - p) : stop - p], dtype=np.int32)
        if start >= p:
            return gen
        return np.concatenate([self.prompt[start:], gen])

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks to add so that `num_tokens` tokens have a KV slot."""
        return max(0, -(-num_tokens // block_size) - len(self.blocks))

    @property
    def held_blocks(self) -> list[int]:
        """The blocks it holds: its table but the released columns."""
        return self.blocks[self.num_released :]

    # --- log-probs wanted -----------------------------------------------------------------------

    @property
    def wants_prompt_log_probs(self) -> bool:
        s = self.sampling
        return s.return_log_probs and not s.skip_prompt_log_probs

    def prompt_targets(self, start: int, stop: int) -> np.ndarray:
        """For the tokens at positions [start, stop): the prompt token that follows each, where
        its log-prob is still wanted (not yet computed: an evicted request recomputes its KV but
        keeps the log-probs it has), else -1."""
        out = np.full(stop - start, -1, dtype=np.int32)
        if not self.wants_prompt_log_probs:
            return out
        first = max(start, len(self.prompt_log_probs))  # position whose successor is next
        last = min(stop, len(self.prompt) - 1)
        if first < last:
            out[first - start : last - start] = self.prompt[first + 1 : last + 1]
        return out

    # --- events -------------------------------------------------------------------------------

    def add_event(self, type_: EventType, timestamp: float, payload: int | None = None) -> None:
        self.events.append(RequestEvent(type_, timestamp, payload))

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        n = len(self.generated)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    # --- reporting ----------------------------------------------------------------------------

    def holdback(self) -> int:
        """Trailing generated tokens that could still turn out to start a stop word (which may be
        dropped): a streaming request must not send them yet."""
        best = 0
        gen = self.generated
        for word in self.sampling.stop_word_ids:
            for k in range(min(len(word) - 1, len(gen)), best, -1):
                if tuple(gen[len(gen) - k :]) == tuple(word[:k]):
                    best = k
                    break
        return best

    def ready_to_stream(self) -> int:
        """How many generated tokens a streaming output may carry now (0 = send nothing yet)."""
        if self.finish_reason is not None:
            return len(self.generated) - self.num_streamed
        n = len(self.generated) - self.holdback() - self.num_streamed
        return n if n >= self.sampling.streaming_interval else 0


# Sliding window (the scheduler's contract, Scheduler._slide_windows; `window` W,
# ModelLoaded.sliding_window: every attention layer reads at most W keys back): at the start of each
# plan, each running or paused request lets go of the leading blocks none of its later queries reads
# (`blocks_behind_window` below, from its num_computed_tokens n: the step being planned computes
# positions >= n). They go to the allocator in that step's BlockOps, before its allocations, as a
# decref (a hashed block stays cached under "lru"), so the step may hand them to another request.
# That is safe with a step in flight: it reads only blocks of positions < n that it was planned
# with, and the device runs it before any write of the new step (one stream). It must be n before
# this plan, not after: the step's own queries start at n. Released columns keep their old ids in
# the block table (the kernels never read them, and the plan is what it would be without releases);
# a request's end frees only the rest (`held_blocks`). Releases ride with the next step that goes
# out (an empty plan keeps them). A request needs only about W / block_size + 2 blocks at a time
# (`Scheduler.min_blocks`), so one longer than the whole pool runs when its window fits.
def blocks_behind_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """How many leading blocks of a request no later query reads, with a sliding `window`
    (0: none). Its next query is at a position >= `num_computed_tokens` (n: every position below
    is computed or being computed by a planned step) and reads keys k > n - window, so block i,
    positions [i * block_size, (i + 1) * block_size), is never read again once
    (i + 1) * block_size <= n - window + 1."""
    if window <= 0:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size
