"""The custom all-reduce of a tensor-parallel group on CUDA: small sums (a decode step's two per
layer, a few KB to a few MB) as one Triton kernel launch (kernels/all_reduce.py) instead of an
NCCL call, as vLLM's and SGLang's custom all-reduce do; larger ones stay with NCCL.

Owns `CustomAllReduce` (this process's buffers, and views of every peer's mapped through CUDA
IPC; a second set for the sum fused with the residual add and RMSNorm after it,
kernels/all_reduce_norm.py) and `attach` (sets one up for a TPGroup, checks it against NCCL
once, and has every peer agree whether to use it). It must not touch what a step computes: it
is a faster path to the same sum, used only where every peer uses it (the peers issue the same
collectives in the same order, and `fits` and `fits_rows` are functions of the tensor's shape
and dtype alone).

The buffers are ordinary CUDA allocations shared with `UntypedStorage._share_cuda_` (what
torch.multiprocessing sends between processes) and opened by each peer on its own device, so
the kernel reads a peer's memory over NVLink (or PCIe) by plain loads. NVLink multicast is never
used (it can take a shared host's GPUs out of service). A peer that dies while the kernel waits
for it leaves that kernel spinning, as an NCCL call would wait: the rank's liveness checks end
the process (actors/gpu/peers.py).
"""

from __future__ import annotations

import dataclasses
import os

import msgpack
import torch
import torch.distributed as dist

from taipan.kernels.all_reduce import (
    DTYPES,
    MAX_PROGRAMS,
    MAX_WORLD,
    UNBOUNDED,
    one_shot_all_reduce,
)
from taipan.kernels.all_reduce_norm import one_shot_all_reduce_rms_norm
from taipan.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from taipan.kernels.gemv_all_reduce import gemv_all_reduce_rms_norm
from taipan.kernels.rmsnorm import rms_norm
from taipan.ops.parallel import TPGroup, all_gather_single

# The largest sum taken by the kernel: each peer's whole input is read by every other, so the
# bytes over the links grow with W - 1; above this NCCL's ring does better (4 H100s, NVLink,
# bf16, from CUDA graphs: 2 ranks 24 us vs NCCL's 29 at 2 MiB, 80 vs 48 at 8 MiB).
MAX_BYTES_TWO_RANKS = 2 << 20
# A row slot of the fused sum + RMSNorm: rows of up to 8192 16-bit (4096 fp32) elements.
ROW_BYTES = 16 << 10
_HANDLE_BYTES = 4096  # one peer's msgpacked IPC handles, padded (a handle is 64 bytes)
# The first sums wait this many polls at most for a peer (seconds), so that peers which cannot
# see each other's flags fall back to NCCL instead of hanging; later ones wait for good.
SELF_TEST_SPINS = 1 << 22


def _gemv_sum() -> bool:
    """TAIPAN_TP_GEMV_SUM=1: a one-row TP step's o_proj and down_proj each run with their
    all-reduce, residual add and the norm after them in one launch (kernels/gemv_all_reduce.py);
    0 (the default until it has run on GPUs): the product, then the fused sum + norm."""
    value = os.environ.get(GEMV_SUM_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{GEMV_SUM_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


GEMV_SUM_ENV = "TAIPAN_TP_GEMV_SUM"
GEMV_SUM = _gemv_sum()  # fixed at import: graphs bake in their path


class CustomAllReduceError(RuntimeError):
    """The custom all-reduce cannot run here (no CUDA, a group too large, peers that cannot map
    each other's memory, a result that disagreed with NCCL); the message says which."""


def max_bytes_for(world: int) -> int:
    return MAX_BYTES_TWO_RANKS // (world - 1) // 4096 * 4096


class CustomAllReduce:
    """This process's part of the group's custom all-reduce: its data buffer (two halves of
    `max_bytes`), flags and call counters, and every peer's buffer and flags mapped here.
    Build it with `attach`; every peer builds its own at the same time (collectives inside)."""

    def __init__(self, tp: TPGroup):
        if tp.size < 2 or tp.size > MAX_WORLD:
            raise CustomAllReduceError(f"needs 2..{MAX_WORLD} ranks, not {tp.size}")
        if tp.device.type != "cuda":
            raise CustomAllReduceError(f"needs CUDA devices, not {tp.device}")
        index = tp.device.index if tp.device.index is not None else torch.cuda.current_device()
        self.rank, self.size, self.device = tp.rank, tp.size, torch.device("cuda", index)
        self.max_bytes = max_bytes_for(tp.size)
        self.data = torch.empty(2 * self.max_bytes, dtype=torch.uint8, device=self.device)
        self.flags = torch.zeros(MAX_PROGRAMS, MAX_WORLD, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(1, dtype=torch.int32, device=self.device)  # 1: a wait gave up
        self.max_spins = UNBOUNDED
        # The fused kernel's own set (the two protocols must not share buffers or epochs).
        self.rows_cap = self.max_bytes // ROW_BYTES
        self.rows_data = torch.empty_like(self.data)
        self.rows_flags = torch.zeros_like(self.flags)
        self.rows_counters = torch.zeros_like(self.counters)
        # The row-parallel GEMV's own set (kernels/gemv_all_reduce.py): a slot per source rank
        # of MAX_ROWS rows in each half, one flag per source, its call count and finished programs.
        self.gemv_data = torch.empty(
            2 * tp.size * GEMV_MAX_ROWS * ROW_BYTES, dtype=torch.uint8, device=self.device
        )
        self.gemv_flags = torch.zeros(MAX_WORLD, dtype=torch.int64, device=self.device)
        self.gemv_state = torch.zeros(2, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)  # flags are zero before any peer can raise one
        mine = (
            self.data, self.flags, self.rows_data, self.rows_flags, self.gemv_data,
            self.gemv_flags,
        )  # fmt: skip
        shared = _exchange([_share(t) for t in mine], tp)
        self.peer_data, self.peer_flags, self.peer_rows_data, self.peer_rows_flags = [], [], [], []
        self.peer_gemv_data, self.peer_gemv_flags = [], []
        lists = (
            self.peer_data, self.peer_flags, self.peer_rows_data, self.peer_rows_flags,
            self.peer_gemv_data, self.peer_gemv_flags,
        )  # fmt: skip
        for q, handles in enumerate(shared):
            for own, handle, into in zip(mine, handles, lists, strict=True):
                into.append(own if q == self.rank else _open(handle, self.device, own.dtype))
        self.peer_flags = [f.view(MAX_PROGRAMS, MAX_WORLD) for f in self.peer_flags]
        self.peer_rows_flags = [f.view(MAX_PROGRAMS, MAX_WORLD) for f in self.peer_rows_flags]
        self._views: dict[torch.dtype, tuple] = {}
        self._row_views: dict[torch.dtype, tuple] = {}
        self._gemv_views: dict[torch.dtype, tuple] = {}

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce_` takes x (the same answer on every peer for the same x)."""
        return (
            x.dtype in DTYPES
            and x.numel() * x.element_size() <= self.max_bytes
            and x.is_contiguous()
            and x.device == self.device
        )

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in place (x must `fit`); returns x. CUDA-graph capturable."""
        bufs = self._views.get(x.dtype)
        if bufs is None:
            bufs = self._views[x.dtype] = tuple(d.view(x.dtype) for d in self.peer_data)
        flat = x.view(-1)
        flags = tuple(self.peer_flags)
        one_shot_all_reduce(
            flat, flat, self.counters, bufs, flags, self.rank, self.status, self.max_spins
        )
        return x

    def fits_rows(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce_rms_norm_` takes x [rows, hidden] (the same answer on every
        peer for the same x): rows that fit a slot, no more rows than slots, and no more
        bytes than `fits` takes (above that NCCL's ring is faster)."""
        return (
            x.dim() == 2
            and x.dtype in DTYPES
            and x.shape[1] * x.element_size() <= ROW_BYTES
            and x.shape[0] <= self.rows_cap
            and x.numel() * x.element_size() <= self.max_bytes
            and x.stride(-1) == 1
            and x.device == self.device
        )

    def all_reduce_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- sum(x) + residual; x <- rmsnorm(residual) * weight (x must `fits_rows`);
        returns (x, residual). One launch, CUDA-graph capturable."""
        bufs = self._row_views.get(x.dtype)
        if bufs is None:
            shape = (2, self.rows_cap, ROW_BYTES // x.element_size())
            bufs = tuple(d[: 2 * self.rows_cap * ROW_BYTES].view(x.dtype).view(shape)
                         for d in self.peer_rows_data)  # fmt: skip
            self._row_views[x.dtype] = bufs
        return one_shot_all_reduce_rms_norm(
            x, residual, weight, eps, x, self.rows_counters, bufs, tuple(self.peer_rows_flags),
            self.rank, self.status, self.max_spins,
        )  # fmt: skip

    def fits_gemv(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `gemv_all_reduce_rms_norm_` takes x [rows, K] @ w [N, K].T (the same answer
        on every peer for the same shapes): at most MAX_ROWS rows and rows of N that fit a
        slot, on this device. Only when TAIPAN_TP_GEMV_SUM=1 (GEMV_SUM)."""
        return (
            GEMV_SUM
            and x.dim() == 2
            and x.shape[0] <= GEMV_MAX_ROWS
            and x.dtype in DTYPES
            and w.dtype == x.dtype
            and w.shape[0] * x.element_size() <= ROW_BYTES
            and x.device == self.device
        )

    def gemv_all_reduce_rms_norm_(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- sum(x @ w.T) + residual; returns (rmsnorm(residual) * weight, residual)
        (x, w must `fits_gemv`): the product, the sum, the add and the norm in one launch."""
        bufs = self._gemv_views.get(x.dtype)
        if bufs is None:
            shape = (2, self.size, GEMV_MAX_ROWS, ROW_BYTES // x.element_size())
            bufs = tuple(d.view(x.dtype).view(shape) for d in self.peer_gemv_data)
            self._gemv_views[x.dtype] = bufs
        return gemv_all_reduce_rms_norm(
            x, w, residual, weight, eps, self.gemv_state, bufs,
            tuple(self.peer_gemv_flags), self.rank, self.status, self.max_spins,
        )  # fmt: skip


def _share(t: torch.Tensor) -> bytes:
    """The IPC handles of t's storage (as torch.multiprocessing sends them), as bytes."""
    (_, handle, size, offset, ref_handle, ref_offset, event, sync) = (
        t.untyped_storage()._share_cuda_()
    )
    return msgpack.packb([handle, size, offset, ref_handle, ref_offset, event, bool(sync)])


def _open(packed: bytes, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A peer's shared storage mapped on this process's `device` (not the peer's index: the
    mapping must belong to the device whose kernels read it)."""
    handle, size, offset, ref_handle, ref_offset, event, sync = msgpack.unpackb(packed)
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index, handle, size, offset, ref_handle, ref_offset, event, sync
    )
    out = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (size,), (1,))
    return out.view(dtype)


def _exchange(items: list[bytes], tp: TPGroup) -> list[list[bytes]]:
    """Every peer's `items` (msgpacked, padded to a fixed size, all-gathered over the group)."""
    blob = msgpack.packb(items)
    if len(blob) > _HANDLE_BYTES - 4:
        raise CustomAllReduceError(f"IPC handles of {len(blob)} bytes do not fit")
    mine = torch.zeros(_HANDLE_BYTES, dtype=torch.uint8)
    mine[:4] = torch.tensor(list(len(blob).to_bytes(4, "little")), dtype=torch.uint8)
    mine[4 : 4 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = torch.empty(tp.size * _HANDLE_BYTES, dtype=torch.uint8, device=tp.device)
    all_gather_single(out, mine.to(tp.device), group=tp.group)
    rows = out.view(tp.size, _HANDLE_BYTES).cpu().numpy().tobytes()
    peers = []
    for q in range(tp.size):
        row = rows[q * _HANDLE_BYTES : (q + 1) * _HANDLE_BYTES]
        peers.append(msgpack.unpackb(row[4 : 4 + int.from_bytes(row[:4], "little")]))
    return peers


def _self_test(fast: CustomAllReduce, tp: TPGroup) -> str | None:
    """One sum of each dtype by the kernel and by NCCL on the same inputs (a few calls, both
    halves, waits bounded); None when they agree, else what differed."""
    gen = torch.Generator(device=fast.device).manual_seed(1234 + tp.rank)
    fast.max_spins = SELF_TEST_SPINS
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n in (4096, 3 * 1024 + 5, fast.max_bytes // 4):
                x = torch.randn(n, generator=gen, device=fast.device).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=tp.group)
                got = fast.all_reduce_(x.clone())
                if fast.status.item():
                    return f"a peer's flag did not arrive within {SELF_TEST_SPINS} polls"
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    err = (got.float() - want.float()).abs().max().item()
                    return f"{dtype} sum of {n} elements differs from NCCL's by {err:.3g}"
        return _self_test_rows(fast, tp, gen)
    finally:
        fast.max_spins = UNBOUNDED


def _self_test_rows(fast: CustomAllReduce, tp: TPGroup, gen: torch.Generator) -> str | None:
    """The fused sum + RMSNorm against NCCL's sum and kernels/rmsnorm.py, twice (both halves)."""
    for rows in (1, fast.rows_cap):
        x = torch.randn(rows, 1024, generator=gen, device=fast.device)
        shared = torch.Generator(device=fast.device).manual_seed(rows)  # the same on every rank
        weight = torch.rand(1024, generator=shared, device=fast.device)
        residual = torch.ones_like(x)  # (every rank's residual stream is the same)
        summed = x.clone()
        dist.all_reduce(summed, group=tp.group)
        want, want_residual = rms_norm(summed, weight, 1e-6, residual=residual.clone())
        got, got_residual = fast.all_reduce_rms_norm_(x, residual, weight, 1e-6)
        if fast.status.item():
            return f"a peer's flag did not arrive within {SELF_TEST_SPINS} polls (fused norm)"
        for what, a, b in (("norm", got, want), ("residual", got_residual, want_residual)):
            if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
                err = (a - b).abs().max().item()
                return f"the fused sum + RMSNorm's {what} differs from NCCL's by {err:.3g}"
    return _self_test_gemv(fast, tp, gen) if GEMV_SUM else None


def _self_test_gemv(fast: CustomAllReduce, tp: TPGroup, gen: torch.Generator) -> str | None:
    """The GEMV with the sum + RMSNorm in its last program against F.linear, NCCL's sum and
    kernels/rmsnorm.py, three times (both halves)."""
    shared = torch.Generator(device=fast.device).manual_seed(77)  # the same on every rank
    weight = torch.rand(1024, generator=shared, device=fast.device)
    for rows in (1, GEMV_MAX_ROWS, 1):
        x = torch.randn(rows, 256, generator=gen, device=fast.device)
        w = torch.randn(1024, 256, generator=gen, device=fast.device) / 16
        residual = torch.ones(rows, 1024, device=fast.device)
        summed = torch.nn.functional.linear(x, w)
        dist.all_reduce(summed, group=tp.group)
        want, want_residual = rms_norm(summed, weight, 1e-6, residual=residual.clone())
        got, got_residual = fast.gemv_all_reduce_rms_norm_(x, w, residual, weight, 1e-6)
        if fast.status.item():
            return f"a peer's flag did not arrive within {SELF_TEST_SPINS} polls (GEMV sum)"
        for what, a, b in (("norm", got, want), ("residual", got_residual, want_residual)):
            if not torch.allclose(a, b, atol=1e-3, rtol=1e-3):
                err = (a - b).abs().max().item()
                return f"the GEMV with the sum + RMSNorm: its {what} differs by {err:.3g}"
    return None


def attach(tp: TPGroup, required: bool = False) -> tuple[TPGroup, str | None]:
    """`tp` with the custom all-reduce, or `tp` unchanged and the reason (a CUDA group of 2..8
    ranks whose peers can map each other's memory, and whose first sums agree with NCCL's). Every
    peer calls this at the same time and all get the same answer. `required`: raise
    CustomAllReduceError instead of falling back."""
    reason = None
    if tp.size < 2 or tp.device.type != "cuda":
        reason = f"a group of {tp.size} on {tp.device.type} has nothing to speed up"
        if required:
            raise CustomAllReduceError(f"custom_all_reduce=true: {reason}")
        return tp, reason  # (no collective: every peer takes this branch alike)
    fast = None
    try:
        fast = CustomAllReduce(tp)
        reason = _self_test(fast, tp)
    except (RuntimeError, ValueError) as exc:  # CUDA IPC errors surface as RuntimeError
        reason = f"{type(exc).__name__}: {exc}"
    ok = torch.tensor([reason is None], dtype=torch.int32, device=tp.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=tp.group)
    if not ok.item():
        reason = reason or "a peer could not set it up"
        if required:
            raise CustomAllReduceError(f"custom_all_reduce=true, but it cannot run: {reason}")
        return tp, reason
    return dataclasses.replace(tp, fast=fast), None


def for_mode(tp: TPGroup, mode: bool | None) -> tuple[TPGroup, str]:
    """The group to compute with under InferenceConfig.custom_all_reduce `mode` (None: the
    custom all-reduce where `attach` can set it up, False: never, True: required, raising
    CustomAllReduceError where it cannot run), and how its sums run, for the load's log."""
    plain = "nccl" if tp.device.type == "cuda" else "gloo"
    if mode is False:
        return tp, plain
    fast, reason = attach(tp, required=mode is True)
    if reason is None:
        return fast, "custom one-shot (small sums), nccl (large)"
    return tp, f"{plain} (custom all-reduce off: {reason})"
