"""A StepPlan checked on the host before the worker queues any device work for it.

Owns the checks that keep a malformed plan from reaching kernels that index unchecked:
prev_rows against the previous step's sampled rows, every Mamba slot id (init, out,
snapshot copies) against the slots the worker holds, and the rows' logprobs_mode; each failure
is a ValueError that names what is wrong, raised before the step touches anything. Also reads
which Mamba snapshots lie inside a chunk (the kernels store those; the rest are copies after
the forward).

Must not touch: torch, the device, the worker's state; numpy arrays of the plan in, ints out.
"""

from __future__ import annotations

import numpy as np

from taipan.messages.gpu import StepPlan


def check_prev_rows(plan: StepPlan, previous: np.ndarray) -> None:
    """prev_rows must name rows the previous step (`previous`: which of its rows sampled)
    had and sampled (ValueError)."""
    prev = plan.prev_rows
    if not len(prev):
        return
    if len(prev) != len(plan.input_ids):
        raise ValueError(
            f"prev_rows has {len(prev)} entries for {len(plan.input_ids)} input tokens"
        )
    if prev.min() < -1:
        raise ValueError(f"prev_rows must be -1 or a row index, got {int(prev.min())}")
    wanted = prev[prev >= 0]
    if len(wanted) and (wanted.max() >= len(previous) or not previous[wanted].all()):
        sampled = np.flatnonzero(previous)[:8].tolist()
        raise ValueError(
            f"prev_rows {sorted(set(wanted.tolist()))[:8]} name rows the previous step "
            f"did not sample (it sampled rows {sampled})"
        )


def check_mamba_slots(plan: StepPlan, mamba_slots: int, snapshot_slots: int) -> None:
    """Every Mamba slot the plan names must exist (the kernels index them unchecked):
    init and out slots are -1 or any slot, snapshot copies go from a live slot to a
    snapshot slot (ValueError)."""
    n, live = mamba_slots, mamba_slots - snapshot_slots
    init, out = plan.mamba_init, plan.mamba_out
    row, pos, dst = plan.mamba_snap_row, plan.mamba_snap_pos, plan.mamba_snap_dst
    if not n:
        if len(init) or len(out) or len(dst) or len(row) or len(pos):
            raise ValueError("the plan names Mamba slots, but the model has no Mamba layers")
        return
    if len(init) != len(plan.seq_lens) or len(out) != len(plan.seq_lens):
        raise ValueError("mamba_init and mamba_out need one slot per sequence")
    for name, a in (("mamba_init", init), ("mamba_out", out)):
        if len(a) and (a.min() < -1 or a.max() >= n):
            raise ValueError(f"{name} names slots outside -1..{n - 1}: {a.tolist()[:8]}")
    if not len(row) == len(pos) == len(dst):
        raise ValueError("mamba_snap_row, mamba_snap_pos and mamba_snap_dst must match")
    if len(dst):
        _check_snapshot_copies(plan, live, n)


def _check_snapshot_copies(plan: StepPlan, live: int, n: int) -> None:
    row, pos, dst = plan.mamba_snap_row, plan.mamba_snap_pos, plan.mamba_snap_dst
    out = plan.mamba_out
    num_seqs = len(plan.seq_lens)
    if row.min() < 0 or row.max() >= num_seqs:
        raise ValueError(f"mamba_snap_row must name sequences 0..{num_seqs - 1}")
    lens = np.diff(plan.query_start_loc)[row]
    if (pos < 1).any() or (pos > lens).any():
        raise ValueError("mamba_snap_pos must lie in 1..the query length of its sequence")
    if ((pos == lens) & ((out[row] < 0) | (out[row] >= live))).any():
        raise ValueError("a snapshot at a chunk's end copies its out slot: a live slot")
    if dst.min() < live or dst.max() >= n or len(set(dst.tolist())) < len(dst):
        raise ValueError(f"mamba_snap_dst must name distinct snapshot slots {live}..{n - 1}")
    if set(dst.tolist()) & set(plan.mamba_init.tolist()):
        raise ValueError("a snapshot slot the step writes cannot be one it reads")


def inner_snapshots(plan: StepPlan) -> dict[int, list[tuple[int, int]]]:
    """The plan's snapshots inside chunks (before the chunk's last token), which the
    kernels store: row -> [(position, slot)]. Such a row has at least two tokens, so it is
    a prefill row. The step runs eagerly (they are rare: a few per shared prefix)."""
    out: dict[int, list[tuple[int, int]]] = {}
    lens = np.diff(plan.query_start_loc)
    for row, pos, dst in zip(
        plan.mamba_snap_row.tolist(), plan.mamba_snap_pos.tolist(),
        plan.mamba_snap_dst.tolist(), strict=True,
    ):  # fmt: skip
        if pos < lens[row]:
            out.setdefault(row, []).append((int(pos), int(dst)))
    return out


def check_logprobs_mode(plan: StepPlan) -> None:
    """logprobs_mode must be empty (all raw) or one 0 (raw) / 1 (processed) per sequence
    (ValueError)."""
    mode = plan.logprobs_mode
    if not len(mode):
        return
    if len(mode) != len(plan.seq_lens):
        raise ValueError(
            f"logprobs_mode has {len(mode)} entries for {len(plan.seq_lens)} sequences"
        )
    if mode.min() < 0 or mode.max() > 1:
        raise ValueError(f"logprobs_mode must be 0 (raw) or 1 (processed), got {mode.tolist()[:8]}")
