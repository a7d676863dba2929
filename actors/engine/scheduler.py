"""Continuous batching: which requests run in the next step, and with how many tokens.

Pure core: ints, lists and numpy; no torch, no zmq, no clock (times come from messages, so a
replay of the same inbound messages makes the same decisions). Owns every EngineRequest, the
queues and the budgets. Its parts: admission.py, batch_arrays.py (the StepPlan's columns),
outputs.py (what a result does to a request), the prefix and Mamba mirrors (prefix.py, mamba.py,
which also take in the replies) and speculation.py (drafts, verify rows); batch.py has the
step's data types. Once per step (actors/engine/flow.py takes a step through its replies):

    batch = scheduler.schedule(now)       # what runs, which blocks to free / allocate
    flow.settle()                         # the allocator's and mamba_cache's answers applied
    arrays = plan_arrays(batch, ...)      # the StepPlan's numpy arrays (batch_arrays.py)
    done = scheduler.update(batch, result, now)  # append sampled tokens, stop checks

Overlap: the next step may be planned while one step is still in flight (its update() not yet
applied). Planning a chunk advances the request at once (`num_computed_tokens`, and
`num_pending` for the token it will sample), so a running request's next decode row is planned
before its token is known: the plan marks that row in `prev_rows`, and the gpu reads the token
the previous step sampled on the device. Stop conditions are checked one step late, in update():
a request that ends there (EOS, a stop word, an abort) may already hold a row in the next step,
whose token is dropped when that step's result comes (the request is finished by then); its
blocks are freed by the step after, which the device runs after both (one stream). A request
certain to end (max_tokens or max_sequence_length reached by its pending tokens) is not planned
again. With nothing in flight this is the plain plan -> run -> update loop. A request that
speculates is planned only once its last token is on the host, as a verify row of that token
and its drafts, and update() appends every token the row accepted (speculation.py); in a step
planned while more requests run than speculative_disable_by_batch_size it is planned as any
other row (once no row of it that may verify is in flight).

Budgets: at most `max_tokens` tokens and `max_requests` running requests per step. Order of
service (Megatron's DynamicInferenceEngine):
1. running requests, decode rows first, then prefill chunks (with chunked prefill cut to the
   token budget and the free blocks); one whose next tokens need a block when none is free is
   *paused*: it keeps its blocks;
2. paused requests resume last-in-first-out as blocks free up;
3. over `max_paused_blocks`, or when nothing can run, the oldest paused ones are *evicted*
   (blocks freed, prompt + generated recomputed later, queued first);
4. waiting requests are admitted FIFO while budgets and blocks allow (none while one is paused).
A request that can never fit (`check`) fails at submission.
"""

# The planning contracts live beside their code: prefix caching at the top of prefix.py, hybrid
# models (Mamba slots and snapshots) at the top of mamba.py, the sliding window in request.py
# beside `blocks_behind_window` (all in actors/engine/).

from __future__ import annotations

from collections import deque

import numpy as np

from taipan.actors.config import RuntimePlan, local_chunk
from taipan.actors.engine.admission import admit, never_fits, register
from taipan.actors.engine.batch import Chunk, Draft, StepBatch
from taipan.actors.engine.batch_arrays import PlanCache
from taipan.actors.engine.grammar import GrammarBook
from taipan.actors.engine.local_kv import LocalPool
from taipan.actors.engine.mamba import MambaMirror
from taipan.actors.engine.outputs import Appending, append_token, take_prompt_log_probs
from taipan.actors.engine.prefix import PrefixIndex, writes_done
from taipan.actors.engine.request import EngineRequest, Status, blocks_behind_window
from taipan.actors.engine.routing import keep_block_routing, take_step
from taipan.actors.engine.speculation import Speculation
from taipan.messages.allocator import PrefixCachingEvictionPolicy
from taipan.messages.block_hash import block_hashes
from taipan.messages.gpu import StepResult
from taipan.messages.requests import EventType, FinishReason, SamplingParams


class Scheduler:
    def __init__(
        self,
        plan: RuntimePlan,
        enable_chunked_prefill: bool,
        track_paused_events: bool = False,
        track_token_events: bool = False,
        prefix_policy: PrefixCachingEvictionPolicy | None = None,
        sliding_window: int | None = None,
        speculation: Speculation | None = None,
    ):
        self.plan = plan
        # Speculative decoding (actors/engine/speculation.py has the contract); None: off.
        self.spec = speculation
        self.chunked_prefill = enable_chunked_prefill
        self.track_paused_events = track_paused_events
        self.track_token_events = track_token_events
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.paused: list[EngineRequest] = []  # a stack: the last one paused resumes first
        self.requests: dict[int, EngineRequest] = {}
        self.grammars = GrammarBook()  # the grammars the gpu holds (structured outputs)
        self.plan_cache = PlanCache()  # a steady decode step's columns (batch_arrays.py)
        self.num_free_blocks = plan.num_blocks  # the allocator's count after the last reply
        self.pending_free: dict[int, int] = {}  # request id -> blocks to free next step
        # Sliding window: request id -> leading columns released in all, not sent yet, and the
        # blocks those releases give back (counted as free while planning).
        self.pending_release: dict[int, int] = {}
        self.pending_release_blocks = 0
        self.num_released_total = 0  # blocks released by windows (stats)
        self.window = 0
        self.set_sliding_window(plan.sliding_window if sliding_window is None else sliding_window)
        self.step = 0
        self.steps_in_flight = 0  # planned steps with chunks whose update() has not run
        self.num_paused_total = 0
        self.num_evicted_total = 0
        self.num_void_rows_total = 0  # (rows a grammar check voided: `_void_next`)
        self.prefix = None
        if prefix_policy is not None:
            self.prefix = PrefixIndex(plan.num_blocks, plan.block_size, prefix_policy)
        self.salt = 0  # the weight version: block hashes are salted with it
        # Off while a pause in mode wait drains: no new request starts (evicted ones do).
        self.admitting = True
        # Hybrid models: the mirror of the mamba_cache actor's slots. A request takes a live
        # slot when admitted and gives it back when it finishes or is evicted; a paused one
        # keeps it. A slot given back may be handed out at once: its new owner reads zeros or a
        # snapshot, and its first write comes after every step in flight (one device stream).
        self.mamba = None
        if plan.mamba_slots:
            self.mamba = MambaMirror(plan.mamba_slots, plan.mamba_snapshot_slots)
        # Mamba prefix caching (snapshots): chunked prefill is on (a long prompt's chunks may
        # hold snapshot boundaries: the kernels store those states inside the chunk).
        self.mamba_snapshots = bool(self.mamba and self.prefix and plan.mamba_snapshot_slots)
        if self.mamba_snapshots:
            self.chunked_prefill = True
        # Per-layer-group KV: the windowed layers' rings (actors/engine/local_kv.py has the
        # contract). A wrapping ring bounds a step's tokens, so prompts run in chunks.
        self.local = None
        if plan.local_window and plan.num_local_blocks:
            k = speculation.k if speculation is not None else 0
            chunk = local_chunk(
                plan.local_window, plan.block_size, plan.max_tokens, plan.max_sequence_length, k
            )
            self.local = LocalPool(
                plan.num_local_blocks, plan.local_window, plan.block_size, chunk,
                caching=self.prefix is not None,
            )  # fmt: skip
            self.chunked_prefill = True

    def set_sliding_window(self, window: int) -> None:
        """The model's sliding window (RuntimePlan.sliding_window unless the constructor was
        given one; 0: some layer reads the whole context): set before the first request."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"sliding_window must be an int >= 0, not {window!r}")
        if self.requests:
            raise RuntimeError("the sliding window is set before any request")
        self.window = window

    @property
    def window_blocks(self) -> int:
        """The most blocks a request with a sliding window holds after a step of one-token
        chunks (1 + ceil((W - 1) / block_size)): what one-token progress needs; 0 without a
        window. (A chunk of c tokens: ceil((W - 1 + c) / block_size) + 1 at most.)"""
        if not self.window:
            return 0
        return 1 + -(-(self.window - 1) // self.plan.block_size)

    def min_blocks(self, prompt_len: int, total: int) -> int:
        """The fewest blocks of the pool a request of `total` tokens (prompt and generated) needs
        to run to its end: all of them, or with a sliding window those of its window (and of
        its whole prompt, which must run in one step without chunked prefill)."""
        bs = self.plan.block_size
        need = -(-total // bs)
        if self.window:
            first = 0 if self.chunked_prefill else -(-prompt_len // bs)
            need = min(need, max(first, self.window_blocks))
        return need

    def hash_prompt(self, prompt: np.ndarray) -> np.ndarray:
        """The prompt's block hashes under the current weights (empty without prefix caching)."""
        if self.prefix is None:
            return np.zeros(0, dtype=np.int64)
        return block_hashes(prompt, self.plan.block_size, self.salt)

    # --- admission ----------------------------------------------------------------------------

    def check(self, prompt_len: int, sampling: SamplingParams) -> str | None:
        """Why a request can never run here, or None (admission.py `never_fits`)."""
        return never_fits(self, prompt_len, sampling)

    def add(self, req: EngineRequest, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id} is already known")
        self.requests[req.request_id] = req
        req.speculates = self.spec is not None and self.spec.eligible(req)
        req.add_event(EventType.ADD_ENGINE, now)
        self.waiting.append(req)

    def abort(self, request_id: int, now: float) -> EngineRequest | None:
        """Mark a request aborted. It ends now (returned) unless a running step holds it; then
        it ends when that step's result is applied (update()) or at the next schedule()."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        req.aborted = True
        if req.status is Status.RUNNING and req.steps_in_flight:
            return None
        self._finish(req, FinishReason.ABORT, now=now)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused or self.pending_free)

    def pending(self) -> int:
        """The requests held (waiting, running, paused): the expert-parallel vote's work count.
        Blocks still to free need no forward (they ride along with the next plan). While not
        `admitting`, only waiting requests that started before count."""
        waiting = len(self.waiting)
        if not self.admitting:
            waiting = sum(1 for r in self.waiting if r.admissions)
        return waiting + len(self.running) + len(self.paused)

    def drained(self) -> bool:
        """Whether every request that started has ended (none running, paused, or evicted and
        waiting to come back): what a pause in mode wait waits for. Requests that never started
        may still wait."""
        return not (self.running or self.paused or any(r.admissions for r in self.waiting))

    # --- one step -----------------------------------------------------------------------------

    def _free_view(self) -> int:
        return self.num_free_blocks + sum(self.pending_free.values()) + self.pending_release_blocks

    def fit(
        self, req: EngineRequest, budget: int, free: int, speculate: bool = True
    ) -> tuple[int, int, bool]:
        """(tokens, new blocks, blocked): what `req` can run this step within `budget` tokens
        and `free` blocks (`speculate`: Draft.speculate). Only a chunked prefill may be cut
        short; `blocked` says that the request could not run for want of a free block (not
        of budget)."""
        bs = self.plan.block_size
        planned = req.num_planned_tokens
        # A speculative request drafts from its last token: it waits until that is known. So
        # does any whose verify row is in flight (how many tokens it gains is not known yet).
        speculating = req.speculates and speculate
        if req.num_pending and (
            speculating or req.verify_in_flight or self._ends_when_known(req, planned)
        ):
            return 0, 0, False
        remaining = planned - req.num_computed_tokens
        n = min(remaining, budget)
        if self.local is not None and self.local.wraps(req.max_total_tokens):
            n = min(n, self.local.chunk)  # (the ring holds what a chunk of that many reads)
        if n <= 0 or (n < remaining and not (self.chunked_prefill or req.generated)):
            return 0, 0, False
        need = req.blocks_needed(req.num_computed_tokens + n, bs)
        if need <= free:
            return n, need, False
        # An evicted request recomputes prompt + generated in chunks even without chunked
        # prefill: its admission promised only prompt + max_tokens <= max_sequence_length.
        # (`free` < 0: the admission's pinned prefix already costs more than is available.)
        if (self.chunked_prefill or req.generated) and remaining > 1 and free >= 0:
            n = min(n, (len(req.blocks) + free) * bs - req.num_computed_tokens)
            if n > 0:
                return n, req.blocks_needed(req.num_computed_tokens + n, bs), False
        return 0, 0, True

    def _ends_when_known(self, req: EngineRequest, planned: int) -> bool:
        """Whether the tokens being sampled for `req` certainly end it (by length; `planned`:
        its num_planned_tokens)."""
        return (
            len(req.generated) + req.num_pending >= req.sampling.max_tokens
            or planned >= self.plan.max_sequence_length
        )

    def schedule(self, now: float) -> StepBatch:
        """Plan the next step (the order of service in the module docstring). At most one step
        may be in flight (planned, update() not run)."""
        self._slide_windows()
        draft = Draft(self.plan.max_tokens, self._free_view())
        ended = [r for r in self.running + self.paused if r.aborted]
        for r in ended:
            self._finish(r, FinishReason.ABORT, now=now)
        draft.speculate = self.spec is not None and self.spec.active(len(self.running))
        self._plan_running(draft, now)
        if not self._plan_paused(draft, now):
            # Nobody was just evicted (the pool is short: re-admitting the evicted request at
            # once would only churn).
            admit(self, draft, now)
        register(self, draft)
        if self.spec is not None and not draft.speculate and draft.chunks:
            self.spec.steps_off += 1
        if self.spec is not None and self.spec.chain_steps > 1:
            self._chain(draft)
        # Rows of one query token first (a stable sort): attention takes them as one decode
        # batch, a prefix of the step, and the longer chunks after them as one prefill batch.
        draft.chunks.sort(key=lambda c: c.num_new_tokens != 1)
        snaps = self._advance(draft.chunks, len(draft.mamba_restore))
        return self._batch(draft, ended, snaps)

    def _slide_windows(self) -> None:
        """Sliding window: each request that holds blocks lets go of those no later query of it
        reads (the contract beside request.py `blocks_behind_window`); sent with the next step."""
        if not self.window:
            return
        bs = self.plan.block_size
        for r in self.running + self.paused:
            upto = min(len(r.blocks), blocks_behind_window(r.num_computed_tokens, self.window, bs))
            if upto > r.num_released:
                self.pending_release_blocks += self._release(r.blocks[r.num_released : upto])
                self.num_released_total += upto - r.num_released
                r.num_released = upto
                self.pending_release[r.request_id] = upto

    def _plan_running(self, draft: Draft, now: float) -> None:
        """1. Running requests, decode rows first, so decode tokens ride along with prefill
        chunks; one that needs a block when none is free is paused."""
        # (A stable partition in one pass, where a sort and a count took two.)
        decode_rows, chunk_rows = [], []
        for r in self.running:
            more = len(r.prompt) + len(r.generated) - r.num_computed_tokens > 1
            (chunk_rows if more else decode_rows).append(r)
        decodes = len(decode_rows)
        for i, req in enumerate(decode_rows + chunk_rows):
            if req.spec_backoff is not None:
                self.spec.resume(req)
            n, need, blocked = self.fit(req, draft.budget, draft.free, draft.speculate)
            if blocked:
                self._pause(req, now)
            if not n:
                continue
            drafts = None
            if n == 1 and req.speculates and draft.speculate:
                budget = draft.budget - max(0, decodes - i - 1)  # (a token each later row)
                drafts = self.spec.drafts_for(req, budget, draft.free, self.plan)
                if drafts is not None:
                    n += len(drafts)
                    need = req.blocks_needed(req.num_computed_tokens + n, self.plan.block_size)
            draft.take(req, n, need)
            if drafts is not None:  # (a Chunk verifies none by default)
                draft.chunks[-1].drafts = drafts
                draft.chunks[-1].gpu_drafts = self.spec.on_gpu

    def _chain(self, draft: Draft) -> None:
        """A step whose verify rows chain in the gpu (speculation.py `Speculation.chain`):
        each row gets the blocks for what it may gain in the chain, as far as free blocks go
        (the gpu stops a row at the end of its blocks)."""
        plain = self.local is not None or self.window  # (a hybrid's rows chain: its decode
        # rows take no Mamba snapshots, and each inner step rolls its states back)
        waiting = bool(self.waiting or self.paused)
        limits = [] if plain else self.spec.chain(draft.chunks, self.plan, waiting)
        bs, k = self.plan.block_size, self.spec.k
        for c, limit in zip(draft.chunks, limits, strict=False):
            r = c.request
            want = min(limit, self.spec.chain_steps * (k + 1))
            more = min(r.blocks_needed(r.num_computed_tokens + want, bs) - c.new_blocks, draft.free)
            if more > 0:
                c.new_blocks += more
                draft.free -= more
            c.chain_limit = limit

    def _plan_paused(self, draft: Draft, now: float) -> bool:
        """2. Paused requests resume LIFO; 3. eviction, over the paused budget or when nothing
        else can run. Whether a request was evicted."""
        self._resume(draft)
        evicted = self._evict_over_budget(now)
        while not draft.chunks and self.paused and not self.steps_in_flight:
            # (With a step in flight, its result may end requests and free blocks: wait for it.)
            self._evict(self.paused[0], now)
            evicted = True
            draft.free = self._free_view()
            self._resume(draft)
        return evicted

    def _advance(self, chunks: list[Chunk], num_restore: int) -> list:
        """The step is planned: advance each request past its chunk. Returns the Mamba
        snapshots the chunks take (request, hash, position)."""
        snaps: list[tuple[EngineRequest, int, int]] = []
        for c in chunks:
            r = c.request
            c.start = r.num_computed_tokens
            c.samples = c.start + c.num_new_tokens == r.num_planned_tokens
            c.gen_index = len(r.generated) + r.num_pending
            if c.drafts is not None:
                # A verify row: its drafts' KV is written, but which of them count is known
                # only from the result (update() sets num_computed_tokens then).
                c.samples = True
                r.num_computed_tokens += 1
                r.verify_in_flight = True
            else:
                r.num_computed_tokens += c.num_new_tokens
            r.num_pending += c.samples
            r.steps_in_flight += 1
            if r.snap_bounds:
                self.mamba.snapshots_in_chunk(
                    r, c.start, self.prefix, num_restore, snaps, self.plan.block_size
                )
        self.steps_in_flight += bool(chunks)
        return snaps

    def _batch(self, draft: Draft, ended: list[EngineRequest], snaps: list) -> StepBatch:
        """The planned step, with the blocks to free that ride along with it."""
        free_ids = list(self.pending_free)
        self.pending_free.clear()
        px = self.prefix
        drop = px is not None and px.drop_pending
        if draft.chunks or free_ids or drop:  # an empty plan is not a step (and sends nothing)
            self.step += 1
        if px is not None:
            px.drop_pending = False
        batch = StepBatch(self.step, draft.chunks, free_ids, ended, draft.pins, draft.regs, drop)
        if batch.is_step and self.pending_release:  # (else they wait for the next step)
            batch.releases = list(self.pending_release.items())
            self.pending_release.clear()
            self.pending_release_blocks = 0
        batch.mamba_live, batch.mamba_restore = draft.mamba_live, draft.mamba_restore
        batch.mamba_snaps = snaps
        if self.local is not None:
            batch.local_copies = draft.local_copies
            if self.local.caching:
                self.local.saves_of(draft.chunks, batch.step, batch.local_saves)
        batch.weight_version = self.salt
        batch.speculate = draft.speculate
        if batch.has_mamba_ops:
            batch.mamba_free, batch.mamba_invalidate, batch.mamba_drop = self.mamba.take_pending()
        return batch

    def _pause(self, req: EngineRequest, now: float) -> None:
        self.running.remove(req)
        req.status = Status.PAUSED
        self.paused.append(req)
        self.num_paused_total += 1
        if self.track_paused_events:
            req.add_event(EventType.PAUSE, now)

    def _resume(self, draft: Draft) -> None:
        while self.paused and len(self.running) < self.plan.max_requests:
            req = self.paused[-1]
            n, need, _ = self.fit(req, draft.budget, draft.free, draft.speculate)
            if n == 0:
                break
            self.paused.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            draft.take(req, n, need)

    def _evict_over_budget(self, now: float) -> bool:
        cap = self.plan.max_paused_blocks
        evicted = False
        while cap is not None and self.paused and sum(_held(r) for r in self.paused) > cap:
            self._evict(self.paused[0], now)
            evicted = True
        return evicted

    def _evict(self, req: EngineRequest, now: float) -> None:
        """Free a paused request's blocks; it recomputes prompt + generated when re-admitted."""
        self.paused.remove(req)
        self.pending_free[req.request_id] = self._release(req.held_blocks)
        req.blocks, req.num_released = [], 0
        self._release_mamba(req)
        self._release_ring(req)
        req.history.checkpoint(req.num_tokens)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.add_event(EventType.EVICT, now)
        self.waiting.appendleft(req)
        self.num_evicted_total += 1

    def flush_cache(self) -> StepBatch | None:
        """Drop every cached prefix block and Mamba snapshot (pause(clear_cache=True), flush_cache;
        no step may be in flight): the step that tells the allocator, with the frees waiting
        (it runs no forward), or None without prefix caching. Blocks that requests hold stay
        theirs, no longer shared; the Mamba pool drops its snapshots with the next MambaOps
        (the mirror forgets them now, so none is restored meanwhile)."""
        if self.prefix is None:
            return None
        if self.steps_in_flight:
            raise RuntimeError("flush_cache with a step in flight")
        self._drop_cached()
        return self._batch(Draft(0, 0), [], [])

    def invalidate_kv(self) -> None:
        """Every cached K/V is gone (a resume after suspend in "recompute" mode): requests keep
        their blocks and recompute prompt + generated tokens into them."""
        if self.steps_in_flight:
            raise RuntimeError("invalidate_kv with a step in flight")
        if self.prefix is not None or self.window:
            # Shared blocks would be recomputed by each holder, and released ones are gone:
            # instead every request lets go of its blocks and queues first, in order, and
            # re-admission shares what the first one recomputes.
            for req in reversed(self.running + self.paused):
                self.pending_free[req.request_id] = self._release(req.held_blocks)
                req.blocks, req.num_released, req.shared_until, req.num_registered = [], 0, 0, 0
                self._release_mamba(req)
                self._release_ring(req)
                req.status = Status.WAITING
                self.waiting.appendleft(req)
            self.running, self.paused = [], []
        if self.prefix is not None:
            self._drop_cached()
        for req in self.running + self.paused + list(self.waiting):
            if req.num_computed_tokens:
                req.num_computed_tokens = 0
                req.history.checkpoint(req.num_tokens)

    def draft_updated(self) -> None:
        """The draft model's weights were updated (UpdateWeights.draft): speculation that
        draft_weight_policy "disable" ended starts again (Speculation.draft_updated)."""
        if self.spec is not None:
            self.spec.draft_updated(self.requests.values())

    def new_weights(self, weight_version: int) -> None:
        """A weight update happened (RL): age every live request's tokens; with prefix caching,
        nothing cached before matches any more (the salt changes) and the KV requests still
        hold was computed with the old weights, so it is never registered."""
        for req in self.requests.values():
            req.history.increment_staleness(req.num_tokens, policy_only=not req.blocks)
        self.salt = weight_version
        if self.spec is not None:
            self.spec.new_weights(self.requests.values())
        if self.prefix is None:
            return
        self._drop_cached()
        for req in self.requests.values():
            req.hashes = self.hash_prompt(req.prompt)
            req.num_registered = len(req.hashes) if req.blocks else 0

    def update(self, batch: StepBatch, result: StepResult | None, now: float, error: str = ""):
        """Apply a step's result (None: the step failed with `error`). Returns the requests
        with something to report: streamable tokens, or an ending. A request that ended while
        the step ran (in update() of the step before, or by an abort) drops its token here."""
        out = []
        k = 0  # offset into the compacted prompt log-probs
        tokens = result.token_ids.tolist() if result is not None else None
        step = Appending(now, self.plan, self.track_token_events, batch.weight_version, tokens)
        if batch.chunks:
            self.steps_in_flight -= 1
        if self.local is not None and self.local.writing:
            writes_done(self.local.writing, batch.step, list(self.local.writing))
        if self.prefix is not None:
            self.prefix.done_writing(batch.step, [reg[2] for reg in batch.regs])
            if self.mamba_snapshots:
                self.mamba.done_writing(batch.step, [h for _, h, _ in batch.mamba_snaps])
            if result is None:
                self._drop_cached()  # the step's blocks (and snapshots) may hold no valid state
        if result is not None and len(result.routed_experts):
            take_step(batch, result.routed_experts, result.spec_tokens)
            if self.prefix is not None and batch.regs:
                px = self.prefix
                keep_block_routing(batch, px.routing_of, px.block_of, self.plan.block_size)
        fixed = set(result.grammar_fixed.tolist()) if result is not None else ()
        for i, c in enumerate(batch.chunks):
            r = c.request
            r.steps_in_flight -= 1
            if result is not None and c.num_prompt_targets:
                take_prompt_log_probs(r, result, k, c.num_prompt_targets)
                k += c.num_prompt_targets
            if r.status is Status.FINISHED:
                continue
            if result is None:
                self._finish(r, FinishReason.ERROR, error or "the step failed", now)
                out.append(r)
                continue
            if r.aborted:
                self._finish(r, FinishReason.ABORT, now=now)
                out.append(r)
                continue
            if not c.samples:
                continue
            if r.void_rows:  # (its input was replaced by the grammar check: computed again)
                r.void_rows -= 1
                continue
            r.num_pending -= 1
            if c.drafts is not None:
                r.verify_in_flight = False
            if c.drafts is not None and len(c.drafts):
                reason = self.spec.append_verified(r, c, result, i, step)
            else:
                reason = append_token(r, result, i, step)
            if self.spec is not None and self.spec.mtp and reason is None:
                self.spec.take_drafts(r, result, i)
            if reason is not None:
                self._finish(r, reason, now=now)
            elif r.steps_in_flight and i in fixed:
                self._void_next(r)
            if r.finish_reason is not None or (r.stream and r.ready_to_stream()):
                out.append(r)
        return out

    def _void_next(self, r: EngineRequest) -> None:
        """`r`'s token was replaced by its grammar check after the step in flight had read the
        old one: that row is void (dropped when it comes) and its position is planned again,
        with the new token."""
        r.num_computed_tokens -= 1
        r.num_pending -= 1
        r.void_rows += 1
        self.num_void_rows_total += 1

    def fail_all(
        self, reason: FinishReason, now: float, error: str | None = None
    ) -> list[EngineRequest]:
        """End every request: at shutdown ("abort"), or when the rank dies ("error", `error`)."""
        ended = []
        for r in list(self.waiting) + list(self.running) + list(self.paused):
            self._finish(r, reason, error, now=now)
            ended.append(r)
        return ended

    def stats(self) -> dict[str, int]:
        return {
            "step": self.step,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": len(self.paused),
            "blocks_free": self.num_free_blocks,
            "blocks_used": self.plan.num_blocks - self.num_free_blocks,
            "paused_total": self.num_paused_total,
            "evicted_total": self.num_evicted_total,
            "grammar_void_rows": self.num_void_rows_total,
            **({"blocks_released": self.num_released_total} if self.window else {}),
            **(self._local_stats() if self.local is not None else {}),
            **(self.prefix.stats() if self.prefix is not None else {}),
            **(self.mamba.stats() if self.mamba is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def _local_stats(self) -> dict[str, int]:
        pool = self.local
        return {
            "local_blocks_used": pool.num_blocks - pool.num_free,
            "local_blocks_cached": pool.num_cached,
            "local_blocks_copied": pool.num_copied,
        }

    # --- ending -------------------------------------------------------------------------------

    def _finish(
        self,
        r: EngineRequest,
        reason: FinishReason,
        error: str | None = None,
        now: float | None = None,
    ) -> None:
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r.status is Status.PAUSED:
            self.paused.remove(r)
        elif r.status is Status.WAITING and r in self.waiting:
            self.waiting.remove(r)
        r.status = Status.FINISHED
        r.num_pending = 0  # tokens still being sampled for it are dropped when they come
        r.verify_in_flight = False
        r.finish_reason = reason
        r.error = error
        if now is not None:
            if reason == FinishReason.ERROR:
                r.add_event(EventType.ERROR_NONTRANSIENT, now)
            failed = reason in (FinishReason.ERROR, FinishReason.ABORT)
            r.add_event(EventType.FAIL if failed else EventType.FINISH, now)
        if r.blocks:  # (all of it released or not: the allocator forgets the table)
            self.pending_free[r.request_id] = self._release(r.held_blocks)
            r.blocks, r.num_released = [], 0
        self._release_mamba(r)
        self._release_ring(r)
        del self.requests[r.request_id]

    def _release_ring(self, r: EngineRequest) -> None:
        """Its local ring goes back at once: a new owner's first write comes after every
        step in flight (one device stream), as a Mamba slot's."""
        if r.ring:
            self.local.give(r.ring)
            r.ring, r.ring_row = [], None

    def _release_mamba(self, r: EngineRequest) -> None:
        r.snap_bounds = []
        if r.mamba_slot >= 0:
            self.mamba.release(r.request_id)
            r.mamba_slot = -1

    def _drop_cached(self) -> None:
        """Every cached K/V hash is void, and so is every Mamba snapshot extending one."""
        self.prefix.drop()
        if self.mamba_snapshots:
            self.mamba.drop()
        if self.local is not None:
            self.local.drop_cache()

    def _release(self, blocks: list[int]) -> int:
        """Blocks that come back (free, or cached and idle) when a request lets go of these."""
        return len(blocks) if self.prefix is None else self.prefix.release(blocks)


def _held(r: EngineRequest) -> int:
    return len(r.blocks) - r.num_released
