"""A step's sampling controls (StepPlan: allowed tokens, penalties, logit biases) applied to
its logits.

Owns the reading of the plan's control arrays into device tensors, and the one thing only the
device knows: the token the previous step sampled for a row whose last input it is (prev_rows),
which the penalties count and a conditional bias (`bias_if_last`) compares against. The math
is ops/logit_controls.py's. A plan without controls costs nothing: `controlled_logits` returns
the logits it was given. Must not touch: the worker's buffers (it reads the previous step's
sampled tokens, never writes them) or the logits it is given (a CUDA graph's output buffer, and
what raw log-probs are of): it works on a copy.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.actors.gpu.host_staging import to_device
from taipan.messages.gpu import StepPlan
from taipan.ops.logit_controls import add_biases, apply_penalties, keep_only


def has_controls(plan: StepPlan) -> bool:
    return bool(len(plan.bias_rows) or len(plan.presence_penalty) or len(plan.allow_rows))


def controlled_logits(plan: StepPlan, logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The logits [B, V] float32 the rows sample from: `logits` itself when the plan has no
    controls, else a copy with its allowed tokens, its biases, then its penalties, applied.
    `sampled`: the previous step's sampled tokens by row (the worker's buffer, not yet
    overwritten)."""
    if not has_controls(plan):
        return logits
    out = logits.float().clone()
    if len(plan.allow_rows):
        allow(out, plan.allow_rows, plan.allow_tokens)
    last = _LastTokens(plan, sampled, logits.device)
    if len(plan.bias_rows):
        values = to_device(plan.bias_values, out.device)
        if_last = plan.bias_if_last
        if (if_last >= 0).any():
            holds = to_device(if_last < 0, out.device) | (
                last.of(plan.bias_rows) == to_device(if_last, out.device, torch.int64)
            )
            values = torch.where(holds, values, torch.zeros_like(values))
        rows, tokens = (
            to_device(a, out.device, torch.int64) for a in (plan.bias_rows, plan.bias_tokens)
        )
        add_biases(out, rows, tokens, values)
    if len(plan.presence_penalty):
        _penalties(plan, out, last)
    return out


def allow(out: torch.Tensor, rows: np.ndarray, tokens: np.ndarray) -> None:
    """keep_only on `out` for the (row, token) entries `rows`, `tokens` (rows of `out`; a row
    may repeat, one entry per token it keeps)."""
    distinct, index = np.unique(rows, return_inverse=True)
    dev = out.device
    keep_only(out, *(to_device(a, dev, torch.int64) for a in (distinct, index, tokens)))


def penalised_rows(plan: StepPlan) -> np.ndarray:
    """The sequences with a penalty (any of presence, frequency, repetition not neutral)."""
    if not len(plan.presence_penalty):
        return np.zeros(0, np.int64)
    pres, freq, rep = plan.presence_penalty, plan.frequency_penalty, plan.repetition_penalty
    return np.flatnonzero((pres != 0) | (freq != 0) | (rep != 1))


def _penalties(plan: StepPlan, out: torch.Tensor, last: _LastTokens) -> None:
    """The penalties of the rows that have any, their tokens as the plan lists them plus the
    last input token of a row whose input is the previous step's sampled one."""
    pres, freq, rep = plan.presence_penalty, plan.frequency_penalty, plan.repetition_penalty
    rows = penalised_rows(plan)
    if not len(rows):
        return
    dev = out.device
    # (plan_checks: every entry names one of `rows`)
    seen_rows = to_device(np.searchsorted(rows, plan.penalty_rows), dev, torch.int64)
    seen_tokens = to_device(plan.penalty_tokens, dev, torch.int64)
    seen_counts = to_device(plan.penalty_counts, dev)
    flying = last.previous_rows(rows)  # indices into `rows`: their last input is in flight
    if len(flying):
        one = torch.ones(len(flying), dtype=torch.int32, device=dev)
        seen_rows = torch.cat([seen_rows, to_device(flying, dev, torch.int64)])
        seen_tokens = torch.cat([seen_tokens, last.of(rows[flying])])
        seen_counts = torch.cat([seen_counts, one])
    params = (to_device(a[rows], dev) for a in (pres, freq, rep))
    apply_penalties(
        out, to_device(rows, dev, torch.int64), *params, seen_rows, seen_tokens, seen_counts
    )


class _LastTokens:
    """Each row's last input token: its input_ids entry, or where prev_rows names a row of the
    previous step, that step's sampled token (read on the device)."""

    def __init__(self, plan: StepPlan, sampled: torch.Tensor, device: torch.device):
        pos = plan.query_start_loc[1:] - 1
        self.known = plan.input_ids[pos]
        has_prev = len(plan.prev_rows) > 0
        self.prev = plan.prev_rows[pos] if has_prev else np.full(len(pos), -1, np.int32)
        self.sampled, self.device = sampled, device

    def previous_rows(self, rows: np.ndarray) -> np.ndarray:
        """The indices i of `rows` whose last input token is the previous step's."""
        return np.flatnonzero(self.prev[rows] >= 0)

    def of(self, rows: np.ndarray) -> torch.Tensor:
        """The last input tokens of `rows` (a row may repeat), int64 on the device."""
        known = to_device(self.known[rows], self.device, torch.int64)
        prev = self.prev[rows]
        if not (prev >= 0).any():
            return known
        p = to_device(prev, self.device, torch.int64)
        return torch.where(p >= 0, self.sampled[p.clamp(min=0)].long(), known)
