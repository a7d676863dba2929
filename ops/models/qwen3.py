"""Qwen3 dense decoder (Qwen3-0.6B ... 32B, and their distills) over a flat varlen batch and a
paged KV cache: Llama's model (ops/models/llama.py) with an RMSNorm on each head of q and of k
before RoPE, as Qwen3-MoE's attention (ops/models/qwen3_moe.py), and no biases. head_dim comes
from the config and may differ from hidden_size / num_heads (Qwen3-0.6B: 1024 / 16 heads, 128).

Owns the model's structure. Parameter names as Llama's, plus `self_attn.q_norm.weight` and
`self_attn.k_norm.weight` ([head_dim], shared by the heads). Tensor parallel (`tp`): as Llama;
the q/k norm weights are replicated (every rank's heads use the same one).
"""

from __future__ import annotations

from dataclasses import dataclass

from taipan.ops.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from taipan.ops.parallel import SINGLE, TPGroup


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Llama's fields; its own type so that a weight update from another family's checkpoint is
    refused (ops/weight_updates.py `check_same_architecture`)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """`forward` and `compute_logits` as LlamaForCausalLM."""

    def __init__(self, config: Qwen3Config, tp: TPGroup = SINGLE) -> None:
        def make_layer(index: int) -> DecoderLayer:
            window = config.layer_window(index)
            return DecoderLayer(config, qk_norm=True, tp=tp, sliding_window=window)

        super().__init__(config, make_layer, tp=tp)
