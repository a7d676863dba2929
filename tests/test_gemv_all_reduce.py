"""The row-parallel GEMV with the all-reduce, the residual add and the RMSNorm in its last
program (kernels/gemv_all_reduce.py). On the CPU the kernel runs in Triton's interpreter as one
rank whose peers have already pushed their partial rows and raised their flags, as
tests/test_all_reduce_norm.py runs the separate all-reduce: the rows summed in rank order, added
and normalized; this rank's partial rows pushed into every rank's buffer at its own slot of the
half its epoch picks; its flag raised at every peer once; a bounded wait that gives up; the
refusals. On GPUs: tests/test_custom_all_reduce.py's `gpu` test, against NCCL."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.all_reduce import MAX_WORLD
from taipan.kernels.gemv import gemv_ref
from taipan.kernels.gemv_all_reduce import gemv_all_reduce_rms_norm, gemv_all_reduce_rms_norm_ref

EPS = 1e-6


class _Peers:
    """One rank's view of a group whose other ranks have already run their part of a call."""

    def __init__(self, world: int, rank: int, rows_cap: int = 4, row_stride: int = 48):
        self.world, self.rank, self.rows_cap = world, rank, rows_cap
        shape = (2, world, rows_cap, row_stride)
        self.bufs = [torch.full(shape, float("nan")) for _ in range(world)]
        self.flags = [torch.zeros(MAX_WORLD, dtype=torch.int64) for _ in range(world)]
        self.state = torch.zeros(2, dtype=torch.int64)
        self.status = torch.zeros(1, dtype=torch.int32)
        self.epoch = 0

    def call(self, xs, ws, residual, weight, absent: int | None = None):
        self.epoch += 1
        half = self.epoch % 2
        mine = self.bufs[self.rank]
        for q in range(self.world):
            if q in (self.rank, absent):
                continue
            part = gemv_ref(xs[q], ws[q])
            mine[half, q, : part.shape[0], : part.shape[1]] = part
            mine_flags = self.flags[self.rank]
            mine_flags[q] = self.epoch
        args = (self.state, tuple(self.bufs), tuple(self.flags), self.rank)
        spins = {} if absent is None else {"max_spins": 3}
        x, w = xs[self.rank], ws[self.rank]
        return gemv_all_reduce_rms_norm(x, w, residual, weight, EPS, *args, self.status, **spins)


@pytest.mark.parametrize("world, rank", [(2, 1), (4, 0)])
def test_rows_summed_added_and_normalized(world, rank):
    gen = torch.Generator().manual_seed(world + rank)
    peers = _Peers(world, rank)
    k = 24
    for call, (rows, n) in enumerate(((1, 40), (3, 40), (1, 16))):  # 10, 10, then 4 programs
        weight = torch.rand(n, generator=gen)
        xs = [torch.randn(rows, k, generator=gen) for _ in range(world)]
        ws = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(world)]
        residual = torch.randn(rows, n, generator=gen)
        want_residual = residual.clone()
        want, _ = gemv_all_reduce_rms_norm_ref(xs, ws, want_residual, weight, EPS)
        got, got_residual = peers.call(xs, ws, residual, weight)
        assert got_residual is residual and peers.status.item() == 0
        torch.testing.assert_close(residual, want_residual, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        epoch, half = call + 1, (call + 1) % 2
        assert peers.state.tolist() == [epoch, 0]  # (the count; no call under way)
        own_part = gemv_ref(xs[rank], ws[rank])
        for q in range(world):  # this rank's rows in every buffer, at its slot, in the half
            pushed = peers.bufs[q][half, rank, :rows, :n]
            torch.testing.assert_close(pushed, own_part, rtol=1e-6, atol=1e-6)
            if q != rank:
                assert peers.flags[q][rank].item() == epoch  # raised at every peer


def test_a_wait_for_an_absent_peer_gives_up_when_bounded():
    gen = torch.Generator().manual_seed(5)
    peers = _Peers(2, 0)
    xs = [torch.randn(1, 16, generator=gen) for _ in range(2)]
    ws = [torch.randn(8, 16, generator=gen) for _ in range(2)]
    peers.call(xs, ws, torch.zeros(1, 8), torch.ones(8), absent=1)
    assert peers.status.item() == 1


def test_refusals():
    peers = _Peers(2, 0)
    x, w, r, nw = torch.zeros(1, 16), torch.zeros(8, 16), torch.zeros(1, 8), torch.ones(8)
    args = (peers.state, tuple(peers.bufs), tuple(peers.flags))
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv_all_reduce_rms_norm(torch.zeros(5, 16), w, torch.zeros(5, 8), nw, EPS, *args, 0,
                                 peers.status)  # fmt: skip
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        gemv_all_reduce_rms_norm(x, w, r, nw, EPS, *args, 2, peers.status)
    with pytest.raises(ValueError, match=r"do not hold 2 x 2 slots of 1 x 64"):
        gemv_all_reduce_rms_norm(x, torch.zeros(64, 16), torch.zeros(1, 64), torch.ones(64), EPS,
                                 *args, 0, peers.status)  # fmt: skip
    with pytest.raises(ValueError, match="residual must be"):
        gemv_all_reduce_rms_norm(x, w, torch.zeros(1, 9), nw, EPS, *args, 0, peers.status)
