"""Tensor parallelism: a model's weights split over T processes (ranks) that run every step
together and combine their partial results through torch.distributed (NCCL on CUDA, gloo on CPU).

Built for every model family: Llama, Qwen3-MoE and NemotronH (experts split along their
intermediate size, ops/moe.py; Mamba mixers by heads and groups, ops/mamba.py), alone or with
expert parallelism (ops/expert_parallel.py `init_tp_ep`). On CUDA the small sums may take the
custom all-reduce (ops/custom_all_reduce.py, `TPGroup.fast`) instead of NCCL.

Owns `TPGroup`, the handle a sharded model holds (rank, size, the process group), with the
collectives the layers call: `all_reduce` (sum, in place) and `all_gather` (along a dim). At size
1 each is a no-op, so one model code path serves every T. Owns too how a dimension is split over
the ranks (`shard_heads`, `even_shard`, `vocab_shard`: pure functions of rank and size), and
`init_tp` / `destroy_tp`, which join and leave the group with a bounded timeout.

The collectives are CUDA-graph capturable with NCCL: no host sync, no branch on tensor values,
their outputs allocated inside the collective call (a graph's memory pool under capture).
Every rank must issue the same collectives in the same order: a follower runs the very plan its
leader runs (actors/gpu), and nothing here decides what a step computes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0  # joining the group, and any one collective after that
# torch 2.13 renamed all_gather_into_tensor (same contract); the GPU image runs 2.11.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPError(ValueError):
    """A model cannot be split over this many ranks, or the group cannot be formed; the
    message names the dimension and the size."""


class HeadShard(NamedTuple):
    """A rank's attention heads: query heads [q_start, q_start + q_count), kv heads
    [kv_start, kv_start + kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


class VocabShard(NamedTuple):
    """A rank's vocabulary rows: ids [start, start + count) are real, the shard holds `padded`
    rows (every rank the same number; rows past the vocabulary are zeros)."""

    start: int
    count: int
    padded: int


def even_shard(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, count) of rank's equal share of `n` items; TPError unless `size` divides n."""
    if n % size:
        raise TPError(f"{what} ({n}) is not divisible by the tensor-parallel size ({size})")
    count = n // size
    return rank * count, count


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Query heads split evenly; kv heads split evenly too, or, when there are fewer kv heads
    than ranks and `size` is a multiple of them, each kv head replicated on size/num_kv_heads
    consecutive ranks (one per rank): the kv head its query heads read, as in Megatron and vLLM.
    Replicated kv heads are stored by every rank that holds them (more KV memory per token)."""
    q_start, q_count = even_shard(num_heads, rank, size, "num_heads")
    if num_kv_heads % size == 0:
        kv_start, kv_count = even_shard(num_kv_heads, rank, size, "num_kv_heads")
    elif size % num_kv_heads == 0:
        kv_start, kv_count = rank // (size // num_kv_heads), 1
    else:
        raise TPError(
            f"num_kv_heads ({num_kv_heads}) is not divisible by the tensor-parallel size "
            f"({size}), nor does it divide it (then each kv head would be replicated)"
        )
    return HeadShard(q_start, q_count, kv_start, kv_count)


def vocab_shard(vocab_size: int, rank: int, size: int) -> VocabShard:
    """Contiguous shards of ceil(vocab_size / size) rows; the last ones are padded."""
    padded = -(-vocab_size // size)
    start = rank * padded
    return VocabShard(start, max(0, min(padded, vocab_size - start)), padded)


class FastAllReduce(Protocol):
    """A faster path to the group's sum for the tensors it `fits` (ops/custom_all_reduce.py),
    and to the sum fused with the residual add and RMSNorm after it for the rows it
    `fits_rows` (ops/layers.RMSNorm calls it), and to a row-parallel product with that sum, add
    and norm for the products it `fits_gemv` (DecoderLayer._fused_tp_forward calls it)."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor: ...

    def fits_rows(self, x: torch.Tensor) -> bool: ...

    def all_reduce_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fits_gemv(self, x: torch.Tensor, w: torch.Tensor) -> bool: ...

    def gemv_all_reduce_rms_norm_(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, eq=False)
class TPGroup:
    """This process's place in its tensor-parallel group. `group` is None exactly at size 1
    (no torch.distributed needed); `device` is where the collectives' tensors live. `fast`:
    the custom all-reduce every peer agreed to use for the sums it fits (None: NCCL / gloo
    for every sum)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")
    fast: FastAllReduce | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TPError(f"the tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise TPError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")
        if (self.group is None) != (self.size == 1):
            raise TPError(f"a tensor-parallel group of size {self.size} needs a process group")

    def __deepcopy__(self, memo) -> TPGroup:
        return self  # a model copy joins the same group; a process group is not copyable

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns x."""
        if self.size > 1:
            if self.fast is not None and self.fast.fits(x):
                return self.fast.all_reduce_(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (same shape on each) concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        # The concatenated form along dim 0 (gloo has no stacked one); then rank r's x is out[r].
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x.contiguous(), group=self.group)
        out = out.view(self.size, *x.shape)
        return out.movedim(0, dim).flatten(dim, dim + 1)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a host sync: for load time, not steps)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return shard_heads(num_heads, num_kv_heads, self.rank, self.size)

    def even(self, n: int, what: str) -> tuple[int, int]:
        return even_shard(n, self.rank, self.size, what)

    def vocab(self, vocab_size: int) -> VocabShard:
        return vocab_shard(vocab_size, self.rank, self.size)


SINGLE = TPGroup()  # no tensor parallelism


def join_world(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    what: str,
    error: type[Exception],
    backend: str | None = None,
) -> str:
    """Join this process's torch.distributed world (`size` processes meeting at `init_method`)
    as `rank`: NCCL bound to `device` on CUDA, gloo otherwise (unless `backend` says). `error`
    (naming `what`) when the process already belongs to one, or the others do not come within
    `timeout_s` (later collectives time out likewise). Returns the backend."""
    if dist.is_initialized():
        raise error("this process already belongs to a torch.distributed group")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device  # NCCL binds its communicator to this device eagerly
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **options,
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError and friends subclass these
        raise error(
            f"{what} could not join the group at {init_method} within {timeout_s:g} s: {exc}"
        ) from exc
    return backend


def share_seed(device: torch.device) -> None:
    """Seed torch's generators from the world's rank 0 (unseeded sampling then draws the same
    keys on every peer, since every peer draws the same sequence)."""
    seed = torch.tensor([torch.initial_seed() & (2**62 - 1)], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed.item()))


def init_tp(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the tensor-parallel group of `size` processes as `rank` (every member calls this
    with the same `init_method`, e.g. "tcp://127.0.0.1:29500" or "file:///tmp/tp-init").
    backend: "nccl" for a CUDA device, "gloo" otherwise (the default). Waits at most
    `timeout_s` for the others (then raises); later collectives time out likewise.

    The group is this process's default (world) group: one tensor-parallel group per process.
    Before returning, one collective creates the communicator (so no CUDA graph capture does)
    and seeds torch's generators from rank 0's (unseeded sampling draws the same keys on every
    rank, since every rank draws the same sequence)."""
    if size < 1:
        raise TPError(f"the tensor-parallel size must be >= 1, got {size}")
    device = torch.device(device)
    if size == 1:
        return TPGroup(device=device)
    if not 0 <= rank < size:
        raise TPError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
    what = f"tensor-parallel rank {rank} of {size}"
    backend = join_world(rank, size, init_method, device, timeout_s, what, TPError, backend)
    tp = TPGroup(rank, size, dist.group.WORLD, device)
    share_seed(device)
    return tp


def destroy_tp(tp: TPGroup) -> None:
    """Leave the group `init_tp` formed (nothing at size 1)."""
    if tp.group is not None and dist.is_initialized():
        dist.destroy_process_group()
