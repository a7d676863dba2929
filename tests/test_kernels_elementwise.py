"""kernels.rmsnorm, kernels.rope, kernels.activation: each Triton kernel against its `*_ref`
(CPU interpreter, fp32, tiny shapes), each ref against the ops/layers.py code the model runs,
the launchers' refusals, and one GPU test (bf16/fp16, realistic shapes, timings printed)."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from taipan.kernels.rmsnorm import (
    add_rms_norm_,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from taipan.kernels.rope import (
    rope_and_write_kv,
    rope_and_write_kv_ref,
    rope_cos_sin_cache,
    write_kv,
    write_kv_ref,
)
from taipan.ops.layers import SwiGLUMLP

transformers = pytest.importorskip("transformers")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

BLOCK_SIZE = 16
NUM_BLOCKS = 4
MAX_POS = 2048
THETA = 10000.0


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error."""
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("num_tokens, hidden", [(1, 32), (5, 100), (8, 128), (3, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(num_tokens, hidden, with_residual):
    g = _gen(num_tokens * 1000 + hidden)
    # x a strided view (rows wider than hidden), as a slice of a larger activation buffer
    x = torch.randn(num_tokens, hidden + 3, generator=g)[:, :hidden]
    weight = torch.randn(hidden, generator=g)
    residual = torch.randn(num_tokens, hidden, generator=g) if with_residual else None
    x_before = x.clone()

    got = rms_norm(x, weight, 1e-6, residual=None if residual is None else residual.clone())
    want = rms_norm_ref(x, weight, 1e-6, residual=None if residual is None else residual.clone())
    assert torch.equal(x, x_before)  # x is only read
    if with_residual:
        (out, new_residual), (want_out, want_residual) = got, want
        assert _rel_err(new_residual, want_residual) < 1e-5
        assert torch.equal(want_residual, x + residual)  # fp32: the sum, exactly
    else:
        out, want_out = got, want
    assert out.shape == (num_tokens, hidden)
    assert _rel_err(out, want_out) < 1e-5


def test_rms_norm_in_place_contract():
    g = _gen(7)
    x, weight = torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    residual = torch.randn(4, 64, generator=g)
    want_out, want_residual = rms_norm_ref(x, weight, 1e-5, residual=residual.clone())
    residual_buffer, out_buffer = residual.clone(), torch.empty(4, 64)
    out, new_residual = rms_norm(x, weight, 1e-5, residual=residual_buffer, out=out_buffer)
    assert out is out_buffer and new_residual is residual_buffer  # persistent buffers
    assert _rel_err(residual_buffer, want_residual) < 1e-5
    assert _rel_err(out_buffer, want_out) < 1e-5
    # out=x: the norm replaces x row by row
    x_copy = x.clone()
    assert rms_norm(x_copy, weight, 1e-5, out=x_copy) is x_copy
    assert _rel_err(x_copy, rms_norm_ref(x, weight, 1e-5)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_hf(dtype):
    g = _gen(3)
    layer = modeling_llama.LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, generator=g))
    layer = layer.to(dtype)
    x = torch.randn(6, 96, generator=g).to(dtype)
    residual = torch.randn(6, 96, generator=g).to(dtype)
    # torch's own bf16 ops on CPU: the ref must reproduce the layer bit for bit
    assert torch.equal(rms_norm_ref(x, layer.weight.data, 1e-5), layer(x))
    out, new_residual = rms_norm_ref(x, layer.weight.data, 1e-5, residual=residual.clone())
    assert torch.equal(new_residual, x + residual)  # HF: hidden = residual + hidden
    assert torch.equal(out, layer(x + residual))


# ------------------------------------------------------------------------------------------- rope


def _kv_problem(seed, num_tokens, num_heads, num_kv_heads, head_dim, num_padding):
    """q, k, v as strided views of one fused qkv projection (as Attention.forward splits it),
    ragged positions incl. 0 and MAX_POS - 1, distinct slots (some -1), a garbage cache."""
    g = _gen(seed)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(widths), generator=g)
    q, k, v = qkv.split(widths, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g)
    positions[0], positions[-1] = 0, MAX_POS - 1
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:num_padding]] = -1
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=g)
    cache.view(-1)[::7] = float("nan")  # unwritten slots hold garbage
    return q, k, v, positions, slots, cache


def _assert_written_only(cache, before, slots, k_want, v_want):
    """Slots of `slots` hold k_want / v_want (v exactly); every other byte is unchanged."""
    flat, flat_before = cache.view(2, -1, *cache.shape[3:]), before.view(2, -1, *cache.shape[3:])
    keep = slots >= 0
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    written[slots[keep]] = True
    assert torch.equal(
        flat[:, ~written].view(torch.int32), flat_before[:, ~written].view(torch.int32)
    )
    assert torch.equal(flat[1, slots[keep]], v_want[keep])
    assert _rel_err(flat[0, slots[keep]], k_want[keep]) < 1e-5


ROPE_CONFIGS = [  # num_tokens, num_heads, num_kv_heads, head_dim, num_padding
    (6, 4, 2, 64, 1),
    (8, 4, 1, 128, 2),
    (3, 2, 2, 64, 0),
    (5, 6, 2, 128, 1),
    (1, 3, 1, 64, 0),
]
# The attention kernels' other head sizes: 80 and 96 rotate 40 and 48 pairs (a half padded to
# 64), 192 rotates 96 (padded to 128); 32 and 256 are powers of two.
ROPE_HEAD_DIM_CONFIGS = [
    (4, 4, 2, 80, 1),
    (3, 2, 1, 96, 0),
    (3, 4, 2, 32, 1),
    (2, 2, 1, 192, 0),
    (2, 2, 2, 256, 1),
]


@pytest.mark.parametrize("config", ROPE_CONFIGS + ROPE_HEAD_DIM_CONFIGS)
def test_rope_and_write_kv_matches_ref(config):
    num_tokens, num_heads, num_kv_heads, head_dim, num_padding = config
    q, k, v, positions, slots, cache = _kv_problem(sum(config), *config)
    cos_sin = rope_cos_sin_cache(MAX_POS, head_dim, THETA)
    k_before, v_before, cache_before = k.clone(), v.clone(), cache.clone()
    want_q = rope_and_write_kv_ref(q.clone(), k, v, positions, cos_sin, cache.clone(), slots)
    # rotated k: the ref run with k in q's place (q's head count is free)
    k_want = rope_and_write_kv_ref(k.clone(), k, v, positions, cos_sin, cache.clone(), slots)

    got_q = rope_and_write_kv(q, k, v, positions.to(torch.int32), cos_sin, cache, slots)
    assert got_q is q  # rotated in place
    assert _rel_err(got_q, want_q) < 1e-5
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # k, v only read
    _assert_written_only(cache, cache_before, slots, k_want, v)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("config", [ROPE_CONFIGS[0], ROPE_HEAD_DIM_CONFIGS[0]])
def test_rope_and_write_kv_with_head_norms_matches_the_norms_then_rope(config, gemma):
    """q/k norms (Qwen3's RMSNorm, Gemma 3's (1 + w)) inside the kernel: what the per-head norm
    kernels followed by the plain kernel give, q in place and k into the cache."""
    num_tokens, num_heads, num_kv_heads, head_dim, num_padding = config
    q, k, v, positions, slots, cache = _kv_problem(7 + sum(config), *config)
    g = torch.Generator().manual_seed(3)
    wq = 1.0 + 0.3 * torch.randn(head_dim, generator=g)
    wk = 1.0 + 0.3 * torch.randn(head_dim, generator=g)
    cos_sin = rope_cos_sin_cache(MAX_POS, head_dim, THETA)
    cache_before = cache.clone()

    def normed(x, w):
        return rms_norm_ref(x.reshape(-1, head_dim), w, 1e-6, gemma=gemma).view(x.shape)

    want_q = rope_and_write_kv_ref(normed(q, wq), k, v, positions, cos_sin, cache.clone(), slots)
    k_want = rope_and_write_kv_ref(normed(k, wk), k, v, positions, cos_sin, cache.clone(), slots)
    ref_q = rope_and_write_kv_ref(
        q.clone(), k, v, positions, cos_sin, cache.clone(), slots,
        q_norm_weight=wq, k_norm_weight=wk, gemma_norm=gemma,
    )  # fmt: skip
    assert torch.equal(ref_q, want_q)  # (the reference composes the two)
    got_q = rope_and_write_kv(
        q, k, v, positions, cos_sin, cache, slots, q_norm_weight=wq, k_norm_weight=wk,
        norm_eps=1e-6, gemma_norm=gemma,
    )  # fmt: skip
    assert got_q is q
    assert _rel_err(got_q, want_q) < 1e-5
    _assert_written_only(cache, cache_before, slots, k_want, v)


def test_rope_and_write_kv_refuses_half_the_norms():
    q, k, v, positions, slots, cache = _kv_problem(5, 4, 4, 2, 64, 0)
    cos_sin = rope_cos_sin_cache(MAX_POS, 64, THETA)
    w = torch.ones(64)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_norm_weight=w)
    with pytest.raises(ValueError, match=r"k_norm_weight must be a \[64\] torch.float32"):
        rope_and_write_kv(
            q, k, v, positions, cos_sin, cache, slots, q_norm_weight=w, k_norm_weight=w[:32]
        )


def test_rope_and_write_kv_into_out_leaves_q():
    q, k, v, positions, slots, cache = _kv_problem(11, 4, 4, 2, 64, 0)
    cos_sin = rope_cos_sin_cache(MAX_POS, 64, THETA)
    q_before, out = q.clone(), torch.empty(4, 4, 64)
    want = rope_and_write_kv_ref(q.clone(), k, v, positions, cos_sin, cache.clone(), slots)
    assert rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, out=out) is out
    assert torch.equal(q, q_before)
    assert _rel_err(out, want) < 1e-5


@pytest.mark.parametrize("config", ROPE_CONFIGS[:3] + ROPE_HEAD_DIM_CONFIGS[:1])
def test_write_kv_matches_ref(config):
    _, _, num_kv_heads, head_dim, _ = config
    _, k, v, _, slots, cache = _kv_problem(sum(config) + 1, *config)
    want, before = cache.clone(), cache.clone()
    write_kv_ref(k, v, want, slots)
    write_kv(k, v, cache, slots)
    _assert_written_only(cache, before, slots, k, v)
    assert torch.equal(cache.isnan(), want.isnan())
    assert torch.equal(cache.nan_to_num(), want.nan_to_num())  # k copied exactly too


def _hf_cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] as Hugging Face's Llama computes them (fp32)."""
    config = transformers.LlamaConfig(
        head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1, rope_theta=THETA
    )
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), head_dim)
    cos, sin = rotary(x, positions[None, :])
    return cos[0], sin[0]


def test_rope_cos_sin_cache_matches_hf():
    positions = torch.tensor([0, 1, 17, 1000, MAX_POS - 1])
    for head_dim in (32, 64, 80, 96, 128, 192, 256):
        table = rope_cos_sin_cache(MAX_POS, head_dim, THETA)
        cos, sin = _hf_cos_sin(positions, head_dim)
        half = head_dim // 2
        assert table.shape == (MAX_POS, head_dim) and table.dtype == torch.float32
        # same fp32 angles; cos/sin of one value may differ by an ulp between vector lanes
        torch.testing.assert_close(table[positions, :half], cos[:, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(table[positions, half:], sin[:, half:], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "config", [(6, 4, 2, 64, 0), (5, 6, 2, 128, 0), (4, 2, 1, 80, 0), (3, 2, 2, 256, 0)]
)
def test_rope_ref_matches_hf(config):
    """What Hugging Face computes: apply_rotary_pos_emb on q and k; then the cache holds the
    rotated k and the raw v at each token's slot."""
    num_tokens, num_heads, num_kv_heads, head_dim, _ = config
    q, k, v, positions, slots, cache = _kv_problem(sum(config) + 2, *config)
    cos, sin = _hf_cos_sin(positions, head_dim)
    # HF's layout: [batch, heads, tokens, head_dim]
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    want_q, want_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)
    want_cache = cache.clone()
    flat = want_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0, slots], flat[1, slots] = want_k, v

    cos_sin = rope_cos_sin_cache(MAX_POS, head_dim, THETA)
    got_q = rope_and_write_kv_ref(q.clone(), k, v, positions, cos_sin, cache, slots)
    assert _rel_err(got_q, want_q) < 1e-5
    assert _rel_err(cache.nan_to_num(), want_cache.nan_to_num()) < 1e-5
    assert torch.equal(cache.isnan(), want_cache.isnan())


@pytest.mark.parametrize("gemma", [False, True])
def test_sandwich_norms_in_one_launch_equal_two(gemma):
    """Gemma 3's post-norm, add and pre-norm (`pre_weight`), and its post-norm and add
    (`add_rms_norm_`), each one launch: the launches they replace, bitwise (fp32, the
    interpreter), and the references likewise."""
    g = _gen(31 + gemma)
    x, r = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w1, w2 = 1.0 + 0.3 * torch.randn(40, generator=g), 1.0 + 0.3 * torch.randn(40, generator=g)
    want_r = r.clone()
    want, _ = rms_norm(rms_norm(x, w1, 1e-6, gemma=gemma), w2, 1e-6, residual=want_r, gemma=gemma)
    got_r = r.clone()
    got, back = rms_norm(x, w2, 1e-6, residual=got_r, gemma=gemma, pre_weight=w1)
    assert back is got_r and torch.equal(got_r, want_r) and torch.equal(got, want)
    ref_r = r.clone()
    ref, _ = rms_norm_ref(x, w2, 1e-6, residual=ref_r, gemma=gemma, pre_weight=w1)
    assert _rel_err(ref, want) < 1e-6 and _rel_err(ref_r, want_r) < 1e-6

    want_r = r + rms_norm(x, w1, 1e-6, gemma=gemma)
    got_r = r.clone()
    assert add_rms_norm_(x, w1, 1e-6, got_r, gemma=gemma) is got_r
    assert torch.equal(got_r, want_r)
    ref_r = r.clone()
    assert add_rms_norm_ref(x, w1, 1e-6, ref_r, gemma=gemma) is ref_r
    assert _rel_err(ref_r, want_r) < 1e-6
    with pytest.raises(ValueError, match="pre_weight needs residual"):
        rms_norm(x, w2, 1e-6, pre_weight=w1)


# ------------------------------------------------------------------------------------ activation


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 16), (3, 37), (8, 128), (2, 1)])
def test_silu_and_mul_matches_ref(num_tokens, intermediate):
    g = _gen(num_tokens * 100 + intermediate)
    x = 3 * torch.randn(num_tokens, 2 * intermediate + 5, generator=g)[:, : 2 * intermediate]
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate)
    assert _rel_err(out, silu_and_mul_ref(x)) < 1e-5
    buffer = torch.empty(num_tokens, intermediate)
    assert silu_and_mul(x, out=buffer) is buffer
    assert _rel_err(buffer, silu_and_mul_ref(x)) < 1e-5


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 16), (3, 37), (2, 1500)])
def test_gelu_tanh_and_mul_matches_ref(num_tokens, intermediate):
    g = _gen(num_tokens * 100 + intermediate + 7)
    x = 4 * torch.randn(num_tokens, 2 * intermediate, generator=g)  # tails of tanh both ways
    assert _rel_err(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x)) < 1e-5


def test_gelu_tanh_and_mul_ref_matches_hf_gemma_mlp():
    from transformers.activations import ACT2FN

    x = torch.randn(6, 2 * 40, generator=_gen(10)).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up  # HF's Gemma3MLP, in bf16
    assert torch.equal(gelu_tanh_and_mul_ref(x), want)


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_ref_and_hf(with_residual):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = _gen(31)
    x = torch.randn(5, 96, generator=g)
    weight = 0.1 * torch.randn(96, generator=g)
    residual = torch.randn(5, 96, generator=g) if with_residual else None
    got = rms_norm(x, weight, 1e-6, residual=None if residual is None else residual.clone(),
                   gemma=True)  # fmt: skip
    want = rms_norm_ref(x, weight, 1e-6, residual=None if residual is None else residual.clone(),
                        gemma=True)  # fmt: skip
    got, want = (got[0], want[0]) if with_residual else (got, want)
    assert _rel_err(got, want) < 1e-5
    hf = Gemma3RMSNorm(96, eps=1e-6)
    hf.weight.data.copy_(weight)
    source = x if residual is None else x + residual
    with torch.no_grad():
        assert _rel_err(want, hf(source)) < 1e-6
        x16 = x.bfloat16()  # the ref rounds as HF in bf16 too
        assert torch.equal(rms_norm_ref(x16, weight.bfloat16(), 1e-6, gemma=True),
                           hf.bfloat16()(x16))  # fmt: skip


def test_silu_and_mul_tiles_a_wide_row():
    x = torch.randn(2, 2 * 1500, generator=_gen(5))  # intermediate > MAX_BLOCK: two tiles
    assert _rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < 1e-5


def test_silu_and_mul_ref_matches_hf_activation():
    g = _gen(9)
    mlp = SwiGLUMLP(32, 48)
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        want = mlp.down_proj(torch.nn.functional.silu(gate) * up)  # HF's LlamaMLP
        got = mlp(x)  # what the model runs (the ref on CPU)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_empty_batches_launch_nothing():
    x, w, cache = torch.empty(0, 32), torch.ones(32), torch.zeros(2, 1, BLOCK_SIZE, 1, 64)
    assert rms_norm(x, w, 1e-6).shape == (0, 32)
    assert silu_and_mul(x).shape == (0, 16)
    q, kv, idx = torch.empty(0, 2, 64), torch.empty(0, 1, 64), torch.empty(0, dtype=torch.int64)
    table = rope_cos_sin_cache(8, 64, THETA)
    assert rope_and_write_kv(q, kv, kv, idx, table, cache, idx).shape == (0, 2, 64)
    write_kv(kv, kv, cache, idx)
    assert not cache.any()


# ------------------------------------------------------------------------- fp16 rounding order


def test_kernels_round_like_refs_in_fp16():
    """Where each rounding happens (the sum stored before it is normalized, the norm cast before
    the weight multiply, one rounding after fp32 RoPE and SiLU) is invisible in fp32. The
    interpreter computes fp16 as IEEE half (bf16 it does not), so fp16 checks it bit for bit."""
    g = _gen(21)
    x = torch.randn(8, 128, generator=g).half()
    residual = (100 * torch.randn(8, 128, generator=g)).half()  # the sum's rounding shows
    weight = torch.randn(128, generator=g).half()
    got = rms_norm(x, weight, 1e-6, residual=residual.clone())
    want = rms_norm_ref(x, weight, 1e-6, residual=residual.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))

    q, k, v, positions, slots, cache = (
        t.half() if t.is_floating_point() else t for t in _kv_problem(22, 8, 4, 2, 128, 1)
    )
    table = rope_cos_sin_cache(MAX_POS, 128, THETA)
    want_cache = cache.clone()
    want_q = rope_and_write_kv_ref(q.clone(), k, v, positions, table, want_cache, slots)
    assert torch.equal(rope_and_write_kv(q, k, v, positions, table, cache, slots), want_q)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))


# ------------------------------------------------------------------------------------- refusals


def _refusals():
    x, w, r = torch.randn(4, 32), torch.randn(32), torch.randn(4, 32)
    q, k, v = torch.randn(4, 4, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    pos, slots = torch.arange(4), torch.arange(4)
    table = rope_cos_sin_cache(64, 64, THETA)
    cache = torch.zeros(2, 2, BLOCK_SIZE, 2, 64)

    def rope(**kw):
        args = dict(q=q, k=k, v=v, positions=pos, cos_sin_cache=table)
        args.update(kv_cache=cache, slot_mapping=slots)
        args.update(kw)
        return lambda: rope_and_write_kv(**args)

    return [
        (lambda: rms_norm(x[None], w, 1e-6), "x must be \\[tokens, hidden\\]"),
        (lambda: rms_norm(x.long(), w, 1e-6), "fp16, bf16 or fp32"),
        (lambda: rms_norm(x, w[:16], 1e-6), "weight must be a contiguous \\[32\\]"),
        (lambda: rms_norm(x, w.double(), 1e-6), "weight must be"),
        (lambda: rms_norm(x.t().contiguous().t(), w, 1e-6), "x must have unit stride"),
        (lambda: rms_norm(x, w, 1e-6, residual=x[:2]), "residual must match x"),
        (lambda: rms_norm(x, w, 1e-6, out=x.half()), "out must match x"),
        (lambda: rms_norm(x, w, 1e-6, residual=r, out=r), "must not be residual"),
        (rope(q=q[0]), "q must be \\[tokens, heads, head_dim\\]"),
        (
            rope(q=q[..., :63], k=k[..., :63], v=v[..., :63], kv_cache=cache[..., :63].clone()),
            "even",
        ),
        (rope(v=v[:, :1]), "v must have shape"),
        (rope(q=q.double()), "q must be one of"),
        (rope(q=q.transpose(0, 2).contiguous().transpose(0, 2)), "q must have unit stride"),
        (rope(cos_sin_cache=table[:, :32]), "cos_sin_cache must be \\[max_pos, 64\\]"),
        (rope(cos_sin_cache=table.double()), "cos_sin_cache must be one of"),
        (rope(kv_cache=cache[:, :, :8]), "kv_cache must be contiguous"),
        (rope(kv_cache=cache[0]), "kv_cache must be one layer's"),
        (rope(slot_mapping=slots.int()), "slot_mapping must be one of"),
        (rope(positions=pos.float()), "positions must be one of"),
        (rope(positions=pos[:3]), "positions must have shape"),
        (rope(out=torch.empty(4, 4, 32)), "out must have shape"),
        (lambda: write_kv(k, v.half(), cache, slots), "v must be one of"),
        (lambda: write_kv(k, v, cache.half()[..., :32], slots), "kv_cache must be"),
        (lambda: silu_and_mul(torch.randn(4, 7)), "2 \\* intermediate"),
        (lambda: silu_and_mul(torch.randn(8)), "2 \\* intermediate"),
        (lambda: silu_and_mul(torch.randn(8, 4).t()), "unit stride"),
        (lambda: silu_and_mul(x, out=torch.empty(4, 32)), "out must be \\(4, 16\\)"),
    ]


@pytest.mark.parametrize("call, message", _refusals())
def test_launchers_refuse_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------------ GPU


def _bench(fn, num_bytes: int, label: str) -> None:
    """Print (not assert) do_bench time against the bytes-moved floor at 3e12 B/s."""
    from triton.testing import do_bench

    us = do_bench(fn) * 1e3
    floor_us = num_bytes / 3e12 * 1e6
    print(f"{label}: {us:8.1f} us, floor {floor_us:7.1f} us ({floor_us / us:4.0%} of it)")


def _graph_replays(fn) -> None:
    """`fn` warmed up, captured in a CUDA graph and replayed: it must not sync the host."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()


def _as_close(one: torch.Tensor, two: torch.Tensor, ref: torch.Tensor) -> None:
    """`one` (a fused launch) is as close to the fp32 `ref` as `two` (the launches it replaces)
    is, and they differ by rounding only (a few elements, a few ulps)."""
    err_one, err_two = _rel_err(one, ref), _rel_err(two, ref)
    assert err_one < 1.5 * err_two + 1e-6, (err_one, err_two)
    assert _rel_err(one, two) < 4 * torch.finfo(two.dtype).eps, _rel_err(one, two)


def _gpu_rms_norm(dtype, num_tokens, hidden, g):
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g)
    r = torch.randn(num_tokens, hidden, device="cuda", generator=g)
    w = torch.randn(hidden, device="cuda", generator=g)
    xd, wd, rd = x.to(dtype), w.to(dtype), r.to(dtype)
    out, new_r = rms_norm(xd, wd, 1e-6, residual=rd)
    want_out, want_r = rms_norm_ref(x, w, 1e-6, residual=r.clone())
    assert _rel_err(new_r, want_r) < 1e-2 and _rel_err(out, want_out) < 1e-2
    buf = torch.empty_like(xd)
    _graph_replays(lambda: rms_norm(xd, wd, 1e-6, out=buf))
    assert _rel_err(buf, rms_norm_ref(x, w, 1e-6)) < 1e-2
    for gemma in (False, True):  # the sandwich norms in one launch against the two launches:
        # bitwise in the interpreter (test_sandwich_norms_*); compiled, the kernels reduce their
        # rows in other orders, so a few elements round to a neighbouring value
        pre = (1.0 + 0.3 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
        two_r, one_r, ref_r = rd.clone(), rd.clone(), rd.float()
        two, _ = rms_norm(rms_norm(xd, pre, 1e-6, gemma=gemma), wd, 1e-6, residual=two_r,
                          gemma=gemma)  # fmt: skip
        one, _ = rms_norm(xd, wd, 1e-6, residual=one_r, gemma=gemma, pre_weight=pre)
        ref, _ = rms_norm_ref(xd.float(), wd.float(), 1e-6, residual=ref_r, gemma=gemma,
                              pre_weight=pre.float())  # fmt: skip
        _as_close(one, two, ref)
        _as_close(one_r, two_r, ref_r)
        two_r = rd + rms_norm(xd, pre, 1e-6, gemma=gemma)
        ref_r = rd.float() + rms_norm_ref(xd.float(), pre.float(), 1e-6, gemma=gemma)
        _as_close(add_rms_norm_(xd, pre, 1e-6, rd.clone(), gemma=gemma), two_r, ref_r)
    _bench(
        lambda: rms_norm(xd, wd, 1e-6, residual=rd, out=buf),
        (4 * num_tokens + 1) * hidden * dtype.itemsize,
        f"rms_norm+residual {dtype} T={num_tokens} N={hidden}",
    )


def _gpu_rope(dtype, num_tokens, g, heads=32, kv_heads=8, head_dim=128, max_pos=8192):
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(widths), device="cuda", generator=g)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(widths, dim=-1))
    qd, kd, vd = (t.unflatten(-1, (-1, head_dim)) for t in qkv.to(dtype).split(widths, dim=-1))
    num_blocks = num_tokens // BLOCK_SIZE + 8
    positions = torch.randint(0, max_pos, (num_tokens,), device="cuda", generator=g)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=g)[:num_tokens]
    slots[::5] = -1
    table = rope_cos_sin_cache(max_pos, head_dim, 500000.0, "cuda")
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda")
    cache_d, q_out = cache.to(dtype), torch.empty_like(qd)
    want_q = rope_and_write_kv_ref(q.clone(), k, v, positions, table, cache, slots)

    def call():
        return rope_and_write_kv(qd, kd, vd, positions, table, cache_d, slots, out=q_out)

    _graph_replays(call)
    assert _rel_err(q_out, want_q) < 1e-2 and _rel_err(cache_d, cache) < 1e-2
    for gemma in (False, True):  # q/k norms inside (Qwen3, Gemma 3) against the fp32 refs
        wq, wk = (1.0 + 0.3 * torch.randn(head_dim, device="cuda", generator=g) for _ in "qk")
        norms = dict(q_norm_weight=wq, k_norm_weight=wk, gemma_norm=gemma)
        want_q = rope_and_write_kv_ref(q.clone(), k, v, positions, table, cache, slots, **norms)
        got = rope_and_write_kv(
            qd, kd, vd, positions, table, cache_d, slots, out=q_out,
            **(norms | dict(q_norm_weight=wq.to(dtype), k_norm_weight=wk.to(dtype))),
        )  # fmt: skip
        assert _rel_err(got, want_q) < 2e-2 and _rel_err(cache_d, cache) < 2e-2
    size, label = dtype.itemsize, f"{dtype} T={num_tokens} KVH={kv_heads} D={head_dim}"
    q_bytes = num_tokens * heads * head_dim * size * 2  # read and write
    kv_bytes = num_tokens * kv_heads * head_dim * size * 4  # k and v, read and write
    _bench(
        call, q_bytes + kv_bytes + num_tokens * head_dim * 4, f"rope_and_write_kv H={heads} {label}"
    )
    _bench(lambda: write_kv(kd, vd, cache_d, slots), kv_bytes, f"write_kv {label}")


def _gpu_silu_and_mul(dtype, num_tokens, intermediate, g):
    x = torch.randn(num_tokens, 2 * intermediate, device="cuda", generator=g)
    xd, buf = x.to(dtype), torch.empty(num_tokens, intermediate, device="cuda", dtype=dtype)
    assert _rel_err(silu_and_mul(xd), silu_and_mul_ref(x)) < 1e-2
    _graph_replays(lambda: silu_and_mul(xd, out=buf))
    assert _rel_err(buf, silu_and_mul_ref(x)) < 1e-2
    _bench(
        lambda: silu_and_mul(xd, out=buf),
        3 * num_tokens * intermediate * dtype.itemsize,
        f"silu_and_mul {dtype} T={num_tokens} I={intermediate}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_against_fp32_refs(dtype):
    """Realistic shapes on CUDA against the fp32 refs; each launch also replayed from a CUDA
    graph; timings printed (run with -s to see them)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for num_tokens in (1, 128, 4096):
        for hidden in (2048, 4096):
            _gpu_rms_norm(dtype, num_tokens, hidden, g)
        _gpu_rope(dtype, num_tokens, g)
        for intermediate in (5632, 14336):
            _gpu_silu_and_mul(dtype, num_tokens, intermediate, g)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 80, 96, 192, 256])
def test_gpu_rope_every_attention_head_dim(head_dim):
    """rope_and_write_kv and write_kv at the attention kernels' other head sizes (padded halves
    included), bf16, against the fp32 refs and replayed from a CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    for num_tokens in (1, 300):
        _gpu_rope(torch.bfloat16, num_tokens, g, heads=8, kv_heads=4, head_dim=head_dim)
