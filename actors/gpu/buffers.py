"""Persistent step inputs: device tensors at fixed addresses, filled by one copy per step.

Owns the layout of everything a step's forward and sampling read from the host (token ids,
positions, slots, block tables, sequence lengths, query starts, sampling parameters): one device
byte buffer, sized once from the static maxima (`max_tokens`, `max_requests`, blocks per
sequence), with each field at a fixed, aligned offset. A step packs its arrays into a pinned host
staging buffer and copies it to the device in one transfer; the forward reads views of the
device buffer, so their addresses never change (what CUDA graphs need) and no step allocates.

Padding: a view can be asked for at a padded size (a CUDA-graph bucket); the rows past the real
ones hold neutral values (slot -1 writes nothing, sequence length 0 attends nothing, query
starts repeat the last one), never stale data of an earlier step.

Two staging buffers alternate, and a buffer is refilled only after the copy that last read it
has finished (an event per buffer): the host never rewrites memory a pending asynchronous copy
still reads (the failure mode of Megatron-LM #5715).

Must not touch: the model, sockets or messages — the worker (actors/gpu/worker.py) hands in numpy
arrays and gets device views back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

ALIGN = 256  # bytes: every field starts on a boundary any kernel's vector loads accept


@dataclasses.dataclass(frozen=True)
class Field:
    """One input: its dtype, the axis sized by the step ("tokens" or "seqs", plus one for
    query starts), any fixed trailing extent, and the value padding rows hold."""

    dtype: np.dtype
    axis: str  # "tokens", "seqs" or "seqs+1"
    width: int = 0  # a second, fixed dimension (block tables); 0 = none
    pad: int | float = 0


def step_fields(
    max_blocks_per_seq: int, local: bool = False, snapshots: int = 0
) -> dict[str, Field]:
    """The inputs of one step (see messages/gpu.StepPlan for their meaning); `local`: the
    windowed layers' block tables and slots too (per-layer-group KV); `snapshots`: a hybrid's
    recurrent-state snapshots inside its verify rows, that many entries a row (position, slot;
    padding (1, -1) stores nothing: actors/gpu/forward.py `_verify_snapshots`)."""
    i32, i64, f32, i8 = (np.dtype(t) for t in (np.int32, np.int64, np.float32, np.int8))
    local_fields = {
        "local_block_tables": Field(i32, "seqs", width=max_blocks_per_seq),
        "local_slot_mapping": Field(i64, "tokens", pad=-1),
    }
    snapshot_fields = {
        "snap_pos": Field(i32, "seqs", width=snapshots, pad=1),
        "snap_slots": Field(i32, "seqs", width=snapshots, pad=-1),
    }
    return (
        (local_fields if local else {})
        | (snapshot_fields if snapshots else {})
        | {
            "input_ids": Field(i32, "tokens"),
            "positions": Field(i32, "tokens"),
            "slot_mapping": Field(i64, "tokens", pad=-1),
            "prompt_targets": Field(i32, "tokens", pad=-1),
            "prev_rows": Field(i32, "tokens", pad=-1),
            "query_start_loc": Field(i32, "seqs+1"),  # padded with its last value: empty rows
            "seq_lens": Field(i32, "seqs"),
            "block_tables": Field(i32, "seqs", width=max_blocks_per_seq),
            "sample": Field(i8, "seqs"),
            "temperature": Field(f32, "seqs"),
            "top_k": Field(i32, "seqs"),
            "top_p": Field(f32, "seqs", pad=1.0),
            "min_p": Field(f32, "seqs"),
            "seeds": Field(i64, "seqs"),
            "gen_index": Field(i32, "seqs"),
            "logprobs": Field(i8, "seqs"),
            "top_n": Field(i32, "seqs"),
            "mamba_init": Field(i32, "seqs", pad=-1),  # padding rows read and write no slot
            "mamba_out": Field(i32, "seqs", pad=-1),
        }
    )


class StepBuffers:
    FIELD_NAMES = tuple(step_fields(1))

    def __init__(
        self,
        device: torch.device | str,
        *,
        max_tokens: int,
        max_requests: int,
        max_blocks_per_seq: int,
        local: bool = False,
        snapshots: int = 0,
    ):
        self.device = torch.device(device)
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.fields = step_fields(max_blocks_per_seq, local, snapshots)
        self.offsets: dict[str, int] = {}
        size = 0
        for name, f in self.fields.items():
            self.offsets[name] = size
            size += _round_up(self._capacity(f) * f.dtype.itemsize, ALIGN)
        self.nbytes = size
        self.device_bytes = torch.empty(size, dtype=torch.uint8, device=self.device)
        pinned = self.device.type == "cuda"
        self._staging = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._host = [s.numpy() for s in self._staging]  # the same memory, as numpy
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        # Full-capacity device views, made once: a step's views are slices of these.
        self._views = {name: self._device_view(name) for name in self.fields}

    def _capacity(self, f: Field) -> int:
        rows = {"tokens": self.max_tokens, "seqs": self.max_requests}.get(f.axis)
        rows = self.max_requests + 1 if f.axis == "seqs+1" else rows
        return rows * max(f.width, 1)

    def _device_view(self, name: str) -> torch.Tensor:
        f = self.fields[name]
        start = self.offsets[name]
        flat = self.device_bytes[start : start + self._capacity(f) * f.dtype.itemsize]
        view = flat.view(_TORCH[f.dtype.name])
        return view.view(-1, f.width) if f.width else view

    def load(
        self, arrays: dict[str, np.ndarray], *, num_tokens: int = 0, num_seqs: int = 0
    ) -> dict[str, torch.Tensor]:
        """Copy one step's arrays to the device; returns device views of every field, sized to
        `num_tokens` / `num_seqs` when given (a padded bucket, at least the real sizes), else to
        the real sizes. Raises ValueError for a step larger than the buffers."""
        return self.upload(self.stage(arrays, num_tokens=num_tokens, num_seqs=num_seqs))

    def stage(
        self, arrays: dict[str, np.ndarray], *, num_tokens: int = 0, num_seqs: int = 0
    ) -> tuple[int, int, int]:
        """`load`'s host half: pack the arrays into the next pinned staging buffer. Returns
        what `upload` takes: (staging buffer, tokens, sequences)."""
        tokens = len(arrays["input_ids"])
        seqs = len(arrays["seq_lens"])
        num_tokens, num_seqs = max(num_tokens, tokens), max(num_seqs, seqs)
        if num_tokens > self.max_tokens or num_seqs > self.max_requests:
            raise ValueError(
                f"a step of {num_tokens} tokens and {num_seqs} sequences exceeds the buffers "
                f"({self.max_tokens} tokens, {self.max_requests} sequences)"
            )
        k = self._next
        self._next ^= 1
        copied = self._copied[k]
        if copied is not None and not copied.query():
            # The copy that last read this staging buffer must be done. (Asked first: it
            # almost always is, and synchronize() lets go of the GIL, which the step's
            # collecting thread may then hold for a while.)
            copied.synchronize()
        host = self._host[k]
        rows = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1}
        for name, f in self.fields.items():
            n = rows[f.axis]
            dst = host[self.offsets[name] :][: n * max(f.width, 1) * f.dtype.itemsize]
            dst = dst.view(f.dtype).reshape((n, f.width) if f.width else (n,))
            _pack(dst, arrays[name], f)
        return k, num_tokens, num_seqs

    def upload(
        self, staged: tuple[int, int, int], *, num_tokens: int = 0, num_seqs: int = 0
    ) -> dict[str, torch.Tensor]:
        """`load`'s device half: one copy of the staged buffer; returns the device views, at
        the staged sizes or at `num_tokens` / `num_seqs` where given (a graph's bucket is
        staged, and the step reads back its real rows)."""
        k, staged_tokens, staged_seqs = staged
        # The whole buffer in one transfer (a few hundred KiB at most): the unused tails of
        # the fields travel too, but no view ever reaches them.
        if self.device.type == "cuda":
            self.device_bytes.copy_(self._staging[k], non_blocking=True)
            # (Each staging buffer's event is recorded again once its last copy is done.)
            if self._copied[k] is None:
                self._copied[k] = torch.cuda.Event()
            self._copied[k].record()
        else:
            self.device_bytes.copy_(self._staging[k])
        return self.views(num_tokens=num_tokens or staged_tokens, num_seqs=num_seqs or staged_seqs)

    def views(self, *, num_tokens: int, num_seqs: int) -> Views:
        """Device views of every field at these sizes, without copying anything: what a CUDA
        graph records, and what the step that replays it reads back."""
        rows = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1}
        return Views(self._views, {name: rows[f.axis] for name, f in self.fields.items()})


class Views(Mapping):
    """The step buffers' fields as device views of one step's sizes, each sliced when first
    read: a graphed step reads back a few of its ~30 fields, and slicing every one was ~30
    torch calls per step (33 us on the 2-core box)."""

    __slots__ = ("_full", "_rows", "_made")

    def __init__(self, full: dict[str, torch.Tensor], rows: dict[str, int]):
        self._full, self._rows = full, rows
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._made.get(name)
        if view is None:
            view = self._made[name] = self._full[name][: self._rows[name]]
        return view

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def _pack(dst: np.ndarray, src: np.ndarray, f: Field) -> None:
    """Write `src` into the head of `dst` and padding into the rest."""
    src = np.asarray(src)
    n = len(src)
    if f.width:
        if src.ndim != 2 or src.shape[1] > f.width:
            raise ValueError(f"rows of shape {src.shape} do not fit {f.width} columns")
        dst[:n, : src.shape[1]] = src
        dst[:n, src.shape[1] :] = f.pad
        dst[n:] = f.pad
        return
    dst[:n] = src
    if f.axis == "seqs+1":
        dst[n:] = src[-1] if n else 0  # padded rows are empty: q_len 0
    else:
        dst[n:] = f.pad


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


_TORCH = {
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
}
