"""The gpu worker's pool sizing (actors/gpu/sizing.py) on plain numbers: no torch, no model.

Checks: the KV budget (asked for, the device default, on CPU a bounded share of the available
host memory split between the ranks that share it); the live Mamba slots with and without
mamba_memory_ratio; the block and slot counts of size_pools at their boundaries (block cap,
snapshots besides the KV budget); the order in which it asks its tensor-parallel peers to agree
and that a peer's smaller count wins; every refusal with its message; the offload host check.
The loads that use these are tests/test_gpu_worker_mamba.py and tests/test_gpu_worker_control.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from taipan.actors.config import ConfigError
from taipan.actors.gpu.sizing import (
    GIB,
    HOST_RESERVE_BYTES,
    PoolSizes,
    available_host_memory,
    kv_budget,
    mamba_live_slots,
    offload_problem,
    size_pools,
)

BLOCK = 4096  # bytes of one KV block in these tests
SLOT = 1024  # bytes of one Mamba slot


# ---- the KV budget ------------------------------------------------------------------------------


def test_kv_budget_asked_for_wins_everywhere():
    assert kv_budget(0.5, on_cpu=True, available=0) == (GIB // 2, "buffer_size_gb=0.5")
    assert kv_budget(3, on_cpu=False, available=0) == (3 * GIB, "buffer_size_gb=3")


def test_kv_budget_device_default_ignores_host_memory():
    want = (20 * GIB, "default buffer_size_gb=20")
    assert kv_budget(None, on_cpu=False, available=1) == want


def test_kv_budget_on_cpu_is_a_bounded_share_of_available_memory():
    budget, source = kv_budget(None, on_cpu=True, available=22 * GIB)
    assert budget == int(0.2 * 22 * GIB) == 4724464025
    assert source == "CPU default: 20% of 22.0 GiB available"
    # At most the seed's 20 GB, however much is free.
    assert kv_budget(None, on_cpu=True, available=1000 * GIB)[0] == 20 * GIB


def test_kv_budget_on_cpu_is_split_between_the_ranks_on_the_host():
    budget, source = kv_budget(None, on_cpu=True, available=10 * GIB, ranks_on_host=3)
    assert budget == int(2 * GIB / 3) == 715827882
    assert source == "CPU default: 20% of 10.0 GiB available, split between 3 ranks"


def test_available_host_memory_is_a_positive_byte_count():
    assert available_host_memory() > 0


# ---- live Mamba slots ---------------------------------------------------------------------------


def test_mamba_live_slots_without_a_ratio_come_besides_the_kv():
    assert mamba_live_slots(1000, 7, 4, None) == (4, 1000)


def test_mamba_live_slots_take_the_ratio_share():
    assert mamba_live_slots(1000, 200, 4, 0.5) == (2, 500)
    assert mamba_live_slots(1000, 10, 4, 0.5) == (4, 500)  # capped, the share still taken
    assert mamba_live_slots(1001, 250, 4, 0.5) == (2, 501)  # int(500.5) = 500 to the states
    assert mamba_live_slots(1000, 500, 4, 0.5) == (1, 500)  # exactly one slot


def test_mamba_live_slots_refuse_a_share_below_one_slot():
    with pytest.raises(ConfigError) as e:
        mamba_live_slots(1000, 501, 4, 0.5)
    assert str(e.value) == (
        "mamba_memory_ratio=0.5 of the KV budget (9.31e-07 GiB) is 500 bytes, "
        "less than one live Mamba slot (501 bytes)"
    )


# ---- size_pools ---------------------------------------------------------------------------------


def test_blocks_fill_the_budget_up_to_the_cap():
    assert size_pools(10 * BLOCK + BLOCK - 1, BLOCK) == PoolSizes(10, 10 * BLOCK + BLOCK - 1)
    assert size_pools(10 * BLOCK, BLOCK, max_blocks=4).num_blocks == 4
    assert size_pools(10 * BLOCK, BLOCK, max_blocks=0).num_blocks == 10  # 0: no cap


def test_a_budget_without_one_block_is_refused():
    with pytest.raises(ValueError) as e:
        size_pools(BLOCK - 1, BLOCK, source="buffer_size_gb=1e-06")
    assert str(e.value) == (
        "the KV budget (3.81e-06 GiB, buffer_size_gb=1e-06) holds no KV block of 4096 bytes"
    )
    # Refused after the agreement: a peer whose budget holds no block fails every rank alike.
    with pytest.raises(ValueError, match=r"\(3.81e-05 GiB, \) holds no KV block"):
        size_pools(10 * BLOCK, BLOCK, agree=lambda v: v if v > 100 else 0)


def test_hybrid_without_a_ratio_gets_a_live_slot_per_request_besides_the_kv():
    sizes = size_pools(8 * BLOCK, BLOCK, slot_bytes=SLOT, max_requests=4)
    assert sizes == PoolSizes(num_blocks=8, kv_bytes=8 * BLOCK, live_slots=4, snapshot_slots=0)
    assert sizes.mamba_slots == 4


def test_hybrid_ratio_and_snapshots():
    sizes = size_pools(
        8 * BLOCK,
        BLOCK,
        slot_bytes=SLOT,
        max_requests=32,
        mamba_memory_ratio=0.25,
        mamba_snapshot_gb=3 * SLOT / GIB,
    )
    # A quarter of 32 KiB is 8 slots; the blocks get the other 24 KiB; snapshots come besides.
    assert sizes == PoolSizes(num_blocks=6, kv_bytes=6 * BLOCK, live_slots=8, snapshot_slots=3)
    assert sizes.mamba_slots == 11


@pytest.mark.parametrize("gb", [None, 0.0, -1.0])
def test_no_or_disabled_snapshot_budget_gives_no_snapshot_slots(gb):
    sizes = size_pools(BLOCK, BLOCK, slot_bytes=SLOT, max_requests=2, mamba_snapshot_gb=gb)
    assert (sizes.live_slots, sizes.snapshot_slots) == (2, 0)


def test_a_snapshot_budget_below_one_slot_is_refused():
    with pytest.raises(ConfigError) as e:
        size_pools(BLOCK, BLOCK, slot_bytes=SLOT, max_requests=2, mamba_snapshot_gb=512 / GIB)
    assert str(e.value) == (
        "prefix_caching_mamba_gb (512 bytes) holds no Mamba snapshot slot: one (the conv and "
        "SSM state of every Mamba layer) takes 1024 bytes"
    )


def test_a_ratio_share_below_one_slot_is_refused():
    with pytest.raises(ConfigError, match="less than one live Mamba slot"):
        size_pools(BLOCK, BLOCK, slot_bytes=SLOT, max_requests=2, mamba_memory_ratio=0.2)


def test_peers_agree_in_a_fixed_order_and_the_smallest_wins():
    """What a tensor-parallel group runs: budget, then live and snapshot slots (hybrids
    only), then blocks; a peer with less (here: half of everything) sets every count."""
    seen = []

    def agree(value: int) -> int:
        seen.append(value)
        return value // 2

    sizes = size_pools(
        16 * BLOCK,
        BLOCK,
        slot_bytes=SLOT,
        max_requests=4,
        mamba_snapshot_gb=4 * SLOT / GIB,
        agree=agree,
    )
    assert seen == [16 * BLOCK, 4, 4, 8]  # the budget agreed first: 8 blocks, then halved
    assert sizes == PoolSizes(num_blocks=4, kv_bytes=8 * BLOCK, live_slots=2, snapshot_slots=2)
    seen.clear()
    size_pools(16 * BLOCK, BLOCK, agree=agree)
    assert seen == [16 * BLOCK, 8]  # no Mamba layers: no slot agreement


def test_pool_sizes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PoolSizes(1, BLOCK).num_blocks = 2


# ---- offload ----------------------------------------------------------------------------------


def test_offload_check_counts_the_reserve():
    assert offload_problem(4 * GIB, 4 * GIB + HOST_RESERVE_BYTES) is None
    assert offload_problem(4 * GIB, 6 * GIB - 1) == (
        "offload needs 4.00 GiB of host memory for the KV cache and keeps 2 GiB free, but only "
        "6.00 GiB is available; nothing was changed: suspend in persist or recompute mode instead"
    )


def test_sizing_imports_no_torch():
    code = "import sys, taipan.actors.gpu.sizing; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
