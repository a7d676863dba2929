"""How many KV blocks and Mamba state slots a rank's memory holds (DESIGN.md §5, §6).

Owns the memory arithmetic of the gpu worker: the KV budget (LoadModel.kv_cache_gb, else
DEFAULT_KV_GB on a device and on CPU the share CPU_KV_SHARE of the host memory available,
at most DEFAULT_KV_GB), its split between live Mamba slots and KV blocks, the snapshot slots,
the block count, whether an offload fits in host memory, and the refusals when a budget holds
nothing. Plain ints and floats in, frozen values out; `available_host_memory` is the one
read of the machine, for the caller to pass in.

Must not touch: torch, the model or its config, LoadModel, collectives. The worker measures
one block's and one slot's bytes and hands in `agree` for its tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from taipan.actors.config import ConfigError, mamba_snapshot_slots

GIB = 1024**3
DEFAULT_KV_GB = 20.0  # the seed's buffer_size_gb
CPU_KV_SHARE = 0.2  # on CPU the KV cache is host memory: take a bounded share of what is free
HOST_RESERVE_BYTES = 2 * GIB  # an offload must leave at least this much host memory free


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """What a rank allocates: KV blocks and Mamba slots (live 0..L-1, then the snapshots, then
    the worker's own scratch slots of speculative verify rows, which the engine never names)."""

    num_blocks: int
    kv_bytes: int  # the budget left to the KV blocks, after the live Mamba slots' share
    live_slots: int = 0  # 0: no Mamba layers
    snapshot_slots: int = 0
    scratch_per_slot: int = 0  # speculative decoding's k (each live slot's scratch slots)
    num_local_blocks: int = 0  # per-layer-group KV: the windowed layers' pool (0: none)

    @property
    def mamba_slots(self) -> int:
        """The slots the engine may name: live, then snapshots."""
        return self.live_slots + self.snapshot_slots

    @property
    def scratch_slots(self) -> int:
        return self.live_slots * self.scratch_per_slot


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (Linux MemAvailable: free memory plus
    what the kernel can reclaim), or free physical pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget(
    requested_gb: float | None, *, on_cpu: bool, available: int, ranks_on_host: int = 1
) -> tuple[int, str]:
    """(bytes for the KV cache, where that number comes from) for LoadModel.kv_cache_gb;
    `available`: the host's available bytes. The CPU default is split between the
    `ranks_on_host` engine ranks that share this memory."""
    if requested_gb is not None:
        return int(requested_gb * GIB), f"buffer_size_gb={requested_gb:g}"
    if not on_cpu:
        return int(DEFAULT_KV_GB * GIB), f"default buffer_size_gb={DEFAULT_KV_GB:g}"
    budget = int(min(DEFAULT_KV_GB * GIB, CPU_KV_SHARE * available) / ranks_on_host)
    source = f"CPU default: {CPU_KV_SHARE:.0%} of {available / GIB:.1f} GiB available"
    if ranks_on_host > 1:
        source += f", split between {ranks_on_host} ranks"
    return budget, source


def mamba_live_slots(
    budget: int, slot_bytes: int, max_requests: int, ratio: float | None
) -> tuple[int, int]:
    """(live Mamba slots, what is left of the KV budget). With mamba_memory_ratio r the live
    states take the share r of the budget (as many slots as fit, at most max_requests) and the
    KV blocks the rest, as Megatron's `mamba_memory_ratio`; without it every request the rank
    may hold gets a slot besides the KV budget."""
    if ratio is None:
        return max_requests, budget
    share = int(budget * ratio)
    live = min(max_requests, share // slot_bytes)
    if live < 1:
        raise ConfigError(
            f"mamba_memory_ratio={ratio:g} of the KV budget ({budget / GIB:.3g} GiB) is "
            f"{share} bytes, less than one live Mamba slot ({slot_bytes} bytes)"
        )
    return live, budget - share


def _same(value: int) -> int:
    return value


def size_pools(
    budget: int,
    block_bytes: int,
    *,
    source: str = "",
    max_blocks: int = 0,
    slot_bytes: int = 0,
    max_requests: int = 0,
    mamba_memory_ratio: float | None = None,
    mamba_snapshot_gb: float | None = None,
    scratch_per_slot: int = 0,
    local_block_bytes: int = 0,
    local_blocks: int = 0,
    agree: Callable[[int], int] = _same,
) -> PoolSizes:
    """The pools of this rank's `budget` bytes (`source`: where it comes from, for the error):
    blocks of `block_bytes`, at most `max_blocks` (0: no cap), and for a hybrid (`slot_bytes`
    > 0) live slots (mamba_live_slots) and snapshot slots (`mamba_snapshot_gb` // a slot).
    With speculative decoding each live slot brings `scratch_per_slot` (k) scratch slots: a
    live state then costs k + 1 slots' bytes (as vLLM keeps a state per speculative position),
    so a mamba_memory_ratio share holds k + 1 times fewer requests.

    `agree` gives the group's smallest value (tensor parallelism: ranks may differ in the bytes
    of a block or slot). It is called in one fixed order (budget, live, snapshots, blocks) so
    every rank runs the same collectives, and the budget first: one too small then fails on
    every rank alike. ConfigError for a Mamba budget below one slot, ValueError for no block.

    Per-layer-group KV (`local_block_bytes` > 0: the windowed layers' block, `block_bytes` the
    other layers'): the windowed layers' pool takes `local_blocks` (what every request's ring
    needs at once), at most their share of the budget as one pool would give them (their bytes
    against all layers'); the rest is the main pool's (ValueError when not one block of the
    windowed layers fits)."""
    budget = agree(budget)
    num_local = 0
    if local_block_bytes:
        share = budget * local_block_bytes // (local_block_bytes + block_bytes)
        num_local = agree(min(local_blocks, share // local_block_bytes))
        if num_local < 1:
            raise ValueError(
                f"the KV budget ({budget / GIB:.3g} GiB, {source}) holds no block of the "
                f"windowed layers ({local_block_bytes} bytes)"
            )
        budget -= num_local * local_block_bytes
    live = snapshots = 0
    if slot_bytes:
        per_request = slot_bytes * (1 + scratch_per_slot)
        live, budget = mamba_live_slots(budget, per_request, max_requests, mamba_memory_ratio)
        snapshots = mamba_snapshot_slots(int((mamba_snapshot_gb or 0) * GIB), slot_bytes)
        # The engine's slot ids must exist on every rank.
        live, snapshots = agree(live), agree(snapshots)
    num_blocks = budget // block_bytes
    if max_blocks > 0:
        num_blocks = min(num_blocks, max_blocks)
    num_blocks = agree(num_blocks)  # the engine's block ids must exist on every rank
    if num_blocks < 1:
        raise ValueError(
            f"the KV budget ({budget / GIB:.3g} GiB, {source}) holds no KV "
            f"block of {block_bytes} bytes"
        )
    return PoolSizes(
        num_blocks, budget, live, snapshots, scratch_per_slot if live else 0, num_local
    )


def offload_problem(kv_bytes: int, available: int) -> str | None:
    """Why copying a KV cache of `kv_bytes` to host memory must be refused, or None."""
    if kv_bytes + HOST_RESERVE_BYTES <= available:
        return None
    return (
        f"offload needs {kv_bytes / GIB:.2f} GiB of host memory for the KV cache and keeps "
        f"{HOST_RESERVE_BYTES / GIB:.0f} GiB free, but only {available / GIB:.2f} GiB is "
        "available; nothing was changed: suspend in persist or recompute mode instead"
    )
