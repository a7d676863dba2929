"""The log-probability of one given token per row, log_softmax(logits.float())[b, tokens[b]], in
one Triton program per row: `logit - logsumexp(row)` with an online max and sum over V chunks, so
no [B, V] fp32 copy is ever built and each logit is read once.

Owns the kernel, its launcher `log_prob_gather` and the plain-torch `log_prob_gather_ref`; they
give raw log-probs (of the logits before temperature / top-k / top-p). On the serving path for
the raw log-probs of the sampled tokens without top-n (ops/logprobs.py token_log_probs, on
CUDA: one launch); processed log-probs and the top-n are computed in torch there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs


@triton.jit
def _log_prob_gather_kernel(
    # pointers
    logits_ptr,  # [B, V], unit stride over V
    tokens_ptr,  # [B] i32 or i64
    out_ptr,  # [B] f32
    # strides
    stride_logits_b,
    # meta-parameters
    V,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits_b
    # Per lane: running max m and sum of exp(x - m); reduced across lanes once at the end.
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no NaN
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    token = tl.load(tokens_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < V)  # an id out of range gives NaN, never a stray read
    picked = tl.load(row_ptr + token, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(out_ptr + row, picked - lse)


def log_prob_gather(
    logits: torch.Tensor, tokens: torch.Tensor, *, block: int = 1024, num_warps: int = 4
) -> torch.Tensor:
    """log_softmax(logits.float(), -1)[b, tokens[b]] per row. logits: [B, V] fp32/bf16/fp16 with
    unit stride over V; tokens: [B] int32/int64 in [0, V) (else NaN). Returns [B] float32."""
    if logits.ndim != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        shape = list(logits.shape)
        raise ValueError(f"log_prob_gather: logits must be [B, V] fp32/bf16/fp16, got "
                         f"{logits.dtype} {shape}")  # fmt: skip
    batch, vocab = logits.shape
    if vocab == 0 or vocab >= 2**31 or (vocab > 1 and logits.stride(1) != 1):
        raise ValueError(
            f"log_prob_gather: logits need 0 < V < 2**31 and stride 1 over V, got "
            f"{list(logits.shape)} strides {logits.stride()}"
        )
    if tokens.shape != (batch,) or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"log_prob_gather: tokens must be int32/int64 [{batch}], got {tokens.dtype} "
            f"{list(tokens.shape)}"
        )
    if batch > 1 and tokens.stride(0) != 1:
        raise ValueError(
            f"log_prob_gather: tokens must be contiguous, got stride {tokens.stride(0)}"
        )
    if tokens.device != logits.device:
        raise ValueError(f"log_prob_gather: tokens on {tokens.device}, logits on {logits.device}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"log_prob_gather: block must be a power of two >= 16, got {block}")
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    _log_prob_gather_kernel[(batch,)](
        # pointers
        logits, tokens, out,
        # strides
        logits.stride(0),
        # meta-parameters
        vocab, BLOCK=block, num_warps=num_warps,
        **launch_kwargs(logits.device),
    )  # fmt: skip
    return out


def log_prob_gather_ref(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`log_prob_gather` in plain torch: logit - logsumexp(row), in fp32. [B] float32."""
    logits = logits.float()
    picked = logits.gather(1, tokens.long()[:, None]).squeeze(1)
    return picked - torch.logsumexp(logits, dim=-1)
