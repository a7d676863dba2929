"""actors/gpu/host_staging.py: a launch's small arrays staged back to back in its arena (here
unpinned, on the CPU: the layout and the turns are the same), the fallback when one does not
fit, and `to_device` off CUDA."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from taipan.actors.gpu import host_staging
from taipan.actors.gpu.host_staging import ALIGN, Arenas, StagingArena, active, to_device
from taipan.actors.gpu.worker import HOST_TOKEN_BUFFERS, MAX_LAUNCHED

ARRAYS = [
    np.arange(5, dtype=np.int64),
    np.array([True, False, True]),
    np.linspace(0, 1, 7, dtype=np.float32).reshape(7),
    np.arange(12, dtype=np.int32).reshape(3, 4),
    np.zeros((0, 4), dtype=np.int32),
    np.int64(9) * np.ones((), dtype=np.int64),  # (0-d)
    np.frombuffer(np.arange(4, dtype=np.int16).tobytes(), dtype=np.int16),  # (read-only)
    np.arange(20, dtype=np.int64)[::3],  # (not contiguous)
]


def test_arrays_are_staged_back_to_back_with_their_dtype_and_shape():
    arena = StagingArena(4096, pinned=False)
    staged = [arena.take(a) for a in ARRAYS]
    for a, t in zip(ARRAYS, staged, strict=True):
        assert t is not None and t.dtype == torch.from_numpy(np.array(a)).dtype
        assert tuple(t.shape) == a.shape and np.array_equal(t.numpy(), a)
    held = [t for t in staged if t.numel()]  # (an empty tensor's data_ptr is 0)
    offsets = [t.data_ptr() - arena.bytes.data_ptr() for t in held]
    assert all(o % ALIGN == 0 for o in offsets)
    ends = [o + t.numel() * t.element_size() for o, t in zip(offsets, held, strict=True)]
    assert all(e <= o for e, o in zip(ends, offsets[1:], strict=False))  # (none overlaps)
    staged[0][0] = 100  # (the arena's bytes, not the array's)
    assert ARRAYS[0][0] == 0


def test_an_array_that_does_not_fit_is_not_staged():
    arena = StagingArena(ALIGN * 2, pinned=False)
    assert arena.take(np.zeros(ALIGN // 8, dtype=np.int64)) is not None
    assert arena.take(np.zeros(ALIGN // 8 + 1, dtype=np.int64)) is None  # (the rest is one)
    assert arena.take(np.zeros(ALIGN // 8, dtype=np.int64)) is not None
    assert arena.take(np.zeros(1, dtype=np.int8)) is None
    arena.reset()
    assert arena.take(np.zeros(2 * ALIGN, dtype=np.int8)) is not None


def test_empty_places_results_in_the_arena():
    arena = StagingArena(1024, pinned=False)
    staged = arena.take(np.arange(3, dtype=np.int32))
    got = arena.empty((4, 2), torch.float32)
    assert got.shape == (4, 2) and got.dtype == torch.float32
    assert got.data_ptr() - arena.bytes.data_ptr() == ALIGN and staged.tolist() == [0, 1, 2]
    assert arena.empty((1024,), torch.int8) is None and arena.used == 2 * ALIGN
    assert arena.empty((0, 3), torch.int64).shape == (0, 3)


def test_arenas_take_turns_and_start_empty():
    arenas = Arenas(3, nbytes=1024, pinned=False)
    first = arenas.next()
    first.take(np.zeros(10, dtype=np.int64))
    assert [arenas.next() for _ in range(2)] == arenas.arenas[1:]
    assert arenas.next() is first and first.used == 0


def test_a_launchs_arena_outlasts_the_launches_in_flight():
    """A launch's arena is reused len(arenas) launches later: by then the gpu actor (at most
    MAX_LAUNCHED launched and uncollected, this one included) has collected it."""
    assert HOST_TOKEN_BUFFERS >= MAX_LAUNCHED + 1


def test_active_is_per_thread_and_nests():
    arena = StagingArena(1024, pinned=False)
    seen = []
    with active(arena):
        assert host_staging._local.arena is arena
        with active(None):
            assert host_staging._local.arena is None
        thread = threading.Thread(
            target=lambda: seen.append(getattr(host_staging._local, "arena", None))
        )
        thread.start()
        thread.join()
        assert host_staging._local.arena is arena
    assert host_staging._local.arena is None and seen == [None]


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.float32])
def test_to_device_off_cuda_copies(dtype):
    a = np.frombuffer(np.arange(6, dtype=np.int32).tobytes(), dtype=np.int32)
    with active(StagingArena(1024, pinned=False)):  # (off CUDA the arena is not used)
        t = to_device(a, torch.device("cpu"), dtype)
    assert t.dtype == (dtype or torch.int32) and t.tolist() == list(range(6))
    t[0] = 7  # (writable, and not `a`'s memory)
    assert a[0] == 0


@pytest.mark.gpu
def test_gpu_staged_copies_arrive_while_the_stream_is_busy():
    """On CUDA, from a pinned arena: each array reaches the device intact, queued behind a
    busy stream without waiting for it, and one that does not fit takes the old path."""
    import time

    device = torch.device("cuda")
    arenas = Arenas(3, nbytes=4096)
    big = np.arange(1024, dtype=np.int64)  # (8 KB: not in a 4 KB arena)
    # Once without a busy stream first: a process's first copy and first int64 -> float32
    # kernel load lazily and wait for the stream (19 and 38 ms on an H200: the probe
    # tests/perf/staging_probe.py), as in the worker, whose warm-up steps take that cost.
    with active(arenas.next()):
        for a in ARRAYS:
            to_device(a, device)
        to_device(big, device, torch.float32)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # (the stream busy for ~50 ms)
    start = time.perf_counter()
    with active(arenas.next()):
        got = [to_device(a, device) for a in ARRAYS] + [to_device(big, device, torch.float32)]
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    for a, t in zip(ARRAYS, got, strict=False):
        assert t.is_cuda and np.array_equal(t.cpu().numpy(), a)
    assert torch.equal(got[-1].cpu(), torch.from_numpy(big).float())
    assert queued < 0.03, queued  # (nothing waited for the sleeping stream)
    arena = arenas.next()
    source = torch.arange(6, device=device, dtype=torch.int64).reshape(2, 3)
    torch.cuda._sleep(100_000_000)
    with active(arena):
        back = host_staging.to_host(source)
    assert arena.used > 0  # (in the arena, not freshly pinned)
    torch.cuda.synchronize()
    assert back.tolist() == [[0, 1, 2], [3, 4, 5]]
