"""Mixture-of-experts expert computation: `fused_moe_ref` (the contract in plain torch); the
Triton kernel and its launcher `fused_moe` come next to it.

Each token goes to `k` experts (`topk_ids`, global expert ids) with weights `topk_weights`; this
file computes the weighted sum of the chosen experts' MLPs:

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])

over the experts this rank holds, `[expert_start, expert_start + E_local)`: a choice of an
expert outside that range contributes nothing, so summing the outputs of every expert-parallel
rank (each with its own range) gives the whole MoE. An expert is
- `swiglu`: w2 @ (silu(gate) * up), with w1 = [gate; up] stacked on rows (Qwen3-MoE, Mixtral);
- `relu2`:  w2 @ relu(w1 @ x)^2 (NemotronH's non-gated experts).

Shapes: x [T, H]; w1 [E_local, N, H] with N = 2 * I (swiglu) or I (relu2); w2 [E_local, H, I];
topk_ids [T, k] int32/int64; topk_weights [T, k] (any float dtype; used in fp32).
Output [T, H] in x's dtype; arithmetic in fp32; each (token, expert) result is weighted, rounded
once to x's dtype and the k of them summed in fp32 (HF's experts round after each projection: a
few ulps apart in bf16, equal in fp32 up to rounding).
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("swiglu", "relu2")


def _check_args(x, w1, w2, topk_ids, topk_weights, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w1 [E, N, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    experts, n, hidden = w1.shape
    inter = w2.shape[2]
    want_n = 2 * inter if activation == "swiglu" else inter
    if hidden != x.shape[1] or w2.shape[:2] != (experts, hidden) or n != want_n:
        raise ValueError(
            f"{activation} experts: w1 must be [E, {want_n}, {x.shape[1]}] and w2 "
            f"[E, {x.shape[1]}, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k], got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {x.shape[0]} tokens")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def fused_moe_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "swiglu",
    expert_start: int = 0,
) -> torch.Tensor:
    """The MoE output of the experts [expert_start, expert_start + E_local) (module docstring).
    Loops over the experts that received a token (a host sync per step: the CPU path)."""
    _check_args(x, w1, w2, topk_ids, topk_weights, activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start  # [T, k]: local expert index, or out of range
    hit = (local >= 0) & (local < w1.shape[0])
    for e in torch.unique(local[hit]).tolist():
        token, choice = torch.nonzero(local == e, as_tuple=True)
        h = x[token].float() @ w1[e].float().t()  # [n, N]
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.relu(h).square()
        y = (h @ w2[e].float().t()) * topk_weights[token, choice, None].float()  # [n, H]
        out.index_add_(0, token, y.to(x.dtype).float())  # rounded once, as a kernel stores it
    return out.to(x.dtype)
