"""kernels.gated_rmsnorm (issue 10: the Mamba2 mixer's gated group norm): the Triton kernel
against its `_ref` (CPU interpreter, fp32, tiny shapes), the ref against Hugging Face
NemotronH's NemotronHRMSNormGated, the launcher's refusals, and a GPU test (bf16, fp16 and
fp32 at NemotronH shapes)."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.gated_rmsnorm import gated_rms_norm, gated_rms_norm_ref

nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("num_tokens, hidden, group", [(1, 16, 16), (3, 64, 16), (2, 48, 24)])
def test_gated_rms_norm_matches_ref_and_hf(num_tokens, hidden, group):
    g = torch.Generator().manual_seed(num_tokens * 100 + hidden + group)
    # x a strided view, as a slice of the in_proj output
    x = torch.randn(num_tokens, hidden + 5, generator=g)[:, :hidden]
    gate = torch.randn(num_tokens, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    x_before = x.clone()
    got = gated_rms_norm(x, gate, weight, 1e-5, group)
    want = gated_rms_norm_ref(x, gate, weight, 1e-5, group)
    assert torch.equal(x, x_before)
    assert _rel_err(got, want) < 1e-5
    hf = nemotron_h.NemotronHRMSNormGated(hidden, group, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert _rel_err(want, hf(x, gate)) < 1e-6


def test_gated_rms_norm_in_place_and_empty():
    g = torch.Generator().manual_seed(3)
    x, gate = torch.randn(2, 32, generator=g), torch.randn(2, 32, generator=g)
    weight = torch.randn(32, generator=g)
    want = gated_rms_norm_ref(x, gate, weight, 1e-6, 8)
    out = gated_rms_norm(x, gate, weight, 1e-6, 8, out=x)
    assert out is x and _rel_err(x, want) < 1e-5
    empty = torch.zeros(0, 32)
    assert gated_rms_norm(empty, empty, weight, 1e-6, 8).shape == (0, 32)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, gt, w: (x, gt, w, 5), "divide the hidden size"),
        (lambda x, gt, w: (x, gt, w, 0), "group_size"),
        (lambda x, gt, w: (x[0], gt, w, 8), r"\[tokens, hidden\]"),
        (lambda x, gt, w: (x, gt[:, :16], w, 8), "gate must match x"),
        (lambda x, gt, w: (x, gt, w[:16], 8), "weight must be"),
        (lambda x, gt, w: (x, gt.double(), w, 8), "gate must match x"),
        (lambda x, gt, w: (x.t().contiguous().t(), gt, w, 8), "unit stride"),
    ],
)
def test_gated_rms_norm_refuses_bad_arguments(make, match):
    x, gate, weight, group = make(torch.randn(4, 32), torch.randn(4, 32), torch.randn(32))
    with pytest.raises(ValueError, match=match):
        gated_rms_norm(x, gate, weight, 1e-6, group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_gated_rms_norm_against_the_fp32_ref(dtype):
    """NemotronH shapes (d_inner 4096-10240, groups of 512-2048 channels) on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for num_tokens in (1, 128, 4096):
        for hidden, group in ((4096, 512), (10240, 1280), (8192, 2048)):
            x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(dtype)
            gate = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
            got = gated_rms_norm(x, gate, weight, 1e-5, group)
            want = gated_rms_norm_ref(x.float(), gate.float(), weight.float(), 1e-5, group)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert _rel_err(got, want) < tol, (dtype, num_tokens, hidden, group)
