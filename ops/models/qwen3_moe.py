"""Qwen3-MoE decoder (Qwen3-30B-A3B, Qwen3-235B-A22B, ...) over a flat varlen batch and a paged KV
cache: Llama's skeleton (ops/models/llama.py: embeddings, pre-norm layers, RoPE, final norm,
LM head) with an RMSNorm on each head of q and k before RoPE, and a sparse MLP (ops/moe.py:
softmax top-k routing over SwiGLU experts) in every layer that `is_moe_layer`, a dense SwiGLU
MLP in the others.

Owns the model's structure. Parameter names are Hugging Face's without the leading `model.`,
with q/k/v and a dense layer's gate/up fused at load (as Llama) and each MoE layer's experts
stacked into `mlp.w1` [E_local, 2 * I, H] (rows: gate, then up) and `mlp.w2` [E_local, H, I]
(ops/loader.py). With `expert_range` the model holds only those experts (expert parallelism).

Tensor parallel (`tp`): attention as Llama's (its q/k norms act on each of this rank's heads
with the one shared weight, so they need no split), the dense layers' MLP column- then
row-parallel, and each MoE layer's experts split along their intermediate size (ops/moe.py),
one all-reduce after attention and one after each MLP or MoE block.
"""

from __future__ import annotations

from dataclasses import dataclass

from taipan.ops.layers import SwiGLUMLP
from taipan.ops.models.llama import DecoderLayer, LlamaForCausalLM
from taipan.ops.moe import ExpertRange, MoE, MoEConfig
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.rope_scaling import RopeScaling


@dataclass(frozen=True)
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense layers' MLP
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    rope_scaling: RopeScaling | None = None  # ops/rope_scaling.py (None: plain RoPE)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.moe.activation != "swiglu" or self.moe.scoring != "softmax":
            raise ValueError("Qwen3-MoE experts are SwiGLU with softmax routing")

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (all of them)."""
        return self.num_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (from 0) has the sparse MLP (Hugging Face's rule)."""
        step = self.decoder_sparse_step
        return index not in self.mlp_only_layers and (index + 1) % step == 0


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """`forward` and `compute_logits` as LlamaForCausalLM. `expert_range` (start, count): the
    experts this rank holds (default all); see ops/moe.py for the combine across ranks. `tp`:
    this rank's place in its tensor-parallel group (not together with an expert range)."""

    def __init__(
        self,
        config: Qwen3MoeConfig,
        expert_range: ExpertRange | tuple[int, int] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        experts = ExpertRange.of(expert_range, config.moe.num_experts)

        def make_layer(index: int) -> DecoderLayer:
            if config.is_moe_layer(index):
                mlp = MoE(config.hidden_size, config.moe, experts, tp=tp)
            else:
                mlp = SwiGLUMLP(
                    config.hidden_size, config.intermediate_size, tp, reduce_output=False
                )
            return DecoderLayer(config, mlp=mlp, qk_norm=True, tp=tp)

        super().__init__(config, make_layer, tp=tp)
        self.expert_range = experts
