"""Programmatic dependent launch (PDL, Hopper and later): every Triton kernel of kernels/ may
start while the kernel before it in the stream is still finishing, so its launch and ramp
overlap the other's tail instead of following it (a one-row decode step is ~100-300 small
kernels back to back, each paying a few microseconds of launch, ramp and tail).

`enter(PDL)` opens every kernel (tests/test_kernels_pdl.py checks it):
`griddepcontrol.launch_dependents` (the next kernel may be scheduled once every program of this
one has passed here), then `griddepcontrol.wait` (this program blocks until the kernel before it
has completed and its writes are visible). Each kernel waits before it reads or writes
anything, and every one of its programs waits, so completion stays transitive: when kernel N has
completed, so has every kernel before it, and N + 1 sees all of their writes, as without PDL. A
kernel launched after one that never signals (cuBLAS, torch's) starts as usual.

`launch_kwargs(device)`: the keyword arguments of a launch on `device` (`PDL` for the kernel,
`launch_pdl` for Triton's launcher); PDL is on where the GPU has it (compute capability 9.0 or
later) and TAIPAN_PDL is not "0" (read once, at import: CUDA graphs bake in the launches). The
CPU interpreter never takes it (its launcher drops `launch_pdl`; the kernel's branch is off).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "TAIPAN_PDL"


def _enabled() -> bool:
    value = os.environ.get(PDL_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


ENABLED = _enabled()
_BY_DEVICE: dict[int, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (CUDA, compute capability >= 9.0, TAIPAN_PDL on)."""
    if not ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BY_DEVICE:
        _BY_DEVICE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _BY_DEVICE[index]


def launch_kwargs(device: torch.device) -> dict:
    """`PDL` (the kernel's constexpr) and `launch_pdl` (the launcher's option) for `device`."""
    on = supported(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def enter(PDL: tl.constexpr):
    """The first statement of a kernel that takes part (see the module docstring)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
