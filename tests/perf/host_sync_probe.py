"""Which host calls wait for the device (device tool helper, not a test): each call below is
timed on the host while the stream runs a ~0.5 s sleep kernel; a call that takes about that long
waited for it. `python3 tests/perf/host_sync_probe.py` on a CUDA machine; prints one line per
call (ms on the host). Issue 28's grammar steps made such calls between their forward and the
next step's launch (tests/perf/NOTES.md, twenty-third session)."""

from __future__ import annotations

import time

import numpy as np
import torch


def probe(name: str, fn, cycles: int = 1_000_000_000) -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # (the device is busy for ~0.5 s)
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    print(f"{name:58s} host {host * 1e3:9.3f} ms (stream {total * 1e3:7.1f} ms)", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    small = np.arange(2, dtype=np.int64)
    masks = np.zeros((64, 1536), dtype=np.int32)
    pinned = torch.zeros(64 * 1536, dtype=torch.int32, pin_memory=True)
    on_dev = torch.zeros(64, 49152, device=dev)
    ring = torch.empty((3, 64), dtype=torch.int64, pin_memory=True)  # (the worker's token ring)
    tokens = torch.zeros(64, dtype=torch.int64, device=dev)
    calls = {
        "sleep alone (nothing after it)": lambda: None,
        "pageable H2D 16 B non_blocking": lambda: torch.from_numpy(small).to(
            dev, non_blocking=True
        ),
        "pageable H2D 393 KB non_blocking": lambda: torch.from_numpy(masks).to(
            dev, non_blocking=True
        ),
        "pinned H2D 393 KB non_blocking (preallocated)": lambda: pinned.to(dev, non_blocking=True),
        "pin_memory() of 16 B (new each time)": lambda: torch.from_numpy(small.copy()).pin_memory(),
        "torch.empty pinned 8 KB": lambda: torch.empty(2048, dtype=torch.int32, pin_memory=True),
        "D2H int64 into a row of a pinned ring (the worker's)": lambda: ring[1][:64].copy_(
            tokens, non_blocking=True
        ),
        "D2H int64 from a stride-0 (expanded) device view": lambda: ring.copy_(
            tokens.expand(3, 64), non_blocking=True
        ),
        "D2H int32 (cast on the device) into a pinned slice": lambda: pinned[:64].copy_(
            on_dev[0, :64].int(), non_blocking=True
        ),
        "D2H into a new pinned tensor non_blocking": lambda: torch.empty(
            64, dtype=torch.int32, pin_memory=True
        ).copy_(on_dev[0, :64].int(), non_blocking=True),
        "device clone 12.6 MB (cached allocator)": lambda: on_dev.clone(),
        "device empty 2 GB (new segment: cudaMalloc)": lambda: torch.empty(
            1 << 29, dtype=torch.float32, device=dev
        ),
        "torch.cuda.Event(blocking=True) + record": lambda: torch.cuda.Event(
            blocking=True
        ).record(),
        "topk 32 of [64, 49152]": lambda: torch.topk(on_dev, 32),
        "topk 32 of [64, 49152], sorted=False": lambda: torch.topk(on_dev, 32, sorted=False),
        "index_select with a blocking index copy": lambda: on_dev.index_select(
            0, torch.from_numpy(small).to(dev)
        ),
        "torch.empty pinned 64 MB (a new size)": lambda: torch.empty(
            16 << 20, dtype=torch.int32, pin_memory=True
        ),
        "D2H int32 into a pinned slice, after that": lambda: pinned[:64].copy_(
            on_dev[0, :64].int(), non_blocking=True
        ),
    }
    for name, fn in calls.items():
        probe(name, fn)


if __name__ == "__main__":
    main()
