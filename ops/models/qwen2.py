"""Qwen2 / Qwen2.5 decoder (and their distills) over a flat varlen batch and a paged KV cache:
Llama's model (ops/models/llama.py) whose q, k and v projections carry biases (o_proj has none),
with tied or untied embeddings as the config says.

Owns the model's structure. Parameter names as Llama's: q/k/v weights fused at load into
`self_attn.qkv_proj.weight`, their biases into `self_attn.qkv_proj.bias` (rows: q, then k,
then v). Tensor parallel (`tp`): as Llama; the biases are column-parallel like their weights
(each rank holds its heads' rows, ops/sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from taipan.ops.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from taipan.ops.parallel import SINGLE, TPGroup


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """Llama's fields; its own type so that a weight update from a Llama checkpoint (or the
    reverse) is refused (ops/weight_updates.py `check_same_architecture`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """`forward` and `compute_logits` as LlamaForCausalLM."""

    def __init__(self, config: Qwen2Config, tp: TPGroup = SINGLE) -> None:
        def make_layer(index: int) -> DecoderLayer:
            window = config.layer_window(index)
            return DecoderLayer(config, tp=tp, qkv_bias=True, sliding_window=window)

        super().__init__(config, make_layer, tp=tp)
