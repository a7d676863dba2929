"""Transformer building blocks shared by the models: RMSNorm, rotary embedding, GQA attention
over the paged KV cache, SwiGLU MLP.

Numerics follow Hugging Face transformers (the test oracle): norms and RoPE angles in fp32,
results cast back to the activation dtype; attention softmax in fp32. Layers never know whether
they run eagerly or under a CUDA graph, and never read the clock, a host tensor or a global.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taipan.ops.attention import AttentionMetadata, paged_attention, write_kv


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [tokens, head_dim] for the given absolute positions [tokens] (rotate-half
    layout: the two halves of head_dim share frequencies). Angles are computed in fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [head_dim / 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [tokens, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [tokens, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention that appends this step's K/V to the paged cache, then attends
    over each sequence's whole context (cached prefix + this step's tokens)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # q, k and v projections fused into one matrix (rows: q, then k, then v): one GEMM.
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        # x: [tokens, hidden]; layer_cache: [2, num_blocks, block_size, kv_heads, head_dim]
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)  # q: [tokens, heads, head_dim]
        k = apply_rope(k, cos, sin)  # k: [tokens, kv_heads, head_dim]
        write_kv(k, v, layer_cache, attn.slot_mapping)
        out = paged_attention(q, layer_cache, attn, self.scale)  # [tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # gate and up projections fused (rows: gate, then up): one GEMM.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden] -> [tokens, 2 * intermediate] -> [tokens, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
