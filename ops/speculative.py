"""Verification of speculative drafts against the target model's logits: how many draft tokens
each request accepts and the one token it adds (Leviathan et al. 2023, Chen et al. 2023).

Owns the acceptance rule and its draws, in torch on any device: CPU and CUDA run the same code,
with no host sync and shapes fixed by the inputs (CUDA-graph safe; only the input checks read
`num_drafts`, and only when it lives on the CPU). Does not own drafting (ops/ngram.py,
a draft model), the logit controls applied before it (ops/logit_controls.py; a penalty at row j
must count drafts 0..j-1 as generated), or what the engine does with the result (append tokens,
roll back the rejected drafts' KV and recurrent state).

Layout, flat as a step's rows are: request i brings k_i = num_drafts[i] draft tokens, contiguous
in `draft_tokens` (sum k_i entries, request order), and k_i + 1 contiguous rows of logits (sum
k_i + 1 rows, request order). Its row j is the target's next-token logits after its context plus
drafts 0..j-1; row k_i scores the bonus token. The result: request i accepts a_i drafts (0..k_i,
`num_accepted`) and gains a_i + 1 tokens, its drafts 0..a_i-1 then the token drawn at row a_i
(the correction at the first rejection, or the bonus token when all k_i pass). `tokens` [rows]
holds them at the request's first a_i + 1 rows and -1 after; `tokens[tokens >= 0]` lists every
request's new tokens in order.

Draws. Row j of request i draws with the key the plain sampler (ops/sampling.py) uses for the
request's generated token number gen_index[i] + j, row_keys(seed, gen_index + j), so a step that
lands a_i + 1 tokens consumes the keys plain decoding would, and k = 0 is exactly `sample`. p is
the row's processed distribution, the one `sample` draws from (temperature, min-p, top-k, top-p:
softmax of `processed_logits`; a point mass on the argmax for greedy rows).
- Deterministic drafts (`draft_probs` None: n-gram, or any drafter whose proposal is a point mass
  q = delta_x): draw y_j with `sample` itself and accept x_j iff x_j == y_j. That is rejection
  sampling for q = delta_x, coupled through the draw: P(accept) = p(x) = min(1, p(x) / q(x)), and
  a rejected row's y_j is distributed as p without x, renormalised, which is max(0, p - q)
  normalised. So the output has law p at every position and, better, a seeded request gets token
  for token what plain decoding draws (greedy rows: the argmax rule, outputs equal to no
  speculation); on CUDA `sample` is the Triton kernel, as in plain decoding.
- Draft distributions (`draft_probs` q [sum k_i, V], the law each draft was drawn from): accept
  x_j iff u_j * q(x_j) < p(x_j), u_j uniform from a second key salted off row j's; a rejected row
  draws from max(0, p - q) normalised by the exponential race with row j's noise (the
  `exponential_noise` of ops/sampling.py); the bonus row draws with `sample`. Exact for any q;
  a seeded request is reproducible, but only its law (not its tokens) equals plain decoding's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from taipan.ops.sampling import (
    GREEDY_EPS,
    exponential_noise,
    processed_logits,
    row_keys,
    sample,
)

__all__ = ["Verified", "verify", "verify_greedy"]

# XORed into a row's key to seed its acceptance uniform apart from its race noise.
_ACCEPT_SALT = 0x3C6EF372


class Verified(NamedTuple):
    """What a verify step decided (shapes of the module docstring's layout)."""

    num_accepted: torch.Tensor  # [R] int64: drafts accepted per request, 0..k_i
    tokens: torch.Tensor  # [rows] int64: request i's a_i + 1 new tokens at its first rows, then -1
    # [rows] float32: log p(token) under the processed law (a greedy row's: of its raw logits,
    # as ops/logprobs.py's processed mode), NaN where tokens is -1; None when not asked for.
    logprobs: torch.Tensor | None


class _Layout(NamedTuple):
    """Per row: its request, its position j in that request's rows, whether it is the bonus row,
    and the draft it scores (-1 on bonus rows)."""

    req: torch.Tensor  # [rows] int64
    pos: torch.Tensor  # [rows] int64
    is_bonus: torch.Tensor  # [rows] bool
    draft: torch.Tensor  # [rows] int64
    draft_index: torch.Tensor  # [rows] int64 into draft_tokens; sum(k_i) (one past) on bonus rows
    num_requests: int


class _RowParams(NamedTuple):
    """The sampling parameters per row, as `sample` takes them; row j's gen_index is the
    request's + j."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    gen_index: torch.Tensor
    min_p: torch.Tensor


def verify_greedy(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    with_logprobs: bool = False,
) -> Verified:
    """Greedy verification: accept the longest prefix of drafts equal to the row's argmax (ties to
    the lowest id, as `sample`'s greedy rows), then add the argmax at the first mismatch or the
    bonus row. logits [rows, V]; draft_tokens [sum k_i] int; num_drafts [R] int. Log-probs, if
    asked, are of the raw logits (what a greedy row's processed log-probs are)."""
    layout = _layout(logits, draft_tokens, num_drafts)
    target = logits.argmax(dim=-1)  # [rows]
    accept = ~layout.is_bonus & (layout.draft == target)
    num_accepted, keep = _accepted_prefix(accept, layout)
    tokens = torch.where(keep, target, -1)
    logprobs = _token_logprobs(logits.float(), tokens) if with_logprobs else None
    return Verified(num_accepted, tokens, logprobs)


def verify(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    gen_index: torch.Tensor,
    min_p: torch.Tensor | None = None,
    *,
    draft_probs: torch.Tensor | None = None,
    with_logprobs: bool = True,
) -> Verified:
    """Exact verification of the module docstring (greedy rows included).

    logits [rows, V]; draft_tokens [sum k_i] int; num_drafts [R] int; the sampling parameters
    per request, as `ops.sampling.sample` takes them per row: temperature [R] f32, top_k [R] i32,
    top_p [R] f32, seeds [R] i64 (-1: unseeded), gen_index [R] i32 (tokens the request generated
    before this step), min_p [R] f32 or None. draft_probs: None for deterministic drafts, else
    [sum k_i, V] the distribution each draft was drawn from. with_logprobs: also return log p of
    each new token (costs a sort of [rows, V]: the gpu actor may skip it and use its own path)."""
    layout = _layout(logits, draft_tokens, num_drafts, draft_probs)
    rp = _row_params(layout.req, layout.pos, temperature, top_k, top_p, seeds, gen_index, min_p)
    target = sample(logits, *rp)  # [rows]: the plain sampler's draw at every row
    processed = None  # [rows, V] f32: what p is the softmax of
    if with_logprobs or draft_probs is not None:
        processed = processed_logits(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p)
    if draft_probs is None:  # point-mass drafts: accept while the draw agrees
        accept = ~layout.is_bonus & (layout.draft == target)
        num_accepted, keep = _accepted_prefix(accept, layout)
        tokens = torch.where(keep, target, -1)
    else:
        probs = _target_probs(logits, processed, rp.temperature)
        num_accepted, keep, new = _verify_against_q(probs, draft_probs, layout, rp, target)
        tokens = torch.where(keep, new, -1)
    logprobs = _token_logprobs(processed, tokens) if with_logprobs else None
    return Verified(num_accepted, tokens, logprobs)


# ---- the parts ---------------------------------------------------------------------------------


def _layout(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> _Layout:
    """Each row's request, position, bonus flag and draft; checks the shapes agree."""
    if logits.ndim != 2 or draft_tokens.ndim != 1 or num_drafts.ndim != 1:
        raise ValueError(
            f"verify: logits [rows, V], draft_tokens [drafts], num_drafts [R]; got "
            f"{list(logits.shape)}, {list(draft_tokens.shape)}, {list(num_drafts.shape)}"
        )
    rows, vocab = logits.shape
    num_requests, total_drafts = num_drafts.shape[0], draft_tokens.shape[0]
    if rows != total_drafts + num_requests:
        raise ValueError(
            f"verify: {num_requests} requests with {total_drafts} drafts need "
            f"{total_drafts + num_requests} rows of logits (k_i + 1 each), got {rows}"
        )
    if num_drafts.device.type == "cpu" and num_requests:  # free to check: no device sync
        if int(num_drafts.min()) < 0 or int(num_drafts.sum()) != total_drafts:
            raise ValueError(
                f"verify: num_drafts must be >= 0 and sum to len(draft_tokens) "
                f"({total_drafts}), got {num_drafts.tolist()}"
            )
    if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
        raise ValueError(
            f"verify: draft_probs must be [{total_drafts}, {vocab}] (one row per draft), "
            f"got {list(draft_probs.shape)}"
        )
    device = logits.device
    counts = num_drafts.to(device=device, dtype=torch.int64) + 1  # [R]
    req = torch.repeat_interleave(
        torch.arange(num_requests, device=device), counts, output_size=rows
    )  # [rows]
    row = torch.arange(rows, device=device)
    pos = row - (torch.cumsum(counts, 0) - counts)[req]
    is_bonus = pos == counts[req] - 1
    # Request i's drafts start at (its first row) - i: every earlier request has one more row.
    draft_index = torch.where(is_bonus, total_drafts, row - req)
    padded = torch.cat([draft_tokens.to(device=device, dtype=torch.int64), row.new_full((1,), -1)])
    return _Layout(req, pos, is_bonus, padded[draft_index], draft_index, num_requests)


def _row_params(req, pos, temperature, top_k, top_p, seeds, gen_index, min_p) -> _RowParams:
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    gen = (gen_index.long()[req] + pos).to(gen_index.dtype)
    return _RowParams(temperature[req], top_k[req], top_p[req], seeds[req], gen, min_p[req])


def _accepted_prefix(accept: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts accepted per request [R]: the position of its first row not accepted, which the
    bonus row bounds; rows that carry a new token [rows]: positions up to that one)."""
    rows = accept.shape[0]
    first_miss = torch.where(accept, rows, layout.pos)  # bonus rows never accept
    num_accepted = torch.full((layout.num_requests,), rows, dtype=torch.int64, device=accept.device)
    num_accepted.scatter_reduce_(0, layout.req, first_miss, reduce="amin")
    return num_accepted, layout.pos <= num_accepted[layout.req]


def _target_probs(
    logits: torch.Tensor, processed: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """p per row [rows, V] float32: softmax of the processed logits; greedy rows a point mass
    on the argmax (processed logits of a greedy row are its raw ones)."""
    probs = torch.softmax(processed, dim=-1)
    greedy = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where((temperature < GREEDY_EPS)[:, None], greedy, probs)


def _verify_against_q(
    probs: torch.Tensor,
    draft_probs: torch.Tensor,
    layout: _Layout,
    rp: _RowParams,
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling with the drafts' law q: (num_accepted [R], rows that carry a new token
    [rows], the token each such row carries [rows]: its draft while accepted, the residual draw
    at the first rejection, the plain draw `target` on the bonus row).

    Accept x iff u * q(x) < p(x) (no division: a draft q gives no mass to is accepted exactly
    when p gives it some). The residual max(0, p - q) is drawn by the exponential race (argmax
    r_i / E_i has law r normalised); where it has no positive mass, p == q up to rounding, a
    rejection is a rounding event and the draw is from p."""
    vocab = probs.shape[1]
    q = torch.cat([draft_probs.float(), probs.new_zeros(1, vocab)])[layout.draft_index]  # [rows, V]
    x = layout.draft.clamp(min=0)[:, None]
    p_x, q_x = probs.gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)
    keys = row_keys(rp.seeds, rp.gen_index)
    uniform = torch.exp(-exponential_noise(keys ^ _ACCEPT_SALT, 1)[:, 0])  # [rows] in (0, 1)
    accept = ~layout.is_bonus & (uniform * q_x < p_x)
    num_accepted, keep = _accepted_prefix(accept, layout)
    residual = (probs - q).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    correction = (residual / exponential_noise(keys, vocab)).argmax(dim=-1)
    drafted = layout.pos < num_accepted[layout.req]
    new = torch.where(drafted, layout.draft, torch.where(layout.is_bonus, target, correction))
    return num_accepted, keep, new


def _token_logprobs(processed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(processed)[row, tokens[row]]; NaN where tokens is -1."""
    lse = torch.logsumexp(processed, dim=-1)
    picked = processed.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1) - lse
    return torch.where(tokens >= 0, picked, float("nan"))
