"""Kernels compiled for an H100 (sm_90) on a machine without a GPU: Triton's front end and
ptxas run as they would on the device, so an error that the CPU interpreter lets through (a
loop-carried variable changing type, a tile too small for `tl.dot`) fails here, in CI, and not
only on a lent GPU. Nothing runs: the interpreter tests check what the kernels compute.

The compiles run in a child process without TRITON_INTERPRET (the interpreter patches
`triton.language` for the whole process it is imported in).
"""

from __future__ import annotations

import os
import subprocess
import sys

H100 = ("cuda", 90, 32)


def compile_for_h100(kernel, pointers: dict, constexprs: dict, num_warps: int = 4):
    """`kernel` compiled to a cubin: `pointers` gives each pointer (or tuple of pointers)
    argument's type, as "*bf16" or a tuple of them; every other argument is a constexpr in
    `constexprs` or an i64 scalar."""
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
            signature[name] = "i64"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget(*H100), options={"num_warps": num_warps})


def all_reduce_kernels() -> list[str]:
    """Both all-reduce kernels, for 2 ranks in bf16 (with programmatic dependent launch,
    kernels/pdl.py) and 4 in fp32 (without); what compiled."""
    from taipan.kernels import all_reduce, all_reduce_norm

    done = []
    for dtype, world in (("bf16", 2), ("fp32", 4)):
        flags = ("*i64",) * world
        common = {"counters_ptr": "*i64", "status_ptr": "*i32", "flags": flags}
        pdl = world == 2
        meta = {"RANK": 1, "WORLD": world, "FLAG_STRIDE": all_reduce.MAX_WORLD, "PDL": pdl}
        plain = compile_for_h100(
            all_reduce._one_shot_all_reduce_kernel,
            {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "bufs": (f"*{dtype}",) * world} | common,
            {**meta, "BLOCK": all_reduce.BLOCK},
        )
        rows = {name: f"*{dtype}" for name in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr")}
        fused = compile_for_h100(
            all_reduce_norm._all_reduce_rms_norm_kernel,
            {**rows, "bufs": (f"*{dtype}",) * world, **common},
            {**meta, "eps": 1e-5, "N": 4096, "ROW_STRIDE": 8192, "BLOCK": 4096},
            num_warps=8,
        )
        for name, compiled in (("one_shot_all_reduce", plain), ("all_reduce_rms_norm", fused)):
            # The flags' system-scope atomics made it through to the machine code.
            assert "atom" in compiled.asm["ptx"] and compiled.asm["cubin"], name
            assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == pdl, name
            done.append(f"{name} {dtype} x{world}")
    return done


def gemv_kernel() -> str:
    """The one-row GEMV with its norm, gate and programmatic dependent launch, in bf16."""
    from taipan.kernels import gemv

    names = ("x_ptr", "w_ptr", "bias_ptr", "norm_ptr", "out_ptr")
    compiled = compile_for_h100(
        gemv._gemv_kernel,
        dict.fromkeys(names, "*bf16"),
        {
            "eps": 1e-5, "NORM": True, "GEMMA_NORM": False, "GATED": True, "GELU": False,
            "RESIDUAL": False, "HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024,
            "PDL": True,
        },
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx
    return "gemv bf16 pdl"


def rope_kernel() -> str:
    """RoPE with the cache write and Gemma's q/k norms inside, head_dim 256, in bf16."""
    from taipan.kernels import rope

    names = ("q_ptr", "k_ptr", "v_ptr", "kv_cache_ptr", "out_ptr", "q_norm_ptr", "k_norm_ptr")
    compiled = compile_for_h100(
        rope._rope_and_write_kv_kernel,
        dict.fromkeys(names, "*bf16") | {
            "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
            "eps": "fp32",
        },
        {
            "NUM_HEADS": 4, "NUM_KV_HEADS": 1, "HEAD_DIM": 256, "BLOCK_HEADS": 4,
            "BLOCK_KV_HEADS": 1, "BLOCK_HALF": 128, "BLOCK_D": 256, "NORM": True, "GEMMA": True,
            "PDL": True,
        },
    )  # fmt: skip
    assert compiled.asm["cubin"]
    return "rope q/k norms bf16"


def gemv_all_reduce_kernel() -> str:
    """The row-parallel GEMV with the all-reduce and the norm in its last program, 2 ranks."""
    from taipan.kernels import gemv_all_reduce

    names = ("x_ptr", "w_ptr", "residual_ptr", "weight_ptr", "out_ptr")
    compiled = compile_for_h100(
        gemv_all_reduce._gemv_all_reduce_rms_norm_kernel,
        dict.fromkeys(names, "*bf16") | {
            "state_ptr": "*i64", "status_ptr": "*i32",
            "bufs": ("*bf16",) * 2, "flags": ("*i64",) * 2,
        },
        {
            "eps": 1e-5, "ROW_STRIDE": 8192, "RANK": 1, "WORLD": 2, "BLOCK_M": 1, "BLOCK_N": 4,
            "BLOCK_K": 1024, "BLOCK_ROW": 4096, "PDL": True,
        },
    )  # fmt: skip
    assert "atom" in compiled.asm["ptx"] and compiled.asm["cubin"]
    return "gemv all-reduce bf16 x2"


def sandwich_norm_kernels() -> str:
    """RMSNorm with Gemma's norm before the add, with and without the norm after it."""
    from taipan.kernels import rmsnorm

    names = ("x_ptr", "residual_ptr", "weight_ptr", "pre_weight_ptr", "out_ptr")
    for final in (True, False):
        compiled = compile_for_h100(
            rmsnorm._rms_norm_kernel,
            dict.fromkeys(names, "*bf16"),
            {
                "eps": 1e-6, "N": 1152, "HAS_RESIDUAL": True, "GEMMA": True, "PRE_NORM": True,
                "FINAL_NORM": final, "BLOCK": 2048, "PDL": True,
            },
        )  # fmt: skip
        assert compiled.asm["cubin"]
    return "sandwich norms bf16"


def test_all_reduce_kernels_compile_for_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_kernels_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout.split("\n")[:8] == [
        "one_shot_all_reduce bf16 x2",
        "all_reduce_rms_norm bf16 x2",
        "one_shot_all_reduce fp32 x4",
        "all_reduce_rms_norm fp32 x4",
        "gemv bf16 pdl",
        "rope q/k norms bf16",
        "sandwich norms bf16",
        "gemv all-reduce bf16 x2",
    ]


if __name__ == "__main__":
    print(
        "\n".join(
            [
                *all_reduce_kernels(),
                gemv_kernel(),
                rope_kernel(),
                sandwich_norm_kernels(),
                gemv_all_reduce_kernel(),
            ]
        )
    )
