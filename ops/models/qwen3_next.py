"""Qwen3-Next-style hybrids (Qwen3NextForCausalLM: Gated-DeltaNet "linear attention" layers
with a recurrent state, interleaved with full-attention layers) over a flat varlen batch, a
paged KV cache (the full-attention layers only) and recurrent state slots (the GDN layers, in
the Mamba state tensors: ops/gated_delta.py).

What differs from Llama (ops/models/llama.py), as Hugging Face's Qwen3Next modules compute it:
- `layer_types` says which layers are GDN (`linear_attention`) and which attention;
- every RMSNorm is zero-centred, x / rms(x) * (1 + w) (ops/layers.GemmaRMSNorm, weights kept as
  the checkpoint has them), the per-head q/k norms too;
- attention has an output gate: q_proj gives each head's query and gate ([q_h | gate_h] rows
  per head), and the output is attention * sigmoid(gate) before o_proj;
- RoPE rotates only the first `rotary_dim` = head_dim * partial_rotary_factor channels of each
  head (rotate-half within them); the rest pass through;
- the MLP is a sparse MoE (ops/moe.py: softmax top-k over SwiGLU experts) plus one SwiGLU shared
  expert scaled by sigmoid(shared_expert_gate(x)), or a dense SwiGLU MLP in the layers that
  `is_moe_layer` says are not sparse (mlp_only_layers, decoder_sparse_step, no experts).

Owns the model's structure. Parameter names are Hugging Face's without `model.`, except that an
attention layer's q/k/v are fused at load into `self_attn.qkv_proj` (rows: q_proj's, gate
interleaved as the checkpoint has it, then k, then v), a dense MLP's and the shared expert's
gate/up into `gate_up_proj`, and a MoE layer's experts stacked into `mlp.w1` / `mlp.w2`
(ops/sharding.py places each checkpoint tensor).

Partial RoPE runs as torch ops here (kernels/rope.py rotates whole heads only), then the keys
go to the cache with kernels/rope.write_kv: a few elementwise launches per attention layer.

Tensor parallel (`tp`): attention splits by heads (as Llama's), GDN by key heads
(ops/gated_delta.py), the MLPs and every expert along their intermediate size, the vocabulary
as Llama's; every block all-reduces its own output (the norms are replicated). The config stays
the whole model's; a rank's KV cache holds its kv heads and its state slots its share
(`Qwen3NextConfig.mamba_state_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from taipan.kernels import rope
from taipan.ops.attention import AttentionMetadata, paged_attention
from taipan.ops.gated_delta import GatedDeltaNet
from taipan.ops.layers import (
    GemmaRMSNorm,
    SwiGLUMLP,
    VocabParallelEmbedding,
    linear,
    lm_logits,
)
from taipan.ops.mamba import MambaMetadata, MambaStateShape
from taipan.ops.moe import ExpertRange, MoE, MoEConfig
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.rope_scaling import RopeScaling, rope_table

LINEAR, FULL = "linear_attention", "full_attention"
GDN_CHUNK = 64  # the chunk of the GDN prefill (Hugging Face's and FLA's chunk_size)


@dataclass(frozen=True)
class Qwen3NextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense layers' MLP
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (GDN) or "full_attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    partial_rotary_factor: float = 0.25
    moe: MoEConfig | None = None  # the sparse layers' routed experts (None: every MLP dense)
    shared_expert_intermediate_size: int = 0  # the sparse layers' one shared expert
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    ssm_state_dtype: str = "float32"  # of the recurrent state (mamba_inference_state_config)
    # Multi-token-prediction layers loaded from the checkpoint's `mtp.*` (load_model(mtp=True);
    # 0: none): each a full-attention decoder layer after the model's (ops/models/
    # qwen3_next_mtp.py), its KV in the same cache at the layer indices after the model's.
    num_mtp_layers: int = 0
    rope_scaling: RopeScaling | None = None  # of the rotated channels (None: plain RoPE)
    # The GDN input projections: Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba (False), or
    # Qwen3.5's separate in_proj_qkv / _z / _b / _a (ops/models/qwen3_5.py's subclass: True).
    gdn_split: ClassVar[bool] = False

    def __post_init__(self) -> None:
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: each must be {LINEAR!r} or {FULL!r}, got {bad}")
        if FULL not in self.layer_types:
            raise ValueError(
                "layer_types has no full_attention layer: pure linear-attention stacks are not "
                "supported (the KV block pool needs at least one attention layer)"
            )
        for a, b, what in (
            (self.num_heads, self.num_kv_heads, "num_attention_heads"),
            (self.linear_num_value_heads, self.linear_num_key_heads, "linear_num_value_heads"),
        ):
            if a % b:
                raise ValueError(f"{what} ({a}) must be a multiple of {b}")
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2 or rotary > self.head_dim:
            raise ValueError(
                f"head_dim ({self.head_dim}) * partial_rotary_factor "
                f"({self.partial_rotary_factor}) must be an even number of channels >= 2"
            )
        moe = self.moe
        if moe is not None and (moe.activation, moe.scoring) != ("swiglu", "softmax"):
            raise ValueError("Qwen3-Next experts are SwiGLU with softmax routing")
        if moe is not None and self.shared_expert_intermediate_size <= 0:
            raise ValueError("Qwen3-Next MoE layers need shared_expert_intermediate_size > 0")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
        if self.ssm_state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"recurrent state dtype {self.ssm_state_dtype!r} is not supported")

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (without the MTP layers after them)."""
        return len(self.layer_types)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones, then the MTP layers."""
        return self.layer_types.count(FULL) + self.num_mtp_layers

    def layer_kind(self, index: int) -> str:
        """LINEAR or FULL for layer `index`; an MTP layer (index >= num_layers) is FULL."""
        return self.layer_types[index] if index < self.num_layers else FULL

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def pattern(self) -> str:
        """One character per layer, `G` GDN and `*` attention (mamba_inference_state_config's
        layer_type_list is checked against it)."""
        return "".join("G" if kind == LINEAR else "*" for kind in self.layer_types)

    @property
    def chunk_size(self) -> int:
        return GDN_CHUNK

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (from 0) has the sparse MLP (Hugging Face's rule). MTP layer i
        (index num_layers + i) is sparse as layer i is: its checkpoint names it `mtp.layers.i`
        and the rule reads that index (as vLLM's Qwen3-Next MTP does)."""
        if index >= self.num_layers:
            index -= self.num_layers
        if self.moe is None or index in self.mlp_only_layers:
            return False
        return (index + 1) % self.decoder_sparse_step == 0

    @property
    def mamba_state(self) -> MambaStateShape:
        """One slot's recurrent state of the whole model (a rank's: `mamba_state_for`)."""
        return self.mamba_state_for(SINGLE)

    def mamba_state_for(self, tp: TPGroup) -> MambaStateShape:
        """One slot's state on a rank of `tp`, per GDN layer: the conv state of its q, k and v
        channels and the recurrent state [Hv, Dk, Dv] of its value heads (TPError naming
        linear_num_key_heads unless T divides it)."""
        _, key_heads = tp.even(self.linear_num_key_heads, "linear_num_key_heads")
        value_heads = key_heads * (self.linear_num_value_heads // self.linear_num_key_heads)
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        return MambaStateShape(
            num_layers=self.layer_types.count(LINEAR),
            conv_dim=2 * key_heads * dk + value_heads * dv,
            conv_kernel=self.linear_conv_kernel,
            num_heads=value_heads,
            head_dim=dk,
            state_size=dv,
        )


def rotate_partial_(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate-half RoPE of the first R channels of each head of x [T, heads, D], in place; the
    other D - R pass through. cos_sin: [T, R] fp32, each token's row of
    ops/rope_scaling.rope_table with head_dim R. fp32 arithmetic, rounded once (as
    kernels/rope.py)."""
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # (new tensors before any write)
    x[..., :half] = r1
    x[..., half : 2 * half] = r2


class GatedAttention(nn.Module):
    """Qwen3-Next's attention: per-head zero-centred q/k norms, partial RoPE, GQA over the
    paged cache, output * sigmoid(gate), o_proj. This rank's heads under `tp`."""

    def __init__(self, config: Qwen3NextConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        c = config
        heads = tp.heads(c.num_heads, c.num_kv_heads)
        self.tp, self.head_dim = tp, c.head_dim
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.scale = c.head_dim**-0.5
        # rows: q_proj's (per head [q_h | gate_h]), then k_proj's, then v_proj's
        rows = (2 * self.num_heads + 2 * self.num_kv_heads) * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, rows, bias=False)
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos_sin: [T, rotary_dim] fp32, the tokens' RoPE rows; layer_cache:
        [2, num_blocks, block_size, kv_heads, head_dim]."""
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qg = qkv[:, : 2 * H * D].view(T, H, 2, D)
        gate = qg[:, :, 1]  # [T, H, D] (a view)
        k = qkv[:, 2 * H * D : (2 * H + KVH) * D].reshape(-1, D)
        v = qkv[:, (2 * H + KVH) * D :].view(T, KVH, D)
        q = self.q_norm(qg[:, :, 0].reshape(-1, D)).view(T, H, D)
        k = self.k_norm(k).view(T, KVH, D)
        rotate_partial_(q, cos_sin)
        rotate_partial_(k, cos_sin)
        store = rope.write_kv if x.is_cuda else rope.write_kv_ref
        store(k, v, layer_cache, attn.slot_mapping)
        out = paged_attention(q, layer_cache, attn, self.scale)  # [T, H, D]
        out = (out * torch.sigmoid(gate)).reshape(T, H * D)
        return self.tp.all_reduce(self.o_proj(out))


class SparseMoeBlock(MoE):
    """ops/moe.MoE (softmax top-k over SwiGLU experts) plus Qwen3-Next's shared expert under
    Hugging Face's names, `shared_expert` (a SwiGLU MLP, split like the experts under `tp`)
    scaled by sigmoid(`shared_expert_gate`(x)): MoE adds it before its one all-reduce."""

    def __init__(self, config: Qwen3NextConfig, experts: ExpertRange, tp: TPGroup = SINGLE) -> None:
        super().__init__(config.hidden_size, config.moe, experts, tp=tp)
        self.shared_expert = SwiGLUMLP(
            config.hidden_size, config.shared_expert_intermediate_size, tp, reduce_output=False
        )
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # (a plain attribute, not a module: MoE.forward calls it, its weights are the two above)
        self.shared_experts = self._gated_shared_expert

    def _gated_shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    """norm -> GDN or attention -> norm -> MLP or MoE, the residual adds fused into the norms.
    `cache_index`: the layer's index among the layers of its kind (its KV cache layer, or its
    state layer in the Mamba tensors)."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        index: int,
        cache_index: int,
        experts: ExpertRange | None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        c = config
        self.linear, self.cache_index = c.layer_kind(index) == LINEAR, cache_index
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                c.hidden_size,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_conv_kernel,
                c.rms_norm_eps,
                tp=tp,
                split=c.gdn_split,
            )
        else:
            self.self_attn = GatedAttention(c, tp)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.is_moe_layer(index):
            self.mlp = SparseMoeBlock(c, experts, tp)
        else:
            self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        mamba: MambaMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)  # residual <- x + residual
        if self.linear:
            h = self.linear_attn(h, mamba, self.cache_index)
        else:
            h = self.self_attn(h, cos_sin, attn, kv_cache[self.cache_index])
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MTPHead(nn.Module):
    """What a multi-token-prediction head adds besides its decoder layers (`mtp.*` of a
    Qwen3-Next checkpoint, kept in Hugging Face's names): the next token's embedding and the
    model's hidden state, each normalized, concatenated [embedding | hidden] and projected
    back to the hidden size by `fc`; `norm` after the layer. Replicated on every rank (fc is
    [hidden, 2 hidden]: small beside the layer)."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm = GemmaRMSNorm(h, eps)

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] embeddings of the next tokens and the model's hidden states -> the
        layer's input [T, hidden]."""
        both = torch.cat(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1
        )
        return linear(both, self.fc.weight)


class Qwen3NextForCausalLM(nn.Module):
    """`forward` runs one step over T tokens from B sequences (no padding) and returns hidden
    states; `compute_logits` turns chosen rows into fp32 logits (as LlamaForCausalLM).
    `expert_range` (start, count): the experts this rank holds in every MoE layer (default
    all). `tp`: this rank's place in its tensor-parallel group."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        expert_range: ExpertRange | tuple[int, int] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.expert_range = ExpertRange.of_model(expert_range, config.moe)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        counts = {LINEAR: 0, FULL: 0}
        layers = []
        for i in range(config.num_layers + config.num_mtp_layers):  # (MTP layers: FULL, last)
            kind = config.layer_kind(i)
            layers.append(Qwen3NextDecoderLayer(config, i, counts[kind], self.expert_range, tp))
            counts[kind] += 1
        # The MTP layers sit after the model's in `layers` (their checkpoint names are mapped
        # there, so loading, sharding and expert placement treat them as any layer); `forward`
        # runs the first num_layers only, `mtp` (when loaded) the rest.
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp = MTPHead(config) if config.num_mtp_layers else None
        self._rope_caches: dict[torch.device, torch.Tensor] = {}
        rows = self.embed_tokens.weight.shape[0]  # this rank's vocabulary shard (padded)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        mamba: MambaMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_kv_layers, 2, blocks, block_size, KVH, D];
        mamba: the step's recurrent state slots (required). Returns hidden: [T, hidden] after
        the final norm."""
        if mamba is None:
            raise ValueError("a Qwen3-Next forward needs MambaMetadata (its GDN state slots)")
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope_cache(x.device)[positions.long()]  # [T, rotary_dim], once a step
        residual = None
        for layer in self.layers[: self.config.num_layers]:
            x, residual = layer(x, residual, cos_sin, attn, kv_cache, mamba)
        x, _ = self.norm(x, residual)
        return x

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The multi-token-prediction head (loaded with load_model(mtp=True)) at T positions:
        `hidden` [T, hidden] the model's output (after its final norm) at `positions`,
        `next_ids` [T] the token after each position. Its attention layer writes its KV at
        `positions` (the last cache layer) and attends over the head's earlier positions.
        Returns [T, hidden] after the head's norm: `compute_logits` of a row scores the token
        two after its position (a drafter's later passes feed it its own output: ops/mtp.py).
        One MTP layer (the loader refuses heads of more)."""
        if self.mtp is None:
            raise ValueError("this model was loaded without its MTP head (load_model(mtp=True))")
        x = self.mtp.fuse(self.embed_tokens(next_ids), hidden)
        cos_sin = self.rope_cache(x.device)[positions.long()]
        layer = self.layers[self.config.num_layers]
        x, residual = layer(x, None, cos_sin, attn, kv_cache, None)
        x, _ = self.mtp.norm(x, residual)
        return x

    def rope_cache(self, device: torch.device) -> torch.Tensor:
        """cos/sin of the rotated channels for every position, fp32 [max_pos, rotary_dim], with
        the config's RoPE scaling (over the rotary dim, as transformers scales a partial RoPE)."""
        cache = self._rope_caches.get(device)
        if cache is None:
            c = self.config
            max_pos, scaling = c.max_position_embeddings, c.rope_scaling
            cache = rope_table(max_pos, c.rotary_dim, c.rope_theta, scaling, device)
            self._rope_caches[device] = cache
        return cache

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_logits(hidden, weight, out, self.tp, self.config.vocab_size)
