"""Token sampling from logits: greedy, temperature, min-p, top-k, top-p, seeded per request.

The one dispatch point for sampling: on CUDA the Triton kernel (kernels/sampling.py, no sort),
elsewhere its torch reference `sample_ref` (sort-based), which defines the semantics; the
kernel equals it token for token on any input but measure-zero ties (see that module). The
per-request parameters arrive as device tensors, so a step never branches on them on the host
(no sync, CUDA-graph safe). Log-probabilities are ops/logprobs.py's; `processed_logits` gives
them the distribution a row is drawn from (LogprobsMode "processed"). The logit controls
(penalties, logit_bias, min_tokens, bad words) come before both: ops/logit_controls.py.

Determinism: a seeded row draws its noise from a counter-based hash of (seed, gen_index, token
id) (`row_keys`, `exponential_noise`), not from a stateful generator, so the same (seed,
gen_index, logits) gives the same token whatever else is in the batch and in whatever order.
Unseeded rows (seed -1) hash a fresh random key from torch's generator instead.
"""

from __future__ import annotations

import torch

from taipan.kernels.sampling import (
    GREEDY_EPS,
    exponential_noise,
    filtered_logits_ref,
    row_keys,
    sample_ref,
)
from taipan.kernels.sampling import sample as sample_kernel

__all__ = ["GREEDY_EPS", "exponential_noise", "processed_logits", "row_keys", "sample"]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    gen_index: torch.Tensor,
    min_p: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row. logits: [B, V] -> tokens: [B] int64.

    temperature [B] f32 (0 = greedy), top_k [B] i32 (0 = off), top_p [B] f32 (1.0 = off),
    seeds [B] i64 (-1 = unseeded), gen_index [B] i32 (how many tokens the request has already
    generated; part of the seed, so each step of a seeded request draws fresh noise), min_p [B]
    f32 (0 = off; None: off for every row); `keys` [B] int64: the rows' noise keys when the
    caller made them (`row_keys`: a grammar check draws a refused row again with its own key),
    else made here from seeds and gen_index.
    """
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    if keys is None:
        keys = row_keys(seeds, gen_index)
    fn = sample_kernel if logits.is_cuda else sample_ref
    return fn(logits, temperature, top_k, top_p, min_p, keys)


def processed_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits `sample` draws from (what processed log-probs are of, LogprobsMode): [B, V]
    float32, logits.float() / temperature with every token min-p, top-k or top-p drops at -inf;
    a greedy row's raw logits. The parameters as `sample`'s.

    The torch reference's filters on every device (sort-based: no Triton kernel). The CUDA
    kernel keeps the same tokens but for the measure-zero near-ties kernels/sampling.py lists,
    where a token at the edge of a cut may be drawn here at -inf."""
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    return filtered_logits_ref(logits, temperature, top_k, top_p, min_p)
