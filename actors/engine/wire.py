"""The engine's wire: pure translations between its messages and its Scheduler, shared by the
live engine actor (actors/engine/actor.py, step.py) and the replay checker (actors/engine/check.py),
so that both build byte-identical messages from the same decisions.

No sockets, no clock, no torch: plain functions of their arguments.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.config import InferenceConfig, RuntimePlan, plan_limits
from taipan.actors.engine.batch_arrays import plan_arrays
from taipan.actors.engine.grammar import grammar_problem
from taipan.actors.engine.local_kv import copy_arrays, local_arrays
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.routing import RoutedExperts
from taipan.actors.engine.scheduler import Scheduler, StepBatch
from taipan.actors.engine.speculation import Speculation
from taipan.messages.allocator import AllocatorReady, BlockOps, PrefixCachingEvictionPolicy
from taipan.messages.gpu import ModelLoaded, StepPlan
from taipan.messages.mamba_cache import MambaInit, MambaOps
from taipan.messages.requests import EngineSubmit


class BootError(Exception):
    """The engine cannot serve with this model and config; the text says why."""


def runtime_plan(config: InferenceConfig, loaded: ModelLoaded, ready: AllocatorReady):
    """What the rank found out at start-up (raises BootError)."""
    if config.max_sequence_length > loaded.max_position_embeddings:
        raise BootError(
            f"max_sequence_length ({config.max_sequence_length}) exceeds the model's "
            f"max_position_embeddings ({loaded.max_position_embeddings})"
        )
    max_requests, max_tokens = plan_limits(config)
    paused = None
    if config.paused_buffer_size_gb is not None:
        # Inclusive in buffer_size_gb, as Megatron's unified_memory_level 0.
        paused = int(config.paused_buffer_size_gb * 1024**3 // loaded.block_bytes)
    return RuntimePlan(
        num_blocks=ready.num_blocks,
        block_size=loaded.block_size,
        max_requests=max_requests,
        max_tokens=max_tokens,
        max_sequence_length=config.max_sequence_length,
        eos_token_ids=tuple(loaded.eos_token_ids),
        max_paused_blocks=paused,
        mamba_slots=loaded.mamba_slots,
        mamba_snapshot_slots=loaded.mamba_snapshot_slots,
        moe_layers=loaded.moe_layers,
        sliding_window=loaded.sliding_window,
        local_window=loaded.local_window,
        num_local_blocks=loaded.num_local_blocks,
    )


def new_scheduler(config: InferenceConfig, plan: RuntimePlan) -> Scheduler:
    return Scheduler(
        plan,
        config.enable_chunked_prefill,
        track_paused_events=config.track_paused_request_events,
        track_token_events=config.track_generated_token_events,
        prefix_policy=prefix_policy(config),
        speculation=speculation(config),
    )


def speculation(config: InferenceConfig) -> Speculation | None:
    """The engine's drafter and counters (None: num_speculative_tokens 0, speculation off)."""
    k = config.num_speculative_tokens
    if not k:
        return None
    on_gpu = config.speculative_method == "draft_model"
    return Speculation(
        k,
        config.ngram_prompt_lookup_min,
        config.ngram_prompt_lookup_max,
        on_gpu=on_gpu,
        disable_on_update=on_gpu and config.draft_weight_policy == "disable",
        mtp=config.speculative_method == "mtp",
        chain_steps=config.speculative_chain_steps,
        chain_max_rows=config.speculative_chain_max_rows,
        off_above=config.speculative_disable_by_batch_size,
    )


def prefix_policy(config: InferenceConfig) -> PrefixCachingEvictionPolicy | None:
    """The allocator's eviction policy with prefix caching on (None: off). Unset means "lru",
    which keeps released blocks cached as vLLM and SGLang do."""
    if not config.enable_prefix_caching:
        return None
    return PrefixCachingEvictionPolicy(
        config.prefix_caching_eviction_policy or PrefixCachingEvictionPolicy.LRU
    )


def derive_seed(request_id: int, arrival_time: float) -> int:
    """A seed for an unseeded request, fixed by its inbound message (replays stay exact)."""
    x = (request_id * 0x9E3779B97F4A7C15 + int(arrival_time * 1e6)) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


def submission(
    sched: Scheduler | None, vocab_size: int, msg: EngineSubmit
) -> tuple[EngineRequest | None, str | None]:
    """(the request to add, None) or (None, why it can never run here)."""
    prompt = msg.prompt_token_ids  # int32[P]: the codec checked dtype and rank
    if sched is None:
        return None, "the engine has no model loaded"
    if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab_size):
        return None, f"prompt token ids must be in [0, {vocab_size})"
    problem = sched.check(len(prompt), msg.sampling)
    if problem is not None:
        return None, problem
    problems = msg.sampling.token_id_problems(vocab_size)
    if problems:
        return None, "; ".join(problems)
    if msg.sampling.structured is not None:
        problem = grammar_problem(msg.sampling.structured)
        if problem is not None:
            return None, problem
    seed = msg.sampling.seed
    if seed is None:
        seed = derive_seed(msg.request_id, msg.arrival_time)
    hashes = sched.hash_prompt(prompt)
    sent = msg.block_hashes
    if len(sent) and msg.hash_salt == sched.salt and not np.array_equal(sent, hashes):
        # Caching KV under hashes that do not name its tokens would poison other requests.
        bad = len(hashes) if len(sent) != len(hashes) else int(np.flatnonzero(sent != hashes)[0])
        return None, (
            f"block_hashes do not match the prompt tokens (first difference at block {bad}; "
            f"{len(sent)} hashes sent, {len(hashes)} complete blocks of "
            f"{sched.plan.block_size} tokens)"
        )
    # A copy: the decoded array is a read-only view of the message's frame.
    req = EngineRequest(
        msg.request_id, prompt.copy(), msg.sampling, msg.stream, msg.arrival_time, seed
    )
    req.hashes = hashes
    if msg.sampling.return_routed_experts:
        req.routed = RoutedExperts()
    return req, None


def block_ops(batch: StepBatch) -> BlockOps | None:
    """The allocator message of a step, or None when the step changes no block. Sliding-window
    releases only ride along: a plan with nothing else is no step (they wait for the next)."""
    counts = np.asarray([c.new_blocks for c in batch.chunks if c.new_blocks], np.int32)
    ids = np.asarray([c.request.request_id for c in batch.chunks if c.new_blocks], np.int64)
    if not (len(ids) or batch.free_ids or batch.pins or batch.regs or batch.drop_cache):
        if not batch.releases:
            return None
    regs = batch.regs
    return BlockOps(
        batch.step,
        np.asarray(batch.free_ids, np.int64),
        ids,
        counts,
        np.asarray([rid for rid, _ in batch.pins], np.int64),
        np.asarray([len(h) for _, h in batch.pins], np.int32),
        np.concatenate([h for _, h in batch.pins]).astype(np.int64)
        if batch.pins
        else np.zeros(0, np.int64),
        np.asarray([r[0] for r in regs], np.int64),
        np.asarray([r[1] for r in regs], np.int32),
        np.asarray([r[2] for r in regs], np.int64),
        np.asarray([r[3] for r in regs], np.int64),
        batch.drop_cache,
        np.asarray([rid for rid, _ in batch.releases], np.int64),
        np.asarray([upto for _, upto in batch.releases], np.int32),
    )


def mamba_ops(batch: StepBatch) -> MambaOps | None:
    """The mamba_cache message of a step, or None when it takes no live slot and reads or
    writes no snapshot (frees and invalidations then wait in the mirror for the next one)."""
    if not batch.has_mamba_ops:
        return None
    return MambaOps(
        batch.step,
        np.asarray(batch.mamba_free, np.int64),
        np.asarray([r.request_id for r in batch.mamba_live], np.int64),
        np.asarray(batch.mamba_invalidate, np.int64),
        np.asarray(batch.mamba_restore, np.int64),
        np.asarray([h for _, h, _ in batch.mamba_snaps], np.int64),
        batch.mamba_drop,
    )


def mamba_init(loaded: ModelLoaded) -> MambaInit | None:
    """The mamba_cache actor's sizing (None: the model has no Mamba layers)."""
    if not loaded.mamba_slots:
        return None
    return MambaInit(loaded.mamba_slots, loaded.mamba_snapshot_slots)


def step_plan(sched: Scheduler, batch: StepBatch) -> StepPlan:
    p = sched.plan
    arrays = plan_arrays(
        batch, p.block_size, sched.mamba is not None, p.eos_token_ids, sched.plan_cache
    )
    arrays |= sched.grammars.arrays(batch, sched.requests)
    if sched.local is not None and batch.chunks:  # (the windowed layers' rings, their copies)
        rows = [c.request.ring_row for c in batch.chunks]
        width = arrays["block_tables"].shape[1]
        arrays |= local_arrays(rows, batch.chunks, width, p.block_size)
        arrays |= copy_arrays(batch.local_copies, batch.local_saves)
    if sched.spec is not None and sched.spec.mtp and batch.chunks:
        arrays |= mtp_arrays(batch)
    if batch.chunks and batch.chunks[0].chain_limit:
        arrays |= chain_arrays(batch, sched.spec, p.block_size, p.eos_token_ids)
    return StepPlan(step=batch.step, **arrays)


def chain_arrays(batch: StepBatch, spec: Speculation, block_size: int, eos_token_ids) -> dict:
    """StepPlan.chain_* of a step whose verify rows chain (Speculation.chain): each row's
    known tokens, its limit, the slots its blocks give and its stop tokens."""
    reqs = [c.request for c in batch.chunks]
    history = [r.token_slice(0, c.start + 1) for r, c in zip(reqs, batch.chunks, strict=True)]
    stops = [
        [*(() if r.sampling.ignore_eos else eos_token_ids), *r.sampling.stop_token_ids]
        for r in reqs
    ]
    d = spec.drafter
    return {
        "chain_steps": spec.chain_steps,
        "chain_ngram": np.asarray([d.min_n, d.max_n, d.k], np.int32),
        "chain_history": np.concatenate(history).astype(np.int32),
        "chain_history_loc": _offsets(len(h) for h in history),
        "chain_limit": np.asarray([c.chain_limit for c in batch.chunks], np.int32),
        "chain_capacity": np.asarray([len(r.blocks) * block_size for r in reqs], np.int32),
        "chain_stops": np.asarray([t for row in stops for t in row], np.int32),
        "chain_stops_loc": _offsets(len(row) for row in stops),
    }


def _offsets(lengths) -> np.ndarray:
    """[0, l0, l0 + l1, ...] as int32."""
    counts = np.fromiter(lengths, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def mtp_arrays(batch: StepBatch) -> dict[str, np.ndarray]:
    """StepPlan.mtp_next / mtp_draft (an MTP head): the token after each chunk that does not
    sample (a known one: such a chunk stops before its request's last known token), and
    which sampling rows want their drafts (those of requests that speculate now). A chunk
    that does not sample and has no known next token gets -1, which the gpu refuses by name."""
    nxt, draft = [], []
    for c in batch.chunks:
        r, stop = c.request, c.start + c.num_new_tokens
        after = [] if c.samples else r.token_slice(stop, stop + 1)
        nxt.append(int(after[0]) if len(after) else -1)
        draft.append(int(c.samples and r.speculates and batch.speculate))
    return {"mtp_next": np.asarray(nxt, np.int32), "mtp_draft": np.asarray(draft, np.int8)}


def dummy_plan(step: int) -> StepPlan:
    """The StepPlan of a dummy step (expert parallelism: this rank has no work in a step its
    group takes): no sequence, no token; `step` is the last step the scheduler planned."""
    i8, i32, i64, f32 = (np.zeros(0, t) for t in (np.int8, np.int32, np.int64, np.float32))
    return StepPlan(
        step=step,
        input_ids=i32,
        positions=i32,
        slot_mapping=i64,
        query_start_loc=np.zeros(1, np.int32),
        seq_lens=i32,
        block_tables=np.zeros((0, 1), np.int32),
        sample=i8,
        temperature=f32,
        top_k=i32,
        top_p=f32,
        min_p=f32,
        seeds=i64,
        gen_index=i32,
        logprobs=i8,
        top_n=i32,
        prompt_targets=i32,
    )
