"""Log-probabilities: of given tokens, the top-n, and a prompt's, chunked; raw or processed.

Owns the math only (torch in, torch out). Which rows and tokens are wanted comes from the caller
(the gpu worker reads them off the StepPlan); nothing here knows about plans or numpy.

A raw log-prob is log-softmax of the fp32 logits before temperature / top-k / top-p, as
`torch.log_softmax(logits.float(), -1)` gives. It is computed as `logit - logsumexp(row)`, which
never builds a second [rows, vocab] matrix. A processed one (LogprobsMode "processed",
`processed_log_probs_and_top_n`) is the same of ops.sampling.processed_logits: the distribution
the row's token is drawn from, with the tokens its filters drop at -inf. Prompt log-probs are
raw only (no prompt token is sampled; vLLM's are raw too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from taipan.kernels.logprobs import log_prob_gather, log_prob_gather_ref
from taipan.ops.sampling import processed_logits


def log_probs_and_top_n(
    logits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the log-prob of `tokens[r]` and the `counts[r]` most likely (id, log-prob) pairs.

    logits: [R, V]; tokens: [R] int; counts: [R] int (0 = no top-n for that row; clipped to n).
    Returns log_probs [R] f32, top_ids [R, n] int64 and top_log_probs [R, n] f32, sorted by
    descending log-prob; entries past a row's count (or past V) are id -1 and NaN.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # [R]
    picked = logits.gather(1, tokens.long()[:, None]).squeeze(1) - lse
    top_ids, top_log_probs = _top_n(logits, lse, counts, n)
    return picked, top_ids, top_log_probs


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per row: the log-prob of `tokens[r]` (log_probs_and_top_n's first output, alone).

    logits: [R, V] (unit stride over V); tokens: [R] int, contiguous. Returns [R] f32. An RL
    rollout's every step asks for this and nothing more: on CUDA one Triton launch
    (kernels/logprobs.py), where torch's gather and logsumexp took about eleven, each host time
    between the step's launch and the next (H200, 1B shape, batch 1 with log-probs: 1.63 ms a
    step with torch's, 1.08-1.12 with the kernel, 1.02-1.07 without log-probs; NOTES,
    twenty-fourth session)."""
    if logits.is_cuda and logits.stride(-1) == 1:
        return log_prob_gather(logits, tokens.contiguous())
    return log_prob_gather_ref(logits, tokens)


def _top_n(
    logits: torch.Tensor, lse: torch.Tensor, counts: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    ids = torch.full((rows, n), -1, dtype=torch.int64, device=logits.device)
    values = torch.full((rows, n), float("nan"), dtype=torch.float32, device=logits.device)
    k = min(n, vocab)
    if k == 0 or rows == 0:
        return ids, values
    # Log-softmax is monotonic in the logits: the top logits are the top log-probs.
    top_logits, top_ids = logits.topk(k, dim=-1, sorted=True)  # [R, k]
    keep = torch.arange(k, device=logits.device)[None, :] < counts.to(logits.device)[:, None]
    ids[:, :k] = torch.where(keep, top_ids, -1)
    values[:, :k] = torch.where(keep, top_logits - lse[:, None], float("nan"))
    return ids, values


def prompt_log_probs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    counts: torch.Tensor,
    n: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`log_probs_and_top_n` for K prompt tokens whose logits are not built yet.

    hidden: [K, H] (the final hidden states of those tokens); targets: [K] (the next prompt
    token of each); counts: [K] top-n per token. Logits are materialized `chunk_rows` rows at a
    time, so a long prompt never holds a [K, vocab] matrix. Returns as `log_probs_and_top_n`.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    parts = [
        log_probs_and_top_n(
            compute_logits(hidden[i : i + chunk_rows]),
            targets[i : i + chunk_rows],
            counts[i : i + chunk_rows],
            n,
        )
        for i in range(0, hidden.shape[0], chunk_rows)
    ]
    return _joined(parts, n, hidden.device)


def processed_log_probs_and_top_n(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    n: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`log_probs_and_top_n` of the distribution each row's token is drawn from
    (ops.sampling.processed_logits with the row's temperature [R] f32, top_k [R] i32, top_p
    [R] f32, min_p [R] f32): a token the filters drop has log-prob -inf, and so do the top-n
    entries past the kept tokens; a greedy row's are its raw log-probs. The filters sort a row,
    so they run `chunk_rows` rows at a time (a few [chunk_rows, V] temporaries each).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    parts = []
    for i in range(0, logits.shape[0], chunk_rows):
        rows = slice(i, i + chunk_rows)
        params = (temperature[rows], top_k[rows], top_p[rows], min_p[rows])
        kept = processed_logits(logits[rows], *params)  # [rows, V] f32, dropped: -inf
        parts.append(log_probs_and_top_n(kept, tokens[rows], counts[rows], n))
    return _joined(parts, n, logits.device)


def _joined(parts: list[tuple], n: int, device) -> tuple[torch.Tensor, ...]:
    """The row chunks' (log_probs, top_ids, top_log_probs), concatenated."""
    if not parts:  # no row wants a log-prob: empty results of the right shapes
        return (
            torch.zeros(0, device=device),
            torch.zeros((0, n), dtype=torch.int64, device=device),
            torch.zeros((0, n), device=device),
        )
    picked, top_ids, top_log_probs = zip(*parts, strict=True)
    return torch.cat(picked), torch.cat(top_ids), torch.cat(top_log_probs)
