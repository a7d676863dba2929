"""Admission: which waiting requests join the step being planned, where each starts (the
cached prefix it shares, the Mamba snapshot it restores from) and what its first chunk is.
Step 4 of the scheduler's order of service (actors/engine/scheduler.py); `register` records
the prompt blocks the planned chunks write, so that a later admission waits for them;
`never_fits` says why a request can never run (Scheduler.check: it fails at submission).

Works on the scheduler's queues and mirrors (`sched`, the Scheduler: its `waiting`, `running`,
`prefix`, `mamba`; not imported here, which would be a cycle) and on the step's Draft; only
`Scheduler.schedule` calls it. Pure: no sockets, no torch, no clock.
"""

from __future__ import annotations

from taipan.actors.engine.batch import Draft
from taipan.actors.engine.local_kv import ring_row
from taipan.actors.engine.request import EngineRequest, Status, blocks_behind_window
from taipan.actors.engine.routing import fill_from_cache, shareable_with_routing
from taipan.messages.requests import EventType, SamplingParams


def admit(sched, draft: Draft, now: float) -> None:
    """4. Waiting requests, FIFO, while the budgets, the blocks and the live Mamba slots
    allow, and only while nobody waits paused (those come first). While `sched.admitting` is
    off (a pause in mode wait drains), only requests that started before (evicted ones, queued
    first) come back."""
    while sched.waiting and not sched.paused:
        req = sched.waiting[0]
        if not (sched.admitting or req.admissions):
            break
        if len(sched.running) >= sched.plan.max_requests or req.steps_in_flight:
            break  # (an evicted request comes back once its last token is known)
        if sched.mamba is not None and not sched.mamba.live_free:
            break  # every live Mamba slot is held (paused requests keep theirs)
        register(sched, draft)  # (so that it waits for prompt blocks this step writes)
        placed = _place(sched, req, draft)
        if placed is None:
            break
        sched.waiting.popleft()
        _start(sched, req, draft, now, *placed)


def _place(sched, req: EngineRequest, draft: Draft) -> tuple | None:
    """Where the waiting `req` starts (the cached blocks it shares, the Mamba snapshot it
    restores) and what it runs this step: (tokens, new blocks, pinning cost, shared
    blocks, restore), or None (it must wait; `req` is left as it was). With a sliding window
    the shared blocks its first query is past are released at once (`req.num_released`)."""
    shared = _shared_prefix(sched, req)
    if shared is None:
        return None  # its next prompt block is being written by a step in flight
    blocks, cost = shared
    bs = sched.plan.block_size
    req.blocks = blocks
    skip, restore = len(blocks) * bs, (0, 0, -1)
    if sched.mamba is not None:
        req.snap_bounds = []
        if sched.mamba_snapshots and len(req.hashes):
            restore = sched.mamba.match(req, len(blocks), sched.running, bs)
        if restore is None:
            req.blocks = []
            return None  # a deeper snapshot of its prefix is coming: wait for it (FIFO)
        skip = restore[0] * bs
    req.num_computed_tokens = min(skip, req.num_planned_tokens - 1)
    if sched.window and blocks:
        behind = blocks_behind_window(req.num_computed_tokens, sched.window, bs)
        req.num_released = min(len(blocks), behind)
        cost = sched.prefix.cost(blocks[req.num_released :])
    n, need, free = 0, 0, draft.free - cost
    comeback = req.blocks_needed(req.num_tokens + 1, bs)
    if sched.window:  # (the shared blocks it holds count toward its window's)
        comeback = min(comeback, max(0, sched.window_blocks - len(req.held_blocks)))
    if not (req.admissions and comeback > free):
        # (an evicted request comes back when all it had, and one more, fits: with a sliding
        # window, what it holds at a time. So does one evicted in its prompt's chunks: back
        # with a chunk at once, two long prompts that each need most of the pool evicted each
        # other for ever: hypothesis, tests/perf/logs/session28_local_kv_livelock.txt)
        n, need, _ = sched.fit(req, draft.budget, free)
    local = sched.local
    if n and local is not None and local.ring_size(req.max_total_tokens) > local.num_free:
        n = 0  # (every ring is held: it waits for one, FIFO)
    if n == 0:
        req.blocks, req.num_computed_tokens, req.snap_bounds, req.num_released = [], 0, [], 0
        return None
    return n, need, cost, blocks, restore


def _start(sched, req, draft: Draft, now: float, n, need, cost, blocks, restore):
    """An admitted request runs: its first chunk, its pinned prefix, its live Mamba slot
    (and the snapshot its first chunk starts from)."""
    draft.take(req, n, need, cost)
    if sched.local is not None:  # (actors/engine/local_kv.py)
        local = sched.local
        # A prefix hit: its window's cached windowed keys, copied into its ring.
        sources = local.window_sources(req.hashes, req.num_computed_tokens) if blocks else []
        req.ring = local.take(local.ring_size(req.max_total_tokens))
        req.ring_row = ring_row(req.ring, local.ring_blocks)  # (the plan's table row)
        local.copies_into(req.ring, sources, draft.local_copies)
    if sched.prefix is not None:
        sched.prefix.pin(req, blocks, draft.pins, req.num_released)
        if req.num_released:  # (with its pin, in this step's BlockOps: nothing comes back)
            sched.pending_release[req.request_id] = req.num_released
        if req.routed is not None:
            fill_from_cache(req, len(blocks), sched.prefix.routing_of, sched.plan.block_size)
    req.admissions += 1
    req.status = Status.RUNNING
    req.add_event(EventType.ADD_CONTEXT, now)
    sched.running.append(req)
    if sched.mamba is not None:
        sched.mamba.live_free -= 1
        draft.mamba_live.append(req)
        if restore[0]:  # its first chunk starts from the snapshot at the match
            draft.chunks[-1].mamba_init = restore[2]
            if restore[1] not in draft.mamba_restore:
                draft.mamba_restore.append(restore[1])
            sched.mamba.num_restored += 1


def register(sched, draft: Draft) -> None:
    """Register the complete prompt blocks the chunks planned so far will write (prefix
    caching), once each."""
    if sched.prefix is not None:
        for c in draft.chunks[draft.claimed :]:
            if c.drafts is not None:  # a decode row (its drafts are no prompt, no prefill)
                continue
            sched.prefix.register(c.request, c.num_new_tokens, sched.step + 1, draft.regs)
        draft.claimed = len(draft.chunks)


def _shared_prefix(sched, req: EngineRequest) -> tuple[list[int], int] | None:
    """(the cached blocks `req` shares, the available blocks pinning them takes), or None
    when it must wait for a block another request's step in flight is writing."""
    px = sched.prefix
    if px is None or not len(req.hashes):
        return [], 0
    if req.wants_prompt_log_probs and len(req.prompt_log_probs) < len(req.prompt) - 1:
        return [], 0  # it needs every prompt position's logits
    blocks, wait = px.match(req.hashes)
    if req.routed is not None:  # only blocks whose routing is kept (actors/engine/routing.py)
        keep = shareable_with_routing(req, len(blocks), px.routing_of, px.block_size)
        if keep < len(blocks):
            blocks, wait = blocks[:keep], False
    if sched.local is not None:  # only blocks whose window's windowed keys are cached too
        keep = sched.local.usable_hit(req.hashes, len(blocks), req.num_planned_tokens)
        if keep < len(blocks):
            blocks, wait = blocks[:keep], False
    if wait:
        return None
    return blocks, px.cost(blocks)


def never_fits(sched, prompt_len: int, sampling: SamplingParams) -> str | None:
    """Why a request can never run on `sched` (Scheduler.check), or None: it fails at
    submission."""
    p = sched.plan
    if prompt_len == 0:
        return "the prompt is empty"
    total = prompt_len + sampling.max_tokens
    if total > p.max_sequence_length:
        return (
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
            f"exceeds max_sequence_length ({p.max_sequence_length})"
        )
    if not sched.chunked_prefill and prompt_len > p.max_tokens:
        return (
            f"prompt ({prompt_len} tokens) exceeds the per-step token budget max_tokens "
            f"({p.max_tokens}); set enable_chunked_prefill=true or raise max_tokens"
        )
    need = sched.min_blocks(prompt_len, total)
    if need > p.num_blocks:
        return f"needs {need} KV blocks; the pool has {p.num_blocks}"
    if sched.local is not None and sched.local.ring_size(total) > sched.local.num_blocks:
        return (
            f"needs {sched.local.ring_size(total)} KV blocks of the windowed layers; their "
            f"pool has {sched.local.num_blocks}"
        )
    if sampling.return_routed_experts and not p.moe_layers:
        return (
            "return_routed_experts needs a mixture-of-experts model; this model has no MoE layers"
        )
    return None
