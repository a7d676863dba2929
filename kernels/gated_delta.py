"""The gated delta rule of a Gated-DeltaNet mixer (Qwen3-Next's linear attention), over a flat
varlen batch whose sequences carry their recurrent state in slots: `gated_delta_varlen`
(prefill chunks; its chunked kernel lives in kernels/gated_delta_chunk.py) and
`gated_delta_update` (decode rows, one token each), Triton kernels + launchers, and
`gated_delta_varlen_ref` and `gated_delta_update_ref`, the same contract in plain torch (fp32
inside, one token at a time).

Per value head, with state S [Dk, Dv] fp32 and the token's q, k (L2-normalised first when
use_qk_l2norm: x * rsqrt(sum(x^2) + 1e-6), as Hugging Face's and FLA's l2norm):
    S <- exp(g_t) · S
    delta = beta_t · (v_t - kᵀ_t S)                  ([Dv]: the part of v_t S does not predict)
    S <- S + k_t ⊗ delta
    o_t = scale · qᵀ_t S                             (scale = Dk ** -0.5 by default)
This is transformers' torch_recurrent_gated_delta_rule (which scales q after the l2norm) and,
chunked, torch_chunk_gated_delta_rule.

Contract (the Triton kernels and their launchers keep it):
- q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; Hk divides Hv and value head h reads key head
  h // (Hv // Hk) (Hugging Face's repeat_interleave of q and k to Hv heads). They may be strided
  views of one conv output (unit stride in the last dim). g: [T, Hv] log-decay (<= 0, fp32 from
  the model: g = -exp(A_log) · softplus(a + dt_bias)); beta: [T, Hv] (sigmoid applied).
  Returns o: [T, Hv, Dv] in v's dtype (into `out` when given); math in fp32.
- Flat varlen batch: sequence b owns tokens query_start_loc[b]:query_start_loc[b + 1]
  (query_start_loc [B + 1], int32/int64). The update variant has one token per row (T == B).
- states: [num_slots, Hv, Dk, Dv] fp32 (one layer's slice of the worker's SSM state tensor).
  Sequence b reads its initial state from states[init_slots[b]] (-1: zeros) and stores its final
  state into states[out_slots[b]] (-1: not stored). The two may be the same slot (a live slot
  that continues) or differ (a prefix snapshot restored into a live slot without a copy).
- A sequence whose slots are both -1 and whose query length is 0 is padding (CUDA graphs). A
  sequence of length 0 with an out slot stores its initial state there (zeros for -1).
- Snapshots (varlen only, optional; prefix caching): snap_pos, snap_slots [B, E], E <=
  ssd_scan.MAX_SNAPS (ssd_scan.check_snapshots); entry (b, e) with a slot >= 0 stores the state
  after the first snap_pos[b, e] tokens of sequence b (1 <= snap_pos <= its query length, any
  position) into that slot. A snapshot slot is only written by the call.

The refs read every slot before writing any. The Triton kernels keep "every read before any
write" only within a sequence (its init and out slot may be one slot); programs of different
sequences are not ordered, so the out and snapshot slots (other than -1) of one call must be
distinct and none of them another sequence's init slot (several sequences may read one
snapshot). Slot numbers and positions are trusted, not checked (that would synchronise).

Kernels. `gated_delta_update`: one program per (row, value head, block of BV columns of Dv)
holds its [Dk, BV] state tile in registers (fp32), advances it one token, stores o and the tile
(or, for a padding row, only o from a zero state). `gated_delta_varlen`: see
kernels/gated_delta_chunk.py (the chunked WY form, one program per (sequence, value head, block
of Dv) walking its sequence chunk by chunk with the state in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.causal_conv1d import _overlaps
from taipan.kernels.gated_delta_chunk import (
    L2NORM_EPS,
    chunk_config,
    gated_delta_chunk_kernel,
    inv_l2norm,
    load_state,
    state_tile,
    store_state,
)
from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.ssd_scan import _check_tokens, _nonempty, check_snapshots, snapshot_entries

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_K_DIM = 256  # Dk: a program holds whole keys (the l2norm) and a [Dk, BV] state tile
DECODE_TILE = 4096  # update: state elements (Dk x BV) per program


@triton.jit
def _gated_delta_update_kernel(
    # pointers
    q_ptr,  # [B, Hk, Dk]
    k_ptr,  # [B, Hk, Dk]
    v_ptr,  # [B, Hv, Dv]
    g_ptr,  # [B, Hv]
    beta_ptr,  # [B, Hv]
    states_ptr,  # [num_slots, Hv, Dk, Dv] fp32
    init_ptr,  # [B]
    dest_ptr,  # [B]
    out_ptr,  # [B, Hv, Dv]
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
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    """One program: row program_id(0), value head program_id(1), Dv columns
    [program_id(2) * BLOCK_V, +BLOCK_V) of its state with all Dk rows: it loads that tile,
    advances it one token and stores it, so its own reads precede its writes."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kh = head // HEADS_PER_KEY
    init = tl.load(init_ptr + row).to(tl.int64)
    dest = tl.load(dest_ptr + row).to(tl.int64)
    kc, vc, kc_ok, vc_ok, tile_ok, state_off = state_tile(
        head, stride_s_h, stride_s_k, Dk, Dv, BLOCK_K, BLOCK_V
    )
    q = tl.load(q_ptr + row * stride_q_t + kh * stride_q_h + kc, mask=kc_ok, other=0.0)
    k = tl.load(k_ptr + row * stride_k_t + kh * stride_k_h + kc, mask=kc_ok, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if USE_L2NORM:
        q = q * inv_l2norm(q, 0)
        k = k * inv_l2norm(k, 0)
    v = tl.load(v_ptr + row * stride_v_t + head * stride_v_h + vc, mask=vc_ok, other=0.0)
    g = tl.load(g_ptr + row * stride_g_t + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_beta_t + head).to(tl.float32)
    state = load_state(states_ptr, init, stride_s_slot, state_off, tile_ok)  # [BLOCK_K, BLOCK_V]

    state = state * tl.exp(g)
    delta = beta * (v.to(tl.float32) - tl.sum(k[:, None] * state, axis=0))  # [BLOCK_V]
    state += k[:, None] * delta[None, :]
    o = tl.sum((q * scale)[:, None] * state, axis=0)
    out_ptrs = out_ptr + row * stride_o_t + head * stride_o_h + vc
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=vc_ok)
    store_state(states_ptr, dest, stride_s_slot, state_off, tile_ok, state)


def gated_delta_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Varlen prefill (module contract), the chunked kernel of kernels/gated_delta_chunk.py.
    Never syncs the device: the grid is (B, Hv, cdiv(Dv, BV)) for B = len(init_slots), and
    each program reads its sequence's bounds and slots on the device (CUDA-graph safe; padding
    sequences exit at once). Returns o [T, Hv, Dv] in v's dtype (`out` if given; tokens no
    sequence covers are not written).

    q, k [T, Hk, Dk] (Dk <= 256), v [T, Hv, Dv], g and beta [T, Hv]: fp16/bf16/fp32, strided
    views allowed with unit stride in the last dim. states [num_slots, Hv, Dk, Dv] fp32, unit
    stride in Dv. query_start_loc [B + 1], init_slots and out_slots [B]: int32/int64,
    contiguous, on v's device. `out` must not overlap q, k or v. snap_pos, snap_slots [B, E]:
    ssd_scan.check_snapshots. `chunk_size` (a power of two >= 16) caps the kernel's chunk, which
    on a GPU is at most 16 tokens for Dk > 64, 32 below (chunk_config: register pressure); the
    result does not depend on it, up to rounding."""
    num_seqs = _check_args(q, k, v, g, beta, states, init_slots, out_slots, out)
    _check_index("query_start_loc", query_start_loc, num_seqs + 1, v.device)
    num_snaps = check_snapshots(snap_pos, snap_slots, num_seqs, v.device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16:
        raise ValueError(f"chunk_size must be an int >= 16, got {chunk_size!r}")
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_heads, head_k_dim, head_v_dim = v.shape[1], k.shape[2], v.shape[2]
    if num_seqs == 0 or num_heads == 0 or head_v_dim == 0:
        return out
    chunk, block_k, block_v, num_warps = chunk_config(v, chunk_size, head_k_dim, head_v_dim)
    # With no tokens (every sequence empty) the token tensors are never read, but a launch
    # still needs real pointers.
    q_, k_, v_, g_, beta_, o_ = (_nonempty(t) for t in (q, k, v, g, beta, out))
    grid = (num_seqs, num_heads, triton.cdiv(head_v_dim, block_v))
    gated_delta_chunk_kernel[grid](
        q_, k_, v_, g_, beta_, query_start_loc, _nonempty(states), init_slots, out_slots,
        snap_pos if num_snaps else init_slots, snap_slots if num_snaps else init_slots, o_,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        head_k_dim, head_v_dim, _scale(scale, head_k_dim),
        HEADS_PER_KEY=num_heads // k.shape[1],
        USE_L2NORM=bool(use_qk_l2norm),
        NUM_SNAPS=num_snaps,
        CHUNK=chunk, BLOCK_K=block_k, BLOCK_V=block_v,
        # fp32 storage (tests, debugging) means fp32 products, not TF32's 10-bit mantissa; k·kᵀ
        # feeds a triangular inverse, so it keeps near-fp32 products (3 TF32 passes) always.
        DOT_PRECISION="ieee" if q.dtype == v.dtype == torch.float32 else "tf32",
        QK_PRECISION="ieee" if q.dtype == v.dtype == torch.float32 else "tf32x3",
        num_warps=num_warps, num_stages=1,
        **launch_kwargs(q_.device),
    )  # fmt: skip
    return out


def gated_delta_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: row b is sequence b's one token (q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta
    [B, Hv]). Returns o [B, Hv, Dv] (into `out`, new if None); advances the state of
    init_slots[b] by one token into out_slots[b]. A row whose slots are both -1 is padding: its
    o row is computed (from a zero state) and no slot is touched. Same argument rules as
    `gated_delta_varlen`; no host synchronisation."""
    num_rows = _check_args(q, k, v, g, beta, states, init_slots, out_slots, out)
    if v.shape[0] != num_rows:
        raise ValueError(
            f"decode: one row per sequence, but v has {v.shape[0]} rows and the slots {num_rows}"
        )
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_heads, head_k_dim, head_v_dim = v.shape[1], k.shape[2], v.shape[2]
    if num_rows == 0 or num_heads == 0 or head_v_dim == 0:
        return out
    block_k = max(16, triton.next_power_of_2(head_k_dim))
    block_v = max(16, min(triton.next_power_of_2(head_v_dim), DECODE_TILE // block_k))
    grid = (num_rows, num_heads, triton.cdiv(head_v_dim, block_v))
    _gated_delta_update_kernel[grid](
        q, k, v, g, beta, states, init_slots, out_slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        head_k_dim, head_v_dim, _scale(scale, head_k_dim),
        HEADS_PER_KEY=num_heads // k.shape[1],
        USE_L2NORM=bool(use_qk_l2norm),
        BLOCK_K=block_k, BLOCK_V=block_v,
        num_warps=4,
        **launch_kwargs(q.device),
    )  # fmt: skip
    return out


def _scale(scale: float | None, head_k_dim: int) -> float:
    return float(head_k_dim**-0.5 if scale is None else scale)


def _check_args(q, k, v, g, beta, states, init_slots, out_slots, out) -> int:
    """Checks both launchers share; returns the number of sequences (rows of init_slots).
    Shapes, dtypes, strides and devices only: no device sync."""
    if v.dim() != 3:
        raise ValueError(f"v must be [tokens, value_heads, head_v_dim], got {tuple(v.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, key_heads, head_k_dim], got {tuple(q.shape)}")
    num_tokens, num_heads, head_v_dim = v.shape
    num_key_heads, head_k_dim = q.shape[1], q.shape[2]
    device = v.device
    _check_tokens("v", v, v.shape, DTYPES, device, anchor="v")
    _check_tokens("q", q, (num_tokens, num_key_heads, head_k_dim), DTYPES, device, anchor="v")
    _check_tokens("k", k, q.shape, DTYPES, device, anchor="v")
    if num_key_heads == 0 or num_heads % num_key_heads:
        raise ValueError(
            f"the key heads ({num_key_heads}) must divide the value heads ({num_heads})"
        )
    if not 0 < head_k_dim <= MAX_HEAD_K_DIM:
        raise ValueError(f"head_k_dim must be in 1..{MAX_HEAD_K_DIM}, got {head_k_dim}")
    _check_tokens("g", g, (num_tokens, num_heads), DTYPES, device, anchor="v")
    _check_tokens("beta", beta, (num_tokens, num_heads), DTYPES, device, anchor="v")
    want = (num_heads, head_k_dim, head_v_dim)
    if (
        states.dim() != 4
        or tuple(states.shape[1:]) != want
        or states.dtype != torch.float32
        or (states.numel() and states.stride(3) != 1)
    ):
        raise ValueError(
            f"states must be an fp32 [num_slots, {', '.join(map(str, want))}] tensor with unit "
            f"stride in its last dim, got shape {tuple(states.shape)}, {states.dtype}, strides "
            f"{states.stride()}"
        )
    if states.device != device:
        raise ValueError(f"states is on {states.device}, v on {device}: use one device")
    if init_slots.dim() != 1:
        raise ValueError(f"init_slots must be 1-D, got shape {tuple(init_slots.shape)}")
    num_seqs = init_slots.shape[0]
    _check_index("init_slots", init_slots, num_seqs, device)
    _check_index("out_slots", out_slots, num_seqs, device)
    if out is not None:
        if out.dtype != v.dtype:
            raise ValueError(f"out must have v's dtype {v.dtype}, got {out.dtype}")
        _check_tokens("out", out, v.shape, DTYPES, device, anchor="v")
        if any(_overlaps(out, t) for t in (q, k, v)):
            raise ValueError("out must not overlap q, k or v (other programs still read them)")
    return num_seqs


def _check_index(name, t, length, device) -> None:
    """A contiguous 1-D int32/int64 tensor of `length` entries on `device`."""
    if t.dim() != 1 or t.shape[0] != length or t.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name} must be a [{length}] int32/int64 tensor, got shape {tuple(t.shape)}, {t.dtype}"
        )
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, v on {device}: use one device")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (Hugging Face's and FLA's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _heads_fp32(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32 copies with q and k expanded to the value heads (head h reads key head h // rep),
    normalised when asked, q times scale."""
    rep = v.shape[1] // k.shape[1]
    q32, k32 = q.float(), k.float()
    if use_qk_l2norm:
        q32, k32 = l2norm(q32), l2norm(k32)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    q32 = q32.repeat_interleave(rep, dim=1) * scale  # [T, Hv, Dk]
    k32 = k32.repeat_interleave(rep, dim=1)
    return q32, k32, v.float(), g.float(), beta.float()


def gated_delta_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    snap_pos: torch.Tensor | None = None,
    snap_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen prefill, one token at a time in fp32 (module contract). Returns o [T, Hv, Dv] in
    v's dtype (`out` if given; rows no sequence covers are left as they were, zeros when new);
    writes states[out_slots[b]] and the snapshot slots after every read."""
    q32, k32, v32, g32, b32 = _heads_fp32(q, k, v, g, beta, scale, use_qk_l2norm)
    if out is None:
        out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    starts = query_start_loc.tolist()
    init, dest = init_slots.tolist(), out_slots.tolist()
    finals = []
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if init[b] >= 0:
            state = states[init[b]].float().clone()  # [Hv, Dk, Dv]
        else:
            state = torch.zeros(states.shape[1:], dtype=torch.float32, device=states.device)
        snaps = {}  # position -> the slots that want the state after it
        for pos, slot in snapshot_entries(snap_pos, snap_slots, b, hi - lo):
            snaps.setdefault(pos, []).append(slot)
        for t in range(lo, hi):
            state *= torch.exp(g32[t])[:, None, None]
            kv = torch.einsum("hk,hkv->hv", k32[t], state)
            delta = b32[t][:, None] * (v32[t] - kv)  # [Hv, Dv]
            state += k32[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q32[t], state).to(out.dtype)
            finals += [(slot, state.clone()) for slot in snaps.get(t + 1 - lo, ())]
        finals.append((dest[b], state))
    for slot, state in finals:  # every read above happened before any write
        if slot >= 0:
            states[slot] = state.to(states.dtype)
    return out


def gated_delta_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: row b is sequence b's one token. Returns o [B, Hv, Dv]; advances the state of
    init_slots[b] by one token into out_slots[b] (a padding row gets o from a zero state)."""
    starts = torch.arange(v.shape[0] + 1, dtype=torch.int64)
    return gated_delta_varlen_ref(
        q, k, v, g, beta, starts, states, init_slots, out_slots,
        scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
    )  # fmt: skip
