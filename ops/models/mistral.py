"""Mistral decoder (Mistral-7B v0.1 ... v0.3, Mistral-Nemo, and their fine-tunes) over a flat
varlen batch and a paged KV cache: Llama's model (ops/models/llama.py) layer for layer, whose
config may set a `sliding_window` (every layer attends to at most that many keys, passed to each
layer's attention; head_dim from the config when it sets one, as Mistral-Nemo's 128 for
5120 / 32 heads).

Owns the model's structure; names and tensor parallelism as Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from taipan.ops.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """Llama's fields, `sliding_window` among them; its own type so that a weight update from
    another family's checkpoint is refused (ops/weight_updates.py)."""


class MistralForCausalLM(LlamaForCausalLM):
    """`forward` and `compute_logits` as LlamaForCausalLM (Llama's layers)."""
