"""CUDA graphs of a draft model's decode-only forwards (speculative_method "draft_model",
actors/gpu/draft.py): every forward the draft runs in a step whose rows are one token each (a
plain decode step's rows, a verify row's last two known tokens as two rows, each greedy draft
step) replays the graph of the smallest bucket that holds its rows, instead of launching the
draft's layers one by one (the thirteenth session measured the eager draft at 7.5x a plain 1B
step on an H100).

A graph reads static buffers at a bucket's size: one int64 block of per-row fields (token, the
row of the previous step's sampled token to take instead or -1, position, slot, context
length, and a gather index the caller may use) and the block tables; it writes each row's
greedy next token (argmax of the draft's logits) into `out`. Padding rows have context length
0 and slot -1: they attend nothing and write nothing (the decode attention kernel's contract).
What a kernel's grid depends on is fixed per bucket, so one capture serves every forward it
holds. The buffers are filled from pinned host memory without waiting (a ring of staging
buffers, each reused once the copy that last read it is done): a copy from pageable memory
would make the host wait for the previous step's whole forward, which is what overlapping
the next step's host work with it is for.

The graphs read the draft's KV cache, its weights and the worker's sampled-token buffer at
their addresses: they are captured with the target's graphs and released with them (a
self-draft's weights are the target's, updated in place; a separate draft's never move). A
self-draft sharded over tensor-parallel peers runs eagerly (its all-reduces would be captured
apart from the target's).

Must not touch: the target's KV cache, its graphs, the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.actors.gpu.graphs import Bucket, StepGraphs
from taipan.ops.attention import AttentionMetadata

__all__ = ["DraftGraphs", "draft_graph_sizes"]

# Rows of the static per-row block (int64).
TOKEN, PREV, POSITION, SLOT, LENGTH, PICK = range(6)
FIELDS = PICK + 1
STAGING = 4  # pinned staging buffers in the ring (a verify step loads up to k + 1 times)


# The largest bucket: a graph keeps its rows' fp32 logits in its pool (128 rows of a 128k
# vocabulary: 64 MiB, outside the KV sizing); speculation pays at small batches, and a larger
# forward runs eagerly.
MAX_ROWS = 128


def draft_graph_sizes(decode_sizes, max_requests: int) -> tuple[int, ...]:
    """The row counts to capture: the target's decode sizes and their doubles (a verify row
    is two rows in the draft's first forward), none above 2 * max_requests or MAX_ROWS."""
    sizes = {s for s in decode_sizes} | {2 * s for s in decode_sizes}
    bound = min(2 * max_requests, MAX_ROWS)
    return tuple(sorted(s for s in sizes if 0 < s <= bound))


class DraftGraphs:
    def __init__(self, model, kv_cache, block_size: int, sizes, max_blocks: int, device):
        if not sizes:
            raise ValueError("DraftGraphs needs at least one bucket size")
        self.model, self.kv_cache, self.device = model, kv_cache, torch.device(device)
        self.block_size = block_size
        self.sizes = tuple(sorted(sizes))
        n = self.sizes[-1]
        # The per-row block of bucket b is the first FIELDS * b values, viewed [FIELDS, b]
        # (`fields`): contiguous, so each load is one plain copy.
        self._rows = torch.zeros(FIELDS * n, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        pinned = self.device.type == "cuda"
        self._staging = [
            (
                torch.zeros(FIELDS * n, dtype=torch.int64, pin_memory=pinned),
                torch.zeros(n, max_blocks, dtype=torch.int32, pin_memory=pinned),
            )
            for _ in range(STAGING if pinned else 1)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._next = 0
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.out = torch.zeros(n, dtype=torch.int64, device=device)
        self._sampled: torch.Tensor | None = None
        self._count = 0  # rows the last load filled
        self.replays = 0  # forwards served by a captured graph
        # Captured, replayed and released as the target's (decode buckets of n rows each).
        self._graphs = StepGraphs(self.sizes, (), max_requests=n)

    def pick(self, num_rows: int) -> int | None:
        """The smallest bucket holding `num_rows` one-token rows, or None (run eagerly)."""
        bucket = self._graphs.pick(num_rows, num_rows, all_decode=True)
        return None if bucket is None else bucket.tokens

    def load(self, n: int, rows: np.ndarray, tables: np.ndarray) -> None:
        """Fill the buffers for a forward of bucket `n`: `rows` [<= FIELDS, R] int64 (TOKEN, PREV,
        POSITION, SLOT, LENGTH[, PICK]), `tables` [R, <= max_blocks]; rows R..n are padding.
        Two asynchronous copies from the next pinned staging buffer, queued in stream order
        after the forward that last read the device buffers."""
        count = self._count = rows.shape[1]
        k = self._next
        self._next = (k + 1) % len(self._staging)
        copied = self._copied[k]
        if copied is not None and not copied.query():
            copied.synchronize()  # (the copy that last read this staging buffer)
        host_rows, host_tables = self._staging[k]
        block, padded = host_rows.numpy()[: FIELDS * n].reshape(FIELDS, n), host_tables.numpy()[:n]
        block[:] = 0
        block[PREV, count:] = block[SLOT, count:] = -1
        block[: rows.shape[0], :count] = rows
        padded[:] = 0
        padded[:count, : tables.shape[1]] = tables
        cuda = self.device.type == "cuda"
        self._rows[: FIELDS * n].copy_(host_rows[: FIELDS * n], non_blocking=cuda)
        self.tables[:n].copy_(host_tables[:n], non_blocking=cuda)
        if cuda:
            if self._copied[k] is None:
                self._copied[k] = torch.cuda.Event()
            self._copied[k].record()

    def fields(self, n: int) -> torch.Tensor:
        """The device block of bucket `n`: [FIELDS, n] int64 (TOKEN, PREV, ... rows)."""
        return self._rows[: FIELDS * n].view(FIELDS, n)

    def body(self, n: int) -> None:
        """What a graph of bucket `n` records. Run eagerly on the CPU (tests), over the loaded
        rows only: the CPU's attention takes no empty rows."""
        rows = self.fields(n)
        if not rows.is_cuda:
            n, rows = self._count, rows[:, : self._count]
        ids = rows[TOKEN]
        if self._sampled is not None:
            prev = rows[PREV]
            ids = torch.where(prev >= 0, self._sampled[prev.clamp(min=0)], ids)
        attn = AttentionMetadata(
            query_start_loc=self.query_start[: n + 1],
            seq_lens=rows[LENGTH].to(torch.int32),
            block_tables=self.tables[:n],
            slot_mapping=rows[SLOT],
            num_decodes=n,
            max_query_len=1,
        )
        if not rows.is_cuda:  # (the CPU's attention wants its layout)
            attn.with_layout(np.arange(n + 1), rows[LENGTH].numpy(), self.block_size)
        hidden = self.model(ids, rows[POSITION], attn, self.kv_cache)
        self.out[:n].copy_(self.model.compute_logits(hidden).argmax(dim=-1))

    def run(self, n: int) -> torch.Tensor:
        """The forward of bucket `n` over the loaded buffers (its graph when captured);
        returns `out[:n]`, each row's greedy next token."""
        if self._graphs.captured:
            self._graphs.replay(Bucket(n, n, True))
            self.replays += 1
        else:
            self.body(n)
        return self.out[:n]

    def capture(self, sampled: torch.Tensor) -> None:
        """Capture every bucket (actors/gpu/graphs.py StepGraphs.capture), each over padding
        only (nothing attended, nothing written); `sampled`: the worker's sampled-token buffer
        (what PREV rows read)."""
        self._sampled = sampled
        empty, no_tables = np.zeros((FIELDS, 0), dtype=np.int64), np.zeros((0, 0), np.int32)
        self._graphs.capture(
            lambda b: self.body(b.tokens), lambda b: self.load(b.tokens, empty, no_tables)
        )

    def use_eagerly(self, sampled: torch.Tensor) -> None:
        """Run the bodies without graphs (the CPU tests: a CPU worker has no draft graphs):
        `sampled` as for capture."""
        self.release()
        self._sampled = sampled

    def release(self) -> None:
        self._graphs.release()
