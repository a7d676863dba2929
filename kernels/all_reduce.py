"""One-shot all-reduce over peer buffers, for the small sums of tensor parallelism (a decode
step's two per layer): `one_shot_all_reduce` (kernel + launcher) and `all_reduce_ref`.

Every rank of a group of W runs the same launch on its own GPU. Each rank owns a data buffer
`[2, cap]` and a flag array `[MAX_PROGRAMS, MAX_WORLD]` (int64) that every peer can reach (CUDA
IPC: ops/custom_all_reduce.py maps them); the launcher gets all W of each, in rank order.
Program p of rank r, in one launch:

1. bumps its own call counter `counters[p]` (local memory, only program p touches it): the
   call's epoch e; the data goes to half e % 2 of the buffer;
2. copies its share of the input (elements p*BLOCK, (p+P)*BLOCK, ...) into its own buffer;
3. writes e into slot [p, r] of every peer's flags (release, system scope: the copy is visible
   before the flag is);
4. waits until every peer's slot [p, q] of its own flags reaches e (acquire, system scope);
5. sums the same share of every rank's buffer, in rank order 0..W-1 and in fp32, into `out`.

So program p of every rank handles the same elements and waits only for program p of the
others. Every rank sums in the same order: the results are bitwise equal on every rank (the
ranks of a tensor-parallel group must hold the same hidden states). Element i always belongs to
program (i // BLOCK) % MAX_PROGRAMS, whatever the size (a launch of fewer programs covers fewer
blocks), so the calls that touch an element alternate its halves. That makes a barrier at the
end unnecessary: a rank writes an element's half again only two calls of its program later,
after every peer raised its flag of the call between, which each does only once its launch
before it (the last read of that half) has finished (launches on one stream run in order).
Epochs are int64: they never wrap.

No host synchronisation and a fixed grid for a given size: CUDA-graph safe. The counters live on
the device, so a graph's replays keep counting. The grid stays at most MAX_PROGRAMS (64) so
every program of a launch is resident at once (a program that spins must not keep a peer's
program it waits for from being scheduled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_WORLD = 8
MAX_PROGRAMS = 64
BLOCK = 1024  # elements a program moves per pass: 16 bytes a thread at 4 warps in bf16
UNBOUNDED = 1 << 62  # polls of a peer's flag before a program gives up: never, in practice


@triton.jit
def _one_shot_all_reduce_kernel(
    # pointers
    x_ptr,  # [n] this rank's input
    out_ptr,  # [n] the sum (may be x)
    counters_ptr,  # [MAX_PROGRAMS] int64, this rank's call count per program
    status_ptr,  # [1] int32, set to 1 when a wait gave up (a peer did not come in max_spins)
    bufs,  # WORLD data buffers [2, cap], in rank order (this rank's at RANK)
    flags,  # WORLD flag arrays [MAX_PROGRAMS, MAX_WORLD] int64, in rank order
    # sizes
    n,
    cap,
    max_spins,
    # meta-parameters
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(counters_ptr + pid) + 1
    tl.debug_barrier()  # every thread has read the count before it changes
    tl.store(counters_ptr + pid, epoch)
    half = (epoch % 2) * cap
    cols = tl.arange(0, BLOCK)
    own = bufs[RANK]
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + cols
        mask = offs < n
        tl.store(own + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # the whole share is written before the flags go up
    for q in tl.static_range(WORLD):
        if q != RANK:
            slot = flags[q] + pid * FLAG_STRIDE + RANK
            tl.atomic_xchg(slot, epoch, sem="release", scope="sys")
    for q in tl.static_range(WORLD):
        if q != RANK:
            slot = flags[RANK] + pid * FLAG_STRIDE + q
            seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < epoch) & (spins < max_spins):
                seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < epoch:
                tl.store(status_ptr, 1)
    tl.debug_barrier()  # every thread reads only after the peers' flags were seen
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + cols
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            part = tl.load(bufs[q] + half + offs, mask=mask, other=0.0, cache_modifier=".cg")
            acc += part.to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def programs_for(n: int) -> int:
    """The grid of a launch over n elements: one program per BLOCK, at most MAX_PROGRAMS."""
    return max(1, min(MAX_PROGRAMS, triton.cdiv(n, BLOCK)))


def one_shot_all_reduce(
    x: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    bufs: tuple[torch.Tensor, ...],
    flags: tuple[torch.Tensor, ...],
    rank: int,
    status: torch.Tensor,
    max_spins: int = UNBOUNDED,
) -> torch.Tensor:
    """out <- the sum over the W = len(bufs) ranks of their x (every rank makes this call with
    the same x shape and dtype, in the same order as every other collective of the group).

    x, out: contiguous, one dtype (fp16, bf16 or fp32), the same number of elements n, `out`
    may be x. bufs[q]: rank q's data buffer in x's dtype, contiguous, >= 2 * cap elements with
    cap >= n (the launcher takes cap = len(bufs[0]) // 2); flags[q]: rank q's int64 flags,
    [MAX_PROGRAMS, MAX_WORLD] contiguous; counters: this rank's int64 [MAX_PROGRAMS], zeros at
    first. No host synchronisation; returns out.

    A program waits for its peers' flags at most `max_spins` polls (default: for good, as an
    NCCL call waits); one that gives up sets status[0] (int32) to 1 and sums what is there
    (wrong): for checks that must not hang, such as ops/custom_all_reduce.py's first sums."""
    world = len(bufs)
    _check_args(x, out, counters, bufs, flags, rank, status)
    n = x.numel()
    if n == 0:
        return out
    cap = bufs[0].numel() // 2
    if n > cap:
        raise ValueError(f"{n} elements exceed the buffers' {cap} (half of each buffer)")
    grid = (programs_for(n),)
    _one_shot_all_reduce_kernel[grid](
        x, out, counters, status, tuple(bufs), tuple(flags), n, cap, max_spins,
        RANK=rank, WORLD=world, FLAG_STRIDE=MAX_WORLD, BLOCK=BLOCK, num_warps=4,
        **launch_kwargs(x.device),
    )  # fmt: skip
    return out


def check_group(bufs, flags, rank: int) -> int:
    """The group's size from its buffers and flag arrays (one each per rank, 2..MAX_WORLD),
    and `rank` within it (raises ValueError naming what does not fit)."""
    world = len(bufs)
    if not 2 <= world <= MAX_WORLD or len(flags) != world:
        raise ValueError(
            f"need 2..{MAX_WORLD} buffers and as many flag arrays, got {world} and {len(flags)}"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    return world


def _check_args(x, out, counters, bufs, flags, rank, status) -> None:
    check_group(bufs, flags, rank)
    if x.dtype not in DTYPES or out.dtype != x.dtype or out.numel() != x.numel():
        raise ValueError(
            f"x and out must share a dtype of {DTYPES} and a size, got {x.dtype} "
            f"{tuple(x.shape)} and {out.dtype} {tuple(out.shape)}"
        )
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("x and out must be contiguous")
    sizes = {b.numel() for b in bufs}
    if len(sizes) != 1 or any(b.dtype != x.dtype or not b.is_contiguous() for b in bufs):
        raise ValueError(f"every buffer must be contiguous, of x's dtype {x.dtype}, one size")
    shape = (MAX_PROGRAMS, MAX_WORLD)
    if any(f.dtype != torch.int64 or tuple(f.shape) != shape for f in flags):
        raise ValueError(f"every flag array must be int64 {shape}")
    if counters.dtype != torch.int64 or tuple(counters.shape) != (MAX_PROGRAMS,):
        raise ValueError(f"counters must be int64 [{MAX_PROGRAMS}]")
    if status.dtype != torch.int32 or status.numel() != 1:
        raise ValueError("status must be one int32")


def all_reduce_ref(xs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank's `one_shot_all_reduce` returns, given every rank's x: their sum in rank
    order, in fp32, cast to x's dtype."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)
