"""kernels.gemv: the fused few-row matrix-vector kernel against `gemv_ref` (CPU interpreter, fp32,
tiny shapes), `gemv_ref` against the unfused kernels' references it replaces, the launcher's
refusals, and a GPU test in bf16 at the 1B shape's sizes against the unfused path."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.activation import silu_and_mul_ref
from taipan.kernels.gemv import MAX_ROWS, gemv, gemv_ref
from taipan.kernels.rmsnorm import rms_norm_ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _operands(m, n, k, seed, device="cpu", dtype=torch.float32, gated=False):
    g = _gen(seed)
    rows = 2 * n if gated else n
    x = torch.randn(m, k + 5, generator=g)[:, :k]  # a strided view, as a slice of a buffer
    w = torch.randn(rows, k, generator=g) / k**0.5
    vecs = torch.randn(n, generator=g), torch.randn(k, generator=g), torch.randn(m, n, generator=g)
    put = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return put(x), put(w), *(put(v) for v in vecs)


# (m, n, k): n and k off the blocks' multiples, one k over several BLOCK_K iterations
SHAPES = [(1, 20, 48), (3, 16, 33), (4, 9, 700), (2, 1, 16)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize(
    "fused",
    [
        {},
        {"bias": True},
        {"norm": True},
        {"norm": True, "gated": True},
        {"residual": True},
        {"norm": True, "bias": True, "residual": True},
        {"norm": True, "gemma_norm": True, "gated": True, "activation": "gelu_tanh"},
    ],
    ids=["plain", "bias", "norm", "norm-gated", "residual", "norm-bias-residual", "gemma"],
)
def test_gemv_matches_ref(m, n, k, fused):
    gated = fused.get("gated", False)
    x, w, bias, norm_w, residual = _operands(m, n, k, seed=m * 1000 + n + k, gated=gated)
    kwargs = dict(
        bias=bias if fused.get("bias") else None,
        norm_weight=norm_w if fused.get("norm") else None,
        eps=1e-5,
        gated=gated,
        gemma_norm=fused.get("gemma_norm", False),
        activation=fused.get("activation", "silu"),
    )
    x_before = x.clone()
    if fused.get("residual"):
        stream, stream_ref = residual.clone(), residual.clone()
        got = gemv(x, w, residual=stream, **kwargs)
        want = gemv_ref(x, w, residual=stream_ref, **kwargs)
        assert got.data_ptr() == stream.data_ptr()  # updated in place and returned
    else:
        got, want = gemv(x, w, **kwargs), gemv_ref(x, w, **kwargs)
    assert torch.equal(x, x_before)  # x is only read
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ref_equals_the_unfused_references():
    """gemv_ref is the norm, the product, the activation and the add it replaces, in order."""
    x, w, _, norm_w, residual = _operands(3, 24, 40, seed=7, gated=True)
    normed = rms_norm_ref(x, norm_w, 1e-5)
    want = silu_and_mul_ref(normed @ w.T)
    got = gemv_ref(x, w, norm_weight=norm_w, eps=1e-5, gated=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    stream = residual.clone()
    gemv_ref(got, w[:24, :24], residual=stream)
    torch.testing.assert_close(stream, residual + got @ w[:24, :24].T, rtol=1e-6, atol=1e-6)


def test_gemma_ref_equals_the_unfused_references():
    """Gemma's (1 + w) norm and GELU-tanh gate, as kernels/rmsnorm and kernels/activation."""
    from taipan.kernels.activation import gelu_tanh_and_mul_ref

    x, w, _, norm_w, _ = _operands(2, 24, 40, seed=9, gated=True)
    want = gelu_tanh_and_mul_ref(rms_norm_ref(x, norm_w, 1e-6, gemma=True) @ w.T)
    got = gemv_ref(x, w, norm_weight=norm_w, gemma_norm=True, gated=True, activation="gelu_tanh")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_out_is_written_and_zero_rows_pass():
    x, w, *_ = _operands(2, 16, 32, seed=3)
    out = torch.full((2, 16), float("nan"))
    assert gemv(x, w, out=out) is out
    torch.testing.assert_close(out, gemv_ref(x, w), rtol=1e-5, atol=1e-5)
    assert gemv(x[:0], w).shape == (0, 16)


def _refusals():
    x, w, bias, norm_w, residual = _operands(2, 8, 16, seed=1)
    wide = torch.zeros(MAX_ROWS + 1, 16)
    yield lambda: gemv(wide, w), f"at most {MAX_ROWS} rows"
    yield lambda: gemv(x, w[:, :8]), r"w must be \[N, 16\]"
    yield lambda: gemv(x, w[:7], gated=True), r"w must be \[2N, 16\]"
    yield lambda: gemv(x, w, bias=bias[:4], gated=True), "gated gemv takes no bias"
    yield lambda: gemv(x, w, bias=bias[:3]), r"bias must be \(8,\)"
    yield lambda: gemv(x, w, norm_weight=norm_w[:3]), r"norm_weight must be \(16,\)"
    yield lambda: gemv(x, w, residual=residual, out=residual), "not both"
    yield lambda: gemv(x, w.double()), "w must be torch.float32"
    yield lambda: gemv(x.int(), w), "fp16, bf16 or fp32"
    yield lambda: gemv(x, w, gated=True, activation="relu"), "activation must be one of"
    yield lambda: gemv(x, w.T.contiguous().T), "unit stride"


@pytest.mark.parametrize("call, message", list(_refusals()))
def test_gemv_refuses_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_gemv_bf16_near_the_unfused_kernels(m):
    """bf16 at the 1B shape's sizes: within bf16 rounding of the unfused path (cuBLAS and the
    norm/activation kernels), whose sums run in another order."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from taipan.kernels.activation import silu_and_mul
    from taipan.kernels.rmsnorm import rms_norm

    dt = torch.bfloat16
    for n, k, gated in [(3072, 2048, False), (8192, 2048, True), (2048, 8192, False)]:
        x, w, _, norm_w, residual = _operands(
            m, n, k, seed=n + k, device="cuda", dtype=dt, gated=gated
        )
        if gated:
            got = gemv(x, w, norm_weight=norm_w, eps=1e-5, gated=True)
            want = silu_and_mul(rms_norm(x.contiguous(), norm_w, 1e-5) @ w.T)
        else:
            stream = residual.clone()
            got = gemv(x, w, residual=stream)
            want = (residual.float() + (x @ w.T).float()).to(dt)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_matches_ref(m, with_bias):
    """The q/k/v product with RoPE and the cache write in its epilogue, against gemv_ref then
    rope_and_write_kv_ref: q equal, the cache equal everywhere (padding rows store nothing)."""
    from taipan.kernels.gemv import gemv_qkv_rope, gemv_qkv_rope_ref
    from taipan.kernels.rope import rope_cos_sin_cache

    heads, kv_heads, head_dim, k = 4, 2, 16, 40
    rows = (heads + 2 * kv_heads) * head_dim
    x, w, _, norm_w, _ = _operands(m, rows, k, seed=11 + m)
    bias = torch.randn(rows, generator=_gen(5)) if with_bias else None
    cos_sin = rope_cos_sin_cache(64, head_dim, 10000.0)
    positions = torch.tensor([5, 17, 63][:m])
    slots = torch.tensor([3, -1, 9][:m], dtype=torch.int64)  # row 1 is padding
    cache = torch.randn(2, 2, 8, kv_heads, head_dim, generator=_gen(6))
    cache_ref = cache.clone()
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, positions=positions,
                  cos_sin_cache=cos_sin, slot_mapping=slots, bias=bias, norm_weight=norm_w,
                  eps=1e-5)  # fmt: skip
    got = gemv_qkv_rope(x, w, kv_cache=cache, **kwargs)
    want = gemv_qkv_rope_ref(x, w, kv_cache=cache_ref, **kwargs)
    assert got.shape == (m, heads, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, cache_ref, rtol=1e-5, atol=1e-5)


def test_qkv_rope_refuses_bad_arguments():
    from taipan.kernels.gemv import gemv_qkv_rope
    from taipan.kernels.rope import rope_cos_sin_cache

    x, w, *_ = _operands(1, 128, 32, seed=2)
    cache = torch.zeros(2, 2, 8, 2, 16)
    kwargs = dict(positions=torch.tensor([1]), cos_sin_cache=rope_cos_sin_cache(8, 16, 1e4),
                  kv_cache=cache, slot_mapping=torch.tensor([0]))  # fmt: skip
    with pytest.raises(ValueError, match="must hold 4 q and 2 kv heads"):
        gemv_qkv_rope(x, w[:96], num_heads=4, num_kv_heads=2, **kwargs)
    with pytest.raises(ValueError, match="positions and slot_mapping must be"):
        gemv_qkv_rope(x, w, num_heads=4, num_kv_heads=2, **(kwargs | {"positions": torch.zeros(2)}))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        bad = kwargs | {"slot_mapping": torch.tensor([0], dtype=torch.int32)}
        gemv_qkv_rope(x, w, num_heads=4, num_kv_heads=2, **bad)
