"""The StepPlan's columns for a planned step (messages/gpu.py): `plan_arrays`.

Owns the translation of a StepBatch (chunks of requests, their blocks, Mamba slots and
sampling parameters) into the numpy arrays the gpu actor reads. Pure: reads the batch and its
requests, writes only each chunk's `num_prompt_targets` and each request's `row` (the row it
samples in this step, which the next step's plan reads as `prev_rows`). No sockets, no torch.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.engine.batch import StepBatch
from taipan.messages.requests import LogprobsMode


def plan_arrays(batch: StepBatch, block_size: int, hybrid: bool) -> dict[str, np.ndarray]:
    """The StepPlan arrays (see messages/gpu.py) for this batch (`hybrid`: the model has Mamba
    layers, so the rows' Mamba slots go too). A one-token chunk (every
    decode row) is read as Python scalars: at batch 256 per-row numpy calls were most of
    the engine's time per step. A decode row whose token the step in flight is sampling
    gets input id 0 and, in `prev_rows`, the row that samples it."""
    bs = block_size
    ids, positions, slots, targets = _Concat(), _Concat(), _Concat(), _Concat()
    seq_lens, sample, prev_rows = [], [], []
    query_start = [0]
    width = max(len(c.request.blocks) for c in batch.chunks)
    padded: list[int] = []  # the block tables, row after row, padded with 0
    for i, c in enumerate(batch.chunks):
        r = c.request
        start, stop = c.start, c.start + c.num_new_tokens
        if c.num_new_tokens == 1:
            p, g = len(r.prompt), len(r.generated)
            if start < p + g:
                ids.add(int(r.prompt[start]) if start < p else r.generated[start - p])
                prev_rows.append(-1)
            else:  # sampled by the step in flight, where this request was row `r.row`
                ids.add(0)
                prev_rows.append(r.row)
            positions.add(start)
            # A position in a block shared from the cache is never written again.
            slot = r.blocks[start // bs] * bs + start % bs if start >= r.shared_until else -1
            slots.add(slot)
            target = int(r.prompt_targets(start, stop)[0]) if r.wants_prompt_log_probs else -1
            targets.add(target)
            c.num_prompt_targets = int(target >= 0)
        else:
            pos = np.arange(start, stop, dtype=np.int64)
            blocks = np.asarray(r.blocks, dtype=np.int64)
            ids.add(r.token_slice(start, stop))
            positions.add(pos)
            chunk_slots = blocks[pos // bs] * bs + pos % bs
            if start < r.shared_until:
                chunk_slots[pos < r.shared_until] = -1
            slots.add(chunk_slots)
            chunk_targets = r.prompt_targets(start, stop)
            targets.add(chunk_targets)
            c.num_prompt_targets = int((chunk_targets >= 0).sum())
            prev_rows.extend([-1] * c.num_new_tokens)
        r.row = i
        query_start.append(query_start[-1] + c.num_new_tokens)
        seq_lens.append(stop)
        sample.append(c.samples)
        padded += r.blocks
        padded += [0] * (width - len(r.blocks))
    tables = np.asarray(padded, dtype=np.int32).reshape(len(batch.chunks), width)
    reqs = [c.request for c in batch.chunks]
    from_previous = max(prev_rows) >= 0
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
            rows = [row[id(r)] for r, _, _ in batch.mamba_snaps]
            mamba["mamba_snap_row"] = np.asarray(rows, dtype=np.int32)
            pos = [p for _, _, p in batch.mamba_snaps]
            mamba["mamba_snap_pos"] = np.asarray(pos, dtype=np.int32)
            mamba["mamba_snap_dst"] = np.asarray(batch.mamba_snap_slots, dtype=np.int32)
    return mamba | {
        "input_ids": ids.array(np.int32),
        "positions": positions.array(np.int32),
        "slot_mapping": slots.array(np.int64),
        "query_start_loc": np.asarray(query_start, dtype=np.int32),
        "seq_lens": np.asarray(seq_lens, dtype=np.int32),
        "block_tables": tables,
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
        # Whether a chunk computes positions whose routed experts its request still wants.
        "return_routed_experts": any(
            c.request.routed is not None and c.start + c.num_new_tokens > c.request.routed.filled
            for c in batch.chunks
        ),
    }


class _Concat:
    """Values in order, some Python scalars and some arrays, joined once into one array: runs of
    scalars become one array each, so a step of decode rows costs one conversion, not one per
    row."""

    def __init__(self):
        self._pieces: list[np.ndarray] = []
        self._run: list[int] = []

    def add(self, value) -> None:
        if isinstance(value, np.ndarray):
            if self._run:
                self._pieces.append(np.asarray(self._run, dtype=np.int64))
                self._run = []
            self._pieces.append(value)
        else:
            self._run.append(value)

    def array(self, dtype) -> np.ndarray:
        if self._run:
            self._pieces.append(np.asarray(self._run, dtype=np.int64))
            self._run = []
        if len(self._pieces) == 1:
            return self._pieces[0].astype(dtype, copy=False)
        return np.concatenate(self._pieces).astype(dtype, copy=False)
