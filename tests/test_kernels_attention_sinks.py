"""Attention sinks (gpt-oss's learned per-head sink logits, issue 27 item 3): the reference
(kernels/attention_ref.py) against a dense float64 softmax with the sink as one more column,
the prefill and decode kernels and ops/attention.py's CPU path against the reference, with and
without a sliding window, and bad sinks refused. On CPU the kernels run in the Triton
interpreter in fp32; the `gpu` test runs them in bf16 and fp32 with the launcher's own tiles.

The dense float64 attention is tests/test_kernels_attention_ref.py's `dense`. The caches are NaN
wherever no sequence wrote (tests/test_kernels_prefill_attention.py's and
tests/test_kernels_decode_attention.py's cases), so a sink that made a kernel read a wrong
slot would show as NaN."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.attention_ref import paged_attention_ref
from taipan.kernels.decode_attention import paged_decode_attention
from taipan.kernels.prefill_attention import paged_prefill_attention
from taipan.ops.attention import AttentionMetadata, paged_attention
from tests.test_kernels_attention_ref import dense
from tests.test_kernels_decode_attention import make_case as decode_case
from tests.test_kernels_prefill_attention import make_case as prefill_case
from tests.test_kernels_prefill_attention import rel_err

# Sink logits around the scores' size (q ~ N(0, 4), scale 1/sqrt(D)): the sink's share of
# each softmax is neither ~0 nor ~1, so a kernel that dropped or doubled it would show.
SINKS = [1.5, -0.5, 3.0, 0.0, 2.0, -2.0]


def sinks_for(heads: int, device="cpu") -> torch.Tensor:
    return torch.tensor((SINKS * heads)[:heads], dtype=torch.float32, device=device)


@pytest.mark.parametrize("window", [None, 9])
def test_ref_matches_dense_float64_with_sinks(window):
    case = prefill_case([(0, 7), (21, 12)], 6, 2, 32, device="cpu", window=window)
    sinks = sinks_for(6)
    out = paged_attention_ref(*case.args(), case.scale, sliding_window=window, sinks=sinks)
    starts = case.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[starts[b] : starts[b + 1]]
        want = dense(q, k, v, case.scale, window, sinks)
        assert torch.allclose(out[starts[b] : starts[b + 1]].double(), want, atol=1e-5)
    # Sinks take mass: the output differs from the sinkless one; a sink of -inf gives it back.
    plain = paged_attention_ref(*case.args(), case.scale, sliding_window=window)
    assert rel_err(out, plain) > 0.05
    gone = torch.full((6,), float("-inf"))
    same = paged_attention_ref(*case.args(), case.scale, sliding_window=window, sinks=gone)
    assert torch.equal(same, plain)


@pytest.mark.parametrize("window", [None, 11])
def test_prefill_kernel_matches_ref_with_sinks(window):
    # Rows of several tiles, a decode row, a GQA group of 3 padded to 4 (masked head rows).
    case = prefill_case([(0, 37), (16, 1), (14, 20)], 6, 2, 64, device="cpu", window=window)
    sinks = sinks_for(6)
    out = case.run(sinks=sinks)
    ref = paged_attention_ref(*case.args(), case.scale, sliding_window=window, sinks=sinks)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 13])
def test_decode_kernel_matches_ref_with_sinks(num_splits, window):
    # An idle row (seq_len 0) among them: zeros, with or without its sinks.
    case = decode_case(3, [40, 0, 17], 4, 2, 64, window=window)
    sinks = sinks_for(4)
    out = case.run(num_splits=num_splits, sinks=sinks)
    starts = torch.arange(4, dtype=torch.int32)
    ref = paged_attention_ref(
        case.q, case.kv_cache, case.block_tables, starts, case.seq_lens, case.scale,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    assert torch.isfinite(out).all() and not out[1].any()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, case.run(num_splits=num_splits)) > 0.05  # (the sinks did something)


@pytest.mark.parametrize("window", [None, 10])
def test_cpu_path_matches_ref_with_sinks(window):
    """ops/attention.py's SDPA path: the sink as a zero key whose additive mask is the logit."""
    case = prefill_case([(5, 9), (0, 1), (30, 4)], 4, 2, 32, device="cpu", window=window)
    starts, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    meta = AttentionMetadata(
        query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        block_tables=case.block_tables, slot_mapping=torch.zeros(0, dtype=torch.int64),
    ).with_layout(starts, lens, case.kv_cache.shape[2])  # fmt: skip
    sinks = sinks_for(4)
    out = paged_attention(case.q, case.kv_cache[:, :], meta, case.scale, window, sinks=sinks)
    ref = paged_attention_ref(*case.args(), case.scale, sliding_window=window, sinks=sinks)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "sinks, match",
    [
        (torch.zeros(5), r"fp32 \[6\]"),
        (torch.zeros(6, dtype=torch.float64), "fp32"),
        (torch.zeros(6, 1), r"\[6\]"),
    ],
)
def test_bad_sinks_are_refused(sinks, match):
    case = prefill_case([(0, 3)], 6, 2, 32, device="cpu")
    with pytest.raises(ValueError, match=match):
        paged_attention_ref(*case.args(), case.scale, sinks=sinks)
    with pytest.raises(ValueError, match=match):
        case.run(sinks=sinks)
    dec = decode_case(0, [5], 6, 2, 32)
    with pytest.raises(ValueError, match=match):
        dec.run(sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, window", [(64, None), (128, 300), (256, None), (80, 33)])
def test_gpu_kernels_with_sinks(dtype, head_dim, window):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    seqs = [(0, 130), (700, 1), (64, 33)]
    case = prefill_case(seqs, 8, 2, head_dim, device="cuda", dtype=dtype, window=window)
    sinks = sinks_for(8, "cuda")
    out = paged_prefill_attention(
        *case.args(), case.scale, max_query_len=case.max_query_len, sliding_window=window,
        sinks=sinks,
    )  # fmt: skip
    ref = paged_attention_ref(*case.args(), case.scale, sliding_window=window, sinks=sinks)
    assert torch.isfinite(out).all() and rel_err(out, ref) < tol
    dec = decode_case(1, [900, 0, 45, 300], 8, 2, head_dim, dtype=dtype, device="cuda")
    dec.window = window
    out = paged_decode_attention(*dec.args(), sliding_window=window, sinks=sinks)
    starts = torch.arange(5, dtype=torch.int32, device="cuda")
    ref = paged_attention_ref(
        dec.q, dec.kv_cache, dec.block_tables, starts, dec.seq_lens, dec.scale,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    assert torch.isfinite(out).all() and not out[1].any() and rel_err(out, ref) < tol
