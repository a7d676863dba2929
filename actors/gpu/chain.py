"""Chained verify steps (StepPlan.chain_steps; InferenceConfig.speculative_chain_steps): the gpu
worker runs up to chain_steps n-gram verify steps one after the other for one plan, drafting
each next step itself, so the engine's turn and the actors' hops between verify steps (most
of a speculating request's step period at batch 1: tests/perf/NOTES.md, "Where an n-gram
verify step's time goes") are paid once per chain.

`run_chain(plan, block_size, run_step)` does it with `run_step` (the worker's launch and collect
of one plan): inner step 0 is the plan's own rows and drafts; after each inner step every
sequence appends its new tokens (the verify row's spec_tokens, or the token drawn where it had
no drafts) to its known tokens and stops at a stop token, at its chain_limit, or where its next
row would need a KV slot at or past chain_capacity; the others get their next row: their last
new token at the position after their accepted ones (a hybrid's recurrent state from its live
slot, where the step before left its last accepted position's), and up to k drafts proposed by
ops/ngram.py's rule over their known tokens (the engine's rule, so the drafts are those the
engine would plan), none after CHAIN_MISSES inner steps in a row whose drafts all failed. The
chain ends where no row has drafts for its next inner step: plain rows run faster from the
engine, whose plain steps overlap the next plan (a chain's inner steps do not: each waits for
the one before). The result is one StepResult for the plan: each sequence's new tokens in
spec_tokens, (drafts, accepted) per inner step in spec_chain. Greedy verification keeps the
outputs those of plain decoding, whatever the drafts, and seeded sampling draws what plain
decoding draws (the point-mass rule of ops/speculative.py, each inner step's gen_index advanced
by the tokens gained); the raw log-probs of the gained tokens come in spec_log_probs where a row
asks, and with StepPlan.return_routed_experts each row's routing of the positions it kept (its
last known token's and each accepted draft's, per inner step), the rows back to back (engine
routing.py `take_step` reads a chain's rows so).

`check_chain` refuses (ValueError) a chain plan outside the contract of messages/gpu.py
StepPlan.chain_steps. A refusal of an inner step after the first (a suspend, a failed
forward) ends the chain there: the tokens gained so far are returned (their KV is written).

Must not touch: torch or the device (numpy on the plan's arrays; `run_step` does the work).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from taipan.messages.gpu import StepPlan, StepResult
from taipan.ops.ngram import NgramDrafter

__all__ = ["check_chain", "run_chain"]

# A row whose drafts all failed in this many inner steps in a row drafts no more in the chain
# (a verify row costs more device time than a plain one; the engine's own back-off,
# actors/engine/speculation.py, then sees the misses in StepResult.spec_chain).
CHAIN_MISSES = 2
MAX_STEPS = 64  # (actors/config.py MAX_CHAIN_STEPS)

# Plan fields a chain plan must leave empty (the contract): what the inner steps could not
# carry over from one step to the next.
_EMPTY_FIELDS = (
    "prev_rows",
    "mamba_snap_row",
    "logprobs_mode",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "penalty_rows",
    "bias_rows",
    "grammar_rows",
    "grammar_drop",
    "draft_prev",
    "allow_rows",
    "local_block_tables",
    "local_copy_src",
    "local_save_src",
    "mtp_next",
    "mtp_draft",
)


def check_chain(plan: StepPlan) -> None:
    """ValueError for a plan with chain_steps > 1 that breaks StepPlan.chain_steps' contract."""
    batch = len(plan.seq_lens)
    if plan.chain_steps > MAX_STEPS:
        raise ValueError(f"chain_steps must be at most {MAX_STEPS}, got {plan.chain_steps}")
    if len(plan.chain_ngram) != 3:
        raise ValueError(f"chain_ngram needs (min_n, max_n, k), got {plan.chain_ngram.tolist()}")
    min_n, max_n, k = (int(v) for v in plan.chain_ngram)
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"chain_ngram needs 1 <= min_n <= max_n and k >= 1, got {min_n, max_n, k}")
    for name in ("chain_limit", "chain_capacity"):
        if len(getattr(plan, name)) != batch:
            raise ValueError(f"{name} has {len(getattr(plan, name))} entries for {batch} sequences")
    for name, values in (("chain_history", plan.chain_history), ("chain_stops", plan.chain_stops)):
        loc = getattr(plan, name + "_loc")
        if (
            len(loc) != batch + 1
            or loc[0] != 0
            or loc[-1] != len(values)
            or (np.diff(loc) < 0).any()
        ):
            raise ValueError(f"{name}_loc must be {batch + 1} ascending offsets into {name}")
    if (np.diff(plan.chain_history_loc) < 1).any():
        raise ValueError("chain_history needs each sequence's tokens, its last known one included")
    if not len(plan.num_drafts) or (plan.num_drafts < 1).any():
        raise ValueError("every sequence of a chain plan verifies drafts")
    if plan.top_n.any():
        raise ValueError("a chain plan's sequences ask no top-n log-probs")
    if (plan.prompt_targets >= 0).any():
        raise ValueError("a chain plan asks no prompt log-probs")
    full = [name for name in _EMPTY_FIELDS if getattr(plan, name).size]
    mamba = (len(plan.mamba_init), len(plan.mamba_out))
    if mamba != (0, 0) and (mamba != (batch, batch) or (plan.mamba_out < 0).any()):
        raise ValueError("a hybrid's chain plan gives each sequence its live Mamba slot")
    if full or plan.grammar_new:
        raise ValueError(f"a chain plan cannot carry {', '.join(full or ['grammar_new'])}")
    last = plan.query_start_loc[1:] - 1 - plan.num_drafts  # each row's last known token
    history_last = plan.chain_history[plan.chain_history_loc[1:] - 1]
    if (plan.input_ids[last] != history_last).any():
        raise ValueError("chain_history must end with each sequence's last known token")


@dataclasses.dataclass
class _Row:
    """One sequence of the chain plan."""

    tokens: list[int]  # its known tokens (chain_history, then what the chain gained)
    position: int  # the position of its last known token (the next row's first)
    left: int  # tokens it may still gain
    capacity: int
    stops: frozenset[int]
    gained: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)  # (of `gained`, if asked)
    routed: list[np.ndarray] = dataclasses.field(default_factory=list)  # (of kept positions)
    done: bool = False
    misses: int = 0  # inner steps in a row whose drafts all failed


def run_chain(
    plan: StepPlan, block_size: int, run_step: Callable[[StepPlan], StepResult]
) -> StepResult:
    """The chain's StepResult (the module docstring); `run_step` runs one inner plan."""
    check_chain(plan)
    min_n, max_n, k = (int(v) for v in plan.chain_ngram)
    drafter = NgramDrafter(min_n, max_n, k)
    batch = len(plan.seq_lens)
    hist, hloc = plan.chain_history, plan.chain_history_loc
    sloc = plan.chain_stops_loc
    first = plan.query_start_loc[:-1]
    rows = [
        _Row(
            tokens=hist[hloc[i] : hloc[i + 1]].tolist(),
            position=int(plan.positions[first[i]]),
            left=int(plan.chain_limit[i]),
            capacity=int(plan.chain_capacity[i]),
            stops=frozenset(plan.chain_stops[sloc[i] : sloc[i + 1]].tolist()),
        )
        for i in range(batch)
    ]
    counts = np.full((batch, plan.chain_steps, 2), -1, dtype=np.int32)
    inner = dataclasses.replace(plan, chain_steps=0, **_NO_CHAIN)
    active = np.arange(batch)
    seconds = device = 0.0
    graphed = True
    for j in range(plan.chain_steps):
        result = run_step(inner)
        if result.error is not None:
            if j == 0:
                return result
            break
        seconds += result.forward_seconds
        device += result.device_seconds
        graphed = graphed and result.graphed
        nd = inner.num_drafts if len(inner.num_drafts) else np.zeros(len(active), np.int32)
        for s, i in enumerate(active.tolist()):
            row = rows[i]
            if nd[s]:
                spec = result.spec_tokens[s]
                new = spec[spec >= 0].tolist()
                lps = result.spec_log_probs[s, : len(new)] if plan.logprobs[i] else None
            else:
                new = [int(result.token_ids[s])]
                lps = result.log_probs[s : s + 1] if plan.logprobs[i] else None
            counts[i, j] = (nd[s], len(new) - 1)
            if nd[s]:
                row.misses = 0 if len(new) > 1 else row.misses + 1
            kept = _gain(row, new, lps)
            if plan.return_routed_experts:  # (its positions whose KV now holds real tokens)
                at = int(inner.query_start_loc[s])
                row.routed.append(result.routed_experts[at : at + kept])
        active = np.asarray([i for i in active.tolist() if not rows[i].done], dtype=np.int64)
        if j + 1 == plan.chain_steps or not len(active):
            break
        inner = _next_plan(plan, active, rows, drafter, block_size)
        if not len(inner.num_drafts):  # (the module docstring: no plain inner steps)
            break
    width = max(len(r.gained) for r in rows)
    spec_tokens = np.full((batch, width), -1, dtype=np.int32)
    spec_log_probs = np.full((batch, width), np.nan, dtype=np.float32)
    for i, r in enumerate(rows):
        spec_tokens[i, : len(r.gained)] = r.gained
        spec_log_probs[i, : len(r.log_probs)] = r.log_probs
    asked = {"spec_log_probs": spec_log_probs} if plan.logprobs.any() else {}
    if plan.return_routed_experts:  # (each row's kept positions, the rows back to back)
        asked["routed_experts"] = np.concatenate([x for r in rows for x in r.routed])
    return StepResult(
        plan.step,
        spec_tokens[:, 0].copy(),
        None,
        seconds,
        device_seconds=device,
        graphed=graphed,
        # (every row's log-probs are in spec_log_probs: log_probs and top-n as a plan asking
        # none would have them)
        log_probs=np.full(batch, np.nan, dtype=np.float32),
        top_n_ids=np.full((batch, 0), -1, dtype=np.int32),
        top_n_log_probs=np.full((batch, 0), np.nan, dtype=np.float32),
        spec_tokens=spec_tokens,
        spec_chain=counts,
        **asked,
    )


def _gain(row: _Row, new: list[int], log_probs: np.ndarray | None) -> int:
    """Append an inner step's new tokens (and their log-probs, where asked) to `row` up to a
    stop token or its limit, and say whether it is done. Returns how many it kept (as many
    of the step's positions, from its first, hold real tokens now)."""
    for n, token in enumerate(new[: row.left]):
        if token in row.stops:
            new = new[: n + 1]
            row.done = True
            break
    new = new[: row.left]
    row.gained += new
    if log_probs is not None:
        row.log_probs += log_probs[: len(new)].tolist()
    row.tokens += new
    row.left -= len(new)
    row.position += len(new)  # (the last new token's: its KV is written by the next row)
    row.done = row.done or row.left <= 0 or row.position >= row.capacity
    return len(new)


def _next_plan(
    plan: StepPlan,
    active: np.ndarray,
    rows: list[_Row],
    drafter: NgramDrafter,
    block_size: int,
) -> StepPlan:
    """The next inner step's plan: the rows of `active` (in order) with their last new token
    and fresh drafts; the per-sequence fields of `plan`'s rows."""
    ids, positions, counts = [], [], []
    for i in active.tolist():
        r = rows[i]
        room = min(r.left - 1, r.capacity - r.position - 1)
        if r.misses >= CHAIN_MISSES:  # (it drafts no more in the chain)
            room = 0
        drafts = drafter.propose(np.asarray(r.tokens, np.int32), room) if room > 0 else []
        ids += [r.tokens[-1], *list(drafts)]
        positions += range(r.position, r.position + 1 + len(drafts))
        counts.append(len(drafts))
    pos = np.asarray(positions, dtype=np.int64)
    nd = np.asarray(counts, dtype=np.int32)
    qsl = np.zeros(len(nd) + 1, dtype=np.int32)
    np.cumsum(nd + 1, out=qsl[1:])
    tables = plan.block_tables[active]
    owner = np.repeat(np.arange(len(nd)), nd + 1)
    slots = tables[owner, pos // block_size].astype(np.int64) * block_size + pos % block_size
    gained = np.asarray([len(rows[i].gained) for i in active.tolist()], dtype=np.int32)
    return dataclasses.replace(
        plan,
        input_ids=np.asarray(ids, dtype=np.int32),
        positions=pos.astype(np.int32),
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=(pos[qsl[1:] - 1] + 1).astype(np.int32),
        block_tables=tables,
        sample=plan.sample[active],
        temperature=plan.temperature[active],
        top_k=plan.top_k[active],
        top_p=plan.top_p[active],
        min_p=plan.min_p[active],
        seeds=plan.seeds[active],
        gen_index=plan.gen_index[active] + gained,
        logprobs=plan.logprobs[active],
        top_n=plan.top_n[active],
        prompt_targets=np.full(len(pos), -1, dtype=np.int32),
        num_drafts=nd if nd.any() else np.zeros(0, np.int32),
        # A hybrid's rows go on from their live slots (the step before rolled them back to
        # their last accepted position).
        mamba_init=plan.mamba_out[active] if len(plan.mamba_out) else plan.mamba_out,
        mamba_out=plan.mamba_out[active] if len(plan.mamba_out) else plan.mamba_out,
        chain_steps=0,
        **_NO_CHAIN,
    )


_NO_CHAIN = {
    name: np.zeros(0, np.int32)
    for name in (
        "chain_ngram",
        "chain_history",
        "chain_history_loc",
        "chain_limit",
        "chain_capacity",
        "chain_stops",
        "chain_stops_loc",
    )
}
