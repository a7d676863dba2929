"""Helpers the GPU timing scripts and tests share: `graph_of`, a function captured in a CUDA
graph after a warm-up on a side stream (as torch asks: allocations and lazy initialization
happen outside the capture), and `graph_us`, the median time of one call from such a graph."""

from __future__ import annotations

import torch


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """`fn` (no arguments) run once on a side stream, then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per call of `fn` (no arguments), from a CUDA graph of `calls` calls replayed
    `reps` times between CUDA events: the median replay over `calls`."""
    graph = graph_of(lambda: [fn() for _ in range(calls)])
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]
