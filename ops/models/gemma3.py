"""Gemma 3 text decoder (Gemma3ForCausalLM: 270M, 1B, and the text half of the larger ones) over
a flat varlen batch and a paged KV cache.

What differs from Llama (ops/models/llama.py), as Hugging Face's Gemma3 modules compute it:
- every norm is Gemma's (1 + w) RMSNorm (ops/layers.GemmaRMSNorm), the weights kept as the
  checkpoint has them, and a layer has four: before and after attention, before and after the
  MLP (the residual is added after the post-norms);
- per-head q/k norms before RoPE, a softmax scale of query_pre_attn_scalar ** -0.5, and head_dim
  from the config (256 for the released models, whatever hidden / heads is);
- local layers (`sliding_layers`) attend within `sliding_window` keys and rotate with their own
  RoPE base (`rope_local_theta`); the global ones see the whole context, with `rope_theta` and
  a linear `rope_scaling_factor` (4B and up: 8);
- the embeddings are multiplied by sqrt(hidden_size) rounded to their dtype; the MLP is
  GELU-tanh gated; the LM head is the embedding (tied).
Logit soft-capping is not implemented: no Gemma 3 sets it, and the loader refuses one that does.

Owns the model's structure. Parameter names are Hugging Face's without `model.`, q/k/v and
gate/up fused as Llama's (`qkv_proj`, `gate_up_proj`); the norms `input_layernorm`,
`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`,
`self_attn.q_norm`, `self_attn.k_norm` and the final `norm`. Tensor parallel (`tp`): as Llama's
projections and vocabulary; the norms are replicated, and attention and the MLP all-reduce their
outputs before the post-norms (the norm of the whole sum).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from taipan.kernels.gemv import gemv
from taipan.ops.attention import AttentionMetadata
from taipan.ops.layers import FUSED_DECODE_ROWS, Attention, GeluTanhMLP, GemmaRMSNorm
from taipan.ops.models.llama import LlamaConfig, LlamaForCausalLM
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.rope_scaling import RopeScaling, rope_table


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """Llama's fields (`sliding_layers`: the local layers, never None here; `rope_theta`: the
    global layers' base; `rope_scaling` unused, always None: the global layers' linear scaling
    is `rope_scaling_factor`) and Gemma's own."""

    rope_local_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # linear RoPE scaling of the global layers
    query_pre_attn_scalar: float = 256.0

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` is a local (sliding-window, local-RoPE) one."""
        return self.sliding_layers is not None and layer in self.sliding_layers


class Gemma3DecoderLayer(nn.Module):
    """Norm, attention, norm, add; norm, MLP, norm, add. `index`: the layer's place, which
    decides its window and its RoPE (`local`)."""

    def __init__(self, config: Gemma3Config, index: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        c = config
        self.local = c.is_local(index)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qk_norm_eps=c.rms_norm_eps,
            tp=tp,
            sliding_window=c.layer_window(index),
            scale=c.query_pre_attn_scalar**-0.5,
            qk_norm=GemmaRMSNorm,
        )
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GeluTanhMLP(c.hidden_size, c.intermediate_size, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [tokens, hidden], the residual stream -> the stream after this layer."""
        if self._fused(x):
            return self._fused_forward(x, positions, cos_sin, attn, layer_cache)
        h = self.self_attn(self.input_layernorm(x), positions, cos_sin, attn, layer_cache)
        # (attention summed over the TP group) x <- x + post_attention_norm(h) in place, and
        # its pre-feedforward norm, in one kernel (HF normalizes the rounded sum too); then
        # x <- x + post_feedforward_norm(mlp) in place, one more.
        h, x = self.pre_feedforward_layernorm(h, residual=x, pre=self.post_attention_layernorm)
        return self.post_feedforward_layernorm.add_to(self.mlp(h), x)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether this step takes the fused few-row path (as Llama's DecoderLayer._fused)."""
        return x.is_cuda and x.shape[0] <= FUSED_DECODE_ROWS and self.self_attn.tp.size == 1

    def _fused_forward(self, x, positions, cos_sin, attn, layer_cache):
        """The input norm inside the qkv product and GELU-tanh inside the gate_up one
        (kernels/gemv.py); the post-norms need whole rows: each in one kernel with the add
        after it (and the pre-feedforward norm after that)."""
        attn_mod, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        qkv = gemv(
            x, attn_mod.qkv_proj.weight, norm_weight=norm.weight, eps=norm.eps, gemma_norm=True
        )
        h = gemv(attn_mod.attend(qkv, positions, cos_sin, attn, layer_cache), attn_mod.o_proj.weight)
        h, x = self.pre_feedforward_layernorm(h, residual=x, pre=self.post_attention_layernorm)
        h = gemv(h, mlp.gate_up_proj.weight, gated=True, activation="gelu_tanh")
        return self.post_feedforward_layernorm.add_to(gemv(h, mlp.down_proj.weight), x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """`forward` and `compute_logits` as LlamaForCausalLM, Gemma's layers and final norm."""

    def __init__(self, config: Gemma3Config, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, lambda index: Gemma3DecoderLayer(config, index, tp), tp=tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # (not Llama's)
        self._local_rope_caches: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward: hidden [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)  # x: [T, hidden]
        x = x * _rounded(self.config.hidden_size**0.5, x.dtype)
        global_cos_sin, local_cos_sin = self.rope_cache(x.device), self.local_rope_cache(x.device)
        for i, layer in enumerate(self.layers):
            cos_sin = local_cos_sin if layer.local else global_cos_sin
            layer_attn = attn.for_window(layer.self_attn.sliding_window)  # (WindowedKV)
            x = layer(x, positions, cos_sin, layer_attn, kv_cache[i])
        return self.norm(x)

    def rope_cache(self, device: torch.device) -> torch.Tensor:
        """The global layers' cos/sin (fp32 [max_position_embeddings, head_dim]), with the
        config's linear scaling, built once per device."""
        cache = self._rope_caches.get(device)
        if cache is None:
            c = self.config
            cache = _rope_table(c, c.rope_theta, c.rope_scaling_factor, device)
            self._rope_caches[device] = cache
        return cache

    def local_rope_cache(self, device: torch.device) -> torch.Tensor:
        """The local layers' cos/sin (base `rope_local_theta`, no scaling)."""
        cache = self._local_rope_caches.get(device)
        if cache is None:
            cache = _rope_table(self.config, self.config.rope_local_theta, 1.0, device)
            self._local_rope_caches[device] = cache
        return cache


def _rope_table(config: Gemma3Config, theta: float, factor: float, device) -> torch.Tensor:
    """cos | sin per position (ops/rope_scaling.rope_table); `factor` != 1: Hugging Face's
    "linear" RoPE, the inverse frequencies divided by it."""
    c = config
    scaling = None if factor == 1.0 else RopeScaling("linear", factor=factor)
    return rope_table(c.max_position_embeddings, c.head_dim, theta, scaling, device)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (HF scales the embeddings by sqrt(hidden) in their dtype)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()
