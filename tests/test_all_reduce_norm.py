"""The one-shot all-reduce fused with the residual add and RMSNorm (kernels/all_reduce_norm.py)
and the norm that dispatches to it (ops/layers.RMSNorm with `tp`).

On the CPU the kernel runs in Triton's interpreter as one rank whose peers have already arrived,
as tests/test_custom_all_reduce.py runs the plain one: the rows summed in rank order, added to
the residual and normalized; each row in its fixed slot of the half its program's epoch picks;
several rows per program; a bounded wait that gives up; the refusals. On GPUs the kernel runs in
tests/test_custom_all_reduce.py's `gpu` test (against NCCL, eagerly and from CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.all_reduce import MAX_PROGRAMS, MAX_WORLD
from taipan.kernels.all_reduce_norm import (
    all_reduce_rms_norm_ref,
    one_shot_all_reduce_rms_norm,
    programs_for_rows,
)
from taipan.ops.layers import RMSNorm
from taipan.ops.parallel import TPGroup

EPS = 1e-6


class _RowPeers:
    """One rank's view of a group whose other ranks have already run their part of a call."""

    def __init__(self, world: int, rank: int, rows_cap: int, row_stride: int):
        self.world, self.rank = world, rank
        shape = (2, rows_cap, row_stride)
        self.bufs = [torch.full(shape, float("nan")) for _ in range(world)]
        self.flags = [torch.zeros(MAX_PROGRAMS, MAX_WORLD, dtype=torch.int64) for _ in range(world)]
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int64)
        self.status = torch.zeros(1, dtype=torch.int32)
        self.epochs = [0] * MAX_PROGRAMS

    def half(self, row: int) -> int:
        """Row r's half: its program's (r % MAX_PROGRAMS) epoch parity."""
        return self.epochs[row % MAX_PROGRAMS] % 2

    def call(self, xs, residual, weight, absent: int | None = None):
        rows, hidden = xs[0].shape
        for p in range(programs_for_rows(rows)):
            self.epochs[p] += 1
        for q in range(self.world):
            if q in (self.rank, absent):
                continue
            for r in range(rows):
                self.bufs[q][self.half(r), r, :hidden] = xs[q][r]
            self.flags[self.rank][:, q] = torch.tensor(self.epochs)
        x = xs[self.rank].clone()
        args = (self.counters, tuple(self.bufs), tuple(self.flags), self.rank, self.status)
        spins = {} if absent is None else {"max_spins": 3}
        return one_shot_all_reduce_rms_norm(x, residual, weight, EPS, x, *args, **spins)


@pytest.mark.parametrize("world, rank", [(2, 1), (4, 0)])
def test_rows_summed_added_and_normalized(world, rank):
    gen = torch.Generator().manual_seed(world + rank)
    peers = _RowPeers(world, rank, rows_cap=MAX_PROGRAMS + 6, row_stride=48)
    weight = torch.rand(40, generator=gen)
    for rows in (3, MAX_PROGRAMS + 6, 1):  # 3 programs; 64 (six of them two rows); 1 again
        xs = [torch.randn(rows, 40, generator=gen) for _ in range(world)]
        residual = torch.randn(rows, 40, generator=gen)
        want_residual = residual.clone()
        want, _ = all_reduce_rms_norm_ref(xs, want_residual, weight, EPS)
        got, got_residual = peers.call(xs, residual, weight)
        assert got_residual is residual and peers.status.item() == 0
        torch.testing.assert_close(residual, want_residual, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert peers.counters.tolist() == peers.epochs
        for q in range(world):
            if q != rank:
                assert peers.flags[q][:, rank].tolist() == peers.epochs
        for r in range(rows):  # this rank's row went to its fixed slot, in its program's half
            assert torch.equal(peers.bufs[rank][peers.half(r), r, :40], xs[rank][r])
    assert peers.epochs[:4] == [3, 2, 2, 1] and peers.epochs[6] == 1


def test_a_wait_for_an_absent_peer_gives_up_when_bounded():
    peers = _RowPeers(2, 0, rows_cap=2, row_stride=16)
    xs = [torch.randn(2, 16) for _ in range(2)]
    peers.call(xs, torch.zeros(2, 16), torch.ones(16), absent=1)
    assert peers.status.item() == 1


def test_refusals():
    peers = _RowPeers(2, 0, rows_cap=4, row_stride=16)
    rest = (peers.counters, tuple(peers.bufs), tuple(peers.flags), 0, peers.status)
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    with pytest.raises(ValueError, match="do not hold"):
        one_shot_all_reduce_rms_norm(torch.randn(5, 16), torch.randn(5, 16), w, EPS,
                                     torch.empty(5, 16), *rest)  # fmt: skip
    with pytest.raises(ValueError, match="do not hold"):
        big = torch.randn(4, 17)
        one_shot_all_reduce_rms_norm(big, big.clone(), torch.ones(17), EPS, big, *rest)
    with pytest.raises(ValueError, match="must not be residual"):
        one_shot_all_reduce_rms_norm(x, r, w, EPS, r, *rest)
    with pytest.raises(ValueError, match="residual must match"):
        one_shot_all_reduce_rms_norm(x, r.double(), w, EPS, x, *rest)
    with pytest.raises(ValueError, match="weight must be"):
        one_shot_all_reduce_rms_norm(x, r, torch.ones(8), EPS, x, *rest)
    with pytest.raises(ValueError, match="unit stride"):
        one_shot_all_reduce_rms_norm(torch.randn(16, 4).t(), r, w, EPS, torch.empty(4, 16), *rest)


class _Fast:
    """A custom all-reduce that takes rows of at most 2 and records what it did."""

    def __init__(self):
        self.calls = []

    def fits(self, x):
        return False

    def fits_rows(self, x):
        return x.shape[0] <= 2

    def all_reduce_(self, x):
        raise AssertionError("not called: fits() is False")

    def all_reduce_rms_norm_(self, x, residual, weight, eps):
        self.calls.append(x.shape[0])
        return x, residual


def test_rms_norm_sums_a_partial_input_first(monkeypatch):
    import torch.distributed as dist

    # The group's sum (patched): two ranks holding the same x.
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: x.mul_(2))
    fast = _Fast()
    tp = TPGroup(0, 2, group=object(), fast=fast)
    norm = RMSNorm(8, EPS)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    # Rows the fast path fits, with a residual: one fused call.
    out = norm(x[:2].clone(), residual[:2].clone(), tp)
    assert fast.calls == [2] and isinstance(out, tuple)
    # Too many rows: the group's sum (NCCL / gloo), then the plain fused add and norm.
    got, got_residual = norm(x.clone(), residual.clone(), tp)
    want_residual = residual.clone()
    want, _ = norm(x * 2, want_residual)
    assert fast.calls == [2]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_residual, want_residual)
    # No residual (nothing to fuse with): summed, then normalized.
    torch.testing.assert_close(norm(x[:1].clone(), None, tp), norm(x[:1] * 2))
    # Without tp the input is whole already.
    torch.testing.assert_close(norm(x.clone()), norm(x))
