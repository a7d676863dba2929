"""Transformer building blocks shared by the models: RMSNorm (fused with the residual add),
rotary embedding fused with the KV-cache write, GQA attention over the paged KV cache, SwiGLU MLP.

Each op has one dispatch point: on CUDA the Triton kernel of kernels/, elsewhere its torch
reference (`*_ref`, the same contract) — chosen by the tensor's device, never by optional
metadata. Numerics follow Hugging Face transformers (the test oracle): norms and RoPE in fp32,
results cast back to the activation dtype; attention softmax in fp32. Layers never know whether
they run eagerly or under a CUDA graph, and never read the clock, a host tensor or a global.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taipan.kernels import activation, rmsnorm, rope
from taipan.ops.attention import AttentionMetadata, paged_attention


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None):
    """hidden: [N, hidden] -> logits [N, vocab] float32 through the LM head `weight`; written into
    `out` when given (the product in the weights' dtype, converted as it is copied)."""
    if out is None:
        return F.linear(hidden, weight).float()
    return out.copy_(F.linear(hidden, weight))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [tokens, hidden] -> normalized x; with `residual`, `(normalized, residual)` after
        `residual <- x + residual` in place (the residual stream of the next layer)."""
        fn = rmsnorm.rms_norm if x.is_cuda else rmsnorm.rms_norm_ref
        return fn(x, self.weight, self.eps, residual=residual)


class Attention(nn.Module):
    """Grouped-query self-attention: rotates q and k, appends this step's K/V to the paged
    cache, then attends over each sequence's whole context (cached prefix + this step)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # q, k and v projections fused into one matrix (rows: q, then k, then v): one GEMM.
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # Qwen3: an RMSNorm over each head of q and of k (weights shared by the heads), before
        # RoPE; None: no such norm (Llama, NemotronH).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos_sin: torch.Tensor | None,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [tokens, hidden]; layer_cache: [2, num_blocks, block_size, kv_heads, head_dim].
        `cos_sin` None: no positional encoding (NemotronH), k and v are stored as they are."""
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # views of the qkv output
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # rows of one head each: [tokens * heads, head_dim]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if cos_sin is None:
            store = rope.write_kv if x.is_cuda else rope.write_kv_ref
            store(k, v, layer_cache, attn.slot_mapping)
        else:
            write = rope.rope_and_write_kv if x.is_cuda else rope.rope_and_write_kv_ref
            q = write(q, k, v, positions, cos_sin, layer_cache, attn.slot_mapping)  # q rotated
        out = paged_attention(q, layer_cache, attn, self.scale)  # [tokens, heads, head_dim]
        return self.o_proj(out.view(num_tokens, q_size))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # gate and up projections fused (rows: gate, then up): one GEMM.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden] -> [tokens, 2 * intermediate] -> [tokens, intermediate] -> hidden
        act = activation.silu_and_mul if x.is_cuda else activation.silu_and_mul_ref
        return self.down_proj(act(self.gate_up_proj(x)))
