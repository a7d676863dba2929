"""CUDA graphs of the step's forward, one per token-count bucket.

Owns which graph a step runs (`StepGraphs.pick`, pure, so CPU tests check it), their capture and
their replay. A graph records the forward and the logits of every sequence's last token, reading
the persistent step buffers (actors/gpu/buffers.py) at a padded size and writing the logits into
one static buffer; the step that replays it has just filled those buffers with one copy. What
varies between steps lives in device memory (ids, positions, slots, block tables, lengths), and
what a kernel's grid depends on is fixed per bucket, so one capture serves every step it holds.

Buckets (sizes from actors/config.cuda_graph_sizes):
- decode-only, n tokens = n sequences of one token each: attention runs the split-K decode kernel
  over all n rows; padding rows have sequence length 0 (they attend nothing and write nothing);
- mixed, n tokens over min(max_requests, n) sequences: every row through the varlen prefill
  kernel with a grid for n query tokens (programs past a row's queries exit at once).
A step takes the smallest bucket that holds it (decode-only first when every row has one token)
and runs eagerly when none does, or when it wants prompt log-probs (they read every token's
hidden state, which the graphs do not keep).

A second graph per mixed bucket (`then`, an MTP head's passes: actors/gpu/mtp.py) records what
runs after the step's sampling over the same buffers; it is captured right after its bucket's
graph, into the same pool, and replayed with `replay_then`.

The graphs read the KV cache and the weights at their addresses: a KV cache that moves
(resume after offload or recompute) needs a new capture (`capture` again); weights updated in
place keep them valid. Must not touch: sockets, messages, scheduling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Bucket:
    tokens: int
    seqs: int
    decode: bool  # every row one token: the decode kernel


class StepGraphs:
    def __init__(self, decode_sizes, mixed_sizes, max_requests: int):
        self.decode = [Bucket(n, n, True) for n in sorted(decode_sizes)]
        self.mixed = [Bucket(n, min(max_requests, n), False) for n in sorted(mixed_sizes)]
        self._graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self._then: dict[Bucket, torch.cuda.CUDAGraph] = {}  # (mixed buckets, with `then`)
        self._pool = None

    @property
    def buckets(self) -> list[Bucket]:
        return self.decode + self.mixed

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def pick(self, num_tokens: int, num_seqs: int, all_decode: bool) -> Bucket | None:
        """The smallest bucket that holds a step of `num_tokens` tokens over `num_seqs`
        sequences (`all_decode`: each has one token), or None: run it eagerly."""
        if all_decode:
            for b in self.decode:
                if b.tokens >= num_tokens:
                    return b
        for b in self.mixed:
            if b.tokens >= num_tokens and b.seqs >= num_seqs:
                return b
        return None

    def capture(
        self,
        body: Callable[[Bucket], None],
        reset: Callable[[Bucket], None],
        then: Callable[[Bucket], None] | None = None,
    ) -> None:
        """Capture `body(bucket)` for every bucket, largest first, into one memory pool (a
        smaller graph reuses the larger one's activations: steps run one at a time). `reset`
        fills the step buffers with a neutral step of that size first (nothing attended,
        nothing written). Each body runs twice eagerly before its capture (Triton compiles,
        cuBLAS picks its kernels), on a side stream as capture wants. `then`: a second graph
        of every mixed bucket, captured after its first the same way (it may read what the
        first wrote outside the pool, never the first's activations)."""
        self.release()
        self._pool = torch.cuda.graph_pool_handle()
        order = sorted(self.buckets, key=lambda b: (b.tokens, b.seqs, b.decode), reverse=True)
        for bucket in order:
            reset(bucket)
            self._graphs[bucket] = self._record(body, bucket)
            if then is not None and not bucket.decode:
                self._then[bucket] = self._record(then, bucket)
        torch.cuda.synchronize()

    def _record(self, body: Callable[[Bucket], None], bucket: Bucket) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body(bucket)
            body(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            body(bucket)
        return graph

    def replay(self, bucket: Bucket) -> None:
        self._graphs[bucket].replay()

    def replay_then(self, bucket: Bucket) -> None:
        """The second graph of a mixed bucket (`capture`'s `then`)."""
        self._then[bucket].replay()

    def release(self) -> None:
        """Drop every graph and its memory pool (suspend frees them; resume captures again)."""
        self._graphs.clear()
        self._then.clear()
        self._pool = None
