"""The depthwise causal conv1d of a Mamba2 mixer, over a flat varlen batch whose sequences carry
their conv state in slots: `causal_conv1d_varlen` (prefill chunks) and `causal_conv1d_update`
(decode rows, one token each), Triton kernels + launchers, and `causal_conv1d_varlen_ref` and
`causal_conv1d_update_ref`, the same contract in plain torch (fp32 inside).

Contract shared by both (the Triton kernels and their launchers keep it):
- x: [T, D] (D = conv_dim channels; may be a strided view of the in_proj output, unit stride in
  D); weight: [D, K]; bias: [D] or None. out = silu(conv(x) + bias), [T, D] in x's dtype.
- conv_states: [num_slots, K - 1, D], the last K - 1 inputs before a sequence's next token
  (oldest first), in the model's dtype. Sequence b reads its initial state from slot
  `init_slots[b]` (-1: zeros, a sequence that starts at position 0) and stores its final state
  (the initial state followed by this step's inputs, last K - 1 of them) into `out_slots[b]`
  (-1: not stored). The two may be the same slot (a live slot that continues), or different (a
  prefix snapshot restored into a live slot without a copy). Every read of a slot happens before
  any write to it within a call (the Triton kernels: within a sequence, see below).
- A sequence whose slots are both -1 and whose query length is 0 is padding (CUDA graphs).
- Snapshots (varlen only, optional; prefix caching): snap_pos, snap_slots [num_seqs, E], E <=
  ssd_scan.MAX_SNAPS entries per sequence; entry (b, k) with a slot >= 0 stores the state after
  the first snap_pos[b, k] tokens of sequence b (its inputs pos - (K - 1) .. pos - 1) into that
  slot, as the SSD scan stores the SSM state there; a snapshot slot is only written by the call.

The Triton kernels keep "every read before any write" for a sequence's own slots (init == out
is safe, also with fewer than K - 1 tokens), but cannot order one sequence's write after another
sequence's read within one launch: they need the out slots (other than -1) of one call distinct
and none of them another sequence's init slot (several sequences may read one snapshot). The refs
allow anything. Slot numbers are not checked (that would synchronise): they must be -1 or lie in
[0, num_slots).

Kernels. `causal_conv1d_varlen`: one program per (sequence, block of BLOCK_D channels, split);
it reads its sequence's start and length from query_start_loc on the device and walks the
sequence's tiles of BLOCK_T tokens split, split + S, split + 2S, ... (S splits, a static function
of the shapes, so that one long sequence still fills the GPU). Each output tile is K shifted
loads (positions before the sequence's start come from the initial state, zeros for -1) times
the weight column, plus bias, then silu, all fp32. Split 0 owns the only state accesses: the
tile holding positions 0..K-2, and the final state (the last K - 1 positions of initial state +
tokens), which it loads, then `tl.debug_barrier()`, then stores, so a slot that is both read and
written is read completely first. `causal_conv1d_update`: one program per (decode row, block of
channels): window [K, BLOCK_D] = (initial state, x row), out = silu(sum(window * weight) + bias),
the new state (the window's last K - 1 rows) loaded, barrier, stored if out_slots[b] >= 0. A
padding row (both slots -1) still gets its out row (zero initial state), never a slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from taipan.kernels.activation import silu
from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.ssd_scan import check_snapshots, snapshot_entries

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SLOT_DTYPES = (torch.int32, torch.int64)
MIN_WIDTH, MAX_WIDTH = 2, 8
# Tile sizes and grid shaping: module globals read at each call (the tests change _MAX_BLOCK_D
# and _TARGET_PROGRAMS to get several channel blocks and splits at tiny shapes).
_MAX_BLOCK_D = 128  # varlen: channels per program
_MAX_BLOCK_D_UPDATE = 256  # update: channels per program
_MIN_BLOCK_T, _MAX_BLOCK_T = 8, 16  # varlen: tokens per tile (>= K - 1: only tile 0 reads state)
_TARGET_PROGRAMS = 4096  # varlen: split sequences until the grid has about this many programs


@triton.jit
def _tap(weight_ptr, cols, col_ok, k: tl.constexpr, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Column k of the weight [D, K] for channels `cols`, fp32; zeros for k >= K."""
    if k < WIDTH:
        w = tl.load(weight_ptr + cols * WIDTH + k, mask=col_ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_D], dtype=tl.float32)
    return w


@triton.jit(do_not_specialize=["num_splits"])  # == 1 would arrive as a plain int
def _causal_conv1d_varlen_kernel(
    # pointers
    x_ptr,  # [T, D]
    weight_ptr,  # [D, K]
    bias_ptr,  # [D] (unused without HAS_BIAS)
    qsl_ptr,  # [num_seqs + 1]
    states_ptr,  # [num_slots, K - 1, D]
    init_ptr,  # [num_seqs]
    dest_ptr,  # [num_seqs]
    snap_pos_ptr,  # [num_seqs, NUM_SNAPS] (unused without snapshots)
    snap_slots_ptr,  # [num_seqs, NUM_SNAPS]
    out_ptr,  # [T, D]
    # sizes and strides
    dim,
    num_splits,
    stride_x_token,
    stride_out_token,
    stride_state_slot,
    # meta-parameters
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_SNAPS: tl.constexpr,  # snapshot entries per sequence (0: none)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_power_of_2(WIDTH - 1)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    seq = tl.program_id(0)
    split = tl.program_id(2)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    init = tl.load(init_ptr + seq).to(tl.int64)
    dest = tl.load(dest_ptr + seq).to(tl.int64)
    has_init = init >= 0
    x_seq = x_ptr + start * stride_x_token
    init_base = states_ptr + init * stride_state_slot  # dereferenced only where has_init
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)

    # The taps, loaded once (fp32 [BLOCK_D] each, zeros past K); taps[k] weighs input t - K + 1 + k.
    taps = (
        _tap(weight_ptr, cols, col_ok, 0, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 1, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 2, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 3, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 4, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 5, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 6, WIDTH, BLOCK_D),
        _tap(weight_ptr, cols, col_ok, 7, WIDTH, BLOCK_D),
    )
    rows = tl.arange(0, BLOCK_T)
    first = split.to(tl.int64) * BLOCK_T
    step = num_splits.to(tl.int64) * BLOCK_T
    for t0 in range(first, length, step):
        x_tile = x_seq + t0 * stride_x_token  # int64 base, int32 offsets inside the tile
        tile_ok = (rows < length - t0)[:, None] & col_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            src = rows + (k - (WIDTH - 1))  # input row, relative to t0
            ok = tile_ok & (src + t0 >= 0)[:, None]  # the token, not the initial state
            ptrs = x_tile + src[:, None] * stride_x_token + cols[None, :]
            v = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            acc += v * taps[k][None, :]
        if (t0 == 0) & has_init:  # positions -(K-1)..-1 come from the initial state
            for k in tl.static_range(WIDTH - 1):
                state_row = rows + k  # = position + K - 1
                ok = tile_ok & (state_row < WIDTH - 1)[:, None]
                ptrs = init_base + state_row[:, None] * dim + cols[None, :]
                v = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
                acc += v * taps[k][None, :]
        y = silu(acc)  # fp32
        out_ptrs = out_ptr + (start + t0) * stride_out_token
        out_ptrs += rows[:, None] * stride_out_token + cols[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=tile_ok)

    j = tl.arange(0, BLOCK_S).to(tl.int64)
    row_ok = (j < WIDTH - 1)[:, None] & col_ok[None, :]
    # Snapshots first: they may read the initial state, which the final state may overwrite.
    # The state after `pos` tokens: positions pos - (K - 1) .. pos - 1 of (initial state, tokens).
    for k in tl.static_range(NUM_SNAPS):
        pos = tl.load(snap_pos_ptr + seq * NUM_SNAPS + k).to(tl.int64)
        slot = tl.load(snap_slots_ptr + seq * NUM_SNAPS + k).to(tl.int64)
        if (split == 0) & (slot >= 0):
            src = pos - (WIDTH - 1) + j
            from_x = src >= 0
            ptrs = tl.where(
                from_x[:, None],
                x_seq + src[:, None] * stride_x_token + cols[None, :],
                init_base + (src + (WIDTH - 1))[:, None] * dim + cols[None, :],
            )
            snap = tl.load(ptrs, mask=row_ok & (from_x | has_init)[:, None], other=0.0)
            snap_ptrs = states_ptr + slot * stride_state_slot + j[:, None] * dim + cols[None, :]
            tl.store(snap_ptrs, snap.to(states_ptr.dtype.element_ty), mask=row_ok)
    if (split == 0) & (dest >= 0):
        # Final state: positions length - (K - 1) .. length - 1 of (initial state, tokens).
        src = length - (WIDTH - 1) + j
        from_x = src >= 0
        ptrs = tl.where(
            from_x[:, None],
            x_seq + src[:, None] * stride_x_token + cols[None, :],
            init_base + (src + (WIDTH - 1))[:, None] * dim + cols[None, :],
        )
        state = tl.load(ptrs, mask=row_ok & (from_x | has_init)[:, None], other=0.0)
        tl.debug_barrier()  # every thread's reads of the slots land before any write
        dest_ptrs = states_ptr + dest * stride_state_slot + j[:, None] * dim + cols[None, :]
        tl.store(dest_ptrs, state.to(states_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _causal_conv1d_update_kernel(
    # pointers
    x_ptr,  # [B, D]
    weight_ptr,  # [D, K]
    bias_ptr,  # [D] (unused without HAS_BIAS)
    states_ptr,  # [num_slots, K - 1, D]
    init_ptr,  # [B]
    dest_ptr,  # [B]
    out_ptr,  # [B, D]
    # sizes and strides
    dim,
    stride_x_token,
    stride_out_token,
    stride_state_slot,
    # meta-parameters
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next_power_of_2(WIDTH)
    BLOCK_S: tl.constexpr,  # next_power_of_2(WIDTH - 1)
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    init = tl.load(init_ptr + row).to(tl.int64)
    dest = tl.load(dest_ptr + row).to(tl.int64)
    has_init = init >= 0
    x_row = x_ptr + row * stride_x_token + cols[None, :]  # [1, BLOCK_D]
    init_base = states_ptr + init * stride_state_slot + cols[None, :]  # dereferenced if has_init

    # The window: rows 0..K-2 the initial state (zeros without one), row K-1 the token.
    r = tl.arange(0, BLOCK_K)[:, None]
    from_x = r == WIDTH - 1
    ptrs = tl.where(from_x, x_row, init_base + r * dim)
    ok = (from_x | ((r < WIDTH - 1) & has_init)) & col_ok[None, :]
    window = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    w_ok = (r < WIDTH) & col_ok[None, :]
    w = tl.load(weight_ptr + cols[None, :] * WIDTH + r, mask=w_ok, other=0.0).to(tl.float32)
    acc = tl.sum(window * w, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = silu(acc)  # fp32
    tl.store(out_ptr + row * stride_out_token + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)

    if dest >= 0:
        # The new state: the window's last K - 1 rows (window row j + 1 into state row j).
        j = tl.arange(0, BLOCK_S)[:, None]
        last = j == WIDTH - 2  # the token
        state_ptrs = tl.where(last, x_row, init_base + (j + 1) * dim)
        row_ok = (j < WIDTH - 1) & col_ok[None, :]
        state = tl.load(state_ptrs, mask=row_ok & (last | has_init), other=0.0)
        tl.debug_barrier()  # every thread's reads of the slot land before any write
        dest_ptrs = states_ptr + dest * stride_state_slot + j * dim + cols[None, :]
        tl.store(dest_ptrs, state.to(states_ptr.dtype.element_ty), mask=row_ok)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    conv_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen prefill: sequence b owns tokens `query_start_loc[b]:query_start_loc[b + 1]` of x
    [T, D]. Returns silu(conv + bias) [T, D] in x's dtype (into `out`, new if None; rows no
    sequence covers are left as they were); writes conv_states[out_slots[b]] (module docstring).

    x needs unit stride in D (rows may be strided); weight [D, K] (2 <= K <= 8) and bias [D] are
    contiguous, any of fp16/bf16/fp32; conv_states [num_slots, K - 1, D] is contiguous in x's
    dtype; query_start_loc [num_seqs + 1] and the slots [num_seqs] are int32/int64, contiguous,
    on x's device. `out` must not overlap x. No host synchronisation: query_start_loc is read on
    the device, so the call can be captured in a CUDA graph and replayed with other lengths.

    `max_query_len`: an optional host-side bound on the query lengths (T when None). It only
    sizes the work (tokens per tile, and how many programs share one sequence); any value gives
    the same result, a wrong one only costs speed.

    snap_pos, snap_slots: [num_seqs, E] (E <= 8 entries, not the width K), both or neither
    (ssd_scan.check_snapshots): the conv state after the first snap_pos[b, k] tokens of
    sequence b goes to slot snap_slots[b, k] (-1: no entry), 1 <= snap_pos <= query length.
    Snapshot slots are only written: none may be read by the call or written twice."""
    num_seqs = _check_args(x, weight, bias, conv_states, init_slots, out_slots, out)
    _check_slots("query_start_loc", query_start_loc, x, num_seqs + 1)
    num_snaps = check_snapshots(snap_pos, snap_slots, num_seqs, x.device)
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    num_tokens, dim = x.shape
    width = weight.shape[1]
    bound = num_tokens if max_query_len is None else max_query_len
    block_t = min(_MAX_BLOCK_T, max(_MIN_BLOCK_T, triton.next_power_of_2(max(bound, 1))))
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(dim))
    num_dblocks = triton.cdiv(dim, block_d)
    wanted = triton.cdiv(_TARGET_PROGRAMS, num_seqs * num_dblocks)
    num_splits = max(1, min(triton.cdiv(bound, block_t), wanted, 65535))
    _causal_conv1d_varlen_kernel[(num_seqs, num_dblocks, num_splits)](
        x,
        weight,
        bias if bias is not None else weight,
        query_start_loc,
        conv_states,
        init_slots,
        out_slots,
        snap_pos if num_snaps else init_slots,
        snap_slots if num_snaps else init_slots,
        out,
        dim,
        num_splits,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        NUM_SNAPS=num_snaps,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(width - 1),
        num_warps=4,
        **launch_kwargs(x.device),
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: x [B, D], one token per sequence (row b is sequence b). Returns silu(conv +
    bias) [B, D] (into `out`, new if None); shifts the state of init_slots[b] by one token into
    out_slots[b]. A row whose slots are both -1 is padding: its out row is computed (from a zero
    state) and no slot is touched.
    Same argument rules as `causal_conv1d_varlen`; no host synchronisation."""
    num_rows = _check_args(x, weight, bias, conv_states, init_slots, out_slots, out)
    if x.shape[0] != num_rows:
        raise ValueError(
            f"decode: one row per sequence, but x has {x.shape[0]} rows and the slots {num_rows}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    dim = x.shape[1]
    width = weight.shape[1]
    block_d = min(_MAX_BLOCK_D_UPDATE, triton.next_power_of_2(dim))
    _causal_conv1d_update_kernel[(num_rows, triton.cdiv(dim, block_d))](
        x,
        weight,
        bias if bias is not None else weight,
        conv_states,
        init_slots,
        out_slots,
        out,
        dim,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        BLOCK_K=triton.next_power_of_2(width),
        BLOCK_S=triton.next_power_of_2(width - 1),
        BLOCK_D=block_d,
        num_warps=4,
        **launch_kwargs(x.device),
    )
    return out


def _check_args(x, weight, bias, conv_states, init_slots, out_slots, out) -> int:
    """Checks what both launchers share; returns the number of sequences."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, conv_dim], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(
            f"x must have unit stride in its last dim, got strides {x.stride()}: "
            "pass a .contiguous() copy"
        )
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [{dim}, K], got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"the kernel width K must be in {MIN_WIDTH}..{MAX_WIDTH}, got {width}")
    _check_param("weight", weight, x)
    if bias is not None:
        if bias.shape != (dim,):
            raise ValueError(f"bias must be [{dim}] or None, got shape {tuple(bias.shape)}")
        _check_param("bias", bias, x)
    expected = (width - 1, dim)
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != expected:
        raise ValueError(
            f"conv_states must be [num_slots, {width - 1}, {dim}] (K - 1 = {width - 1}), got "
            f"shape {tuple(conv_states.shape)}"
        )
    if conv_states.dtype != x.dtype:
        raise ValueError(
            f"conv_states must have x's dtype {x.dtype} (the model dtype), got {conv_states.dtype}"
        )
    if conv_states.device != x.device:
        raise ValueError(f"conv_states is on {conv_states.device}, x on {x.device}: use one device")
    if not conv_states.is_contiguous():
        raise ValueError(f"conv_states must be contiguous, got strides {conv_states.stride()}")
    num_seqs = init_slots.shape[0] if init_slots.dim() == 1 else -1
    _check_slots("init_slots", init_slots, x, num_seqs)
    _check_slots("out_slots", out_slots, x, num_seqs)
    if out is not None:
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}: use one device")
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(
                f"out must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(out.shape)}, "
                f"{out.dtype}"
            )
        if out.stride(1) != 1:
            raise ValueError(f"out must have unit stride in its last dim, got {out.stride()}")
        if _overlaps(out, x):
            raise ValueError("out must not overlap x (later tiles still read earlier tokens)")
    return num_seqs


def _check_param(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be fp16, bf16 or fp32, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x on {x.device}: use one device")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_slots(name: str, t: torch.Tensor, x: torch.Tensor, length: int) -> None:
    if t.dim() != 1 or (length >= 0 and t.shape[0] != length):
        want = "1-D" if length < 0 else f"[{length}]"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.dtype not in SLOT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x on {x.device}: use one device")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b intersect (host arithmetic on pointers, no sync)."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    conv_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen prefill: sequence b owns tokens `query_start_loc[b]:query_start_loc[b + 1]` of x.
    Returns silu(conv + bias) [T, D]; writes conv_states[out_slots[b]] (and the snapshots)."""
    width = weight.shape[1]
    starts = query_start_loc.tolist()
    init, dest = init_slots.tolist(), out_slots.tolist()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    finals = []
    w = weight.float().unsqueeze(1)  # [D, 1, K]
    b32 = None if bias is None else bias.float()
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if init[b] >= 0:
            history = conv_states[init[b]].float()  # [K-1, D]
        else:
            history = x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        seq = torch.cat([history, x[lo:hi].float()])  # [K-1+L, D]
        if hi > lo:
            y = F.conv1d(seq.t().unsqueeze(0), w, b32, groups=x.shape[1])[0].t()  # [L, D]
            out[lo:hi] = F.silu(y).to(x.dtype)
        for pos, slot in snapshot_entries(snap_pos, snap_slots, b, hi - lo):
            finals.append((slot, seq[pos : pos + width - 1]))  # inputs pos-(K-1)..pos-1
        finals.append((dest[b], seq[seq.shape[0] - (width - 1) :]))
    for slot, state in finals:  # every read above happened before any write
        if slot >= 0:
            conv_states[slot] = state.to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Decode: x [B, D], one token per sequence (row b is sequence b). Returns [B, D]; shifts
    the state of init_slots[b] by one token into out_slots[b]."""
    starts = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return causal_conv1d_varlen_ref(x, weight, bias, starts, conv_states, init_slots, out_slots)
