"""Cores of the processes that drive GPUs (runtime/placement.py `gpu_process_cpu_sets`,
runtime/roles.py), with TAIPAN_GPU_PROCESS_CORES=N (opt-in; default 0: none): N of their own
each, chosen by the GPU's index on the host so runtimes on other GPUs take other cores, nothing
pinned on a CPU device; a bad value, or cores the host cannot spare, is a LaunchError naming
it."""

from __future__ import annotations

import types

import pytest

from taipan import roles
from taipan.placement import (
    CORES_ENV,
    FUSED_GEMV_ENV,
    GIL_SWITCH_MS,
    SWITCH_ENV,
    LaunchError,
    check_fused_gemv,
    gil_switch_seconds,
    gpu_process_cores,
    gpu_process_cpu_sets,
    physical_gpu,
)

CPUS = list(range(16))


def test_each_gpu_process_gets_cores_of_its_own_counted_from_the_end():
    assert gpu_process_cpu_sets([0], CPUS, 2) == [[14, 15]]
    assert gpu_process_cpu_sets([1, 2], CPUS, 2) == [[12, 13], [10, 11]]
    # Another runtime on GPU 3 takes other cores than one on GPU 0.
    assert gpu_process_cpu_sets([3], CPUS, 2) == [[8, 9]]


def test_cores_the_host_cannot_spare_are_a_launch_error_and_zero_pins_nothing():
    with pytest.raises(LaunchError, match=f"{CORES_ENV}=2"):
        gpu_process_cpu_sets([0], [0, 1], 2)  # (the 2-core CI box)
    with pytest.raises(LaunchError, match="set it lower"):
        gpu_process_cpu_sets([0, 1, 2, 3, 4, 5, 6, 7], CPUS, 2)  # none left over
    assert gpu_process_cpu_sets([0], CPUS, 0) is None
    assert gpu_process_cpu_sets([], CPUS, 2) is None


def test_the_physical_gpu_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_gpu("cuda") == 0 and physical_gpu("cuda:3") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    assert physical_gpu("cuda:0") == 5 and physical_gpu("cuda:1") == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-uuid-1")
    assert physical_gpu("cuda:0") == 0


def test_the_core_count_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(CORES_ENV, raising=False)
    assert gpu_process_cores() == 0
    monkeypatch.setenv(CORES_ENV, "2")
    assert gpu_process_cores() == 2
    monkeypatch.setenv(CORES_ENV, "two")
    with pytest.raises(LaunchError, match=CORES_ENV):
        gpu_process_cores()


def test_the_gil_switch_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert gil_switch_seconds() == GIL_SWITCH_MS / 1e3
    monkeypatch.setenv(SWITCH_ENV, "5")
    assert gil_switch_seconds() == 0.005
    for bad in ("fast", "0", "-1", "nan", "1000"):
        monkeypatch.setenv(SWITCH_ENV, bad)
        with pytest.raises(LaunchError, match=SWITCH_ENV):
            gil_switch_seconds()


def test_a_bad_fused_gemv_setting_is_the_launchs_error_and_the_layers_agree(monkeypatch):
    """TAIPAN_FUSED_GEMV is 0 or 1: anything else is refused at launch (runtime/placement.py)
    and, were a child started anyway, when its layers load (ops/layers.py)."""
    import subprocess
    import sys

    for good in ("0", "1"):
        monkeypatch.setenv(FUSED_GEMV_ENV, good)
        check_fused_gemv()
    monkeypatch.setenv(FUSED_GEMV_ENV, "yes")
    with pytest.raises(LaunchError, match=FUSED_GEMV_ENV):
        check_fused_gemv()
    child = subprocess.run(
        [sys.executable, "-c", "import taipan.ops.layers"], capture_output=True, text=True
    )
    assert child.returncode != 0 and "TAIPAN_FUSED_GEMV must be 0 or 1" in child.stderr
    monkeypatch.setenv(FUSED_GEMV_ENV, "1")
    for name, module in (("TAIPAN_PDL", "taipan.kernels.pdl"),
                         ("TAIPAN_TP_GEMV_SUM", "taipan.ops.custom_all_reduce")):  # fmt: skip
        monkeypatch.setenv(name, "2")
        with pytest.raises(LaunchError, match=name):
            check_fused_gemv()
        child = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                               text=True)  # fmt: skip
        assert child.returncode != 0 and f"{name} must be 0 or 1" in child.stderr
        monkeypatch.setenv(name, "0")
        check_fused_gemv()


def _rt(device: str, num_ranks: int = 1, tp: int = 1, role: str = "all"):
    return types.SimpleNamespace(
        role=role, device=device, num_ranks=num_ranks, tp_size=tp, tp_address=None
    )


def test_the_launch_spec_pins_gpu_ranks_and_their_peers(monkeypatch):
    monkeypatch.delenv(CORES_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(roles.os, "sched_getaffinity", lambda pid: set(CPUS))
    assert roles._cpu_sets(_rt("cuda")) == [None]  # (off by default)
    monkeypatch.setenv(CORES_ENV, "2")
    assert roles._cpu_sets(_rt("cuda")) == [[14, 15]]
    assert roles._cpu_sets(_rt("cuda:1", num_ranks=2)) == [[12, 13], [10, 11]]
    assert roles._tp_cpu_sets(_rt("cuda", tp=2)) == [[[14, 15], [12, 13]]]
    # A CPU device keeps every core (torch's matmul threads), and so does an engine started
    # alone (whoever started it placed it).
    assert roles._cpu_sets(_rt("cpu")) == [None]
    assert roles._cpu_sets(_rt("cuda", role="engine")) == [None]
    monkeypatch.setenv(CORES_ENV, "0")
    assert roles._cpu_sets(_rt("cuda")) == [None]
