"""The StepPlan's columns for a planned step (messages/gpu.py): `plan_arrays`.

Owns the translation of a StepBatch (chunks of requests, their blocks, Mamba slots and
sampling parameters) into the numpy arrays the gpu actor reads. Pure: reads the batch and its
requests, writes only each chunk's `num_prompt_targets` and each request's `row` (the row it
samples in this step, which the next step's plan reads as `prev_rows`). No sockets, no torch.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.engine.batch import StepBatch
from taipan.actors.engine.control_arrays import control_arrays
from taipan.messages.requests import LogprobsMode


def plan_arrays(
    batch: StepBatch, block_size: int, hybrid: bool, eos_token_ids: tuple[int, ...] = ()
) -> dict[str, np.ndarray]:
    """The StepPlan arrays (see messages/gpu.py) for this batch (`hybrid`: the model has Mamba
    layers, so the rows' Mamba slots go too; `eos_token_ids`: what min_tokens forbids besides
    stop_token_ids, control_arrays.py). A one-token chunk (every
    decode row) is read as Python scalars: at batch 256 per-row numpy calls were most of
    the engine's time per step. A decode row whose token the step in flight is sampling
    gets input id 0 and, in `prev_rows`, the row that samples it."""
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
