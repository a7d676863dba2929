"""StepResult's log-prob arrays for one step, built from its logits and hidden states.

Owns which rows get log-probs (the sampled rows that ask, and every input token with a prompt
target), the padding of the arrays (NaN, and -1 ids) and how many prompt rows go through the
logits at a time. The math is ops/logprobs.py's. Must not touch the worker's state, the KV
cache or the sampled tokens: it reads tensors and returns numpy arrays (a device-to-host wait).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from taipan.messages.gpu import StepPlan
from taipan.ops.logprobs import log_probs_and_top_n, prompt_log_probs

# Prompt log-probs build fp32 logits at most this many rows, and elements, at a time.
PROMPT_LOGITS_MAX_ROWS = 1024
PROMPT_LOGITS_MAX_ELEMENTS = 1 << 26  # 256 MiB


def wants_log_probs(plan: StepPlan) -> bool:
    return bool(plan.top_n.any() or plan.logprobs.any() or (plan.prompt_targets >= 0).any())


def no_log_probs(batch: int, n: int) -> dict[str, np.ndarray]:
    return {
        "log_probs": np.full(batch, np.nan, dtype=np.float32),
        "top_n_ids": np.full((batch, n), -1, dtype=np.int32),
        "top_n_log_probs": np.full((batch, n), np.nan, dtype=np.float32),
    }


def log_prob_arrays(
    plan: StepPlan,
    rows: np.ndarray,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor | None,
    *,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    device: torch.device,
) -> dict[str, np.ndarray]:
    """StepResult's log-prob arrays when the plan asks for any, else {}. The prompt ones read
    every token's hidden state, so only an eager step (`hidden` not None) has them."""
    if not wants_log_probs(plan):
        return {}
    n = int(plan.top_n.max(initial=0))
    extra = _sampled_log_probs(plan, rows, logits, tokens, n, device)
    if hidden is not None:
        extra.update(_prompt_log_probs(plan, hidden, n, compute_logits, vocab_size, device))
    return extra


def _on(a: np.ndarray, device: torch.device, dtype=None) -> torch.Tensor:
    # np.frombuffer views are read-only; torch wants writable memory.
    t = torch.from_numpy(np.array(a, copy=True))
    return t.to(device, dtype=dtype, non_blocking=True)


def _sampled_log_probs(
    plan: StepPlan, rows: np.ndarray, logits: torch.Tensor, tokens: torch.Tensor, n: int, device
) -> dict[str, np.ndarray]:
    """StepResult's log_probs / top_n arrays (n columns) for the sampled rows; device work
    only where a sampled row asks for it."""
    out = no_log_probs(len(plan.sample), n)
    wanted, counts = plan.logprobs[rows] != 0, plan.top_n[rows]
    if wanted.any() or counts.any():
        index = _on(rows, device, torch.int64)
        picked, ids, values = log_probs_and_top_n(
            logits[index], tokens[index], _on(counts, device), n
        )
        out["log_probs"][rows] = np.where(wanted, picked.cpu().numpy(), np.nan)
        out["top_n_ids"][rows] = ids.cpu().numpy()
        out["top_n_log_probs"][rows] = values.cpu().numpy()
    return out


def _prompt_log_probs(
    plan: StepPlan, hidden: torch.Tensor, n: int, compute_logits, vocab_size: int, device
) -> dict[str, np.ndarray]:
    """StepResult's prompt_* arrays: one row per input token with a prompt target."""
    tokens = np.flatnonzero(plan.prompt_targets >= 0)
    if len(tokens) == 0:
        return {
            "prompt_log_probs": np.zeros(0, dtype=np.float32),
            "prompt_top_n_ids": np.zeros((0, n), dtype=np.int32),
            "prompt_top_n_log_probs": np.zeros((0, n), dtype=np.float32),
        }
    seq = np.searchsorted(plan.query_start_loc, tokens, side="right") - 1
    by_vocab = PROMPT_LOGITS_MAX_ELEMENTS // vocab_size
    picked, ids, values = prompt_log_probs(
        hidden[_on(tokens, device, torch.int64)],
        _on(plan.prompt_targets[tokens], device, torch.int64),
        _on(plan.top_n[seq], device),
        n,
        compute_logits,
        chunk_rows=max(1, min(PROMPT_LOGITS_MAX_ROWS, by_vocab)),
    )
    return {
        "prompt_log_probs": picked.cpu().numpy(),
        "prompt_top_n_ids": ids.cpu().numpy().astype(np.int32),
        "prompt_top_n_log_probs": values.cpu().numpy(),
    }
