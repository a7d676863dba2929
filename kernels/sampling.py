"""Token sampling, one Triton program per row: greedy, temperature, min-p, top-k, top-p, and a
seeded exponential race. No sort: the top-k and top-p cuts are logit thresholds found by a search
whose every step is one pass over the row in chunks, so V = 128,256 needs no scratch memory, no
host sync and no data-dependent grid (CUDA-graph safe).

Owns the kernel, its launcher `sample`, the plain-torch `sample_ref` (ops/sampling.py's original
sort-based algorithm plus min-p), and the noise both draw: `row_keys` and `exponential_noise`,
ops/sampling.py's original formulas bit for bit but for the uniform's width (23 bits, not 24:
see `exponential_noise`), which changed seeded draws once (2026-11-23), and
`filtered_logits_ref`: the logits `sample_ref` draws from, dropped tokens at -inf (what
processed log-probs are of). Imports nothing from ops. Does not own log-probs
(kernels/logprobs.py) or how parameters reach the device.

Semantics, per row (`sample_ref` is the definition; the kernel reproduces it):
- temperature < 1e-5: greedy, the argmax of the raw logits, ties to the lowest token id.
- s = logits.float() / temperature; tokens are ranked by s descending, ties by lower token id.
- min-p (vLLM's, applied before top-k/top-p there too): drop a token whose probability is below
  min_p times the top token's, p_i < min_p * p_max with p = softmax(s) over the whole row, i.e.
  exp(s_i - s_max) < min_p (the normaliser cancels). min_p <= 0 is off; min_p is clamped to 1 so
  the top token always stays.
- top-k (k <= 0 or k >= V: off) keeps the first k ranks. min-p and top-k both keep a prefix of the
  ranking, so their survivors are the shorter prefix.
- top-p (>= 1: off) over the survivors' renormalised probabilities: drop a token when the mass of
  the tokens ranked above it reaches top_p; the first token always stays.
- the draw is argmax_i p_i / E_i over the kept tokens, E = exponential_noise(keys) indexed by token
  id; ties go to the lowest token id.

Where the kernel can differ from `sample_ref` (each needs two numbers within about 1e-6 relative
of each other, so on random inputs the tokens are equal; bf16 ties are handled exactly):
- it ranks raw logits, the ref x / T: two fp32 logits an ulp apart can round to one s (a tie the
  ref breaks by id, the kernel by value); 16-bit logits never merge (24-bit fp32 quotients).
- it computes e = exp(s - s_max) as 2^((x - x_max) * log2(e) / T) (GPU exp2/log/div approximate),
  so min_p within rounding of some e_i, top_p within rounding of a partial mass sum (the kernel
  sums in another order than the ref's cumsum), or two near-equal race values can go either way.
  A top-p cut that moves by one boundary token changes the draw only if that token wins the race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs

GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows)
_MASK32 = 0xFFFFFFFF
_HI_MASK = 0x7FFFFFFF  # keeps the high word non-negative in int64
_GREEDY_EPS_TL = tl.constexpr(GREEDY_EPS)
_LOG2E = tl.constexpr(1.4426950408889634)
# Scaled logits more than this below the max have probability exactly 0 in fp32 (e^-110 < 2^-150),
# so the threshold searches never look below max - _SPAN * temperature.
_SPAN = tl.constexpr(110.0)
# Search passes that may split the bracket in value; later ones split bit patterns, which end any
# search in ceil(32 / log2(PIVOTS + 1)) more. The cap is a guard: no search comes near it.
_VALUE_PASSES = tl.constexpr(12)
_MAX_PASSES = tl.constexpr(64)


# ---- noise: counter-based, shared by the kernel and the reference ------------------------------


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """ops.sampling._mix32: a 32-bit hash on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, gen_index: torch.Tensor) -> torch.Tensor:
    """One 32-bit noise key per row from (seed, gen_index); random for seeds < 0. [B] int64."""
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
    # 23 random bits -> u in [2^-24, 1 - 2^-24], exact in fp32 (24 bits would round the top
    # value, 1 - 2^-25, to 1.0: a noise of 0 that wins any race it enters, 1 token in 2^24).
    u = ((h >> 9).float() + 0.5) * (1.0 / 2**23)
    return -torch.log(u)


@triton.jit
def _noise_tl(key, offs):
    """`exponential_noise` for tokens `offs` of the row keyed `key` (int64 < 2**32)."""
    # The same int64 arithmetic as ops (no product overflows); _mix32 twice, inline, since a
    # nested call per chunk is slow in the CPU interpreter.
    h = (key + offs.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF
    for r in tl.static_range(2):
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h = h ^ (h >> 15)
        h = (h * 0x5BD1E995) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h = h ^ (h >> 16)
        if r == 0:
            h = h ^ key
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(u)


# ---- threshold search ------------------------------------------------------------------------
# A cut is a bracket [lo, hi) of logits: every token >= hi stays, every token < lo goes, and the
# tokens inside are resolved in token-id order by the race pass. Each search pass counts the row
# against PIVOTS thresholds spread over the bracket and keeps the sub-bracket holding the cut, so
# a pass narrows it (PIVOTS + 1)-fold; the same pass finds the least and greatest logit inside
# the bracket, which moves lo up onto data and ends the search once the bracket holds a single
# value (a tie group on the cut). It also ends as soon as the bracket needs no resolving.


@triton.jit
def _to_key(v):
    """fp32 -> int64 with the same order; -0.0 and +0.0 share key 0."""
    b = v.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b, -(b + 2147483648))


@triton.jit
def _from_key(k):
    bits = tl.where(k >= 0, k, 2147483648 - k)
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _pivots(lo, top, step, TEST_LO: tl.constexpr, PIVOTS: tl.constexpr):
    """PIVOTS ascending thresholds in (lo, top] splitting [lo, top] evenly, top being the
    greatest logit the bracket may hold (so every pass makes progress); with TEST_LO, the first
    pass tests lo itself instead of the last split.

    Even in value (logits cluster, so this converges fastest); even in bit pattern once the
    span is a few ulps wide, or after _VALUE_PASSES: slower on logits, but it ends any search.
    """
    j = tl.arange(0, PIVOTS)
    first = ((step == 0) & TEST_LO).to(tl.int32)
    parts = PIVOTS + 1 - first
    num = j + 1 - first
    wide = (top - lo) > (tl.abs(lo) + tl.abs(top)) * (1.0 / 1048576.0)
    if (step < _VALUE_PASSES) & wide:
        pivots = lo + (top - lo) * (num.to(tl.float32) / parts)
    else:  # rounded up, so that a span of two adjacent floats still splits
        key_lo = _to_key(lo)
        pivots = _from_key(key_lo + ((_to_key(top) - key_lo) * num + parts - 1) // parts)
    return pivots


@triton.jit
def _count_at_least(row_ptr, V, pivots, lo, hi, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """[PIVOTS] counts of logits >= each pivot, and the least and greatest logit in [lo, hi);
    one pass."""
    # Per-lane accumulators, reduced once at the end; counts in fp32 (exact below 2**24).
    count = tl.full([BLOCK, PIVOTS], 0, dtype=tl.float32)
    least = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    most = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        count += (x[:, None] >= pivots[None, :]).to(tl.float32)
        inside = (x >= lo) & (x < hi)
        least = tl.minimum(least, tl.where(inside, x, float("inf")))
        most = tl.maximum(most, tl.where(inside, x, float("-inf")))
    return tl.sum(count, axis=0).to(tl.int32), tl.min(least, axis=0), tl.max(most, axis=0)


@triton.jit
def _mass_at_least(row_ptr, V, pivots, lo, hi, x_max, scale, min_p, BLOCK: tl.constexpr,
                   PIVOTS: tl.constexpr):  # fmt: skip
    """`_count_at_least` over the min-p survivors, plus their [PIVOTS] masses (sums of
    e = exp(s - s_max)) >= each pivot; one pass."""
    count = tl.full([BLOCK, PIVOTS], 0, dtype=tl.float32)
    mass = tl.full([BLOCK, PIVOTS], 0, dtype=tl.float32)
    least = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    most = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((x - x_max) * scale)
        survives = e >= min_p
        take = (x[:, None] >= pivots[None, :]) & survives[:, None]
        count += take.to(tl.float32)
        mass += tl.where(take, e[:, None], 0.0)
        inside = (x >= lo) & (x < hi) & survives
        least = tl.minimum(least, tl.where(inside, x, float("inf")))
        most = tl.maximum(most, tl.where(inside, x, float("-inf")))
    count = tl.sum(count, axis=0).to(tl.int32)
    return count, tl.sum(mass, axis=0), tl.min(least, axis=0), tl.max(most, axis=0)


@triton.jit
def _top_k_cut(row_ptr, V, k, lo, hi, top, PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Bracket the k-th largest logit. Invariant: #{x >= lo} >= k > #{x >= hi}. The first pass
    tests lo: if fewer than k tokens reach it, the bracket closes and every token >= lo stays.

    Returns lo, hi, how many tokens in [lo, hi) stay, and whether that is fewer than are there
    (a tie on the cut, to resolve by token id).
    """
    c_lo = V  # tokens >= lo, assumed >= k until the first pass tells
    c_hi = 0
    least = lo  # least and greatest logit in [lo, hi): unknown (distinct) before a pass
    most = top
    step = 0
    while (c_lo > k) & (lo < hi) & (least < most) & (step < _MAX_PASSES):
        pivots = _pivots(lo, top, step, True, PIVOTS)
        c, least, most = _count_at_least(row_ptr, V, pivots, lo, hi, BLOCK, PIVOTS)
        up = c >= k  # a prefix: counts fall as pivots rise
        # No token lies in [lo, least): lifting lo onto it changes no count.
        lo = tl.maximum(tl.max(tl.where(up, pivots, lo), axis=0), least)
        c_lo = tl.min(tl.where(up, c, c_lo), axis=0)
        hi = tl.min(tl.where(up, hi, pivots), axis=0)
        c_hi = tl.max(tl.where(up, c_hi, c), axis=0)
        top = tl.minimum(tl.minimum(top, most), hi)  # bounds the logits in the new bracket
        step += 1
    return lo, hi, k - c_hi, (c_lo > k) & (lo < hi)


@triton.jit
def _kept_mass(row_ptr, V, x_max, scale, min_p, lo_k, hi_k, n_keep, ties_k,
               BLOCK: tl.constexpr):  # fmt: skip
    """Sum of e over the top-k and min-p survivors: top-p's normaliser. One pass."""
    mass = tl.full([BLOCK], 0, dtype=tl.float32)
    seen = 0  # tokens in [lo_k, hi_k) so far
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((x - x_max) * scale)
        keep = x >= lo_k
        if ties_k:
            inside = ((x >= lo_k) & (x < hi_k)).to(tl.int32)
            rank = seen + tl.cumsum(inside, axis=0) - inside
            seen += tl.sum(inside, axis=0)
            keep = (x >= hi_k) | ((inside != 0) & (rank < n_keep))
        mass += tl.where(keep & (e >= min_p), e, 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _top_p_cut(row_ptr, V, x_max, scale, min_p, top_p, z, lo, hi, PIVOTS: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """Bracket the top-p cut. M(t) = mass of the survivors >= t, over z (their total).
    Invariant: M(lo) >= top_p > M(hi); lo starts at the top-k cut, where M is 1.

    Every survivor >= hi stays (the mass above it is < top_p), every one < lo goes (the mass
    above it is >= top_p). Ends when [lo, hi) holds one survivor (it stays) or one value.
    Returns lo, hi, M(hi) * z, and whether [lo, hi) may hold several survivors.
    """
    n_lo = V + 1  # survivors >= lo: unknown until the first pass
    n_hi = 0
    mass_hi = 0.0
    least = lo  # as in _top_k_cut
    most = x_max
    top = x_max
    step = 0
    while (n_lo - n_hi > 1) & (lo < hi) & (least < most) & (step < _MAX_PASSES):
        pivots = _pivots(lo, top, step, False, PIVOTS)
        n, mass, least, most = _mass_at_least(
            row_ptr, V, pivots, lo, hi, x_max, scale, min_p, BLOCK, PIVOTS
        )
        up = mass / z >= top_p  # a prefix: masses fall as pivots rise
        lo = tl.maximum(tl.max(tl.where(up, pivots, lo), axis=0), least)
        n_lo = tl.min(tl.where(up, n, n_lo), axis=0)
        hi = tl.min(tl.where(up, hi, pivots), axis=0)
        n_hi = tl.max(tl.where(up, n_hi, n), axis=0)
        mass_hi = tl.max(tl.where(up, mass_hi, mass), axis=0)
        top = tl.minimum(tl.minimum(top, most), hi)
        step += 1
    return lo, hi, mass_hi, n_lo - n_hi > 1


# ---- the kernel ------------------------------------------------------------------------------


@triton.jit
def _row_argmax(row_ptr, V, BLOCK: tl.constexpr):
    """(max, lowest id holding it) of the raw logits; one pass."""
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_id = tl.full([BLOCK], 0, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: each lane keeps its earliest (lowest id) maximum
        best = tl.where(better, x, best)
        best_id = tl.where(better, offs, best_id)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_id, V), axis=0)


@triton.jit
def _race(row_ptr, V, key, x_max, scale, min_p, lo_k, hi_k, n_keep, ties_k, lo_p, hi_p, mass_hi,
          ties_p, z, top_p, BLOCK: tl.constexpr):  # fmt: skip
    """argmax over the kept tokens of e_i / E_i, ties to the lowest id. e = exp(s - s_max) is p
    without its normaliser, which cannot move the argmax. One pass."""
    best = tl.full([BLOCK], 0, dtype=tl.float32)
    best_id = tl.full([BLOCK], 0, dtype=tl.int32)
    seen_k = 0  # tokens in the top-k bracket so far
    seen_p = 0  # top-k and min-p survivors in the top-p bracket so far
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((x - x_max) * scale)
        keep = x >= lo_k
        if ties_k:  # the first n_keep of the bracket, by id
            in_k = ((x >= lo_k) & (x < hi_k)).to(tl.int32)
            rank_k = seen_k + tl.cumsum(in_k, axis=0) - in_k
            seen_k += tl.sum(in_k, axis=0)
            keep = (x >= hi_k) | ((in_k != 0) & (rank_k < n_keep))
        keep = keep & (e >= min_p)
        if ties_p:  # members by id, while the mass ranked above stays < top_p
            in_p = (keep & (x >= lo_p) & (x < hi_p)).to(tl.int32)
            rank_p = seen_p + tl.cumsum(in_p, axis=0) - in_p
            seen_p += tl.sum(in_p, axis=0)
            under = (rank_p == 0) | ((mass_hi + rank_p.to(tl.float32) * e) / z < top_p)
            keep = keep & ((x >= hi_p) | ((in_p != 0) & under))
        else:
            keep = keep & (x >= lo_p)
        race = tl.where(keep, e / _noise_tl(key, offs), 0.0)
        better = race > best  # strict: each lane keeps its lowest id on ties
        best = tl.where(better, race, best)
        best_id = tl.where(better, offs, best_id)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_id, V), axis=0)


@triton.jit
def _sample_kernel(
    # pointers
    logits_ptr,  # [B, V], unit stride over V
    temperature_ptr,  # [B] f32
    top_k_ptr,  # [B] i32
    top_p_ptr,  # [B] f32
    min_p_ptr,  # [B] f32
    keys_ptr,  # [B] i64, each < 2**32
    out_ptr,  # [B] i64
    # strides
    stride_logits_b,
    # meta-parameters
    V,
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits_b
    temperature = tl.load(temperature_ptr + row)
    x_max, token = _row_argmax(row_ptr, V, BLOCK)
    # Passes over the row: 1 here, then for a sampled row ~log(110 T / gap) / log(PIVOTS + 1)
    # for each active cut (+1 for top-p's normaliser), and the race.
    if temperature >= _GREEDY_EPS_TL:
        # Cuts are on raw logits: s = x / T is monotone in x, and e = exp(s - s_max)
        # = 2^((x - x_max) * log2(e) / T) needs no division per token.
        scale = _LOG2E / temperature
        min_p = tl.minimum(tl.load(min_p_ptr + row), 1.0)
        top_k = tl.load(top_k_ptr + row)
        # top_p = 0 keeps the top token, as any top_p below its probability does; the cut's
        # invariant M(lo) >= top_p > M(hi) needs top_p > 0 (an empty mass is never >= it).
        top_p = tl.maximum(tl.load(top_p_ptr + row), 1e-30)
        # Tokens below the floor have probability 0 (the clamp keeps hi - lo finite; rows need a
        # finite max logit).
        floor = tl.maximum(x_max - _SPAN * temperature, -1e38)
        ceiling = _from_key(_to_key(x_max) + 1)  # the next float above the max
        lo_k = floor
        hi_k = floor
        n_keep = 0
        ties_k = False
        if (top_k > 0) & (top_k < V):
            lo_k, hi_k, n_keep, ties_k = _top_k_cut(
                row_ptr, V, top_k, floor, ceiling, x_max, PIVOTS, BLOCK
            )
        lo_p = lo_k
        hi_p = lo_k
        mass_hi = 0.0
        ties_p = False
        z = 1.0
        if top_p < 1.0:
            z = _kept_mass(row_ptr, V, x_max, scale, min_p, lo_k, hi_k, n_keep, ties_k, BLOCK)
            lo_p, hi_p, mass_hi, ties_p = _top_p_cut(
                row_ptr, V, x_max, scale, min_p, top_p, z, lo_k, ceiling, PIVOTS, BLOCK
            )
        key = tl.load(keys_ptr + row)
        token = _race(row_ptr, V, key, x_max, scale, min_p, lo_k, hi_k, n_keep, ties_k, lo_p,
                      hi_p, mass_hi, ties_p, z, top_p, BLOCK)  # fmt: skip
    tl.store(out_ptr + row, token.to(tl.int64))


# ---- launcher --------------------------------------------------------------------------------


def _check_row_param(name: str, t: torch.Tensor, dtype: torch.dtype, batch: int, device) -> None:
    if t.shape != (batch,) or t.dtype != dtype:
        raise ValueError(f"sample: {name} must be {dtype} [{batch}], got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"sample: {name} is on {t.device}, logits on {device}")
    if batch > 1 and t.stride(0) != 1:
        raise ValueError(f"sample: {name} must be contiguous, got stride {t.stride(0)}")


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block: int = 1024,
    pivots: int = 8,
    num_warps: int = 8,
) -> torch.Tensor:
    """One token per row, as `sample_ref`. logits: [B, V] fp32/bf16/fp16 with unit stride over V;
    temperature [B] f32 (< 1e-5: greedy), top_k [B] i32 (0: off), top_p [B] f32 (1: off), min_p
    [B] f32 (0: off), keys [B] int64 (`row_keys`). Returns (or fills `out`) tokens [B] int64.
    No host sync and a grid of B programs: safe to capture in a CUDA graph.

    Tuning only (same semantics; `block` changes just the fp32 summation order of the masses):
    `block` logits per chunk, `pivots` thresholds per search pass (more: fewer passes, more work
    per pass), `num_warps`. Per-lane accumulators hold block * pivots values: 1024 x 8 over 8
    warps takes 185 registers a thread on sm_90, without spills.
    """
    if logits.ndim != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        shape = list(logits.shape)
        raise ValueError(
            f"sample: logits must be [B, V] fp32/bf16/fp16, got {logits.dtype} {shape}"
        )
    batch, vocab = logits.shape
    if vocab == 0 or vocab >= 2**24 or (vocab > 1 and logits.stride(1) != 1):
        raise ValueError(  # 2**24: the search counts tokens in fp32
            f"sample: logits need 0 < V < 2**24 and stride 1 over V, got "
            f"{list(logits.shape)} strides {logits.stride()}"
        )
    if block < 16 or block & (block - 1) or pivots < 2 or pivots & (pivots - 1):
        raise ValueError(f"sample: block ({block}) and pivots ({pivots}) must be powers of two, "
                         "block >= 16, pivots >= 2")  # fmt: skip
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("keys", keys, torch.int64),
    ):
        _check_row_param(name, t, dtype, batch, logits.device)
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _check_row_param("out", out, torch.int64, batch, logits.device)
    if batch == 0:
        return out
    _sample_kernel[(batch,)](
        # pointers
        logits, temperature, top_k, top_p, min_p, keys, out,
        # strides
        logits.stride(0),
        # meta-parameters
        vocab, PIVOTS=pivots, BLOCK=block, num_warps=num_warps,
        **launch_kwargs(logits.device),
    )  # fmt: skip
    return out


# ---- reference -------------------------------------------------------------------------------


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """The module docstring's semantics in plain torch: ops.sampling.sample's sort-based algorithm
    (stable sort, so ties rank by token id) plus min-p, with the row keys given. [B] int64."""
    batch, vocab = logits.shape
    logits = logits.float()
    sorted_logits, sorted_ids, greedy = _filtered_sorted(logits, temperature, top_k, top_p, min_p)
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V], renormalised over the kept set

    noise = exponential_noise(keys, vocab)  # [B, V], indexed by token id
    race = probs / torch.gather(noise, 1, sorted_ids)
    # Back to token order, so race ties go to the lowest token id as in the kernel.
    race = torch.empty_like(race).scatter_(1, sorted_ids, race)
    return torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))


def filtered_logits_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The logits `sample_ref` draws from, in token order: logits.float() / temperature with
    every token min-p, top-k or top-p drops at -inf, so their softmax is the draw's
    distribution; a greedy row's are its raw fp32 logits. [B, V] float32. The same tensors and
    shapes as `sample_ref` (no host sync): safe to capture in a CUDA graph."""
    logits = logits.float()
    sorted_logits, sorted_ids, greedy = _filtered_sorted(logits, temperature, top_k, top_p, min_p)
    filtered = torch.empty_like(sorted_logits).scatter_(1, sorted_ids, sorted_logits)
    return torch.where(greedy[:, None], logits, filtered)


def _filtered_sorted(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scaled logits sorted descending with the dropped ones -inf [B, V], their token ids
    [B, V], greedy rows [B] bool) for fp32 `logits`: the filters of the module docstring."""
    vocab = logits.shape[1]
    greedy = temperature < GREEDY_EPS  # [B]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / temp[:, None]  # [B, V]

    # Filter in descending order: the kept set is a prefix of the sorted row.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()  # [B]
    ratio = torch.exp(sorted_logits - sorted_logits[:, :1])  # p_i / p_max
    below_min_p = ratio < min_p.float().clamp(max=1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill((rank >= k[:, None]) | below_min_p, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first never drops).
    mass_above = torch.cumsum(probs, dim=-1) - probs
    active = (top_p < 1.0)[:, None]  # top_p >= 1 keeps everything, whatever the rounding
    drop = (mass_above >= top_p.float()[:, None]) & (rank > 0) & active
    return sorted_logits.masked_fill(drop, float("-inf")), sorted_ids, greedy
