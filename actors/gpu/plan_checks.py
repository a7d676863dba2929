"""A StepPlan checked on the host before the worker queues any device work for it.

Owns the checks that keep a malformed plan from reaching kernels that index unchecked:
prev_rows against the previous step's sampled rows, every Mamba slot id (init, out,
snapshot copies) against the slots the worker holds, the rows' logprobs_mode, and the rows and
token ids of the sampling controls (penalties, biases); each failure
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
    if not len(plan.mamba_snap_row):  # (most steps)
        return out
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


CONTROL_ARRAYS = (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_rows",
    "penalty_tokens", "penalty_counts", "bias_rows", "bias_tokens", "bias_values", "bias_if_last",
    "bias_offsets", "allow_rows", "allow_tokens",
)  # fmt: skip


def check_sampling_controls(plan: StepPlan, vocab_size: int) -> None:
    """The control arrays (StepPlan: penalties, biases, allowed tokens) must be empty or one
    entry per sequence, and their (row, token) entries name sequences and tokens that exist,
    the penalty ones sequences that have a penalty, the allowed ones sequences that sample (the
    device indexes them unchecked) (ValueError)."""
    if not any(len(getattr(plan, name)) for name in CONTROL_ARRAYS):
        return  # (a step without controls)
    num_seqs = len(plan.seq_lens)
    per_seq = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    sizes = {len(getattr(plan, name)) for name in per_seq}
    if sizes - {0, num_seqs} or len(sizes) > 1:
        raise ValueError(f"{', '.join(per_seq)} need one entry per sequence, or all none")
    if len(plan.repetition_penalty) and not (plan.repetition_penalty > 0).all():
        raise ValueError("repetition_penalty must be > 0")
    _check_entries(plan, ("penalty_rows", "penalty_tokens", "penalty_counts"), vocab_size)
    if len(plan.penalty_rows):
        pres, freq, rep = (getattr(plan, name) for name in per_seq)
        penalised = (pres != 0) | (freq != 0) | (rep != 1) if len(pres) else np.zeros(0, bool)
        if not len(pres) or not penalised[plan.penalty_rows].all():
            raise ValueError("penalty_rows must name sequences with a penalty")
        if (plan.penalty_counts < 0).any():
            raise ValueError("penalty_counts must be >= 0")
    _check_entries(plan, ("bias_rows", "bias_tokens", "bias_values", "bias_if_last"), vocab_size)
    if len(plan.bias_rows):
        if np.isnan(plan.bias_values).any() or (plan.bias_values == np.inf).any():
            raise ValueError("bias_values must be numbers or -inf")
        if plan.bias_if_last.min() < -1 or plan.bias_if_last.max() >= vocab_size:
            raise ValueError(f"bias_if_last must be -1 or a token id below {vocab_size}")
    _check_offsets(plan)
    _check_entries(plan, ("allow_rows", "allow_tokens"), vocab_size)
    if len(plan.allow_rows) and not plan.sample[plan.allow_rows].all():
        raise ValueError("allow_rows must name sequences that sample")


def _check_offsets(plan: StepPlan) -> None:
    """bias_offsets: empty, or one per bias entry, each -1 or a scored position of the
    entry's sequence (0..num_drafts)."""
    offsets = plan.bias_offsets
    if not len(offsets):
        return
    if len(offsets) != len(plan.bias_rows):
        raise ValueError("bias_offsets must be empty or have one entry per bias entry")
    drafts = plan.num_drafts[plan.bias_rows] if len(plan.num_drafts) else 0
    if (offsets < -1).any() or (offsets > drafts).any():
        raise ValueError("bias_offsets must be -1 or a scored position of the entry's sequence")


def _check_entries(plan: StepPlan, names: tuple[str, ...], vocab_size: int) -> None:
    """Parallel arrays of (row, token, ...) entries: equal lengths, rows and tokens in range."""
    rows, tokens = getattr(plan, names[0]), getattr(plan, names[1])
    if len({len(getattr(plan, name)) for name in names}) > 1:
        raise ValueError(f"{', '.join(names)} must have one length")
    if not len(rows):
        return
    if rows.min() < 0 or rows.max() >= len(plan.seq_lens):
        raise ValueError(f"{names[0]} must name sequences 0..{len(plan.seq_lens) - 1}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{names[1]} must be token ids below {vocab_size}")


def check_local_kv(plan: StepPlan, num_local_blocks: int, block_size: int) -> None:
    """Per-layer-group KV: with a windowed layers' pool of `num_local_blocks` (0: none), a plan
    with sequences carries their local block tables (as wide as its block tables) and one local
    slot per input token (-1: none), and its block copies (prefix caching) name blocks of that
    pool; without one, none of these (ValueError)."""
    tables, slots = plan.local_block_tables, plan.local_slot_mapping
    copies = (plan.local_copy_src, plan.local_copy_dst, plan.local_save_src, plan.local_save_dst)
    if not num_local_blocks:
        if tables.size or len(slots) or any(len(a) for a in copies):
            raise ValueError("local_block_tables / local_slot_mapping need a windowed layers' pool")
        return
    for src, dst, kind in ((copies[0], copies[1], "copy"), (copies[2], copies[3], "save")):
        if len(src) != len(dst):
            raise ValueError(f"local_{kind}_src and local_{kind}_dst must have one length")
        both = np.concatenate([src, dst])
        if len(both) and (both.min() < 0 or both.max() >= num_local_blocks):
            raise ValueError(f"local_{kind}_src / _dst must name blocks 0..{num_local_blocks - 1}")
    if not len(plan.seq_lens):
        return
    if tables.shape != plan.block_tables.shape or len(slots) != len(plan.input_ids):
        raise ValueError(
            f"local_block_tables {tables.shape} and local_slot_mapping ({len(slots)}) must match "
            f"block_tables {plan.block_tables.shape} and the {len(plan.input_ids)} input tokens"
        )
    if tables.size and (tables.min() < 0 or tables.max() >= num_local_blocks):
        raise ValueError(f"local_block_tables must name blocks 0..{num_local_blocks - 1}")
    if len(slots) and (slots.min() < -1 or slots.max() >= num_local_blocks * block_size):
        raise ValueError(
            f"local_slot_mapping must be -1 or a slot of the {num_local_blocks} blocks"
        )


def check_mtp(plan: StepPlan, mtp: bool, vocab_size: int) -> None:
    """An MTP head (`mtp`: LoadModel.mtp) reads, per sequence, the token after each prompt chunk
    that does not sample (mtp_next, a token id there and -1 where the sequence samples) and
    whether to return its drafts (mtp_draft, 0 or 1); without a head, neither (ValueError)."""
    nxt, draft = plan.mtp_next, plan.mtp_draft
    if not mtp:
        if len(nxt) or len(draft):
            raise ValueError("mtp_next / mtp_draft need an MTP head (speculative_method 'mtp')")
        return
    batch = len(plan.seq_lens)
    if len(nxt) != batch or len(draft) != batch:
        raise ValueError(
            f"mtp_next ({len(nxt)}) and mtp_draft ({len(draft)}) need one entry per sequence "
            f"({batch})"
        )
    samples = plan.sample != 0
    if (nxt[samples] != -1).any():
        raise ValueError("mtp_next must be -1 for a sequence that samples")
    quiet = nxt[~samples]
    if len(quiet) and (quiet.min() < 0 or quiet.max() >= vocab_size):
        raise ValueError(
            f"mtp_next of a sequence that does not sample must be a token id in [0, {vocab_size})"
        )
    if ((draft != 0) & (draft != 1)).any() or (draft.astype(bool) & ~samples).any():
        raise ValueError("mtp_draft must be 0 or 1, and 1 only for a sequence that samples")
