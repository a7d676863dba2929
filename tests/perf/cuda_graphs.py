"""One helper the GPU timing scripts and tests share: `graph_of`, a function captured in a CUDA
graph after a warm-up on a side stream (as torch asks: allocations and lazy initialization
happen outside the capture)."""

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
