"""The chunked (WY / UT-transform) Triton kernel behind kernels/gated_delta.py's
`gated_delta_varlen`; the contract, the launcher and the reference live there. This file owns
only the kernel, its tile-size choice and the tile helpers it shares with gated_delta.py's
decode kernel (state tile, slot load/store, l2norm); it touches no state beyond the slots it is
given.

The chunk form. Within a chunk of C tokens starting from state S0, with cum_t = g_1 + .. + g_t
(inclusive, log of the decay from the chunk's start) and Γ_t = exp(cum_t), the deltas
delta_t = beta_t (v_t - kᵀ_t exp(g_t) S_{t-1}) of the recurrence satisfy

    delta_t + Σ_{s<t} A_ts delta_s = beta_t v_t - beta_t Γ_t kᵀ_t S0,
    A_ts = beta_t (k_t · k_s) exp(cum_t - cum_s)                (strictly lower, [C, C])

so Δ = (I + A)⁻¹ (βV - (βΓK) S0), with (I + A)⁻¹ built by forward substitution (row i of the
inverse is e_i - Σ_{j<i} A_ij row_j). Then, all exact (no division by Γ, every exp <= 1):

    o_t  = scale (Γ_t qᵀ_t S0 + Σ_{s<=t} exp(cum_t - cum_s) (q_t · k_s) delta_s)
    S_j  = Γ_j S0 + Σ_{s<=j} exp(cum_j - cum_s) k_s ⊗ delta_s      (after the chunk's token j)

S_j at j = C - 1 is the state passed to the next chunk; at a snapshot position inside the chunk
it is one more [Dk, C] x [C, BV] dot, so chunks need not end at snapshots. Tokens past the
sequence's end are loaded as zeros (g = beta = 0): they add nothing and decay nothing.

In the kernel q and k are L2-normalised in fp32 as loaded (q times the scale); the dots run in
TF32 on GPUs for 16-bit storage, except k·kᵀ and q·kᵀ in tf32x3 (A gets inverted), and in
plain fp32 ("ieee") for fp32 storage.

One program per (sequence, value head, block of BV columns of Dv) walks its sequence chunk by
chunk (chunks start at the sequence's first token) with its [Dk, BV] state tile in fp32
registers: it alone reads the initial state and writes the snapshots and the final state, so a
sequence's init and out slot may be one slot. (I + A)⁻¹ depends on q and k only, so programs of
one head's other Dv blocks recompute it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter

L2NORM_EPS = 1e-6
EPS = tl.constexpr(L2NORM_EPS)  # the same, readable inside @triton.jit


@triton.jit
def _unit_lower_inverse(A, CHUNK: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular A [CHUNK, CHUNK] (fp32), by forward
    substitution: row i of the inverse T is e_i - Σ_{j<i} A_ij T_j (rows j < i already final)."""
    r = tl.arange(0, CHUNK)
    T = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, CHUNK):
        is_row = r[:, None] == i
        a = tl.sum(tl.where(is_row, A, 0.0), axis=0)  # row i of A, over j (zero for j >= i)
        T = tl.where(is_row, T - tl.sum(a[:, None] * T, axis=0)[None, :], T)
    return T


@triton.jit
def state_tile(head, stride_s_h, stride_s_k, Dk, Dv, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's [BLOCK_K, BLOCK_V] tile of value head `head`'s [Dk, Dv] state: every row,
    the columns from program_id(2) * BLOCK_V. Returns (kc, vc, kc_ok, vc_ok, tile_ok, state_off),
    state_off the tile's element offsets within a slot."""
    kc = tl.arange(0, BLOCK_K)
    vc = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kc_ok = kc < Dk
    vc_ok = vc < Dv
    tile_ok = kc_ok[:, None] & vc_ok[None, :]
    state_off = head * stride_s_h + kc[:, None] * stride_s_k + vc[None, :]
    return kc, vc, kc_ok, vc_ok, tile_ok, state_off


@triton.jit
def load_state(states_ptr, slot, stride_s_slot, state_off, tile_ok):
    """The fp32 state tile of `slot` (int64), zeros for slot -1."""
    return tl.load(
        states_ptr + tl.maximum(slot, 0) * stride_s_slot + state_off,
        mask=tile_ok & (slot >= 0),
        other=0.0,
    )


@triton.jit
def store_state(states_ptr, slot, stride_s_slot, state_off, tile_ok, state):
    """Stores the state tile into `slot` (int64); nothing for slot -1."""
    tl.store(
        states_ptr + tl.maximum(slot, 0) * stride_s_slot + state_off,
        state,
        mask=tile_ok & (slot >= 0),
    )


@triton.jit
def inv_l2norm(x, AXIS: tl.constexpr):
    """1 / sqrt(sum(x^2) + eps) along AXIS of fp32 x: the factor of HF's and FLA's l2norm."""
    return tl.rsqrt(tl.sum(x * x, axis=AXIS) + EPS)


@triton.jit
def _load_rows(ptr, tok, t_ok, cols, col_ok, stride_t):
    """Rows `tok`, columns `cols` of a [T, D] head view, in its storage dtype (zeros outside)."""
    return tl.load(
        ptr + tok[:, None] * stride_t + cols[None, :],
        mask=t_ok[:, None] & col_ok[None, :],
        other=0.0,
    )


@triton.jit
def _row_scale(x, USE_L2NORM: tl.constexpr):
    """Per row of x [CHUNK, BLOCK_K], the factor of its l2norm (1 without), fp32 [CHUNK]."""
    if USE_L2NORM:
        r = inv_l2norm(x.to(tl.float32), 1)
    else:
        r = tl.full([x.shape[0]], 1.0, dtype=tl.float32)
    return r


@triton.jit
def gated_delta_chunk_kernel(
    # pointers
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv]
    beta_ptr,  # [T, Hv]
    qsl_ptr,  # [B + 1]
    states_ptr,  # [num_slots, Hv, Dk, Dv] fp32
    init_ptr,  # [B]
    dest_ptr,  # [B]
    snap_pos_ptr,  # [B, NUM_SNAPS] (unused without snapshots)
    snap_slots_ptr,  # [B, NUM_SNAPS]
    out_ptr,  # [T, Hv, Dv]
    # strides (every last dim has unit stride)
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_g_t,
    stride_beta_t,
    stride_o_t,
    stride_o_h,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    # scalars
    Dk,
    Dv,
    scale,
    # meta-parameters
    HEADS_PER_KEY: tl.constexpr,  # Hv // Hk
    USE_L2NORM: tl.constexpr,
    NUM_SNAPS: tl.constexpr,  # snapshot entries per sequence (0: none)
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (fp32 storage) or "tf32"
    QK_PRECISION: tl.constexpr,  # of k·kᵀ and q·kᵀ: "ieee" or "tf32x3" (A gets inverted)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    init = tl.load(init_ptr + seq).to(tl.int64)
    dest = tl.load(dest_ptr + seq).to(tl.int64)
    if (end <= start) & (dest < 0):  # padding (or nothing to store)
        return
    kh = head // HEADS_PER_KEY
    kc, vc, kc_ok, vc_ok, tile_ok, state_off = state_tile(
        head, stride_s_h, stride_s_k, Dk, Dv, BLOCK_K, BLOCK_V
    )
    state = load_state(states_ptr, init, stride_s_slot, state_off, tile_ok)  # [BLOCK_K, BLOCK_V]

    t = tl.arange(0, CHUNK)
    strict = t[:, None] > t[None, :]
    causal = t[:, None] >= t[None, :]
    q_base = q_ptr + kh * stride_q_h
    k_base = k_ptr + kh * stride_k_h
    for c0 in range(start, end, CHUNK):
        tok = c0 + t
        t_ok = tok < end
        q = _load_rows(q_base, tok, t_ok, kc, kc_ok, stride_q_t)  # [CHUNK, BLOCK_K]
        q = q.to(tl.float32) * (_row_scale(q, USE_L2NORM) * scale)[:, None]
        k = _load_rows(k_base, tok, t_ok, kc, kc_ok, stride_k_t)
        k = k.to(tl.float32) * _row_scale(k, USE_L2NORM)[:, None]
        v = _load_rows(v_ptr + head * stride_v_h, tok, t_ok, vc, vc_ok, stride_v_t)
        g = tl.load(g_ptr + tok * stride_g_t + head, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_beta_t + head, mask=t_ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)
        total = tl.sum(g, axis=0)  # = cum at the chunk's last token (g = 0 past the end)
        diff = cum[:, None] - cum[None, :]
        gamma = tl.exp(cum)

        # Δ = (I + A)⁻¹ (βV - (βΓK) S0)
        kk = tl.dot(k, tl.trans(k), input_precision=QK_PRECISION)
        A = tl.where(strict, beta[:, None] * kk * tl.exp(tl.where(strict, diff, 0.0)), 0.0)
        inv = _unit_lower_inverse(A, CHUNK)
        ks = tl.dot(k, state, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]
        rhs = v.to(tl.float32) * beta[:, None] - ks * (beta * gamma)[:, None]
        delta = tl.dot(inv, rhs, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]

        # o = Γ q S0 + (q kᵀ ⊙ causal decay) Δ   (q carries the scale)
        qk = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION)
        scores = tl.where(causal, qk * tl.exp(tl.where(causal, diff, 0.0)), 0.0)
        o = tl.dot(q, state, input_precision=DOT_PRECISION) * gamma[:, None]
        o = tl.dot(scores, delta, acc=o, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + tok[:, None] * stride_o_t + head * stride_o_h + vc[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=t_ok[:, None] & vc_ok[None, :],
        )

        # Snapshots inside this chunk: the state after its token j.
        for e in tl.static_range(NUM_SNAPS):
            pos = tl.load(snap_pos_ptr + seq * NUM_SNAPS + e).to(tl.int64)
            slot = tl.load(snap_slots_ptr + seq * NUM_SNAPS + e).to(tl.int64)
            j = start + pos - 1 - c0
            if (slot >= 0) & (j >= 0) & (j < CHUNK):
                cum_j = tl.sum(tl.where(t == j, cum, 0.0), axis=0)
                w = tl.where(t <= j, tl.exp(tl.minimum(cum_j - cum, 0.0)), 0.0)
                snap = tl.dot(
                    tl.trans(k),
                    delta * w[:, None],
                    acc=state * tl.exp(cum_j),
                    input_precision=DOT_PRECISION,
                )
                tl.store(states_ptr + slot * stride_s_slot + state_off, snap, mask=tile_ok)

        # S <- Γ_C S0 + Σ_s exp(cum_C - cum_s) k_s ⊗ delta_s
        delta_to_end = delta * tl.exp(total - cum)[:, None]
        state = tl.dot(
            tl.trans(k), delta_to_end, acc=state * tl.exp(total), input_precision=DOT_PRECISION
        )

    store_state(states_ptr, dest, stride_s_slot, state_off, tile_ok, state)


def chunk_config(
    v: torch.Tensor, chunk_size: int, head_k_dim: int, head_v_dim: int
) -> tuple[int, int, int, int]:
    """(CHUNK, BLOCK_K, BLOCK_V, num_warps) for a launch, from shapes only.

    Sized from ptxas reports for sm_90 (bf16 storage, QK_PRECISION tf32x3; compiled ahead of
    time, not yet timed on a GPU): the program holds q and k [C, Dk] in fp32, the [Dk, BV]
    state and a few [C, C] and [C, BV] tiles in registers, and the forward substitution costs
    C steps of [C, C] work, so chunks stay small. Dk = 128: C = 16, BV = 32, 8 warps (16 bytes
    of spills; C = 64 spills over a kilobyte per thread). Dk <= 64: C = 32, BV = 64, 8 warps
    (4 bytes). chunk_size caps C (the result does not depend on it, up to rounding). The CPU
    interpreter takes chunk_size as given, with the smallest tiles tl.dot allows."""
    block_k = max(16, triton.next_power_of_2(head_k_dim))
    block_v = max(16, triton.next_power_of_2(head_v_dim))
    if not v.is_cuda:
        return chunk_size, block_k, 16, 4
    if block_k <= 64:
        return min(chunk_size, 32), block_k, min(block_v, 64), 8
    return min(chunk_size, 16), block_k, min(block_v, 32), 8
