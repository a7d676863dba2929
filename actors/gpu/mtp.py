"""An MTP head's drafts in the gpu worker (speculative_method "mtp", LoadModel.mtp):
`step_drafts`, StepResult.next_drafts of one step, after its sampling and verification.

Owns the translation of a StepPlan and the step's outcome into ops/mtp.py `mtp_drafts`: each
row's last valid position (its last token, or a verify row's last accepted one) and the token
after it (the token sampled there, the verify row's token drawn after its accepted drafts, or
a prompt chunk's next prompt token, StepPlan.mtp_next). Must not touch the worker's buffers or
the sampled-token buffer; writes only the head's KV layer (through the model).
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.actors.gpu.speculative import draft_rows
from taipan.messages.gpu import StepPlan
from taipan.ops.attention import AttentionMetadata
from taipan.ops.mtp import mtp_drafts

__all__ = ["step_drafts"]


def step_drafts(
    model,
    kv_cache: torch.Tensor,
    block_size: int,
    plan: StepPlan,
    hidden: torch.Tensor | None,
    tokens: torch.Tensor,
    spec: np.ndarray | None,
    k: int,
) -> np.ndarray:
    """int32 [B, k] drafts of the rows the plan asks for (StepPlan.mtp_draft; empty [0, 0]
    when none asks). `hidden` [>= T, H]: the forward's (eager, or a mixed graph's kept
    states); `tokens` [B]: the step's sampled tokens; `spec`: StepResult.spec_tokens of a step
    that verified drafts (else None). Waits for the step's tokens."""
    if hidden is None:
        raise ValueError("an MTP step needs the forward's hidden states (a mixed graph or eager)")
    qsl = plan.query_start_loc.astype(np.int64)
    last, after = qsl[1:] - 1, plan.mtp_next.astype(np.int64)
    sampled = np.flatnonzero(plan.sample)
    after[sampled] = tokens.cpu().numpy()[sampled]
    if spec is not None:  # a verify row: its last accepted draft, then the token drawn
        for row in draft_rows(plan).tolist():
            new = spec[row][spec[row] >= 0]
            last[row], after[row] = qsl[row] + len(new) - 1, new[-1]
    device = hidden.device
    attn = AttentionMetadata(
        query_start_loc=torch.tensor(plan.query_start_loc, device=device),
        seq_lens=torch.tensor(plan.seq_lens, device=device),
        block_tables=torch.tensor(plan.block_tables, device=device),
        slot_mapping=torch.tensor(plan.slot_mapping, device=device),
    ).with_layout(plan.query_start_loc, plan.seq_lens, block_size)
    tables = [
        row[: -(-int(n) // block_size)].tolist()
        for row, n in zip(plan.block_tables, plan.seq_lens, strict=True)
    ]
    drafts = mtp_drafts(
        model,
        kv_cache,
        attn,
        tables,
        block_size,
        torch.tensor(plan.input_ids, device=device),
        torch.tensor(plan.positions, dtype=torch.int64, device=device),
        hidden[: len(plan.input_ids)],
        last,
        after,
        plan.mtp_draft.astype(bool) & (plan.sample != 0),
        k,
    )
    return drafts.astype(np.int32) if plan.mtp_draft.any() else np.zeros((0, 0), np.int32)
