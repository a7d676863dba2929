"""Weights straight from a trainer's processes, no disk (DESIGN.md §13): the process group that a
trainer and every gpu process join (`WeightGroup`), the bucket layout both sides derive from the
same list of tensor specs (`BucketLayout`), and a bucket received into views of one flat buffer.

The group is a torch.distributed process group of its own, apart from the default group that
tensor and expert parallelism use: a TCPStore at the trainer's `master_address:master_port`
(hosted by rank 0, the trainer's first sender) and a ProcessGroupNCCL (CUDA) or ProcessGroupGloo
(CPU) over it. Ranks 0 .. rank_offset-1 are the trainer's; taipan's gpu processes take
rank_offset + their index (engine rank * tp_size + tp rank), so one broadcast reaches every TP
follower and EP member too. Made once (`init_weight_transfer`), reused for every update.

A bucket is a list of `TensorSpec` (Hugging Face name, dtype, shape). Its small tensors (under
DIRECT_MIN_BYTES) travel packed: the sender puts them back to back (each at a 256-byte aligned
offset) into one flat uint8 buffer, broadcast first; each receiver reads them as views of its
copy and maps them onto its parameters as a state-dict update (ops/weight_updates.py: fused
rows, its TP shard, its EP experts). Each large tensor then travels alone, in spec order: a
receiver whose destination is a contiguous view of a parameter of the same dtype and shape (a
whole tensor, or a fused q/k/v or gate/up part at TP = 1) receives it straight into the
parameter, with no copy; otherwise into a buffer of its own, mapped like the packed ones. Both
sides derive the same plan from the specs (`BucketLayout`), so only the specs travel. Over NCCL a
bucket's broadcasts go as one coalesced group (`broadcast_bucket`).

A trainer on the same host may instead share its CUDA tensors by CUDA IPC handles, as
torch.multiprocessing shares them (`ipc_handles`: plain wire records, messages/lifecycle.py
IpcTensor); each gpu process opens them where they live (`open_ipc_tensor`: views of the
trainer's memory, no copy through the host) and copies its part in.

Owns: the group, the layout, packing and unpacking, the IPC records both ways. Must not touch the
model's parameters (the gpu worker copies what `state_updates` maps) or the lifecycle (the engine
decides when).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import math
import os
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from taipan.messages.lifecycle import IpcTensor

ALIGN = 256  # bytes: every tensor of a bucket starts at a multiple (any dtype's view is legal)
DIRECT_MIN_BYTES = 1 << 20  # a tensor this large travels alone (straight into its parameter)
BACKENDS = ("nccl", "gloo")
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


class WeightTransferError(RuntimeError):
    """A weight transfer that cannot start or did not complete; the text says which and why."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket: its Hugging Face name, dtype (a key of DTYPES) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise WeightTransferError(
                f"{self.name}: dtype {self.dtype!r} cannot travel (one of {', '.join(DTYPES)})"
            )
        if any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise WeightTransferError(f"{self.name}: bad shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls(name, dtype, tuple(tensor.shape))


class BucketLayout:
    """How a bucket travels (the same on every process): `packed`, its small tensors at
    `offsets` in one flat buffer of `nbytes`; then `direct`, its large ones alone, in order."""

    def __init__(self, specs: Sequence[TensorSpec]):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise WeightTransferError(f"a bucket names a tensor twice: {sorted(names)[:5]}")
        if not specs:
            raise WeightTransferError("an empty bucket")
        self.specs = tuple(specs)
        self.packed = tuple(s for s in specs if s.nbytes < DIRECT_MIN_BYTES)
        self.direct = tuple(s for s in specs if s.nbytes >= DIRECT_MIN_BYTES)
        self.offsets, end = [], 0
        for spec in self.packed:
            self.offsets.append(end)
            end += -(-spec.nbytes // ALIGN) * ALIGN
        self.nbytes = end

    def pack(self, tensors: dict[str, torch.Tensor], device) -> torch.Tensor:
        """The sender's flat buffer: every packed tensor, contiguous, at its offset."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for spec, view in zip(self.packed, self._views(flat), strict=True):
            view.copy_(_checked(spec, tensors[spec.name]))
        return flat

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each packed tensor of the bucket as a view of the received flat buffer."""
        return {s.name: v for s, v in zip(self.packed, self._views(flat), strict=True)}

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise WeightTransferError(
                f"a bucket buffer of {flat.numel()} bytes, expected {self.nbytes}"
            )
        out = []
        for spec, offset in zip(self.packed, self.offsets, strict=True):
            raw = flat[offset : offset + spec.nbytes]
            out.append(raw.view(DTYPES[spec.dtype]).view(spec.shape))
        return out


def _checked(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    if tuple(tensor.shape) != spec.shape or TensorSpec.of("", tensor).dtype != spec.dtype:
        raise WeightTransferError(
            f"{spec.name}: {tuple(tensor.shape)} {tensor.dtype} does not match its spec "
            f"{spec.shape} {spec.dtype}"
        )
    return tensor.detach()


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 30
) -> list[list[TensorSpec]]:
    """Split named tensors into buckets of at most `bucket_bytes` (a larger tensor goes alone), in
    the order given."""
    if bucket_bytes < 1:
        raise WeightTransferError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = [[]]
    size = 0
    for name, tensor in named:
        spec = TensorSpec.of(name, tensor)
        padded = -(-spec.nbytes // ALIGN) * ALIGN
        if buckets[-1] and size + padded > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += padded
    return [b for b in buckets if b]


def nccl_high_priority() -> bool:
    """Whether the weight group's NCCL kernels run on a high-priority stream: by default yes. A
    receiver copies each bucket into its parameters on a side stream while the next bucket's
    broadcast runs (actors/gpu/controls.py); the copies' kernels fill every SM, and a broadcast
    kernel queued behind their blocks starts late, which holds the trainer's next send.
    TAIPAN_WEIGHT_STREAM_PRIORITY=normal gives NCCL's own default (to compare the two)."""
    value = os.environ.get("TAIPAN_WEIGHT_STREAM_PRIORITY", "high")
    if value not in ("high", "normal"):
        raise WeightTransferError(
            f"TAIPAN_WEIGHT_STREAM_PRIORITY must be 'high' or 'normal', got {value!r}"
        )
    return value == "high"


class WeightGroup:
    """One process's membership of a weight-transfer group (trainer or taipan side alike)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        backend: str,
        device: torch.device | str,
        timeout_s: float = 60.0,
    ):
        if backend not in BACKENDS:
            raise WeightTransferError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise WeightTransferError(f"rank {rank} is outside a world of {world_size}")
        self.device = torch.device(device)
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightTransferError(f"backend nccl needs a CUDA device, this one is {device}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                master_address, master_port, world_size, rank == 0, timeout=timeout
            )
            store = dist.PrefixStore("taipan-weight-transfer", store)
            if backend == "gloo":
                self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                options.is_high_priority_stream = nccl_high_priority()
                self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        except (RuntimeError, ValueError) as e:
            raise WeightTransferError(
                f"could not join the weight-transfer group at {master_address}:{master_port} "
                f"as rank {rank} of {world_size} ({backend}): {e}"
            ) from None
        self._store = store  # keeps the rendezvous alive as long as the group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast `tensor` in place from group rank `src`; raises WeightTransferError when a
        peer is gone or the collective times out."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        try:
            self.group.broadcast([tensor], opts).wait()
        except RuntimeError as e:
            raise WeightTransferError(f"weight broadcast failed: {e}") from None

    def receive(
        self, specs: Sequence[TensorSpec], src: int = 0, into=None
    ) -> dict[str, torch.Tensor]:
        """Receive one bucket broadcast from `src`. `into(spec)`: where a large tensor may land
        straight away (a tensor of its dtype and shape, contiguous), or None. Returns the
        tensors that did not land so: packed ones as views of one flat buffer, large ones in
        buffers of their own."""
        layout = BucketLayout(specs)
        out, buffers = {}, []
        if layout.packed:
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            buffers.append(flat)
            out = layout.unpack(flat)  # (views: read only after the broadcast, on the device)
        for spec in layout.direct:
            target = into(spec) if into is not None else None
            if target is None:
                target = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=self.device)
                out[spec.name] = target
            buffers.append(target)
        self.broadcast_bucket(buffers, src)
        return out

    def send(self, specs: Sequence[TensorSpec], tensors: dict[str, torch.Tensor]) -> None:
        """Broadcast one bucket from this rank (the trainer's sender)."""
        layout = BucketLayout(specs)
        buffers = [layout.pack(tensors, self.device)] if layout.packed else []
        for spec in layout.direct:
            tensor = _checked(spec, tensors[spec.name])
            if tensor.device != self.device or not tensor.is_contiguous():
                tensor = tensor.to(self.device).contiguous()
            buffers.append(tensor)
        self.broadcast_bucket(buffers, self.rank)

    def broadcast_bucket(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Broadcast a bucket's buffers in order, as one coalesced NCCL group where the backend
        coalesces (one launch for the bucket instead of one per tensor: a model of 291 tensors
        paid each one's start-up on both sides); gloo broadcasts them one by one. Every member
        calls this with the same buffers' sizes in the same order (both derive them from the
        bucket's specs), so the groups match."""
        if len(tensors) < 2 or self.backend != "nccl":
            for tensor in tensors:
                self.broadcast(tensor, src)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        try:
            self.group._start_coalescing()  # (the backend's: no device argument)
            for tensor in tensors:
                self.group.broadcast([tensor], opts)
            self.group._end_coalescing().wait()
        except RuntimeError as e:
            raise WeightTransferError(f"weight broadcast failed: {e}") from None

    def synchronize(self) -> None:
        """Wait until every collective this process queued has run on its device."""
        _sync(self.device)

    def close(self) -> None:
        """Leave the group without waiting for the other members (NCCL's abort: a shutdown
        would wait for every member to shut down too, and the trainer closes after taipan)."""
        group, self.group = self.group, None
        for name in ("abort", "shutdown"):
            end = getattr(group, name, None)
            if end is not None:
                try:
                    end()
                except RuntimeError:
                    pass  # already gone with its peers
                return


def trainer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    backend=None,
    device=None,
    rank: int = 0,
    timeout_s: float = 60.0,
) -> WeightGroup:
    """The trainer's membership (taipan.rl.init_weight_transfer_group): `device` None: the
    current CUDA device if any, else the CPU; `backend` None: nccl on CUDA, else gloo."""
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    return WeightGroup(
        master_address, master_port, world_size, rank, backend, device, timeout_s=timeout_s
    )


# ---- CUDA IPC: a trainer's tensors on the same host (update_weights_from_ipc) -----------------

# torch.multiprocessing.reductions.rebuild_cuda_tensor's parameters, as reduce_tensor gives its
# arguments (the same from torch 1.x through 2.13; checked before use, so that a torch that
# changed them is a clear error rather than a wrong tensor).
REBUILD_CUDA_TENSOR_ARGS = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
    "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)  # fmt: skip


def ipc_handles(named: Iterable[tuple[str, torch.Tensor]]) -> list[IpcTensor]:
    """The wire records of a trainer's CUDA tensors, one per (Hugging Face name, tensor), shared
    as torch.multiprocessing shares them (`reduce_tensor`: an IPC handle of the allocation, and
    an event recorded on the current stream that the receiver waits on before reading). The
    records point at the trainer's memory: keep every tensor alive and unchanged until taipan
    has acknowledged the update. Raises WeightTransferError for a tensor that is not on a CUDA
    device or whose dtype cannot travel."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    records = []
    for name, tensor in named:
        tensor = tensor.detach()  # (a parameter's data: autograd cannot cross processes)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WeightTransferError(
                f"{name}: dtype {dtype} cannot travel (one of {', '.join(DTYPES)})"
            )
        if tensor.device.type != "cuda":
            raise WeightTransferError(
                f"update_weights_from_ipc shares CUDA tensors only; {name} is on {tensor.device}"
            )
        index = tensor.device.index
        if tensor.numel() == 0:  # no storage to share
            records.append(IpcTensor(
                name, dtype, list(tensor.shape), list(tensor.stride()), 0, index,
                _device_uuids()[index], None, 0, 0, None, 0, None, False,
            ))  # fmt: skip
            continue
        rebuild, args = reduce_tensor(tensor)
        if rebuild is not rebuild_cuda_tensor or len(args) != len(REBUILD_CUDA_TENSOR_ARGS):
            raise WeightTransferError(
                f"torch {torch.__version__} shares CUDA tensors in a way taipan does not know "
                f"({getattr(rebuild, '__name__', rebuild)} with {len(args)} arguments)"
            )
        a = dict(zip(REBUILD_CUDA_TENSOR_ARGS, args, strict=True))
        device = int(getattr(a["storage_device"], "index", a["storage_device"]))
        records.append(IpcTensor(
            name, dtype, list(a["tensor_size"]), list(a["tensor_stride"]), a["tensor_offset"],
            device, _device_uuids()[device], a["storage_handle"],
            a["storage_size_bytes"], a["storage_offset_bytes"], a["ref_counter_handle"],
            a["ref_counter_offset"], a["event_handle"], bool(a["event_sync_required"]),
        ))  # fmt: skip
    return records


def open_ipc_tensor(record: IpcTensor) -> torch.Tensor:
    """The trainer's tensor of `record`, opened in this process on the GPU it lives on (found by
    its UUID, so a process that numbers the GPUs otherwise still finds it): a view of the
    trainer's memory, no copy. Valid while the trainer keeps the tensor; dropping every view
    closes the mapping and releases the trainer's block. Rebuilt from the record's data with
    torch's own `rebuild_cuda_tensor` (nothing is unpickled). Raises WeightTransferError naming
    the tensor when the record does not describe a tensor or the handle cannot be opened (the
    trainer is on another host, is this very process, or has freed the tensor)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    name = record.name
    problem = _record_problem(record)
    if problem is not None:
        raise WeightTransferError(f"update_weights_from_ipc: {name}: {problem}")
    device, dtype = ipc_device(record), DTYPES[record.dtype]
    if math.prod(record.shape) == 0:
        return torch.empty(tuple(record.shape), dtype=dtype, device=device)
    _check_rebuild_signature(rebuild_cuda_tensor)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(record.shape), tuple(record.stride), record.storage_offset,
            torch.UntypedStorage, dtype, device, record.handle, record.storage_size_bytes,
            record.storage_offset_bytes, False, record.ref_counter_handle,
            record.ref_counter_offset, record.event_handle, record.event_sync_required,
        )  # fmt: skip
    except (RuntimeError, TypeError, ValueError) as e:
        raise WeightTransferError(
            f"update_weights_from_ipc: cannot open {name}'s CUDA IPC handle on cuda:{device}: "
            f"{e} (the trainer must be another process on this host, keeping the tensor alive "
            "until the ack)"
        ) from None


def _record_problem(r: IpcTensor) -> str | None:
    """What makes a record describe no tensor of its storage, or None (checked before a handle
    is opened: a view past its storage would read another tensor's memory)."""
    if r.dtype not in DTYPES:
        return f"dtype {r.dtype!r} cannot travel (one of {', '.join(DTYPES)})"
    if len(r.shape) != len(r.stride):
        return f"shape {list(r.shape)} and stride {list(r.stride)} differ in rank"
    if min((*r.shape, *r.stride, r.storage_offset, r.storage_offset_bytes), default=0) < 0:
        return "a negative size, stride or offset"
    if math.prod(r.shape) == 0:
        return None
    itemsize = DTYPES[r.dtype].itemsize
    end = r.storage_offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride, strict=True)) + 1
    if end * itemsize > r.storage_size_bytes:
        return f"its view ends at byte {end * itemsize}, past its storage's {r.storage_size_bytes}"
    if r.handle is None or r.ref_counter_handle is None:
        return "no IPC handle for a tensor with elements"
    if r.event_sync_required and r.event_handle is None:
        return "an event to wait on, but no event handle"
    return None


def ipc_device(record: IpcTensor) -> int:
    """This process's index of the GPU holding `record`'s tensor: the one with its UUID (the
    trainer's index where the record has none)."""
    if not torch.cuda.is_available():
        raise WeightTransferError("update_weights_from_ipc needs CUDA, and this process has none")
    wanted = record.device_uuid.lower().removeprefix("gpu-")
    if wanted:
        uuids = _device_uuids()
        if wanted not in uuids:
            raise WeightTransferError(
                f"update_weights_from_ipc: {record.name} lives on GPU {record.device_uuid}, "
                f"which this process does not see (it sees {', '.join(uuids) or 'none'}): CUDA "
                "IPC needs the trainer and every taipan process on one host, seeing that GPU"
            )
        return uuids.index(wanted)
    if not 0 <= record.device < torch.cuda.device_count():
        raise WeightTransferError(
            f"update_weights_from_ipc: {record.name} is on cuda:{record.device}, which this "
            f"process does not have ({torch.cuda.device_count()} GPUs)"
        )
    return record.device


@functools.cache
def _device_uuids() -> tuple[str, ...]:
    """The UUID of each CUDA device of this process, by index ("" where torch does not tell),
    in one spelling (older torch gave "GPU-<uuid>", 2.11 and later a `_CUuuid` printing bare)."""
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return tuple(str(getattr(p, "uuid", "") or "").lower().removeprefix("gpu-") for p in props)


@functools.cache
def _check_rebuild_signature(rebuild) -> None:
    names = tuple(inspect.signature(rebuild).parameters)
    if names != REBUILD_CUDA_TENSOR_ARGS:
        raise WeightTransferError(
            f"torch {torch.__version__}'s rebuild_cuda_tensor takes {names}, not the arguments "
            "taipan knows; update_weights_from_ipc cannot rebuild the trainer's tensors"
        )


# ---- the link alone (`taipan bench --workload weight-sync`: the raw broadcast of the same bytes)


def time_broadcasts(group: WeightGroup, sizes: Sequence[int], repeats: int) -> list[float]:
    """Seconds of each of `repeats` rounds broadcasting one flat buffer per size from rank 0
    (every member runs this; buffers allocated once, before the first round)."""
    buffers = [torch.zeros(n, dtype=torch.uint8, device=group.device) for n in sizes]
    seconds = []
    for _ in range(repeats):
        _sync(group.device)
        start = time.perf_counter()
        for buf in buffers:
            group.broadcast(buf, 0)
        _sync(group.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def link_receiver(
    master_address: str,
    master_port: int,
    rank: int,
    device: str,
    sizes,
    repeats: int,
    world_size: int = 2,
) -> None:
    """A process that only receives (`time_broadcasts` on rank `rank` of `world_size`)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    group = WeightGroup(master_address, master_port, world_size, rank, backend, device)
    time_broadcasts(group, sizes, repeats)
    group.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
