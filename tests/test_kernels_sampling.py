"""kernels.sampling and kernels.logprobs: the row keys, the noise and sample_ref (min_p = 0)
against ops.sampling as it was before the kernel (a frozen copy here: seeded draws must not
change), the Triton kernels against their refs (CPU interpreter, fp32, V <= 512 in chunks of
128), min-p as vLLM defines it, the draws' distribution, the search's pass count, the launchers'
refusals, and one GPU test (V = 128,256, bf16 and fp32, timings printed)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from taipan.kernels.logprobs import log_prob_gather, log_prob_gather_ref
from taipan.kernels.sampling import exponential_noise, row_keys, sample, sample_ref
from taipan.ops import sampling as ops_sampling

BLOCK = 128  # chunk size on CPU: V = 300 and 512 take several chunks, 300 a partial one


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row parameter tensors (scalars broadcast), as the launcher takes them."""

    def row(value, dtype):
        return torch.as_tensor(value, dtype=dtype).expand(batch).contiguous()

    return dict(
        temperature=row(temperature, torch.float32),
        top_k=row(top_k, torch.int32),
        top_p=row(top_p, torch.float32),
        min_p=row(min_p, torch.float32),
    )


def _keys(batch: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**32, (batch,), generator=g, dtype=torch.int64)


def _random_params(batch: int, vocab: int, g: torch.Generator) -> dict:
    """Each row: greedy or a temperature, and each filter off, on, or at its edge."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def uniform(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    rows = []
    for _ in range(batch):
        rows.append(
            (
                pick([0.0, 1.0, uniform(0.3, 2.0), uniform(0.3, 2.0)]),
                pick([0, 1, int(torch.randint(2, 60, (1,), generator=g)), vocab - 1, vocab]),
                pick([1.0, uniform(0.05, 0.99), uniform(0.5, 0.99), 0.0]),
                pick([0.0, 0.0, uniform(0.001, 0.3)]),
            )
        )
    temperature, top_k, top_p, min_p = zip(*rows, strict=True)
    return _params(batch, list(temperature), list(top_k), list(top_p), list(min_p))


def _assert_kernel_matches_ref(logits, params, keys, **kw):
    got = sample(logits, **params, keys=keys, block=kw.pop("block", BLOCK), **kw)
    want = sample_ref(logits, **params, keys=keys)
    assert torch.equal(got, want), (got.tolist(), want.tolist(), params)


def _rounding_explains(row, p, key, got: int, want: int) -> str:
    """Why `got` may stand for `want` under rounding, or "" if nothing explains it: both in the
    ref's float64 kept set with race values within 1e-4, or `got` on the top-p edge (the mass
    ranked above it within 1e-4 of top_p)."""
    temp = float(p["temperature"])
    if temp < 1e-5:
        return ""
    s = row.double() / temp
    order = s.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    e = torch.exp(s - s.max())
    k = int(p["top_k"])
    kept = (rank < (k if 0 < k < len(s) else len(s))) & (e >= float(p["min_p"]))
    mass = torch.where(kept, e, 0.0)
    above = (mass[order].cumsum(0) - mass[order])[rank] / mass.sum()  # mass ranked above each
    noise = exponential_noise(key[None], len(s))[0].double()
    race = e / noise
    top_p = float(p["top_p"])
    if top_p < 1.0 and abs(float(above[got]) - top_p) < 1e-4:
        return f"top-p edge (mass above {float(above[got]):.6f} vs top_p {top_p:.6f})"
    if kept[got] and abs(float(race[got] / race[want]) - 1) < 1e-4:
        return f"race near-tie ({float(race[got]):.8g} vs {float(race[want]):.8g})"
    return ""


def _diagnose(row, p, key, tokens: dict[str, int]) -> dict:
    """What the ref's float64 view says of each token: rank, e, noise, race value, mass above."""
    temp = float(p["temperature"])
    s = row.double() / max(temp, 1e-5)
    order = s.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    e = torch.exp(s - s.max())
    above = (e[order].cumsum(0) - e[order])[rank] / e.sum()
    noise = exponential_noise(key[None], len(s))[0].double()
    return {
        name: dict(
            rank=int(rank[t]),
            e=float(e[t]),
            noise=float(noise[t]),
            race=float(e[t] / noise[t]),
            above=float(above[t]),
        )  # fmt: skip
        for name, t in tokens.items()
    }


# ---- the pre-kernel ops.sampling, frozen (commit 81761fd) but for the 23-bit noise ----------

_M32 = 0xFFFFFFFF


def _legacy_mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    x = x ^ (x >> 13)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _legacy_row_keys(seeds, gen_index):  # seeded rows only
    lo, hi = seeds & _M32, (seeds >> 32) & 0x7FFFFFFF
    return _legacy_mix32(_legacy_mix32(_legacy_mix32(lo ^ 0x2545F491) ^ hi) ^ gen_index.long())


def _legacy_noise(keys, vocab):
    token = torch.arange(vocab, dtype=torch.int64)
    h = _legacy_mix32((keys[:, None] + token[None, :] * 0x9E3779B1) & _M32)
    h = _legacy_mix32(h ^ keys[:, None])
    # The one change since: 23 random bits, not 24, so u never rounds to 1 (a zero noise).
    return -torch.log(((h >> 9).float() + 0.5) * (1.0 / 2**23))


def _legacy_sample(logits, temperature, top_k, top_p, seeds, gen_index):
    vocab = logits.shape[1]
    greedy = temperature < 1e-5
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_above >= top_p[:, None]) & (rank > 0) & (top_p < 1.0)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    noise = _legacy_noise(_legacy_row_keys(seeds, gen_index), vocab)
    race = probs / torch.gather(noise, 1, sorted_ids)
    choice = torch.gather(sorted_ids, 1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), choice)


# ---- noise and keys --------------------------------------------------------------------------


def test_row_keys_are_ops_row_keys_for_seeded_rows():
    g = _gen(0)
    seeds = torch.cat(
        [
            torch.tensor([0, 1, 7, 2**31, 2**32 + 5, 2**62 + 12345, 2**63 - 1]),
            torch.randint(0, 2**62, (57,), generator=g),
        ]
    )
    gen_index = torch.randint(0, 5000, seeds.shape, generator=g, dtype=torch.int32)
    keys = row_keys(seeds, gen_index)
    assert torch.equal(keys, _legacy_row_keys(seeds, gen_index))
    assert keys.dtype == torch.int64 and bool(((keys >= 0) & (keys < 2**32)).all())
    fresh = row_keys(torch.full((64,), -1), torch.zeros(64, dtype=torch.int32))
    assert bool(((fresh >= 0) & (fresh < 2**31)).all()) and fresh.unique().numel() > 60


def test_exponential_noise_is_ops_noise():
    keys = torch.cat([torch.tensor([0, 1, 2**32 - 1]), _keys(13, _gen(1))])
    assert torch.equal(exponential_noise(keys, 1000), _legacy_noise(keys, 1000))


def test_noise_is_positive_and_finite_for_every_hash():
    """The extreme hashes give u strictly inside (0, 1) in fp32: no zero (an always-winning
    token) and no infinite noise."""
    h = torch.tensor([0, 511, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = ((h >> 9).float() + 0.5) * (1.0 / 2**23)
    assert bool(((u > 0) & (u < 1)).all())
    noise = exponential_noise(torch.arange(64), 128256)
    assert bool(((noise > 0) & noise.isfinite()).all())


def test_kernel_draws_the_noise_of_ops():
    """Uniform logits, no filter: the race picks the token with the smallest E, so the kernel's
    in-register hash must be the ops noise bit for bit (23-bit u, exact)."""
    vocab, g = 300, _gen(2)
    for _ in range(4):
        keys = _keys(4, g)
        got = sample(torch.zeros(4, vocab), **_params(4), keys=keys, block=BLOCK)
        assert torch.equal(got, _legacy_noise(keys, vocab).argmin(dim=-1))


# ---- sample_ref against ops.sampling.sample --------------------------------------------------


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (0.0, 0, 1.0),  # greedy
        (1.0, 0, 1.0),  # temperature only
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),  # top-k
        (1.0, 0, 0.8),  # top-p
        (0.9, 20, 0.9),  # both
        (1.0, 100, 0.5),  # top_k >= V
        (1.0, 1000, 1.0),
        (1.0, 3, 0.0),  # top_p = 0 keeps the first
        ("mixed", None, None),
    ],
)
def test_sample_ref_equals_ops_sample(temperature, top_k, top_p):
    """Also through today's ops.sampling.sample, which dispatches to sample_ref on CPU."""
    batch, vocab, g = 64, 100, _gen(3)
    for _ in range(5):
        logits = torch.randn(batch, vocab, generator=g) * 3
        if temperature == "mixed":
            params = _random_params(batch, vocab, g)
            params["min_p"].zero_()
        else:
            params = _params(batch, temperature, top_k, top_p)
        seeds = torch.randint(0, 2**62, (batch,), generator=g)
        gen_index = torch.randint(0, 1000, (batch,), generator=g, dtype=torch.int32)
        min_p = params.pop("min_p")
        want = _legacy_sample(logits, **params, seeds=seeds, gen_index=gen_index)
        got = sample_ref(logits, **params, min_p=min_p, keys=row_keys(seeds, gen_index))
        assert torch.equal(got, want)
        via_ops = ops_sampling.sample(logits, **params, seeds=seeds, gen_index=gen_index)
        assert torch.equal(via_ops, want)


def test_min_p_is_vllms_rule_applied_before_top_k_and_top_p():
    """vLLM drops p < min_p * p_max (p: the temperature-scaled softmax of the whole row), then
    applies top-k / top-p: masking those tokens up front and sampling without min-p must give
    the same draws, in the ref and in the kernel (whose -inf logits this also exercises)."""
    batch, vocab, g = 4, 300, _gen(4)
    for top_k, top_p in [(0, 1.0), (0, 0.7), (10, 1.0), (25, 0.9)]:
        logits = torch.randn(batch, vocab, generator=g) * 3
        params = _params(batch, 0.8, top_k, top_p, min_p=0.02)
        probs = torch.softmax(logits / 0.8, dim=-1)
        masked = logits.masked_fill(probs < 0.02 * probs.max(-1, keepdim=True).values, -math.inf)
        keys = _keys(batch, g)
        want = sample_ref(masked, **{**params, "min_p": torch.zeros(batch)}, keys=keys)
        assert torch.equal(sample_ref(logits, **params, keys=keys), want)
        assert torch.equal(sample(masked, **params, keys=keys, block=BLOCK), want)


# ---- the kernel against sample_ref -----------------------------------------------------------


@pytest.mark.parametrize("vocab", [512, 300])
def test_kernel_equals_ref_on_random_configs(vocab):
    g = _gen(vocab)
    for _ in range(12):
        logits = torch.randn(4, vocab, generator=g) * float(
            torch.empty(()).uniform_(0.5, 4, generator=g)
        )
        _assert_kernel_matches_ref(logits, _random_params(4, vocab, g), _keys(4, g))


def test_kernel_equals_ref_on_a_strided_view_and_tiny_rows():
    g = _gen(5)
    wide = torch.randn(4, 300 + 7, generator=g) * 2
    _assert_kernel_matches_ref(wide[:, :300], _params(4, 1.0, 40, 0.9, 0.01), _keys(4, g))
    for vocab in (1, 2, 5):  # a single partial chunk; top_k >= V
        logits = torch.randn(4, vocab, generator=g)
        _assert_kernel_matches_ref(
            logits, _params(4, 1.0, [0, 1, 2, 3], 0.6), _keys(4, g), block=16
        )


def test_kernel_equals_ref_at_extreme_temperatures():
    """Near-greedy rows put most logits below the probability-0 floor; hot rows are flat, so
    top-p cuts deep into the row."""
    g = _gen(13)
    for temperature in ([0.01, 1e-4, 30.0, 1e4], [0.05, 3e-5, 100.0, 1e3]):
        logits = torch.randn(4, 300, generator=g) * 4
        params = _params(4, temperature, [0, 20, 0, 20], [0.9, 0.5, 0.8, 0.3], [0.0, 0.1, 0.0, 0.5])
        _assert_kernel_matches_ref(logits, params, _keys(4, g))


def test_top_p_zero_keeps_only_the_top_token():
    """top_p = 0: every token but the top one has mass ranked above it >= 0, so it goes."""
    batch, vocab = 4, 300
    logits = torch.randn(batch, vocab, generator=_gen(5)) * 4
    params = _params(batch, [0.5, 1.0, 1.5, 3.0], 0, 0.0)
    keys = row_keys(torch.arange(batch), torch.zeros(batch, dtype=torch.int32))
    got = sample(logits, **params, keys=keys, block=BLOCK)
    assert torch.equal(got, logits.argmax(dim=-1))
    _assert_kernel_matches_ref(logits, params, keys)


def test_searches_end_in_a_few_passes(monkeypatch):
    """Each search pass reads the whole row on the GPU: count them (interpreter only: the jitted
    kernel looks its helpers up when it runs). PIVOTS = 8 splits the bracket 9-fold a pass, and
    ties on a cut end as soon as the bracket holds one value."""
    import taipan.kernels.sampling as kernel_module

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton CPU interpreter")
    passes = {}
    for name in ("_count_at_least", "_mass_at_least"):
        helper = getattr(kernel_module, name)

        def counted(*args, _helper=helper, _name=name):
            passes[_name] = passes.get(_name, 0) + 1
            return _helper(*args)

        monkeypatch.setattr(kernel_module, name, counted)
    g = _gen(14)
    for row in range(18):
        vocab = (512, 300)[row % 2]
        logits = torch.randn(1, vocab, generator=g) * 3
        if row % 3 == 1:
            logits = logits.bfloat16().float()  # ties
        elif row % 3 == 2:
            logits = torch.randint(-8, 9, (1, vocab), generator=g).float() * 0.25
        passes.clear()
        params = _params(1, [0.7, 1.5][row % 2], [0, 50][row % 4 // 2], 0.9, 0.01)
        _assert_kernel_matches_ref(logits, params, _keys(1, g))
        assert max(passes.values()) <= 6, passes


def test_greedy_rows_are_the_exact_argmax_ties_to_the_lowest_id():
    g = _gen(6)
    logits = torch.randint(-3, 4, (4, 300), generator=g).float()  # many ties, at the max too
    logits[3, 299] = 10.0  # the max in the last, partial chunk
    for temperature in (0.0, 1e-6):
        params = _params(4, temperature, top_k=5, top_p=0.5, min_p=0.1)
        got = sample(logits, **params, keys=_keys(4, g), block=BLOCK)
        assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(1, 1.0, 0.0), (7, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.3, 0.0), (0, 0.9, 0.0), (30, 0.6, 0.05),
     (0, 0.0, 0.0)],
)  # fmt: skip
def test_ties_on_the_cuts_are_broken_by_token_id(top_k, top_p, min_p):
    """Logits on a coarse grid put tie groups on the top-k and top-p cuts (as bf16 logits do):
    the kernel keeps their lowest ids first, as the ref's stable sort does."""
    g = _gen(7)
    for _ in range(2):
        logits = torch.randint(-8, 9, (4, 300), generator=g).float() * 0.25
        _assert_kernel_matches_ref(logits, _params(4, 1.0, top_k, top_p, min_p), _keys(4, g))


def _filtered_softmax(logits, temperature, top_k, top_p, min_p) -> list[float]:
    """The module's semantics, written out in plain Python for one row."""
    s = [x / temperature for x in logits]
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    top = s[order[0]]
    kept = [i for r, i in enumerate(order) if r < top_k and math.exp(s[i] - top) >= min_p]
    z = sum(math.exp(s[i] - top) for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if nucleus and mass >= top_p:
            break
        nucleus.append(i)
        mass += math.exp(s[i] - top) / z
    z = sum(math.exp(s[i] - top) for i in nucleus)
    return [math.exp(s[i] - top) / z if i in nucleus else 0.0 for i in range(len(s))]


def _chi2(tokens: torch.Tensor, expected: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).tolist()
    assert all(c == 0 for c, p in zip(counts, expected, strict=True) if p == 0), counts
    n = tokens.numel()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True) if p)


def test_draws_follow_the_filtered_softmax():
    """One row, many keys. Here min-p drops ids 6-7, top-k (5) id 5, top-p (0.85) id 4. The
    kernel over a few hundred keys (a loose bound), the ref over many (a tight one)."""
    logits = [2.0, 1.5, 1.4, 1.0, 0.3, 0.0, -1.0, -3.0]
    expected = _filtered_softmax(logits, 0.8, 5, 0.85, 0.05)
    assert [p > 0 for p in expected] == [True] * 4 + [False] * 4
    for draws, fn, kw in [(120, sample, dict(block=16)), (50000, sample_ref, {})]:
        rows = torch.tensor(logits).expand(draws, -1)
        keys = _keys(draws, _gen(draws))
        tokens = fn(rows, **_params(draws, 0.8, 5, 0.85, 0.05), keys=keys, **kw)
        assert _chi2(tokens, expected) < 20.0  # 3 degrees of freedom: P(chi2 > 20) < 2e-4


def test_out_is_filled_in_place():
    g = _gen(9)
    logits, out = torch.randn(4, 300, generator=g), torch.full((4,), -1, dtype=torch.int64)
    params, keys = _params(4, 1.0, 10, 0.9), _keys(4, g)
    assert sample(logits, **params, keys=keys, out=out, block=BLOCK) is out
    assert torch.equal(out, sample_ref(logits, **params, keys=keys))


# ---- log_prob_gather -------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [512, 300, 5])
def test_log_prob_gather_matches_ref_and_log_softmax(vocab):
    g = _gen(10 + vocab)
    logits = torch.randn(4, vocab + 3, generator=g)[:, :vocab] * 5  # a strided view
    logits[1, : vocab // 2] = -math.inf  # masked tokens, and a first chunk that is all -inf
    tokens = torch.tensor([0, vocab - 1, vocab // 3, vocab - 2])
    got = log_prob_gather(logits, tokens, block=BLOCK if vocab > 16 else 16)
    assert (got - log_prob_gather_ref(logits, tokens)).abs().max() < 1e-5
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert (got - want).abs().max() < 1e-5


def test_log_prob_gather_gives_nan_for_an_id_out_of_range():
    logits = torch.randn(3, 40, generator=_gen(11))
    got = log_prob_gather(logits, torch.tensor([-1, 40, 3], dtype=torch.int32), block=16)
    assert got[:2].isnan().all() and not got[2].isnan()


# ---- refusals --------------------------------------------------------------------------------


def _good_args(batch=2, vocab=10):
    return dict(logits=torch.randn(batch, vocab), **_params(batch), keys=torch.zeros(batch).long())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(logits=torch.randn(10)), "logits must be"),
        (dict(logits=torch.zeros(2, 10, dtype=torch.int32)), "logits must be"),
        (dict(logits=torch.randn(10, 2).t()), "stride 1 over V"),
        (dict(logits=torch.randn(2, 0)), "0 < V"),
        (dict(top_k=torch.zeros(2, dtype=torch.int64)), "top_k must be torch.int32"),
        (dict(temperature=torch.ones(3)), r"temperature must be torch.float32 \[2\]"),
        (dict(keys=torch.zeros(2, dtype=torch.int32)), "keys must be torch.int64"),
        (dict(min_p=torch.zeros(4)[::2]), "min_p must be contiguous"),
        (dict(out=torch.zeros(2, dtype=torch.int32)), "out must be torch.int64"),
        (dict(block=100), "powers of two"),
        (dict(pivots=3), "powers of two"),
    ],
)
def test_sample_refuses_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        sample(**{**_good_args(), **change})


@pytest.mark.parametrize(
    "logits, tokens, message",
    [
        (torch.randn(2, 3, 4), torch.zeros(2).long(), "logits must be"),
        (torch.randn(2, 10).t(), torch.zeros(10).long(), "stride 1 over V"),
        (torch.randn(2, 10), torch.zeros(3).long(), r"tokens must be int32/int64 \[2\]"),
        (torch.randn(2, 10), torch.zeros(2), "tokens must be int32/int64"),
        (torch.randn(2, 10), torch.zeros(4).long()[::2], "tokens must be contiguous"),
    ],
)
def test_log_prob_gather_refuses_bad_arguments(logits, tokens, message):
    with pytest.raises(ValueError, match=message):
        log_prob_gather(logits, tokens)


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_large_vocab_matches_ref_and_times():
    """B = 256, V = 128,256 on CUDA: tokens equal the ref's for fp32 logits and for bf16 logits
    (both upcast them the same way); log-probs within 1e-4. Prints do_bench timings."""
    from triton.testing import do_bench

    batch, vocab, device = 256, 128256, "cuda"
    g = torch.Generator(device=device).manual_seed(12)
    logits32 = torch.randn(batch, vocab, device=device, generator=g) * 2.5
    params = {k: v.to(device) for k, v in _random_params(batch, vocab, _gen(12)).items()}
    keys = row_keys(
        torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.int32, device=device)
    )
    for logits in (logits32, logits32.bfloat16()):
        got = sample(logits, **params, keys=keys)
        want = sample_ref(logits, **params, keys=keys)
        bad = (got != want).nonzero().flatten().tolist()
        # GPU exp2/log round differently from torch's exp/log (the module docstring): a row may
        # differ only where the ref itself is within rounding of a decision.
        assert len(bad) <= batch // 50, bad
        for r in bad:
            why = _rounding_explains(logits[r], {k: v[r] for k, v in params.items()}, keys[r],
                                     int(got[r]), int(want[r]))  # fmt: skip
            p = {k: v[r] for k, v in params.items()}
            seen = _diagnose(logits[r], p, keys[r], {"got": int(got[r]), "want": int(want[r])})
            assert why, (r, {k: v.item() for k, v in p.items()}, seen)
            print(f"row {r}: kernel {int(got[r])} vs ref {int(want[r])}: {why}")
        tokens = got.flip(0)
        err = (log_prob_gather(logits, tokens) - log_prob_gather_ref(logits, tokens)).abs().max()
        assert err < 1e-4, err

    configs = {
        "temperature": (1.0, 0, 1.0, 0.0),
        "top_k=50": (1.0, 50, 1.0, 0.0),
        "top_p=0.9": (1.0, 0, 0.9, 0.0),
        "k50+p0.9+min_p": (1.0, 50, 0.9, 0.05),
    }
    for rows in (1, 256):
        for dtype in (torch.bfloat16, torch.float32):
            logits = logits32[:rows].to(dtype)
            for name, config in configs.items():
                p = {k: v.to(device) for k, v in _params(rows, *config).items()}
                kernel_ms = do_bench(lambda: sample(logits, **p, keys=keys[:rows]))  # noqa: B023
                ref_ms = do_bench(lambda: sample_ref(logits, **p, keys=keys[:rows]))  # noqa: B023
                print(f"sample B={rows} {dtype} {name}: {kernel_ms * 1e3:.0f} us "
                      f"(torch ref {ref_ms * 1e3:.0f} us)")  # fmt: skip
            tokens = torch.zeros(rows, dtype=torch.int64, device=device)
            lp_ms = do_bench(lambda: log_prob_gather(logits, tokens))  # noqa: B023
            print(f"log_prob_gather B={rows} {dtype}: {lp_ms * 1e3:.0f} us")
