"""The SSD (state space duality) scan of a Mamba2 mixer for prefill chunks, over a flat varlen
batch whose sequences carry their SSM state in slots: `ssd_scan_varlen` (Triton kernel +
launcher) and `ssd_scan_varlen_ref`, the same contract in plain torch (fp32 inside).

Per head h, with dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max) and a = exp(dt'·A[h]):
    state_t = a_t · state_{t-1} + dt'_t · x_t ⊗ B_t          (state: [P, N] per head)
    y_t     = state_t · C_t + D[h] · x_t
B and C are shared by the H / G heads of a group (head h uses group h // (H / G)). The chunked
form computes the same thing `chunk_size` tokens at a time (a masked quadratic form inside a
chunk, the recurrence between chunks); chunks restart at each sequence's first token.

Contract (the Triton kernel and its launcher keep it):
- x: [T, H, P]; dt: [T, H] (raw, before bias and softplus); A: [H] fp32 (already -exp(A_log));
  B, C: [T, G, N]; D, dt_bias: [H]. Inputs may be strided views of the conv output.
- ssm_states: [num_slots, H, P, N] fp32. Sequence b (tokens query_start_loc[b]:[b + 1]) starts
  from slot init_slots[b] (-1: zeros) and stores its final state into out_slots[b] (-1: not
  stored); all reads of a call happen before its writes, so the two may be the same slot.
- Snapshots (optional; prefix caching): snap_pos, snap_slots: [S, K]. Entry (b, k) with
  snap_slots[b, k] >= 0 stores sequence b's state after its first snap_pos[b, k] tokens of this
  call (1 <= snap_pos <= its query length) into that slot, besides the final state; -1: none.
  A snapshot slot is written only: no sequence of the call reads it, and no two entries share it.
- Returns y: [T, H, P] in x's dtype (before the gated norm; the z gate is not applied here).

The Triton kernel (`ssd_scan_varlen`): one program per (sequence, head, block of P) walks its
sequence in steps of at most MAX_STEP tokens (a chunk is only a grouping: longer chunks are cut
into steps, the same math) with the running [BLOCK_P, N] state in fp32 registers. Per step: dt'
and its cumulative log-decay, the intra-step quadratic form (C·Bᵀ masked by the causal decay,
times dt'·x), the carried-in term exp(cum)·C·stateᵀ, the D skip, y stored; then the state
advanced to the step's end. The program owns its state tile from the first read to the last
write, so a sequence's init and out slot may be one slot; but programs of different sequences
are not ordered, so no sequence may read a slot that another one writes in the same call.
A snapshot inside a step costs one more [BLOCK_P, STEP] x [STEP, N] dot in that step only, so
the chunks need not end at snapshot positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from taipan.kernels.decode_attention import _num_sms
from taipan.kernels.pdl import enter, launch_kwargs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PARAM_DTYPES = (*DTYPES, torch.float64)  # D and dt_bias
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_STATE = 256  # N: one program holds a [BLOCK_P, N] fp32 state tile in registers
MAX_STEP = 32  # tokens per kernel step (16 for N > 128): longer chunks are cut into steps
MAX_SNAPS = 8  # snapshot entries per sequence and call


@triton.jit
def _discretize(v, dt_min, dt_max):
    """clamp(softplus(v), dt_min, dt_max) in fp32, v = dt + dt_bias. softplus(v) = max(v, 0) +
    log1p(exp(-|v|)); log1p(e) = log(u) * e / (u - 1) with u = 1 + e (Goldberg), which stays exact
    where fp32 rounds 1 + e (and is e itself once u == 1)."""
    e = tl.exp(-tl.abs(v))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.minimum(tl.maximum(tl.maximum(v, 0.0) + log1p, dt_min), dt_max)


@triton.jit
def _ssd_scan_kernel(
    # pointers
    x_ptr,  # [T, H, P]
    dt_ptr,  # [T, H]
    A_ptr,  # [H] fp32
    B_ptr,  # [T, G, N]
    C_ptr,  # [T, G, N]
    D_ptr,  # [H]
    dt_bias_ptr,  # [H]
    query_start_loc_ptr,  # [S + 1]
    states_ptr,  # [num_slots, H, P, N] fp32
    init_slots_ptr,  # [S]
    out_slots_ptr,  # [S]
    snap_pos_ptr,  # [S, NUM_SNAPS] (unused without snapshots)
    snap_slots_ptr,  # [S, NUM_SNAPS]
    y_ptr,  # [T, H, P]
    # strides (every last dim has unit stride)
    stride_x_t,
    stride_x_h,
    stride_dt_t,
    stride_b_t,
    stride_b_g,
    stride_c_t,
    stride_c_g,
    stride_y_t,
    stride_y_h,
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    # scalars
    P,
    N,
    dt_min,
    dt_max,
    # meta-parameters
    HEADS_PER_GROUP: tl.constexpr,
    NUM_SNAPS: tl.constexpr,  # snapshot entries per sequence (0: none)
    STEP: tl.constexpr,  # tokens per step (<= BLOCK_T)
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CB_NATIVE: tl.constexpr,  # C·Bᵀ straight from 16-bit storage (exact products, fp32 sums)
    DOT_PRECISION: tl.constexpr,  # of the dots on fp32 values: "ieee" or "tf32"
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    """One program: sequence program_id(0), head program_id(1), head_dim rows
    [program_id(2) * BLOCK_P, +BLOCK_P) of its state, all N columns. It walks the sequence STEP
    tokens at a time with the running state in registers (fp32), so it alone reads the initial
    state and writes the final one (and the snapshots)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    init = tl.load(init_slots_ptr + seq).to(tl.int64)
    dest = tl.load(out_slots_ptr + seq).to(tl.int64)
    if (end <= start) & (dest < 0):  # padding (or nothing to store)
        return
    group = head // HEADS_PER_GROUP
    a = tl.load(A_ptr + head).to(tl.float32)
    d = tl.load(D_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)

    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < P
    n_ok = n < N
    tile_ok = p_ok[:, None] & n_ok[None, :]
    state_off = head * stride_s_h + p[:, None] * stride_s_p + n[None, :]
    state = tl.load(
        states_ptr + tl.maximum(init, 0) * stride_s_slot + state_off,
        mask=tile_ok & (init >= 0),
        other=0.0,
    )  # [BLOCK_P, BLOCK_N]; slot -1: zeros

    t = tl.arange(0, BLOCK_T)
    causal = t[:, None] >= t[None, :]
    x_base = x_ptr + head * stride_x_h
    y_base = y_ptr + head * stride_y_h
    b_base = B_ptr + group * stride_b_g
    c_base = C_ptr + group * stride_c_g
    for c0 in range(start, end, STEP):
        tok = c0 + t
        t_ok = (t < STEP) & (tok < end)
        tok = tok.to(tl.int64)
        dt_raw = tl.load(dt_ptr + tok * stride_dt_t + head, mask=t_ok, other=0.0)
        # Tokens past the step get dt' = 0: no decay, no input, so cum stays flat after them.
        dtp = tl.where(t_ok, _discretize(dt_raw.to(tl.float32) + bias, dt_min, dt_max), 0.0)
        cum = tl.cumsum(dtp * a, axis=0)  # log of the decay from the step's start
        total = tl.sum(tl.where(t == BLOCK_T - 1, cum, 0.0), axis=0)  # = cum at the last token

        x = tl.load(
            x_base + tok[:, None] * stride_x_t + p[None, :],
            mask=t_ok[:, None] & p_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_P]
        tn_ok = t_ok[:, None] & n_ok[None, :]
        b = tl.load(b_base + tok[:, None] * stride_b_t + n[None, :], mask=tn_ok, other=0.0)
        c = tl.load(c_base + tok[:, None] * stride_c_t + n[None, :], mask=tn_ok, other=0.0)

        # y_l = sum_{s<=l} (C_l·B_s) exp(cum_l - cum_s) dt'_s x_s + exp(cum_l) C_l·state + D x_l
        if CB_NATIVE:
            cb = tl.dot(c, tl.trans(b))  # [BLOCK_T, BLOCK_T]
        else:
            cb = tl.dot(c.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision=DOT_PRECISION)
        c32 = c.to(tl.float32)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = cb * decay * dtp[None, :]
        y = tl.dot(c32, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
        y = tl.dot(scores, x, acc=y + d * x, input_precision=DOT_PRECISION)
        tl.store(
            y_base + tok[:, None] * stride_y_t + p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=t_ok[:, None] & p_ok[None, :],
        )

        b32 = b.to(tl.float32)
        # Snapshots inside this step: the state after its token j (0 <= j < STEP), which is
        # exp(cum_j) state + sum_{s<=j} exp(cum_j - cum_s) dt'_s x_s ⊗ B_s. One more dot, only
        # in the (rare) steps that hold a snapshot position.
        for k in tl.static_range(NUM_SNAPS):
            sp = tl.load(snap_pos_ptr + seq * NUM_SNAPS + k).to(tl.int32)
            slot = tl.load(snap_slots_ptr + seq * NUM_SNAPS + k).to(tl.int64)
            j = start + sp - 1 - c0
            if (slot >= 0) & (j >= 0) & (j < STEP):
                cum_j = tl.sum(tl.where(t == j, cum, 0.0), axis=0)
                w = tl.where(t <= j, tl.exp(cum_j - cum) * dtp, 0.0)
                snap = tl.dot(
                    tl.trans(x * w[:, None]),
                    b32,
                    acc=state * tl.exp(cum_j),
                    input_precision=DOT_PRECISION,
                )
                snap_ptr = states_ptr + slot * stride_s_slot + head * stride_s_h
                snap_ptr += p[:, None] * stride_s_p
                tl.store(snap_ptr + n[None, :], snap, mask=p_ok[:, None] & n_ok[None, :])

        # state <- exp(total) state + sum_s exp(total - cum_s) dt'_s x_s ⊗ B_s
        xw = x * (tl.exp(total - cum) * dtp)[:, None]
        state = tl.dot(tl.trans(xw), b32, acc=state * tl.exp(total), input_precision=DOT_PRECISION)

    # Spelled unlike the initial load, so that the compiler does not keep one [BLOCK_P, BLOCK_N]
    # offset tile and mask live in registers across the whole loop to share them.
    row_ptr = states_ptr + tl.maximum(dest, 0) * stride_s_slot + head * stride_s_h
    row_ptr += p[:, None] * stride_s_p
    tl.store(row_ptr + n[None, :], state, mask=(p_ok & (dest >= 0))[:, None] & n_ok[None, :])


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    chunk_size: int,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    out: torch.Tensor | None = None,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunked SSD scan of the module contract, in Triton. Never syncs the device: the grid
    is (S, H, cdiv(P, BLOCK_P)) for S = len(init_slots) sequences, and each program reads its
    sequence's bounds and slots on the device (CUDA-graph safe; padding sequences exit at once).

    x: [T, H, P]; dt: [T, H]; B, C: [T, G, N] (G divides H, N <= 256): fp16/bf16/fp32, strided
    views allowed with unit stride in the last dim. A: [H] fp32; D, dt_bias: [H] (any float).
    query_start_loc: [S + 1], init_slots, out_slots: [S] (int32 or int64, on x's device);
    ssm_states: [num_slots, H, P, N] fp32 contiguous. Returns y [T, H, P] in x's dtype (`out`
    if given; it may be x). Tokens outside [query_start_loc[0], query_start_loc[S]) are not
    written. A sequence of query length 0 copies its initial state into its out slot (if any),
    as the reference does.

    Values on the device are trusted, not checked: query_start_loc nondecreasing within [0, T],
    slots in [-1, num_slots). A sequence's own init and out slot may be the same; a slot that
    one sequence writes must not be another sequence's init slot in the same call (programs of
    different sequences are not ordered).

    chunk_size only groups tokens (the result does not depend on it, up to rounding): the
    kernel steps at most MAX_STEP tokens at a time.

    snap_pos, snap_slots: [S, K] (K <= MAX_SNAPS), int32/int64, contiguous, both or neither:
    the states after the first snap_pos[b, k] tokens of sequence b go to slots snap_slots[b, k]
    (-1: no entry; module docstring). Trusted like the slots: 1 <= snap_pos <= query length.
    """
    num_seqs = _check_scan_args(
        x, dt, A, B, C, D, dt_bias, query_start_loc, ssm_states, init_slots, out_slots,
        chunk_size, out,
    )  # fmt: skip
    num_snaps = check_snapshots(snap_pos, snap_slots, num_seqs, x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    if num_seqs == 0 or num_heads == 0 or head_dim == 0:
        return out
    step, block_t, block_p, block_n, num_warps, num_stages = _scan_config(
        x, num_seqs, num_heads, head_dim, state_size, chunk_size
    )
    # With no tokens (every sequence empty) the token tensors are never read, but a launch
    # still needs real pointers.
    x_, dt_, B_, C_, y_ = (_nonempty(t) for t in (x, dt, B, C, out))
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
        x_, dt_, A, B_, C_, D, dt_bias,
        query_start_loc, _nonempty(ssm_states), init_slots, out_slots,
        snap_pos if num_snaps else init_slots, snap_slots if num_snaps else init_slots, y_,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        C.stride(0), C.stride(1), out.stride(0), out.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        head_dim, state_size, float(dt_min), float(dt_max),
        HEADS_PER_GROUP=num_heads // groups,
        NUM_SNAPS=num_snaps,
        STEP=step, BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=block_n,
        CB_NATIVE=B.dtype == C.dtype and B.dtype != torch.float32,
        # fp32 storage (tests, debugging) means fp32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
        **launch_kwargs(x_.device),
    )  # fmt: skip
    return out


def _scan_config(x, num_seqs, num_heads, head_dim, state_size, chunk_size):
    """(STEP, BLOCK_T, BLOCK_P, BLOCK_N, num_warps, num_stages) for this launch, from shapes only.

    Sized from ptxas reports for sm_90 (bf16, N = 128, P = 64: at most a few bytes of register
    spills): steps of 32 tokens (16 for N > 128) keep the [STEP, N] operand tiles small; 64-token
    steps spill hundreds of bytes per thread. Two stages prefetch the next step's dt, x, B and C
    while this one computes. fp32 storage (tests) uses smaller P blocks and one stage."""
    block_n = max(16, triton.next_power_of_2(state_size))
    step = min(chunk_size, MAX_STEP if block_n <= 128 else max(1, MAX_STEP // 2))
    block_t = max(16, triton.next_power_of_2(step))
    if not x.is_cuda:  # the CPU interpreter: the smallest tiles tl.dot allows
        return step, block_t, 16, block_n, 4, 1
    wide = x.element_size() == 2
    block_p = min(64 if wide and block_n <= 128 else 32, max(16, triton.next_power_of_2(head_dim)))
    # Fewer programs than SMs (one long sequence): split head_dim finer, at the price of
    # recomputing C·Bᵀ per block.
    if block_p > 16 and num_seqs * num_heads * triton.cdiv(head_dim, block_p) < _num_sms(x.device):
        block_p //= 2
    return step, block_t, block_p, block_n, 4, 2 if wide else 1


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """t itself, or a one-element stand-in of its dtype when t has no elements (never read)."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def _check_vector(name, t, length, dtypes, device) -> None:
    """A contiguous 1-D tensor of `length` entries with a dtype in `dtypes`, on `device`."""
    if t.dim() != 1 or t.shape[0] != length or t.stride(0) != 1 or t.dtype not in dtypes:
        raise ValueError(
            f"{name} must be a contiguous [{length}] tensor of {_names(dtypes)}, got shape "
            f"{tuple(t.shape)}, {t.dtype}, strides {t.stride()}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x on {device}: use one device")


def _check_tokens(name, t, shape, dtypes, device, anchor: str = "x") -> None:
    """A [T, ...] token tensor (possibly a strided view) with unit stride in its last dim, on
    `device` (that of the tensor named `anchor`). Shared with gated_delta."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {_names(dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, {anchor} on {device}: use one device")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dim, got strides {t.stride()}: "
            "pass a .contiguous() copy"
        )


def _check_ssm_args(x, dt, A, B, C, D, dt_bias, ssm_states, init_slots, out_slots, out) -> int:
    """Checks shared by the prefill scan and the decode update; returns the number of
    sequences (rows of init_slots). Shapes, dtypes, strides and devices only: no device sync."""
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be {_names(DTYPES)}, got {x.dtype}")
    num_tokens, num_heads, head_dim = x.shape
    device = x.device
    _check_tokens("x", x, x.shape, DTYPES, device)
    _check_tokens("dt", dt, (num_tokens, num_heads), DTYPES, device)
    if B.dim() != 3 or B.shape[0] != num_tokens:
        raise ValueError(f"B must be [{num_tokens}, groups, state], got shape {tuple(B.shape)}")
    groups, state_size = B.shape[1], B.shape[2]
    if groups == 0 or num_heads % groups:
        raise ValueError(f"the groups of B and C ({groups}) must divide the heads ({num_heads})")
    if not 0 < state_size <= MAX_STATE:
        raise ValueError(f"the state size N must be in 1..{MAX_STATE}, got {state_size}")
    _check_tokens("B", B, B.shape, DTYPES, device)
    _check_tokens("C", C, B.shape, DTYPES, device)
    _check_vector("A", A, num_heads, (torch.float32,), device)
    _check_vector("D", D, num_heads, PARAM_DTYPES, device)
    _check_vector("dt_bias", dt_bias, num_heads, PARAM_DTYPES, device)
    want = (num_heads, head_dim, state_size)
    if (
        ssm_states.dim() != 4
        or tuple(ssm_states.shape[1:]) != want
        or ssm_states.dtype != torch.float32
        or not ssm_states.is_contiguous()
    ):
        raise ValueError(
            f"ssm_states must be a contiguous fp32 [num_slots, {', '.join(map(str, want))}] "
            f"tensor, got shape {tuple(ssm_states.shape)}, {ssm_states.dtype}, "
            f"contiguous={ssm_states.is_contiguous()}"
        )
    if ssm_states.device != device:
        raise ValueError(f"ssm_states is on {ssm_states.device}, x on {device}: use one device")
    if init_slots.dim() != 1:
        raise ValueError(f"init_slots must be 1-D, got shape {tuple(init_slots.shape)}")
    num_seqs = init_slots.shape[0]
    _check_vector("init_slots", init_slots, num_seqs, INDEX_DTYPES, device)
    _check_vector("out_slots", out_slots, num_seqs, INDEX_DTYPES, device)
    if out is not None:
        _check_tokens("out", out, x.shape, (x.dtype,), device)
    return num_seqs


def _check_scan_args(
    x, dt, A, B, C, D, dt_bias, query_start_loc, ssm_states, init_slots, out_slots, chunk_size, out
) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    num_seqs = _check_ssm_args(x, dt, A, B, C, D, dt_bias, ssm_states, init_slots, out_slots, out)
    _check_vector("query_start_loc", query_start_loc, num_seqs + 1, INDEX_DTYPES, x.device)
    return num_seqs


def check_snapshots(snap_pos, snap_slots, num_seqs: int, device) -> int:
    """Snapshot entries per sequence (0 without): both tensors [num_seqs, K], 1 <= K <=
    MAX_SNAPS, int32/int64, contiguous, on `device` (ValueError). Shared with causal_conv1d."""
    if snap_pos is None and snap_slots is None:
        return 0
    if snap_pos is None or snap_slots is None:
        raise ValueError("snap_pos and snap_slots go together: pass both or neither")
    for name, t in (("snap_pos", snap_pos), ("snap_slots", snap_slots)):
        if (
            t.dim() != 2
            or t.shape[0] != num_seqs
            or not 1 <= t.shape[1] <= MAX_SNAPS
            or t.dtype not in INDEX_DTYPES
            or not t.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous [{num_seqs}, K] int32/int64 tensor with 1 <= K <= "
                f"{MAX_SNAPS}, got shape {tuple(t.shape)}, {t.dtype}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, x on {device}: use one device")
    if snap_pos.shape != snap_slots.shape:
        raise ValueError(
            f"snap_pos {tuple(snap_pos.shape)} and snap_slots {tuple(snap_slots.shape)} differ"
        )
    return snap_pos.shape[1]


def snapshot_entries(snap_pos, snap_slots, b: int, length: int) -> list[tuple[int, int]]:
    """The refs' view of sequence b's snapshot entries: (position, slot) with slot >= 0 and
    1 <= position <= length (others are not stored)."""
    if snap_pos is None:
        return []
    pairs = zip(snap_pos[b].tolist(), snap_slots[b].tolist(), strict=True)
    return [(p, s) for p, s in pairs if s >= 0 and 1 <= p <= length]


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float
) -> torch.Tensor:
    """dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max), fp32 (shared with the decode ref)."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min, max=dt_max)


def ssd_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    chunk_size: int,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_heads, groups = x.shape[1], B.shape[1]
    rep = num_heads // groups
    starts = query_start_loc.tolist()
    init, dest = init_slots.tolist(), out_slots.tolist()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    step = discretize_dt(dt, dt_bias, dt_min, dt_max)  # [T, H]
    A32, D32 = A.float(), D.float()
    finals = []
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if init[b] >= 0:
            state = ssm_states[init[b]].float().clone()  # [H, P, N]
        else:
            state = x.new_zeros(ssm_states.shape[1:], dtype=torch.float32)
        wanted = snapshot_entries(snap_pos, snap_slots, b, hi - lo)
        for c0 in range(lo, hi, chunk_size):
            c1 = min(c0 + chunk_size, hi)
            xs = x[c0:c1].float()  # [l, H, P]
            dts = step[c0:c1]  # [l, H]
            Bs = B[c0:c1].float().repeat_interleave(rep, dim=1)  # [l, H, N]
            Cs = C[c0:c1].float().repeat_interleave(rep, dim=1)
            cum = torch.cumsum(dts * A32, dim=0)  # [l, H], log of the decay from chunk start
            # decay[l, s, h] = exp(cum[l] - cum[s]) for s <= l, else 0
            diff = cum[:, None, :] - cum[None, :, :]
            causal = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=x.device).tril()
            decay = torch.exp(diff.masked_fill(~causal[:, :, None], -math.inf))
            scores = torch.einsum("lhn,shn->lsh", Cs, Bs) * decay  # [l, s, H]
            y_diag = torch.einsum("lsh,sh,shp->lhp", scores, dts, xs)
            y_off = torch.einsum("lhn,hpn->lhp", Cs, state) * torch.exp(cum)[:, :, None]
            y[c0:c1] = (y_diag + y_off + D32[None, :, None] * xs).to(x.dtype)
            for pos, slot in wanted:  # the state after token j of this chunk
                j = lo + pos - 1 - c0
                if 0 <= j < c1 - c0:
                    w = torch.exp(cum[j][None, :] - cum[: j + 1]) * dts[: j + 1]  # [j+1, H]
                    snap = state * torch.exp(cum[j])[:, None, None] + torch.einsum(
                        "sh,shp,shn->hpn", w, xs[: j + 1], Bs[: j + 1]
                    )
                    finals.append((slot, snap))
            to_end = torch.exp(cum[-1][None, :] - cum)  # [l, H]
            state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
                "sh,shp,shn->hpn", to_end * dts, xs, Bs
            )
        finals.append((dest[b], state))
    for slot, state in finals:  # every read above happened before any write
        if slot >= 0:
            ssm_states[slot] = state.to(ssm_states.dtype)
    return y
