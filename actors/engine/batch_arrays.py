"""The StepPlan's columns for a planned step (messages/gpu.py): `plan_arrays`.

Owns the translation of a StepBatch (chunks of requests, their blocks, Mamba slots and
sampling parameters) into the numpy arrays the gpu actor reads. Pure: reads the batch and its
requests, writes only each chunk's `num_prompt_targets`, each request's `row` (the row it
samples in this step, which the next step's plan reads as `prev_rows`) and the scheduler's
PlanCache (a steady decode step's columns, reused by the next one). No sockets, no torch.
"""

from __future__ import annotations

import operator

import numpy as np

from taipan.actors.engine.batch import StepBatch
from taipan.actors.engine.control_arrays import control_arrays
from taipan.messages.requests import LogprobsMode

# The columns of a step that depend on its requests only (and which rows they sit in), not on
# where they are: a steady decode step (`PlanCache`) takes them from the step before.
REQUEST_COLUMNS = (
    "query_start_loc", "sample", "temperature", "top_k", "top_p", "min_p", "seeds", "logprobs",
    "top_n", "prompt_targets", "prev_rows", "logprobs_mode", "num_drafts", "draft_prev",
)  # fmt: skip


class PlanCache:
    """The last planned step's requests (in row order) and its REQUEST_COLUMNS, when the next
    step may reuse them: every row of it one token, each reading its own row of the step in
    flight, or none reading that step (`ids` None otherwise). Owned by the scheduler; only
    `plan_arrays` reads and writes it."""

    def __init__(self) -> None:
        self.ids: list[int] | None = None  # id() of each row's EngineRequest
        self.columns: dict[str, np.ndarray] = {}
        # The last step's block tables and, per row, its request's block list and its length
        # then (a table only grows at its end, or its list is replaced: `_table_row`).
        self.tables: np.ndarray | None = None
        self.blocks: list[list[int]] = []
        self.lengths: np.ndarray | None = None


def plan_arrays(
    batch: StepBatch,
    block_size: int,
    hybrid: bool,
    eos_token_ids: tuple[int, ...] = (),
    cache: PlanCache | None = None,
) -> dict[str, np.ndarray]:
    """The StepPlan arrays (see messages/gpu.py) for this batch (`hybrid`: the model has Mamba
    layers, so the rows' Mamba slots go too; `eos_token_ids`: what min_tokens forbids besides
    stop_token_ids, control_arrays.py). With a `cache` (the scheduler's), a steady decode step
    (`_steady_arrays`: the same requests in the same rows as the step before, each one token
    past it) computes only its inputs, positions, slots, lengths and controls; any other step
    is built row by row (`_arrays`)."""
    if cache is None:
        return _arrays(batch, block_size, hybrid, eos_token_ids)
    out = None if hybrid else _steady_arrays(batch, block_size, eos_token_ids, cache)
    if out is None:
        out = _arrays(batch, block_size, hybrid, eos_token_ids)
        n = len(batch.chunks)
        prev = out["prev_rows"]
        steady = not hybrid and n > 0 and len(out["input_ids"]) == n
        # (every row reads the step in flight, from its own row of it; or none does)
        steady = steady and (not len(prev) or bool((prev == np.arange(n)).all()))
        cache.ids = [id(c.request) for c in batch.chunks] if steady else None
        cache.columns = {k: _frozen(out[k]) for k in REQUEST_COLUMNS} if steady else {}
        cache.tables = None
    return out


def _steady_tables(chunks, lengths: np.ndarray, cache: PlanCache) -> np.ndarray:
    """The block tables of a steady step's rows: the step before's when no row's block list
    was replaced or grew since, else built again (and kept)."""
    blocks = [c.request.blocks for c in chunks]
    if (
        cache.tables is None
        or not np.array_equal(lengths, cache.lengths)
        or any(map(operator.is_not, blocks, cache.blocks))
    ):
        cache.tables = _frozen(_block_tables([_table_row(c.request) for c in chunks]))
        cache.blocks, cache.lengths = blocks, lengths
    return cache.tables


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # (shared by the steps that reuse it: a write would raise)
    return a


def _steady_arrays(batch: StepBatch, block_size: int, eos_token_ids, cache: PlanCache):
    """`_arrays` of a steady decode step, or None when the step is not one: the step before
    had the same requests in the same rows, one token each, and so has this one, every row
    reading the token the step before samples in its own row (overlapped steps) or, in both,
    every row a generated token of its own; then every REQUEST_COLUMNS column is the step
    before's, and inputs, positions, slots, lengths and tables are computed at once for all
    rows (`wire.step_plan` 96-98 -> 61-62 us a step at batch 64 on the 2-core box, the
    engine's host work per step 375-380 -> 341-345: tests/perf/engine_step_cost.py)."""
    chunks = batch.chunks
    if cache.ids is None or [id(c.request) for c in chunks] != cache.ids:
        return None
    # Per row: its position, token count, prompt length, tokens generated, first position not
    # shared from the cache, generated index, whether it samples, blocks.
    rows = np.array(
        [(c.start, c.num_new_tokens, len(c.request.prompt), len(c.request.generated),
          c.request.shared_until, c.gen_index, c.samples, len(c.request.blocks))
         for c in chunks],
        dtype=np.int64,
    )  # fmt: skip
    start, new, prompt, generated, shared, gen, samples, lengths = rows.T
    n = len(chunks)
    if (new != 1).any() or (samples != cache.columns["sample"]).any():
        return None
    # (Each request sits in the row it had in the step before, which set its `row` to it: the
    # prev_rows column, i -> i, holds.)
    if len(cache.columns["prev_rows"]):  # (overlapped: each reads its row of the step before)
        if (start < prompt + generated).any():
            return None
        ids = np.zeros(n, dtype=np.int32)
    else:  # (each reads a token it generated)
        at = start - prompt
        if (at < 0).any() or (at >= generated).any():
            return None
        ids = np.asarray(
            [c.request.generated[i] for c, i in zip(chunks, at.tolist(), strict=True)],
            dtype=np.int32,
        )
    tables = _steady_tables(chunks, lengths, cache)
    bs = block_size
    slots = tables[np.arange(n), start // bs].astype(np.int64) * bs + start % bs
    slots[start < shared] = -1
    out = dict(cache.columns)
    out |= control_arrays(chunks, eos_token_ids)
    return out | {
        "input_ids": ids,
        "positions": start.astype(np.int32),
        "slot_mapping": slots,
        "seq_lens": (start + 1).astype(np.int32),
        "block_tables": tables,
        "gen_index": gen.astype(np.int32),
        "return_routed_experts": any(
            c.request.routed is not None and c.start + 1 > c.request.routed.filled for c in chunks
        ),
    }


def _arrays(batch, block_size, hybrid, eos_token_ids) -> dict[str, np.ndarray]:
    """`plan_arrays` row by row. A one-token chunk (every decode row) is read as Python
    scalars: at batch 256 per-row numpy calls were most of the engine's time per step. A
    decode row whose token the step in flight is sampling gets input id 0 and, in
    `prev_rows`, the row that samples it."""
    bs = block_size
    ids, positions, slots, targets = _Concat(), _Concat(), _Concat(), _Concat()
    # Decode rows append Python scalars to the current runs (bound once: most rows are these).
    add_id, add_pos = ids.scalars.append, positions.scalars.append
    add_slot, add_target = slots.scalars.append, targets.scalars.append
    seq_lens, sample, prev_rows = [], [], []
    query_start = [0]
    table_rows = [_table_row(c.request) for c in batch.chunks]
    for i, c in enumerate(batch.chunks):
        r = c.request
        start, stop = c.start, c.start + c.num_new_tokens
        if c.num_new_tokens == 1:
            p, g = len(r.prompt), len(r.generated)
            if start < p + g:
                add_id(int(r.prompt[start]) if start < p else r.generated[start - p])
                prev_rows.append(-1)
            else:  # sampled by the step in flight, where this request was row `r.row`
                add_id(0)
                prev_rows.append(r.row)
            add_pos(start)
            # A position in a block shared from the cache is never written again.
            add_slot(r.blocks[start // bs] * bs + start % bs if start >= r.shared_until else -1)
            if r.wants_prompt_log_probs:
                target = int(r.prompt_targets(start, stop)[0])
                c.num_prompt_targets = int(target >= 0)
            else:
                target = -1
                c.num_prompt_targets = 0
            add_target(target)
        else:
            pos = np.arange(start, stop, dtype=np.int64)
            if c.drafts is None:
                ids.add_array(r.token_slice(start, stop))
            else:  # a verify row: its last known token, then its drafts
                ids.add_array(np.concatenate([r.token_slice(start, start + 1), c.drafts]))
            positions.add_array(pos)
            chunk_slots = table_rows[i][pos // bs].astype(np.int64) * bs + pos % bs
            if start < r.shared_until:
                chunk_slots[pos < r.shared_until] = -1
            slots.add_array(chunk_slots)
            chunk_targets = r.prompt_targets(start, stop)
            targets.add_array(chunk_targets)
            c.num_prompt_targets = int((chunk_targets >= 0).sum())
            prev_rows.extend([-1] * c.num_new_tokens)
        r.row = i
        query_start.append(query_start[-1] + c.num_new_tokens)
        seq_lens.append(stop)
        sample.append(c.samples)
    reqs = [c.request for c in batch.chunks]
    from_previous = max(prev_rows) >= 0
    num_drafts = [0 if c.drafts is None else len(c.drafts) for c in batch.chunks]
    # A draft model's rows: the token before the last known one (the gpu's draft reads both).
    draft_prev = [
        int(c.request.token_slice(c.start - 1, c.start)[0]) if c.gpu_drafts and n else -1
        for c, n in zip(batch.chunks, num_drafts, strict=True)
    ]
    processed = [r.sampling.logprobs_mode is LogprobsMode.PROCESSED for r in reqs]
    mamba = {}
    if hybrid:
        # A chunk from position 0 starts from zeros, a restored one from its snapshot, any
        # other from its own slot.
        out = [r.mamba_slot for r in reqs]
        init = [
            (s if c.start else -1) if c.mamba_init is None else c.mamba_init
            for s, c in zip(out, batch.chunks, strict=True)
        ]
        mamba = {
            "mamba_init": np.asarray(init, dtype=np.int32),
            "mamba_out": np.asarray(out, dtype=np.int32),
        }
        if batch.mamba_snap_slots:
            row = {id(c.request): i for i, c in enumerate(batch.chunks)}
            snap_rows = [row[id(r)] for r, _, _ in batch.mamba_snaps]
            mamba["mamba_snap_row"] = np.asarray(snap_rows, dtype=np.int32)
            pos = [p for _, _, p in batch.mamba_snaps]
            mamba["mamba_snap_pos"] = np.asarray(pos, dtype=np.int32)
            mamba["mamba_snap_dst"] = np.asarray(batch.mamba_snap_slots, dtype=np.int32)
    mamba |= control_arrays(batch.chunks, eos_token_ids)  # (and the controls: {} if none)
    return mamba | {
        "input_ids": ids.array(np.int32),
        "positions": positions.array(np.int32),
        "slot_mapping": slots.array(np.int64),
        "query_start_loc": np.asarray(query_start, dtype=np.int32),
        "seq_lens": np.asarray(seq_lens, dtype=np.int32),
        "block_tables": _block_tables(table_rows),
        "sample": np.asarray(sample, dtype=np.int8),
        "temperature": np.asarray([r.sampling.temperature for r in reqs], dtype=np.float32),
        "top_k": np.asarray([r.sampling.top_k for r in reqs], dtype=np.int32),
        "top_p": np.asarray([r.sampling.top_p for r in reqs], dtype=np.float32),
        "min_p": np.asarray([r.sampling.min_p for r in reqs], dtype=np.float32),
        "seeds": np.asarray([r.seed for r in reqs], dtype=np.int64),
        "gen_index": np.asarray([c.gen_index for c in batch.chunks], dtype=np.int32),
        "logprobs": np.asarray([r.sampling.return_log_probs for r in reqs], dtype=np.int8),
        "top_n": np.asarray([r.sampling.top_n_logprobs for r in reqs], dtype=np.int32),
        "prompt_targets": targets.array(np.int32),
        # Empty when no row reads the step in flight (the gpu then takes input_ids as is).
        "prev_rows": np.asarray(prev_rows if from_previous else [], dtype=np.int32),
        # Empty when every row's log-probs are raw (the plan's default).
        "logprobs_mode": np.asarray(processed if any(processed) else [], dtype=np.int8),
        # Speculative decoding: draft tokens per sequence (empty when the step verifies none).
        "num_drafts": np.asarray(num_drafts if any(num_drafts) else [], dtype=np.int32),
        "draft_prev": np.asarray(draft_prev if max(draft_prev, default=-1) >= 0 else [], np.int32),
        # Whether a chunk computes positions whose routed experts its request still wants.
        "return_routed_experts": any(
            c.request.routed is not None and c.start + c.num_new_tokens > c.request.routed.filled
            for c in batch.chunks
        ),
    }


class _Concat:
    """Values in order, some Python scalars and some arrays, joined once into one array: runs of
    scalars (appended to `scalars`) become one array each, so a step of decode rows costs one
    conversion, not one per row."""

    def __init__(self):
        self._pieces: list[np.ndarray] = []
        self.scalars: list[int] = []  # the current run (kept as one list: callers bind append)

    def _flush(self) -> None:
        if self.scalars:
            self._pieces.append(np.asarray(self.scalars, dtype=np.int64))
            self.scalars.clear()

    def add_array(self, value: np.ndarray) -> None:
        self._flush()
        self._pieces.append(value)

    def array(self, dtype) -> np.ndarray:
        self._flush()
        if len(self._pieces) == 1:
            return self._pieces[0].astype(dtype, copy=False)
        return np.concatenate(self._pieces).astype(dtype, copy=False)


def _block_tables(rows: list[np.ndarray]) -> np.ndarray:
    """The rows' block tables as one [rows, longest] int32 array, zero-padded: one
    concatenation (and, for unequal rows, one masked assignment), not a slice assignment per
    row (18 us at batch 64 on the 2-core box, against 7-11)."""
    lengths = np.fromiter((len(t) for t in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    flat = np.concatenate(rows)
    if len(flat) == width * len(rows):
        return flat.reshape(len(rows), width)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    tables[np.arange(width) < lengths[:, None]] = flat
    return tables


def _table_row(r) -> np.ndarray:
    """`r.blocks` as int32, kept on the request between steps (`table_cache`): a table only
    grows at its end or is replaced by a new list (a reset, an admission), so a row is rebuilt
    only then and extended otherwise; converting every row's Python list each step was a tenth
    of the engine's host time per decode step at batch 64."""
    blocks, cache = r.blocks, r.table_cache
    if cache is None or cache[0] is not blocks or len(cache[1]) > len(blocks):
        row = np.asarray(blocks, dtype=np.int32)
    elif len(cache[1]) < len(blocks):
        row = np.concatenate([cache[1], np.asarray(blocks[len(cache[1]) :], dtype=np.int32)])
    else:
        return cache[1]
    r.table_cache = (blocks, row)
    return row
