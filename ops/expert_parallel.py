"""Expert parallelism: the E ranks of a group each hold 1/E of every MoE layer's routed experts
(`expert_share`), while attention, the router and the shared experts stay whole on every rank
and each rank serves its own tokens (data parallel). Inside every MoE layer the tokens of all
ranks meet the experts that hold them (`TokenExchange`):

    all-gather the ranks' tokens (padded to an agreed count n): x [E·n, H], ids, weights
    every rank runs its local experts over all E·n rows (a partial sum: kernels/moe.py)
    reduce-scatter (sum): each rank gets back its own n rows, summed over every rank's experts

All-gather + reduce-scatter rather than an all-to-all: shapes are fixed by n alone (one CUDA
graph per bucket; no count exchange, no host sync), no token is ever dropped, and each rank
receives the same E·n rows a capacity-free padded all-to-all would have to reserve (a token may
choose experts on every rank). An all-to-all moves less only with variable splits, which need
the counts on the host first.

Every rank must call the exchange of every MoE layer in the same order with the same n: a rank
with no tokens runs `exchange_only` (its experts still serve the others' rows). n is agreed per
step by `EPGroup.agree` (an all-reduce max over a gloo group of host integers: no device sync,
and on CUDA no kernel) before any forward, and is a plain int when a CUDA graph is captured.

With tensor parallelism too (`init_tp_ep`), each engine rank is T processes holding a slice of
every one of its experts' intermediate size: the exchange runs between the processes of one
slice, and the layer's TP all-reduce adds the slices.

Owns the group (`init_ep`, `init_tp_ep`, `EPGroup`) and the exchange. Must not touch:
scheduling, sockets.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from taipan.ops.moe import exchange_rows, moe_blocks, mtp_moe_blocks, set_expert_dispatch
from taipan.ops.parallel import TPGroup, join_world, share_seed

DEFAULT_TIMEOUT_S = 120.0  # joining the group, and any one collective after that
# torch 2.13 renamed these (same contracts); the GPU image runs 2.11.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class EPError(ValueError):
    """The group cannot be formed, or a model cannot be split over it; the text says why."""


@dataclasses.dataclass(frozen=True, eq=False)
class EPGroup:
    """This process's place in its expert-parallel group: `group` carries the tensors (NCCL on
    CUDA, gloo on CPU), `host` the agreed host integers (gloo: `group` itself on CPU)."""

    rank: int
    size: int
    group: dist.ProcessGroup
    host: dist.ProcessGroup
    device: torch.device

    def agree(self, values: Sequence[int]) -> list[int]:
        """The elementwise max of every rank's `values` (a blocking host collective)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host)
        return t.tolist()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on each) stacked along dim 0 in rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [size·n, ...] summed over the ranks; returns this rank's n rows of the sum."""
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter(out, x.contiguous(), group=self.group)
        return out


def expert_share(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's experts: an equal, contiguous share."""
    if num_experts % size:
        raise EPError(
            f"the model's {num_experts} experts cannot be split evenly over an expert-parallel "
            f"group of {size} ranks: choose an expert_parallel_size that divides {num_experts}"
        )
    count = num_experts // size
    return rank * count, count


@dataclasses.dataclass(frozen=True)
class ExpertShare:
    """A rank's `expert_share`, resolved once the model's expert count is known (what
    ops.loader.load_model takes as `expert_range`)."""

    rank: int
    size: int

    def __call__(self, num_experts: int) -> tuple[int, int]:
        return expert_share(num_experts, self.rank, self.size)

    def __repr__(self) -> str:
        return f"(rank {self.rank}'s share of an expert-parallel group of {self.size})"


def init_ep(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> EPGroup:
    """Join the expert-parallel group of `size` processes as `rank` (every member calls this
    with the same `init_method`, e.g. "tcp://127.0.0.1:29500"); waits at most `timeout_s` for
    the others, and later collectives time out likewise. The group is this process's default
    (world) group. One collective before returning creates the communicators, so no CUDA graph
    capture does (the hang of Megatron-LM #6412)."""
    if not 0 <= rank < size or size < 2:
        raise EPError(f"expert-parallel rank {rank} of {size}: need 0 <= rank < size, size >= 2")
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    what = f"expert-parallel rank {rank} of {size}"
    backend = join_world(rank, size, init_method, device, timeout_s, what, EPError)
    world = dist.group.WORLD
    host = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    ep = EPGroup(rank, size, world, host, device)
    ep.agree([0])
    dist.barrier(group=world)  # (NCCL: the communicator exists before any capture)
    return ep


def init_tp_ep(
    ep_rank: int,
    ep_size: int,
    tp_rank: int,
    tp_size: int,
    init_method: str,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[TPGroup, EPGroup]:
    """Join an expert-parallel group of `ep_size` engine ranks that are each `tp_size`
    tensor-parallel processes: one world of ep_size x tp_size processes (process
    ep_rank * tp_size + tp_rank; every one the same `init_method`), cut into one tensor-parallel
    group per engine rank and one expert-parallel group per tensor-parallel rank (the processes
    holding the same slice of every expert). Returns this process's (TPGroup, EPGroup).

    Inside a MoE layer the exchange runs over the EP group of this slice (every TP peer of an
    engine rank holds the same tokens), its reduce-scatter sums the slice over the experts of
    every engine rank, and the layer's one TP all-reduce sums the slices (ops/moe.py)."""
    if tp_size < 2:
        raise EPError(f"init_tp_ep is for tensor-parallel size >= 2 (got {tp_size}): use init_ep")
    if not 0 <= tp_rank < tp_size or not 0 <= ep_rank < ep_size or ep_size < 2:
        raise EPError(
            f"expert-parallel rank {ep_rank} of {ep_size}, tensor-parallel rank {tp_rank} of "
            f"{tp_size}: need 0 <= rank < size, and an expert-parallel size >= 2"
        )
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    what = (
        f"process {tp_rank} of expert-parallel rank {ep_rank} (a group of {ep_size} x {tp_size} "
        "processes)"
    )
    world_rank, world_size = ep_rank * tp_size + tp_rank, ep_size * tp_size
    backend = join_world(world_rank, world_size, init_method, device, timeout_s, what, EPError)
    # Every process creates every subgroup, in the same order (torch.distributed's rule).
    tp_groups = [
        dist.new_group([e * tp_size + k for k in range(tp_size)], timeout=timeout)
        for e in range(ep_size)
    ]
    ep_groups, ep_hosts = [], []
    for k in range(tp_size):
        ranks = [e * tp_size + k for e in range(ep_size)]
        group = dist.new_group(ranks, timeout=timeout)
        host = (
            group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        ep_groups.append(group)
        ep_hosts.append(host)
    tp = TPGroup(tp_rank, tp_size, tp_groups[ep_rank], device)
    ep = EPGroup(ep_rank, ep_size, ep_groups[tp_rank], ep_hosts[tp_rank], device)
    share_seed(device)  # the TP peers draw the same unseeded samples, as under init_tp
    ep.agree([0])
    dist.barrier()  # (NCCL: every communicator exists before any capture)
    tp.all_reduce(torch.zeros(1, device=device))
    ep.all_gather(torch.zeros(1, device=device))
    return tp, ep


def destroy_ep(ep: EPGroup | None) -> None:
    if ep is not None and dist.is_initialized():
        dist.destroy_process_group()


Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TokenExchange:
    """The dispatch of every MoE layer of a model served by an expert-parallel group (module
    docstring). `tokens`: the agreed rows per rank of the current forward (set before it,
    fixed in a captured graph)."""

    def __init__(self, ep: EPGroup):
        self.ep = ep
        self.tokens = 0

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts
    ) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] (this rank's tokens, T <= tokens) -> the routed
        output of every rank's experts for them, [T, H]."""
        n, t = self.tokens, x.shape[0]
        if t > n:
            raise RuntimeError(f"{t} tokens exceed the exchange's agreed {n} rows per rank")
        pad = (0, 0, 0, n - t)
        # Padding rows choose expert -1 (no rank holds it): they cost rows, not expert work.
        x_all = self.ep.all_gather(F.pad(x, pad))  # [E·n, H]
        ids_all = self.ep.all_gather(F.pad(ids.long(), pad, value=-1))  # [E·n, k]
        w_all = self.ep.all_gather(F.pad(weights.float(), pad))  # [E·n, k]
        partial = experts(x_all, ids_all, w_all)  # [E·n, H]: this rank's experts only
        return self.ep.reduce_scatter(partial)[:t]


def install_exchange(model: nn.Module, ep: EPGroup) -> TokenExchange:
    """Route every MoE layer of `model` through one exchange over `ep`, an MTP head's too;
    returns it."""
    exchange = TokenExchange(ep)
    if not set_expert_dispatch(model, exchange):
        raise EPError("expert parallelism needs a mixture-of-experts model; this one has none")
    for block in mtp_moe_blocks(model):
        block.dispatch = exchange
    return exchange


def exchange_only(
    model: nn.Module, dtype: torch.dtype, device: torch.device, head_passes: int = 0
) -> int:
    """A dummy forward: every MoE layer's exchange, in forward order, with no token of this
    rank (its experts still serve the others' rows), then `head_passes` passes of an MTP
    head's MoE layers (what a rank's step runs after its forward: ops/mtp.py). Returns the
    layers visited."""
    blocks = moe_blocks(model) + mtp_moe_blocks(model) * head_passes
    for block in blocks:
        exchange_rows(block, dtype, device)
    return len(blocks)
