"""Triton kernels, one file per algorithm stage. Each file stacks: the @triton.jit kernel(s) ->
a launcher that checks shapes, dtypes and strides and picks the grid -> `*_ref`, the same
contract in plain torch (fp32 inside), which the CPU path runs and the tests compare against.
The two paged-attention kernels (decode, prefill) share one reference, attention_ref.py.

Conventions shared by every kernel:
- Storage is bf16/fp16/fp32; arithmetic inside is fp32; outputs are cast to the storage dtype.
- A layer's KV cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = keys,
  1 = values), contiguous; token p of a sequence lives in block `block_table[p // block_size]`
  at offset `p % block_size` (slot `block * block_size + offset`). Unwritten slots hold garbage
  (possibly NaN): a kernel never reads a slot past a sequence's length.
- Grids and shapes must be CUDA-graph safe: no host synchronisation, no data-dependent grid
  sizes (bound them by static maxima and let surplus programs exit), slot -1 = padding (skip).
- `tl.dot` tiles are at least 16 in every dimension (real GPUs require it).
- Every kernel's first statement is `enter(PDL)` and its launch passes
  `**launch_kwargs(device)` (kernels/pdl.py: programmatic dependent launch on Hopper).
- Must work on triton 3.6 (the GPU image) and 3.7.1 (CI); tests run the CPU interpreter
  (`TRITON_INTERPRET=1`, set by tests/conftest.py without a GPU) in fp32, with tiny grids.
"""
