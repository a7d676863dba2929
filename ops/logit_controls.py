"""Logit controls applied before sampling, with vLLM's semantics: allowed tokens (every other
token -inf), additive biases (logit_bias; -inf for what min_tokens and bad words forbid) and
the repetition, frequency and presence penalties.

Plain torch on whatever device the logits are (no Triton kernel: they touch only the rows and
tokens that use them), run eagerly after the forward (a CUDA graph never holds them) and only
for a step some row of which uses a control. Which rows and tokens get what is the caller's
(actors/gpu/sampling_controls.py reads it from the StepPlan). Both functions change `logits`
in place: the caller passes its own copy when the original must survive (raw log-probs).
"""

from __future__ import annotations

import torch


def keep_only(
    logits: torch.Tensor, rows: torch.Tensor, entry_rows: torch.Tensor, tokens: torch.Tensor
) -> None:
    """Every token of rows `rows` but those listed for it -inf, in place: row rows[j] keeps
    tokens[i] where entry_rows[i] == j (a row listed in `rows` keeps only its entries).

    logits [B, V] float32; rows [P] int64 distinct; entry_rows [A] int64 in 0..P-1, tokens [A]
    int64."""
    keep = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool, device=logits.device)
    keep[entry_rows, tokens] = True
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))


def add_biases(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor
) -> None:
    """logits[rows[i], tokens[i]] += values[i], in place; entries of one (row, token) add up
    (-inf plus anything finite stays -inf: a forbidden token stays forbidden).

    logits [B, V] float32; rows, tokens [M] int64; values [M] float32."""
    logits.index_put_((rows, tokens), values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    seen_rows: torch.Tensor,
    seen_tokens: torch.Tensor,
    seen_counts: torch.Tensor,
) -> None:
    """vLLM's penalties on the P distinct rows `rows` of logits [B, V] float32, in place.

    Row rows[j] has penalties presence[j], frequency[j], repetition[j] ([P] float32) and has
    seen token seen_tokens[i] where seen_rows[i] == j (seen_* [K]: seen_rows int64 in 0..P-1,
    seen_tokens int64, seen_counts int32), which adds seen_counts[i] to the token's output
    count (0: a prompt token; entries of one token add up). Then, for each of those rows:
    a seen token's logit x becomes x / repetition if x > 0 else x * repetition, and every
    token's logit loses frequency * count + presence * (count > 0).
    """
    sub = logits[rows]  # [P, V], a copy
    counts = torch.zeros_like(sub)
    counts.index_put_((seen_rows, seen_tokens), seen_counts.to(sub.dtype), accumulate=True)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=sub.device)
    seen[seen_rows, seen_tokens] = True
    rep = repetition[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    logits[rows] = sub
