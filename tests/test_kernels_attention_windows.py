"""The two paged-attention kernels compiled for an H100 (sm_90) at each head size, with and
without a sliding window, on a machine without a GPU: the CPU interpreter runs Python, not
Triton's compiler, so a padded head size or the windowed loops could compile wrongly (a static
branch changing a tile's shape, a tile too big for shared memory) and pass every interpreter
test. The launchers' own tile choices are compiled; nothing runs (what the kernels compute is
tests/test_kernels_{decode,prefill}_attention.py's job).

The compiles run in a child process without TRITON_INTERPRET (the interpreter patches
`triton.language` for the whole process it is imported in). Registers and spills are printed
(`-s`), not asserted: they move with ptxas versions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# An H100's shared memory per block (opt-in maximum), bytes.
H100_SHARED = 227 * 1024


def _compile(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    """`kernel` compiled to a cubin for sm_90: `pointers` gives each pointer argument's type,
    every other argument is a constexpr in `constexprs`, the fp32 scale, or an i32 scalar."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if "scale" in name else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _usage(compiled) -> str:
    """Registers and stack (spills) of the cubin, from the cuobjdump Triton ships."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        try:
            text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        except OSError:
            return "usage n/a"
    found = re.search(r"REG:(\d+) STACK:(\d+)", text.stdout)
    return f"regs {found[1]} stack {found[2]}" if found else "usage n/a"


class _CudaTensor:  # what prefill's _tile_config reads of q
    is_cuda = True

    def __init__(self, element_size: int):
        self._size = element_size

    def element_size(self) -> int:
        return self._size


def prefill(dtype: str, head_dim: int, windowed: bool, group: int = 2):
    """`_prefill_attention_kernel` with the launcher's tiles for a long prompt."""
    import triton

    from taipan.kernels import prefill_attention as pa
    from taipan.kernels.attention_ref import head_dim_pad

    pad, group_pad = head_dim_pad(head_dim), triton.next_power_of_2(group)
    q = _CudaTensor(4 if dtype == "fp32" else 2)
    block_m, block_n, num_warps, num_stages = pa._tile_config(q, group_pad, 4096, pad)
    block_q = max(1, block_m // group_pad)
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    for name in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"):
        pointers[name] = "*i32"
    pointers["sinks_ptr"] = "*fp32"
    constexprs = dict(
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, BLOCK_SIZE=16,
        BLOCK_Q=block_q, BLOCK_M=block_q * group_pad, BLOCK_N=block_n, WINDOWED=windowed,
        SINKS=False, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", PDL=False,
    )  # fmt: skip
    return _compile(pa._prefill_attention_kernel, pointers, constexprs, num_warps, num_stages)


def decode(dtype: str, head_dim: int, group: int = 4, splits: int = 64):
    """`_decode_split_kernel` and `_decode_merge_kernel` as the launcher sets them up."""
    import triton

    from taipan.kernels import decode_attention as da
    from taipan.kernels.attention_ref import head_dim_pad

    pad = head_dim_pad(head_dim)
    partials = {name: "*fp32" for name in ("part_max_ptr", "part_sum_ptr", "part_acc_ptr")}
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers |= {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", **partials}
    constexprs = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pad, BLOCK_SIZE=16,
        BLOCK_N=da._MAX_TILE_TOKENS if pad <= 128 else da._MAX_TILE_TOKENS_WIDE,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", PDL=False,
    )  # fmt: skip
    split = _compile(da._decode_split_kernel, pointers, constexprs, 4, 3)  # launch defaults
    splits_pad = triton.next_power_of_2(splits)
    merge = _compile(
        da._decode_merge_kernel,
        {**partials, "sinks_ptr": "*fp32", "out_ptr": f"*{dtype}"},
        dict(SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, SINKS=False, PDL=False),
        4 if splits_pad * pad <= 8192 else 8,
        3,
    )
    return split, merge


def compile_all(dtypes: list[str], head_dims: list[int], quick: bool) -> list[str]:
    """One line per compiled kernel: name, shared memory and register use. `quick`: only the
    windowed prefill kernel and the decode split kernel (the merge and the unwindowed prefill
    differ from them by little code)."""
    lines = []
    for dtype in dtypes:
        for head_dim in head_dims:
            windows = (True,) if quick else (False, True)
            kernels = {f"prefill window={w}": prefill(dtype, head_dim, w) for w in windows}
            kernels["decode split"], merge = decode(dtype, head_dim)
            if not quick:
                kernels["decode merge"] = merge
            for name, compiled in kernels.items():
                shared = compiled.metadata.shared
                assert compiled.asm["cubin"] and shared <= H100_SHARED, (name, shared)
                usage = _usage(compiled)
                lines.append(f"{name} {dtype} D={head_dim}: shared {shared} B, {usage}")
    return lines


def _run_child(dtypes: str, head_dims: str, quick: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    module = "tests.test_kernels_attention_windows"
    child = subprocess.run(
        [sys.executable, "-m", module, dtypes, head_dims, "quick" if quick else "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    print(child.stdout)
    return child.stdout.strip().split("\n")


@pytest.mark.slow  # (11-17 s of compiling on the 2-core box; the gpu tests run these kernels)
def test_padded_and_wide_heads_compile_for_h100():
    """The riskiest shapes: 80 (padded to 128) and 256 (smaller tiles), bf16, windowed."""
    lines = _run_child("bf16", "80,256", quick=True)
    assert len(lines) == 4 and all("shared" in line for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # fp32's exact dots compile slowly: minutes on a 2-core box
def test_every_head_dim_compiles_for_h100():
    from taipan.kernels.attention_ref import SUPPORTED_HEAD_DIMS

    lines = _run_child("bf16,fp32", ",".join(map(str, SUPPORTED_HEAD_DIMS)), quick=False)
    assert len(lines) == 2 * len(SUPPORTED_HEAD_DIMS) * 4


if __name__ == "__main__":
    dtypes, head_dims = sys.argv[1].split(","), [int(d) for d in sys.argv[2].split(",")]
    print("\n".join(compile_all(dtypes, head_dims, quick=sys.argv[3] == "quick")))
