"""Token sampling from logits: greedy, temperature, top-k, top-p, seeded per request.

Owns turning a step's logits [B, V] into one token per row (log-probabilities are
ops/logprobs.py's). The per-request parameters arrive as device tensors so a step never branches
on them on the host (no sync, CUDA-graph safe); a Triton sampling kernel would implement the same
contract.

Determinism: a seeded row draws its noise from a counter-based hash of (seed, gen_index, token
id), not from a stateful generator, so the same (seed, gen_index, logits) gives the same token
whatever else is in the batch and in whatever order. The hash is integer arithmetic, identical
on CPU and GPU; only the final `log` may differ by an ulp between devices. Unseeded rows (seed
-1) hash a fresh random key from torch's generator instead.

The draw is an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is
distributed as p (the Gumbel-max trick in another form), so no cumulative sums or searches.
"""

from __future__ import annotations

import torch

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows)
_MASK32 = 0xFFFFFFFF
_HI_MASK = 0x7FFFFFFF  # keeps the high word non-negative in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32.

    Multipliers stay below 2**31 so no int64 product overflows (signed overflow is not portable):
    results are identical on CPU and GPU.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, gen_index: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, gen_index); random for unseeded rows. [B] int64."""
    seeds = seeds.long()
    lo, hi = seeds & _MASK32, (seeds >> 32) & _HI_MASK
    key = _mix32(_mix32(lo ^ 0x2545F491) ^ hi)
    key = _mix32(key ^ gen_index.long())
    fresh = torch.randint(0, 2**31, seeds.shape, device=seeds.device, dtype=torch.int64)
    return torch.where(seeds < 0, fresh, key)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E[b, i] ~ Exp(1), a pure function of (keys[b], i). keys: [B] int64 -> [B, V] float32."""
    token = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32((keys[:, None] + token[None, :] * 0x9E3779B1) & _MASK32)
    h = _mix32(h ^ keys[:, None])
    # 24 random bits -> u uniform in (0, 1), never 0 or 1, exact in float32
    u = ((h >> 8).float() + 0.5) * (1.0 / 2**24)
    return -torch.log(u)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    gen_index: torch.Tensor,
) -> torch.Tensor:
    """One token per row. logits: [B, V] float32 -> tokens: [B] int64.

    temperature [B] f32 (0 = greedy), top_k [B] i32 (0 = off), top_p [B] f32 (1.0 = off),
    seeds [B] i64 (-1 = unseeded), gen_index [B] i32 (how many tokens the request has already
    generated; part of the seed, so each step of a seeded request draws fresh noise).
    Top-k is applied before top-p; top-p always keeps the most likely token.
    """
    batch, vocab = logits.shape
    logits = logits.float()
    greedy = temperature < _GREEDY_EPS  # [B]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / temp[:, None]  # [B, V]

    # Filter in descending order: the kept set is a prefix of the sorted row.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()  # [B]
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first never drops).
    mass_above = torch.cumsum(probs, dim=-1) - probs
    # top_p >= 1 must keep everything, even where rounding pushes the running sum to 1.
    active = (top_p < 1.0)[:, None]
    drop = (mass_above >= top_p.float()[:, None]) & (rank > 0) & active
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V], renormalized over the kept set

    # Noise is indexed by token id (not rank), so ties in the sort cannot change a seeded draw.
    noise = exponential_noise(_row_keys(seeds, gen_index), vocab)  # [B, V]
    race = probs / torch.gather(noise, 1, sorted_ids)
    choice = torch.gather(sorted_ids, 1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), choice)
