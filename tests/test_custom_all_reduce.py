"""The custom all-reduce (kernels/all_reduce.py, ops/custom_all_reduce.py).

On the CPU the kernel runs in Triton's interpreter as one rank whose peers have already arrived
(their data written into their buffers and their flags raised in this rank's flag array, as the
peers' own launches would): the sum, both halves of the buffers over successive calls, the
flags this rank raises in every peer's array, several passes per program, and the refusals.
`TPGroup.all_reduce` takes the fast path exactly for the tensors it fits.

On two or four GPUs (`gpu`): every rank's kernel sum equals NCCL's on the same inputs and is
bitwise the same on every rank, eagerly and replayed from a CUDA graph (the device counters keep
the halves in step across replays), for fp32, bf16 and fp16 and sizes from 1 element to the
largest the kernel takes; `attach` agrees on every rank; latencies of both paths are printed.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from taipan.kernels.all_reduce import (
    BLOCK,
    MAX_PROGRAMS,
    MAX_WORLD,
    all_reduce_ref,
    one_shot_all_reduce,
    programs_for,
)
from taipan.ops.parallel import SINGLE, TPGroup
from tests.perf.cuda_graphs import graph_of
from tests.test_tp import run_ranks


class _Peers:
    """One rank's view of a group whose other ranks have already run their part of a call."""

    def __init__(self, world: int, rank: int, cap: int, dtype=torch.float32):
        self.world, self.rank, self.cap = world, rank, cap
        self.bufs = [torch.full((2 * cap,), float("nan"), dtype=dtype) for _ in range(world)]
        self.flags = [torch.zeros(MAX_PROGRAMS, MAX_WORLD, dtype=torch.int64) for _ in range(world)]
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int64)
        self.status = torch.zeros(1, dtype=torch.int32)
        self.epochs = [0] * MAX_PROGRAMS  # every rank's count of calls per program

    def halves(self, n: int) -> torch.Tensor:
        """Each element's offset in the buffers at the programs' current epochs: element i
        always belongs to program (i // BLOCK) % MAX_PROGRAMS, whatever n."""
        program = (torch.arange(n) // BLOCK) % MAX_PROGRAMS
        parity = torch.tensor(self.epochs)[program] % 2
        return parity * self.cap + torch.arange(n)

    def call(
        self, xs: list[torch.Tensor], out: torch.Tensor | None = None, absent: int | None = None
    ) -> torch.Tensor:
        """The peers' part of the next call (their data and flags; not peer `absent`'s), then
        this rank's launch (its waits bounded when a peer is absent)."""
        n = xs[0].numel()
        for p in range(programs_for(n)):
            self.epochs[p] += 1
        where = self.halves(n)
        for q in range(self.world):
            if q not in (self.rank, absent):
                self.bufs[q][where] = xs[q]
                self.flags[self.rank][:, q] = torch.tensor(self.epochs)
        x = xs[self.rank].clone()
        out = x if out is None else out
        args = (tuple(self.bufs), tuple(self.flags), self.rank, self.status)
        spins = {} if absent is None else {"max_spins": 3}
        return one_shot_all_reduce(x, out, self.counters, *args, **spins)


@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (4, 2)])
def test_kernel_sums_every_rank_in_rank_order(world, rank):
    gen = torch.Generator().manual_seed(world * 10 + rank)
    peers = _Peers(world, rank, cap=3 * BLOCK + 64)
    for n in (1, 3 * BLOCK + 5, BLOCK):  # one program; four (the last partial); one again
        xs = [torch.randn(n, generator=gen) for _ in range(world)]
        got = peers.call(xs)
        assert torch.equal(got, all_reduce_ref(xs)) and peers.status.item() == 0
        # This rank raised each program's epoch in every peer's array, and counted the calls
        # of each program as the peers did.
        assert peers.counters.tolist() == peers.epochs
        for q in range(world):
            if q != rank:
                assert peers.flags[q][:, rank].tolist() == peers.epochs
        # Its data went to each element's half of its program's epoch.
        assert torch.equal(peers.bufs[rank][peers.halves(n)], xs[rank])
    assert peers.epochs[:5] == [3, 1, 1, 1, 0]


def test_kernel_writes_out_and_runs_several_passes_per_program():
    """More elements than MAX_PROGRAMS programs cover in one pass: each loops (the grid is
    capped so that every program of a launch is resident at once)."""
    n = MAX_PROGRAMS * BLOCK + 3
    assert programs_for(n) == MAX_PROGRAMS
    peers = _Peers(2, 1, cap=n)
    xs = [torch.randn(n) for _ in range(2)]
    out = torch.full((n,), float("nan"))
    x_before = xs[1].clone()
    peers.call(xs, out)
    assert torch.equal(out, all_reduce_ref(xs)) and torch.equal(xs[1], x_before)


def test_a_wait_for_an_absent_peer_gives_up_when_bounded():
    """A peer that never raises its flag: with `max_spins` the program stops polling, marks
    the status and returns (what it sums is not the sum), instead of spinning for good."""
    peers = _Peers(4, 0, cap=BLOCK)
    peers.call([torch.randn(BLOCK) for _ in range(4)], absent=2)
    assert peers.status.item() == 1


def test_kernel_refusals():
    peers = _Peers(2, 0, cap=64)
    x = torch.randn(8)
    bufs, flags, counters, st = tuple(peers.bufs), tuple(peers.flags), peers.counters, peers.status
    with pytest.raises(ValueError, match="exceed the buffers"):
        one_shot_all_reduce(torch.randn(65), torch.empty(65), counters, bufs, flags, 0, st)
    with pytest.raises(ValueError, match="2..8 buffers"):
        one_shot_all_reduce(x, x, counters, bufs[:1], flags[:1], 0, st)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        one_shot_all_reduce(x, x, counters, bufs, flags, 2, st)
    with pytest.raises(ValueError, match="share a dtype"):
        one_shot_all_reduce(x, x.double(), counters, bufs, flags, 0, st)
    with pytest.raises(ValueError, match="contiguous"):
        one_shot_all_reduce(torch.randn(8, 2)[:, 0], torch.empty(8), counters, bufs, flags, 0, st)
    with pytest.raises(ValueError, match="x's dtype"):
        one_shot_all_reduce(x.half(), x.half(), counters, bufs, flags, 0, st)
    with pytest.raises(ValueError, match="flag array"):
        one_shot_all_reduce(x, x, counters, bufs, (flags[0], flags[1][:4]), 0, st)
    with pytest.raises(ValueError, match="counters"):
        one_shot_all_reduce(x, x, counters.int(), bufs, flags, 0, st)
    with pytest.raises(ValueError, match="status"):
        one_shot_all_reduce(x, x, counters, bufs, flags, 0, st.long())


class _Recorder:
    """A fast path that takes tensors of at most 4 elements and records what it summed."""

    def __init__(self):
        self.took = []

    def fits(self, x):
        return x.numel() <= 4

    def all_reduce_(self, x):
        self.took.append(x.numel())
        return x.mul_(2)


def test_tp_group_takes_the_fast_path_for_what_it_fits():
    fast = _Recorder()
    tp = TPGroup(0, 2, group=object(), fast=fast)  # (a group object that is never called)
    assert tp.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert fast.took == [3]
    assert SINGLE.fast is None and SINGLE.all_reduce(torch.ones(9)).tolist() == [1.0] * 9


def test_attach_keeps_nccl_without_cuda():
    from taipan.ops.custom_all_reduce import CustomAllReduceError, attach, for_mode

    tp, reason = attach(SINGLE)
    assert tp is SINGLE and "nothing to speed up" in reason
    with pytest.raises(CustomAllReduceError, match="custom_all_reduce=true"):
        attach(SINGLE, required=True)
    assert for_mode(SINGLE, False) == (SINGLE, "gloo")
    tp, how = for_mode(SINGLE, None)
    assert tp is SINGLE and how.startswith("gloo (custom all-reduce off: ")
    with pytest.raises(CustomAllReduceError, match="nothing to speed up"):
        for_mode(SINGLE, True)


def test_a_worker_refuses_custom_all_reduce_true_where_it_cannot_run(model_path):
    """custom_all_reduce=true is never ignored: a load with it fails, saying why."""
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import LoadModel
    from taipan.ops.custom_all_reduce import CustomAllReduceError

    load = LoadModel(model_path, "float32", "cpu", 16, 8, 0.01, 64, 4, 128)
    with pytest.raises(CustomAllReduceError, match="custom_all_reduce=true"):
        ModelWorker().load(dataclasses.replace(load, custom_all_reduce=True))


# ---- on two or four GPUs ------------------------------------------------------------------------


def _latency_us(graph, reps: int = 200) -> float:
    """Median µs per replay of `graph` (which holds 10 calls), events around each replay."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 10)
    return sorted(times)[len(times) // 2]


def gpu_job(tp: TPGroup) -> dict:
    """On every rank: attach, compare with NCCL eagerly and from a graph, time both paths."""
    import torch.distributed as dist

    from taipan.ops.custom_all_reduce import attach

    tp, reason = attach(tp, required=True)
    assert reason is None and tp.fast is not None
    fast, dev = tp.fast, tp.device
    gen = torch.Generator(device=dev).manual_seed(tp.rank)
    gathered = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        limit = fast.max_bytes // torch.empty((), dtype=dtype).element_size()
        for n in (1, 7, 4096, 64 * 4096 + 3, limit):
            x = torch.randn(n, generator=gen, device=dev).to(dtype)
            every = torch.empty(tp.size * n, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(every, x, group=tp.group)
            want = all_reduce_ref(list(every.view(tp.size, n)))  # fp32, in rank order
            nccl = x.clone()
            dist.all_reduce(nccl, group=tp.group)  # (16-bit: NCCL rounds at every hop)
            got = tp.all_reduce(x.clone())
            if fast.fits(x):  # (larger sums go to NCCL, whose ring adds in another order)
                assert torch.equal(got, want), (dtype, n)
            tol = 1e-5 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(got.float(), nccl.float(), atol=tol, rtol=tol)
            gathered.append(got.float().sum().item())
    # From a CUDA graph: three sums of different sizes per replay, new inputs each replay.
    xs = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in (4096, 8192, 3 * 4096 + 1)]
    graph = graph_of(lambda: [tp.all_reduce(x) for x in xs])
    for _ in range(5):
        inputs = [torch.randn(x.numel(), generator=gen, device=dev).bfloat16() for x in xs]
        for x, v in zip(xs, inputs, strict=True):
            x.copy_(v)
        graph.replay()
        for x, v in zip(xs, inputs, strict=True):
            every = torch.empty(tp.size * v.numel(), dtype=v.dtype, device=dev)
            dist.all_gather_into_tensor(every, v, group=tp.group)
            assert torch.equal(x, all_reduce_ref(list(every.view(tp.size, -1))))
            nccl = v.clone()  # (NCCL's bf16 ring rounds every partial sum: 4 ranks that
            dist.all_reduce(nccl, group=tp.group)  # cancel can be off by 2**-7 and more)
            torch.testing.assert_close(x.float(), nccl.float(), atol=5e-2, rtol=5e-2)
            gathered.append(x.float().sum().item())
    torch.cuda.synchronize(dev)
    timings = {}
    sizes = (8 << 10, 64 << 10, 512 << 10, 2 << 20, fast.max_bytes)
    for nbytes in sorted({n for n in sizes if n <= fast.max_bytes}):  # (what the kernel takes)
        x = torch.randn(nbytes // 2, generator=gen, device=dev).bfloat16()
        custom = graph_of(lambda x=x: [fast.all_reduce_(x) for _ in range(10)])
        nccl = graph_of(lambda x=x: [dist.all_reduce(x, group=tp.group) for _ in range(10)])
        dist.barrier(group=tp.group)
        timings[nbytes] = {"custom_us": _latency_us(custom), "nccl_us": _latency_us(nccl)}
        time.sleep(0.01)
    fused, fused_timings = _fused_norm_job(tp, gen)
    gemv_sums, gemv_timings = _gemv_sum_job(tp, gen)
    return {"sums": gathered, "timings": timings, "fused": fused, "fused_timings": fused_timings,
            "gemv": gemv_sums, "gemv_timings": gemv_timings}  # fmt: skip


def _gemv_sum_job(tp: TPGroup, gen: torch.Generator) -> tuple[list[float], dict]:
    """The row-parallel GEMV with the sum, the add and the norm in its last program
    (kernels/gemv_all_reduce.py): equal to the product, NCCL's sum and kernels/rmsnorm.py in
    fp32 and bf16, eagerly and from a CUDA graph (both halves); then its latency against the
    product followed by the fused sum + norm, for an 8B layer's o_proj at TP = 2."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from taipan.kernels.gemv import gemv
    from taipan.kernels.rmsnorm import rms_norm

    fast, dev, eps = tp.fast, tp.device, 1e-5
    shared = torch.Generator(device=dev).manual_seed(11)  # the same stream on every rank
    out = []

    def want(x, w, residual, weight):
        summed = F.linear(x.float(), w.float()).to(x.dtype).float()
        dist.all_reduce(summed, group=tp.group)  # (fp32: rank order does not matter here)
        return rms_norm(summed.to(x.dtype), weight, eps, residual=residual.clone())

    def check(got, got_residual, wanted, tol):
        torch.testing.assert_close(got_residual.float(), wanted[1].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got.float(), wanted[0].float(), atol=tol, rtol=tol)
        out.append(got.float().sum().item())

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        weight = torch.rand(2048, generator=shared, device=dev).to(dtype)
        for rows in (1, 3, 4):
            x = torch.randn(rows, 512, generator=gen, device=dev).to(dtype)
            w = (torch.randn(2048, 512, generator=gen, device=dev) / 23).to(dtype)
            residual = torch.randn(rows, 2048, generator=shared, device=dev).to(dtype)
            wanted = want(x, w, residual, weight)
            check(*fast.gemv_all_reduce_rms_norm_(x, w, residual.clone(), weight, eps), wanted, tol)
    x = torch.empty(1, 2048, dtype=torch.bfloat16, device=dev)
    w = (torch.randn(4096, 2048, generator=gen, device=dev) / 45).bfloat16()
    weight = torch.rand(4096, generator=shared, device=dev).bfloat16()
    r = torch.empty(1, 4096, dtype=torch.bfloat16, device=dev)
    captured = {}

    def step():
        captured["out"] = fast.gemv_all_reduce_rms_norm_(x, w, r, weight, eps)

    graph = graph_of(step)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device=dev))
        r.copy_(torch.randn(r.shape, generator=shared, device=dev))
        wanted = want(x, w, r, weight)
        graph.replay()
        check(*captured["out"], wanted, 3e-2)
    ways = {
        "one_launch_us": lambda: fast.gemv_all_reduce_rms_norm_(x, w, r, weight, eps),
        "gemv_then_sum_norm_us": lambda: fast.all_reduce_rms_norm_(gemv(x, w), r, weight, eps),
    }
    timings = {}
    for name, fn in ways.items():
        g = graph_of(lambda fn=fn: [fn() for _ in range(10)])
        dist.barrier(group=tp.group)
        timings[name] = _latency_us(g)
        time.sleep(0.01)
    return out, timings


def _fused_norm_job(tp: TPGroup, gen: torch.Generator) -> tuple[list[float], dict]:
    """The sum fused with the residual add and RMSNorm (kernels/all_reduce_norm.py): equal to
    its reference on every input, eagerly and from a CUDA graph; then the latency of a decoder
    layer's sum + add + norm three ways: fused, custom sum then the norm kernel, NCCL then it."""
    import torch.distributed as dist

    from taipan.kernels.all_reduce_norm import all_reduce_rms_norm_ref
    from taipan.kernels.rmsnorm import rms_norm

    fast, dev, eps, hidden = tp.fast, tp.device, 1e-5, 4096
    shared = torch.Generator(device=dev).manual_seed(7)  # the same stream on every rank
    out = []

    def check(x, residual, weight, got, got_residual):
        every = torch.empty(tp.size * x.numel(), dtype=x.dtype, device=dev)
        dist.all_gather_into_tensor(every, x, group=tp.group)
        want, want_residual = all_reduce_rms_norm_ref(
            list(every.view(tp.size, *x.shape)), residual.clone(), weight, eps
        )
        assert torch.equal(got_residual, want_residual)  # (the same roundings as the ref)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # (one bf16 ulp)
        out.append(got.float().sum().item())

    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.rand(hidden, generator=shared, device=dev).to(dtype)
        for rows in (1, 7, fast.rows_cap):
            x = torch.randn(rows, hidden, generator=gen, device=dev).to(dtype)
            residual = torch.randn(rows, hidden, generator=shared, device=dev).to(dtype)
            if dtype == torch.float32 and not fast.fits_rows(x):
                continue
            got, got_residual = fast.all_reduce_rms_norm_(x.clone(), residual.clone(), weight, eps)
            check(x, residual, weight, got, got_residual)
    weight = torch.rand(hidden, generator=shared, device=dev).bfloat16()
    xs = [torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev) for rows in (1, 16)]
    rs = [torch.empty_like(x) for x in xs]
    graph = graph_of(
        lambda: [fast.all_reduce_rms_norm_(x, r, weight, eps) for x, r in zip(xs, rs, strict=True)]
    )
    for _ in range(4):
        inputs = [torch.randn(x.shape, generator=gen, device=dev).bfloat16() for x in xs]
        residuals = [torch.randn(x.shape, generator=shared, device=dev).bfloat16() for x in xs]
        for x, r, v, w in zip(xs, rs, inputs, residuals, strict=True):
            x.copy_(v)
            r.copy_(w)
        graph.replay()
        for x, r, v, w in zip(xs, rs, inputs, residuals, strict=True):
            check(v, w, weight, x, r)
    timings = {}
    for rows in (1, min(64, fast.rows_cap)):  # (T = 4 takes 42 rows of 4096 bf16)
        x = torch.randn(rows, hidden, generator=gen, device=dev).bfloat16()
        r = torch.randn(rows, hidden, generator=shared, device=dev).bfloat16()
        ways = {
            "fused_us": lambda x=x, r=r: fast.all_reduce_rms_norm_(x, r, weight, eps),
            "custom_then_norm_us": lambda x=x, r=r: rms_norm(
                fast.all_reduce_(x), weight, eps, residual=r
            ),
            "nccl_then_norm_us": lambda x=x, r=r: rms_norm(
                dist.all_reduce(x, group=tp.group) or x, weight, eps, residual=r
            ),
        }
        timings[rows] = {}
        for name, fn in ways.items():
            g = graph_of(lambda fn=fn: [fn() for _ in range(10)])
            dist.barrier(group=tp.group)
            timings[rows][name] = _latency_us(g)
            time.sleep(0.01)
    return out, timings


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_gpu_custom_all_reduce_equals_nccl(size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} CUDA GPUs")
    ranks = run_ranks(gpu_job, size=size, cuda=True)
    # Every rank holds the very same sums (the kernel sums in rank order on every rank).
    assert all(r["sums"] == ranks[0]["sums"] for r in ranks)
    assert all(r["fused"] == ranks[0]["fused"] for r in ranks)
    assert all(r["gemv"] == ranks[0]["gemv"] for r in ranks)
    gemv_timings = ranks[0]["gemv_timings"].items()
    print(f"T={size} 8B o_proj at TP=2 with its sum + add + RMSNorm: "
          + ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in gemv_timings))  # fmt: skip
    for nbytes, t in ranks[0]["timings"].items():
        print(f"T={size} {nbytes >> 10} KiB: custom {t['custom_us']:.1f} us, "
              f"NCCL {t['nccl_us']:.1f} us")  # fmt: skip
    for rows, t in ranks[0]["fused_timings"].items():
        print(f"T={size} sum + add + RMSNorm of {rows} x 4096 bf16: "
              + ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in t.items()))  # fmt: skip
