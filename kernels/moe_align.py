"""The alignment step of the fused MoE: a step's T·k (token, expert) pairs grouped by local
expert into row blocks of BLOCK_M, on the device and without a host sync (`moe_align`), and the
same layout in plain torch (`moe_align_ref`). kernels/moe.py's GEMMs read this layout; nothing
here touches activations or weights.

Layout. Pair p = t·k + j is token t's j-th choice, topk_ids[t, j]. Local expert e (global id
expert_start + e, 0 <= e < E_local) owns cdiv(count_e, BLOCK_M) consecutive row blocks, experts
in order; its pairs fill them in increasing p, and the rest of its last block is -1 (padding).
- sorted_pairs [max_blocks · BLOCK_M] int32: the pair of each row, -1 for padding; rows of
  unused blocks are never written (garbage).
- block_expert [max_blocks] int32: each block's local expert, -1 for the unused tail.
max_blocks = min(T·k, cdiv(T·k, BLOCK_M) + E_local) bounds the blocks used whatever the routing
(every used block holds at least one pair; each expert wastes less than one block), so the grids
of the GEMMs are static: a decode step (T·k pairs) launches at most T·k blocks, not E_local.
Pairs of experts outside the local range are in no block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs

SCAN_BLOCK = 1024  # pairs per step of a program's scan over topk_ids


@triton.jit
def _load_ids(
    topk_ids_ptr, start, num_pairs, stride_t, stride_k, TOPK: tl.constexpr, BLOCK: tl.constexpr
):
    """Pairs [start, start + BLOCK) (global expert ids; -1 past the end) and their indices."""
    pair = start + tl.arange(0, BLOCK)
    ok = pair < num_pairs
    ids = tl.load(
        topk_ids_ptr + (pair // TOPK) * stride_t + (pair % TOPK) * stride_k, mask=ok, other=-1
    )
    return ids, pair


@triton.jit
def _count_kernel(
    # pointers
    topk_ids_ptr,  # [T, k] global expert ids
    counts_ptr,  # [E_local] int32: pairs per local expert (written)
    # strides
    stride_t,
    stride_k,
    # scalars
    num_pairs,
    expert_start,
    # meta-parameters
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    """One program per local expert counts the pairs that chose it."""
    expert = tl.program_id(0)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        ids, _ = _load_ids(topk_ids_ptr, start, num_pairs, stride_t, stride_k, TOPK, BLOCK)
        total += (ids == expert_start + expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def _place_kernel(
    # pointers
    topk_ids_ptr,  # [T, k] global expert ids
    counts_ptr,  # [E_local] int32, from _count_kernel
    sorted_pairs_ptr,  # [max_blocks * BLOCK_M] int32 (written)
    block_expert_ptr,  # [max_blocks] int32 (written)
    # strides
    stride_t,
    stride_k,
    # scalars
    num_pairs,
    expert_start,
    # meta-parameters
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    """One program per local expert writes its blocks' rows; the last one also marks the
    unused tail blocks (-1)."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < NUM_EXPERTS, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(experts < expert, blocks, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    num_blocks = (count + BLOCK_M - 1) // BLOCK_M
    rows_ptr = sorted_pairs_ptr + first_block * BLOCK_M

    for start in range(0, num_blocks, BLOCK):
        b = start + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + first_block + b, expert, mask=b < num_blocks)
    # The scan keeps pair order inside an expert: the layout is deterministic.
    placed = count * 0  # an int32 scalar, carried through the loop
    for start in range(0, num_pairs, BLOCK):
        ids, pair = _load_ids(topk_ids_ptr, start, num_pairs, stride_t, stride_k, TOPK, BLOCK)
        hit = (ids == expert_start + expert).to(tl.int32)
        rank = placed + tl.cumsum(hit, axis=0) - 1
        tl.store(rows_ptr + rank, pair, mask=hit != 0)
        placed += tl.sum(hit, axis=0)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(rows_ptr + pad, -1, mask=pad < num_blocks * BLOCK_M)

    if expert == NUM_EXPERTS - 1:
        for start in range(first_block + num_blocks, MAX_BLOCKS, BLOCK):
            b = start + tl.arange(0, BLOCK)
            tl.store(block_expert_ptr + b, -1, mask=b < MAX_BLOCKS)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the row blocks any routing of `num_pairs` pairs uses."""
    return min(num_pairs, triton.cdiv(num_pairs, block_m) + num_experts)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, expert_start: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) of the module docstring for topk_ids [T, k] (int32/int64,
    any strides; T·k >= 1) and the local experts [expert_start, expert_start + num_experts),
    num_experts >= 1. Two launches of num_experts programs each; never syncs the host."""
    num_pairs = topk_ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    scan = min(SCAN_BLOCK, max(16, triton.next_power_of_2(num_pairs)))
    strides = (topk_ids.stride(0), topk_ids.stride(1))
    topk = topk_ids.shape[1]
    _count_kernel[(num_experts,)](
        topk_ids,
        counts,
        *strides,
        num_pairs,
        expert_start,
        TOPK=topk,
        BLOCK=scan,
        **launch_kwargs(topk_ids.device),
    )
    _place_kernel[(num_experts,)](
        topk_ids, counts, sorted_pairs, block_expert, *strides, num_pairs, expert_start,
        TOPK=topk, NUM_EXPERTS=num_experts, EXPERTS_PAD=triton.next_power_of_2(num_experts),
        MAX_BLOCKS=blocks, BLOCK_M=block_m, BLOCK=scan,
        **launch_kwargs(topk_ids.device),
    )  # fmt: skip
    return sorted_pairs, block_expert


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, expert_start: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` in plain torch on the host; unused rows hold -1 here (the kernel leaves them
    unwritten)."""
    ids = topk_ids.reshape(-1).cpu().long()
    blocks = max_blocks(ids.numel(), num_experts, block_m)
    sorted_pairs = torch.full((blocks * block_m,), -1, dtype=torch.int32)
    block_expert = torch.full((blocks,), -1, dtype=torch.int32)
    block = 0
    for e in range(num_experts):
        pairs = torch.nonzero(ids == expert_start + e).flatten()
        n = triton.cdiv(pairs.numel(), block_m)
        sorted_pairs[block * block_m : block * block_m + pairs.numel()] = pairs.int()
        block_expert[block : block + n] = e
        block += n
    return sorted_pairs.to(topk_ids.device), block_expert.to(topk_ids.device)
