"""ops.sampling: greedy, top-k, top-p, temperature, and seeded draws independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from taipan.ops.sampling import exponential_noise, sample

VOCAB = 64


def _params(batch, temperature=1.0, top_k=0, top_p=1.0, seeds=None, gen_index=0):
    """Per-row parameter tensors as the GPU actor passes them."""
    if seeds is None:
        seeds = torch.arange(batch, dtype=torch.int64)
    return dict(
        temperature=torch.full((batch,), temperature, dtype=torch.float32),
        top_k=torch.full((batch,), top_k, dtype=torch.int32),
        top_p=torch.full((batch,), top_p, dtype=torch.float32),
        seeds=torch.as_tensor(seeds, dtype=torch.int64),
        gen_index=torch.full((batch,), gen_index, dtype=torch.int32),
    )


def _repeat(probs: list[float], batch: int) -> torch.Tensor:
    """[batch, len(probs)] logits whose softmax is `probs`."""
    return torch.tensor(probs).log().expand(batch, -1).contiguous()


def test_greedy_is_argmax_whatever_the_other_parameters():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    params = _params(8, temperature=0.0, top_k=5, top_p=0.3)
    assert torch.equal(sample(logits, **params), logits.argmax(-1))


def test_top_k_one_is_argmax():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    params = _params(8, temperature=1.5, top_k=1, seeds=[-1] * 8)
    assert torch.equal(sample(logits, **params), logits.argmax(-1))


def test_tiny_temperature_is_greedy():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(logits, **_params(8, temperature=1e-7)), logits.argmax(-1))


def test_seeded_row_ignores_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, VOCAB, generator=gen)
    for seed in range(20):
        for gen_index in (0, 1, 7):
            alone = sample(row, **_params(1, 1.0, 0, 0.9, seeds=[seed], gen_index=gen_index))
            others = torch.randn(5, VOCAB, generator=gen)
            batch = torch.cat([others[:2], row, others[2:]])
            seeds = [11, -1, seed, 5, -1, 99]
            mixed = sample(batch, **_params(6, 1.0, 0, 0.9, seeds=seeds, gen_index=gen_index))
            assert mixed[2] == alone[0]


def test_seed_and_gen_index_both_change_the_draw():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is down to the noise
    by_seed = {int(sample(logits, **_params(1, seeds=[s]))) for s in range(40)}
    by_step = {int(sample(logits, **_params(1, seeds=[7], gen_index=g))) for g in range(40)}
    assert len(by_seed) > 20 and len(by_step) > 20
    big_seed = 2**62 + 12345  # seeds use all 63 bits
    a = sample(logits, **_params(1, seeds=[big_seed]))
    assert torch.equal(a, sample(logits, **_params(1, seeds=[big_seed])))


def test_unseeded_rows_vary():
    logits = torch.zeros(1, VOCAB)
    draws = {int(sample(logits, **_params(1, seeds=[-1]))) for _ in range(40)}
    assert len(draws) > 20


def _frequencies(tokens: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=n).double() / tokens.numel()


def _assert_close_to(freq: torch.Tensor, probs: list[float], draws: int):
    for f, p in zip(freq.tolist(), probs, strict=True):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / draws)
        assert abs(f - p) < 5 * sigma + 1e-9, (freq.tolist(), probs)


def test_plain_sampling_follows_softmax():
    probs, draws = [0.4, 0.3, 0.2, 0.1], 20000
    tokens = sample(_repeat(probs, draws), **_params(draws))
    _assert_close_to(_frequencies(tokens, 4), probs, draws)


def test_top_p_keeps_only_the_nucleus():
    probs, draws = [0.5, 0.3, 0.15, 0.05], 20000
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two tokens, renormalized.
    tokens = sample(_repeat(probs, draws), **_params(draws, top_p=0.7))
    _assert_close_to(_frequencies(tokens, 4), [0.625, 0.375, 0.0, 0.0], draws)


def test_top_p_keeps_at_least_one_token():
    tokens = sample(_repeat([0.9, 0.1], 500), **_params(500, top_p=0.01))
    assert torch.all(tokens == 0)


def test_top_k_keeps_the_k_best():
    probs, draws = [0.1, 0.4, 0.2, 0.3], 20000
    tokens = sample(_repeat(probs, draws), **_params(draws, top_k=2))
    _assert_close_to(_frequencies(tokens, 4), [0.0, 4 / 7, 0.0, 3 / 7], draws)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_or_flattens(temperature):
    probs, draws = [0.6, 0.3, 0.1], 20000
    tempered = torch.tensor(probs).log() / temperature
    expected = torch.softmax(tempered, 0).tolist()
    tokens = sample(_repeat(probs, draws), **_params(draws, temperature=temperature))
    _assert_close_to(_frequencies(tokens, 3), expected, draws)


def test_noise_is_exponential_and_keyed():
    keys = torch.tensor([1, 2, 3], dtype=torch.int64)
    noise = exponential_noise(keys, 50000)
    assert noise.min() > 0
    assert abs(noise.mean().item() - 1.0) < 0.02 and abs(noise.var().item() - 1.0) < 0.05
    assert torch.equal(noise[1], exponential_noise(keys[1:2], 50000)[0])
    assert not torch.equal(noise[0], noise[1])
