"""The torch references of the Mamba2 mixer's stages (kernels/causal_conv1d.py, ssd_scan.py,
selective_state.py; issue 10) against Hugging Face NemotronH's own torch functions and against a
token-by-token recurrence: varlen batches, initial states from slots, final states into slots,
chunks shorter than, equal to and several times `chunk_size`."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from taipan.kernels.selective_state import selective_state_update_ref
from taipan.kernels.ssd_scan import ssd_scan_varlen_ref

hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

H, P, G, N = 4, 8, 2, 16


def _qsl(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _ssm_inputs(total, gen):
    x = torch.randn(total, H, P, generator=gen)
    dt = torch.randn(total, H, generator=gen)
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    B = torch.randn(total, G, N, generator=gen)
    C = torch.randn(total, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    return x, dt, A, B, C, D, dt_bias


def _recurrence(x, dt, A, B, C, D, dt_bias, state):
    """Token by token, the definition the chunked scan must equal."""
    rep = H // G
    dts = torch.nn.functional.softplus(dt + dt_bias)
    ys = []
    for t in range(x.shape[0]):
        Bh = B[t].repeat_interleave(rep, 0)  # [H, N]
        Ch = C[t].repeat_interleave(rep, 0)
        a = torch.exp(dts[t] * A)  # [H]
        state = state * a[:, None, None] + (dts[t][:, None] * x[t])[..., None] * Bh[:, None]
        ys.append(torch.einsum("hpn,hn->hp", state, Ch) + D[:, None] * x[t])
    return torch.stack(ys), state


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_ssd_scan_varlen_equals_recurrence_and_hf(chunk):
    gen = torch.Generator().manual_seed(chunk)
    lens = [1, 8, 21, 3]  # shorter than, equal to and several times the chunk
    total = sum(lens)
    x, dt, A, B, C, D, dt_bias = _ssm_inputs(total, gen)
    states = torch.randn(6, H, P, N, generator=gen)
    init = torch.tensor([-1, 2, 3, -1], dtype=torch.int32)
    dest = torch.tensor([0, 2, 4, -1], dtype=torch.int32)  # slot 2: read, then overwritten
    before = states.clone()
    y = ssd_scan_varlen_ref(
        x, dt, A, B, C, D, dt_bias, _qsl(lens), states, init, dest, chunk_size=chunk
    )
    starts = _qsl(lens).tolist()
    for b in range(len(lens)):
        lo, hi = starts[b], starts[b + 1]
        s0 = before[init[b]] if init[b] >= 0 else torch.zeros(H, P, N)
        want_y, want_state = _recurrence(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, dt_bias, s0)
        torch.testing.assert_close(y[lo:hi], want_y, rtol=1e-4, atol=1e-4)
        if dest[b] >= 0:
            torch.testing.assert_close(states[dest[b]], want_state, rtol=1e-4, atol=1e-4)
        # HF's chunked torch scan (one sequence, batch 1) agrees too
        hf_y, hf_state = hf.mamba2_chunk_scan(
            x[None, lo:hi],
            dt[None, lo:hi],
            A,
            B[None, lo:hi],
            C[None, lo:hi],
            chunk_size=chunk,
            D=D,
            dt_bias=dt_bias,
            initial_states=s0[None],
            dt_softplus=True,
            return_final_states=True,
        )
        torch.testing.assert_close(y[lo:hi], hf_y[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(want_state, hf_state[0], rtol=1e-4, atol=1e-4)
    untouched = [1, 3, 5]
    assert torch.equal(states[untouched], before[untouched])


def test_selective_state_update_equals_recurrence_and_hf():
    gen = torch.Generator().manual_seed(7)
    rows = 3
    x, dt, A, B, C, D, dt_bias = _ssm_inputs(rows, gen)
    states = torch.randn(5, H, P, N, generator=gen)
    init = torch.tensor([1, -1, 4], dtype=torch.int32)
    dest = torch.tensor([1, 0, 2], dtype=torch.int32)
    before = states.clone()
    y = selective_state_update_ref(x, dt, A, B, C, D, dt_bias, states, init, dest)
    for b in range(rows):
        s0 = before[init[b]] if init[b] >= 0 else torch.zeros(H, P, N)
        want_y, want_state = _recurrence(
            x[b : b + 1], dt[b : b + 1], A, B[b : b + 1], C[b : b + 1], D, dt_bias, s0
        )
        torch.testing.assert_close(y[b], want_y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[dest[b]], want_state, rtol=1e-5, atol=1e-5)
        hf_state = s0[None].clone()
        hf_y = hf.mamba2_selective_state_update(
            hf_state,
            x[b : b + 1],
            dt[b : b + 1, :, None].expand(1, H, P),
            A[:, None, None].expand(H, P, N),
            B[b : b + 1],
            C[b : b + 1],
            D[:, None].expand(H, P),
            dt_bias=dt_bias[:, None].expand(H, P),
            dt_softplus=True,
        )
        torch.testing.assert_close(y[b], hf_y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[dest[b]], hf_state[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(states[3], before[3])


def test_causal_conv1d_varlen_and_update_equal_hf():
    gen = torch.Generator().manual_seed(3)
    dim, width = 12, 4
    lens = [1, 2, 9, 5]
    total = sum(lens)
    x = torch.randn(total, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    states = torch.randn(5, width - 1, dim, generator=gen)
    init = torch.tensor([-1, 1, -1, 1], dtype=torch.int32)
    dest = torch.tensor([0, 2, 3, 1], dtype=torch.int32)  # slot 1 read twice, written last
    before = states.clone()
    y = causal_conv1d_varlen_ref(x, weight, bias, _qsl(lens), states, init, dest)
    starts = _qsl(lens).tolist()
    for b in range(len(lens)):
        lo, hi = starts[b], starts[b + 1]
        hist = before[init[b]] if init[b] >= 0 else torch.zeros(width - 1, dim)
        full = torch.cat([hist, x[lo:hi]])  # HF: the history as the first inputs
        want = hf.causal_conv1d_fn(full.t()[None], weight, bias, activation="silu")[0].t()
        torch.testing.assert_close(y[lo:hi], want[width - 1 :], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[dest[b]], full[-(width - 1) :])
    assert torch.equal(states[4], before[4])
    # decode: HF's update keeps a width-long state; ours the width - 1 inputs before the token
    states2 = before.clone()
    rows = torch.randn(2, dim, generator=gen)
    got = causal_conv1d_update_ref(
        rows, weight, bias, states2, torch.tensor([3, -1]), torch.tensor([3, 4])
    )
    for b, slot in enumerate([3, -1]):
        hist = before[slot] if slot >= 0 else torch.zeros(width - 1, dim)
        hf_state = torch.cat([torch.zeros(1, dim), hist]).t()[None].clone()
        want = hf.causal_conv1d_update(rows[b][None, :, None], hf_state, weight, bias, "silu")
        torch.testing.assert_close(got[b], want[0, :, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states2[[3, 4][b]], torch.cat([hist[1:], rows[b][None]]))
