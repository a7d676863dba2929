"""Small host arrays to the device, and small results back, inside a step's launch without a
pinned allocation each: `to_device`, `to_host`, and the per-launch pinned arenas they take
their bytes from (`Arenas`, `StagingArena`).

A copy to the device from pageable memory may wait for the stream (tests/perf/host_sync_probe.py),
so every such array goes through pinned memory. `Tensor.pin_memory()` allocates it: 0.15-0.4 ms
of host time each (the probe; a step with penalties, biases or grammar rows makes several),
spent between one step's launch and the next. Instead the worker gives each launch an arena: a
pinned buffer whose bytes the launch's arrays are copied into back to back, and from which
they go to the device without waiting; a result read at collect (`to_host`: a grammar check's
candidates, top-n log-probs) lands there too. An arena is reused `len(Arenas)` launches later, when
the launch that used it has been collected (its end event passed, so its copies ran): the gpu
actor keeps at most worker.py MAX_LAUNCHED launches uncollected, and `Arenas` has more. An
array that does not fit what is left of the arena, or one staged outside a launch (a thread
with no arena: the grammar check at collect), takes the old path.

Must not touch: anything but its own buffers. Thread-safe as the worker uses it: one launch at
a time, and each thread sees only the arena its own launch set (`active`).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

ALIGN = 256  # bytes: each staged array starts on this boundary (any element type's)
ARENA_BYTES = 8 << 20  # grammar masks of 256 rows of a 150k vocabulary fit (4.9 MB)

_local = threading.local()
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return _TORCH_DTYPES[dtype]


class StagingArena:
    """One launch's pinned bytes (`take` appends, `reset` starts over)."""

    def __init__(self, nbytes: int, pinned: bool = True):
        self.bytes = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._host = self.bytes.numpy()
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def take(self, a: np.ndarray) -> torch.Tensor | None:
        """A host tensor in the arena holding a copy of `a` (its dtype and shape), or None
        when it does not fit."""
        a = np.ascontiguousarray(a).reshape(np.shape(a))  # (it makes a 0-d array 1-d)
        start = self.used
        if start + a.nbytes > len(self._host):
            return None
        self.used = start + -(-a.nbytes // ALIGN) * ALIGN
        view = self._host[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        dtype = _TORCH_DTYPES.get(a.dtype) or _torch_dtype(a.dtype)
        return self.bytes[start : start + a.nbytes].view(dtype).reshape(a.shape)

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized host tensor in the arena (a copy from the device lands there and is
        read once the launch is collected), or None when it does not fit."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self.used
        if start + nbytes > len(self._host):
            return None
        self.used = start + -(-nbytes // ALIGN) * ALIGN
        return self.bytes[start : start + nbytes].view(dtype).reshape(shape)


class Arenas:
    """The worker's arenas, one per launch in turn (`next`)."""

    def __init__(self, count: int, nbytes: int = ARENA_BYTES, pinned: bool = True):
        self.arenas = [StagingArena(nbytes, pinned) for _ in range(count)]
        self._turn = 0

    def __len__(self) -> int:
        return len(self.arenas)

    def next(self) -> StagingArena:
        arena = self.arenas[self._turn % len(self.arenas)]
        self._turn += 1
        arena.reset()
        return arena


@contextlib.contextmanager
def active(arena: StagingArena | None):
    """Inside: `to_device` in this thread stages into `arena` (None: allocates as before)."""
    before = getattr(_local, "arena", None)
    _local.arena = arena
    try:
        yield
    finally:
        _local.arena = before


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` (on CUDA) copied to pinned host memory without waiting (read it once the launch is
    collected: its end event covers the copy): into the active arena, else freshly pinned.
    A strided `t` is made contiguous on the device first: torch stages a copy from a strided
    source through a temporary and waits for the stream (tests/perf/host_sync_probe.py)."""
    t = t.contiguous()
    arena = getattr(_local, "arena", None)
    host = arena.empty(tuple(t.shape), t.dtype) if arena is not None else None
    if host is None:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def to_device(a: np.ndarray, device: torch.device, dtype=None) -> torch.Tensor:
    """`a` on `device` (as `dtype`), queued without waiting for the stream: on CUDA from the
    active arena's pinned bytes, else from freshly pinned memory."""
    if device.type != "cuda":
        # (np.frombuffer views are read-only; torch wants writable memory)
        return torch.from_numpy(np.array(a, copy=True)).to(device, dtype=dtype)
    arena = getattr(_local, "arena", None)
    staged = arena.take(np.asarray(a)) if arena is not None else None
    if staged is None:
        staged = torch.from_numpy(np.array(a, copy=True)).pin_memory()
    return staged.to(device, dtype=dtype, non_blocking=True)
