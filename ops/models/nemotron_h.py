"""NemotronH hybrids (NVIDIA Nemotron-H): a stack of pre-norm residual blocks whose mixers follow a
pattern string — `M` a Mamba2 mixer, `*` attention without positional encoding, `-` a ReLU² MLP,
`E` a mixture of ReLU² experts (ops/moe.py: sigmoid grouped top-k routing, a shared expert,
optional latent projections) — over a flat varlen batch, a paged KV cache (attention layers
only) and Mamba state slots.

Owns the model's structure and its forward pass. Weights come from ops/loader.py; block tables,
slots and positions from the GPU actor (`AttentionMetadata`), Mamba slots likewise
(`MambaMetadata`, ops/mamba.py). Parameter names are Hugging Face's without the leading
`backbone.` / `model.` (`layers.0.mixer.in_proj.weight`), except that an attention layer's
q/k/v are fused at load into `mixer.qkv_proj` and an `E` layer's experts are stacked into
`mixer.w1` [E_local, I, H_in] (up_proj) and `mixer.w2` [E_local, H_in, I] (down_proj). With
`expert_range` the model holds only those experts (expert parallelism).

Tensor parallel (a `TPGroup` of size T, ops/parallel.py), as LlamaForCausalLM: every rank builds
the same module tree with its shards (ops/sharding.py says which slices it reads): Mamba2
mixers split by heads and groups (ops/mamba.py), attention by heads and the ReLU² MLP by its
intermediate size (column-parallel in, row-parallel out, one all-reduce each), the embedding
and LM head by vocabulary. The config stays the whole model's; a rank's KV cache holds its kv
heads and its Mamba state slots its share (`NemotronHConfig.mamba_state_for`). `E` (MoE) layers
split every expert's intermediate size (ops/moe.py), the shared expert alike, with one
all-reduce for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from taipan.ops.attention import AttentionMetadata
from taipan.ops.layers import Attention, RMSNorm, VocabParallelEmbedding, lm_logits
from taipan.ops.mamba import Mamba2Mixer, MambaMetadata, MambaStateShape
from taipan.ops.moe import ExpertRange, MoE, MoEConfig
from taipan.ops.parallel import SINGLE, TPGroup

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    pattern: str  # one character per layer, see LAYER_KINDS
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int  # mamba_chunk_size: the SSD scan's chunk
    norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dt_limit: tuple[float, float] = (0.0, math.inf)
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    ssm_state_dtype: str = "float32"  # mamba_ssm_cache_dtype
    moe: MoEConfig | None = None  # the `E` layers' (None: the pattern has none)

    def __post_init__(self) -> None:
        bad = sorted(set(self.pattern) - set(LAYER_KINDS))
        if bad or not self.pattern:
            raise ValueError(
                f"layer pattern {self.pattern!r}: every character must be one of "
                f"{''.join(LAYER_KINDS)} (M Mamba2, * attention, - MLP, E MoE); "
                f"got {bad or 'nothing'}"
            )
        if ("E" in self.pattern) != (self.moe is not None):
            raise ValueError(
                f"layer pattern {self.pattern!r}: MoE settings are needed exactly when it has "
                "MoE layers ('E')"
            )
        moe = self.moe
        if moe is not None and (moe.activation, moe.scoring) != ("relu2", "sigmoid"):
            raise ValueError("NemotronH experts are ReLU² with sigmoid routing")
        if "*" not in self.pattern:
            raise ValueError(
                f"layer pattern {self.pattern!r} has no attention layer ('*'): pure Mamba "
                "stacks are not supported (the KV block pool needs at least one attention layer)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                f"n_groups ({self.n_groups})"
            )
        if self.ssm_state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"mamba_ssm_cache_dtype {self.ssm_state_dtype!r} is not supported")

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (attention)."""
        return self.pattern.count("*")

    @property
    def mamba_state(self) -> MambaStateShape:
        """One slot's state of the whole model (a tensor-parallel rank's: `mamba_state_for`)."""
        return self.mamba_state_for(SINGLE)

    def mamba_state_for(self, tp: TPGroup) -> MambaStateShape:
        """One slot's state on a rank of `tp`: its heads' SSM state and the conv state of its
        x, B and C channels (TPError naming mamba_num_heads or n_groups if T divides not)."""
        _, heads = tp.even(self.mamba_num_heads, "mamba_num_heads")
        _, groups = tp.even(self.n_groups, "n_groups")
        inner = heads * self.mamba_head_dim
        return MambaStateShape(
            num_layers=self.pattern.count("M"),
            conv_dim=inner + 2 * groups * self.ssm_state_size,
            conv_kernel=self.conv_kernel,
            num_heads=heads,
            head_dim=self.mamba_head_dim,
            state_size=self.ssm_state_size,
        )


class ReLU2MLP(nn.Module):
    """down(relu(up(x))²) over this rank's share of the intermediate size (`tp`), summed over
    the ranks unless `reduce_results` is False (a MoE's shared expert: the MoE block sums it
    with the routed experts' partial output in one all-reduce)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup = SINGLE,
        reduce_results: bool = True,
        what: str = "intermediate_size",
    ) -> None:
        super().__init__()
        _, inter = tp.even(intermediate_size, what)
        self.tp, self.reduce_results = tp, reduce_results
        self.up_proj = nn.Linear(hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(torch.square(F.relu(self.up_proj(x))))
        return self.tp.all_reduce(out) if self.reduce_results else out


class HybridBlock(nn.Module):
    """norm -> mixer -> residual add (the add fused into the next norm). `cache_index` is the
    layer's index among the layers of its kind (its KV cache layer, or its Mamba state layer);
    `tp`: this rank's share of the mixer."""

    def __init__(
        self,
        config: NemotronHConfig,
        kind: str,
        cache_index: int,
        experts: ExpertRange | None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.kind, self.cache_index = kind, cache_index
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        c = config
        if kind == "mamba":
            self.mixer = Mamba2Mixer(
                c.hidden_size,
                c.mamba_num_heads,
                c.mamba_head_dim,
                c.n_groups,
                c.ssm_state_size,
                c.conv_kernel,
                c.chunk_size,
                c.norm_eps,
                dt_limit=c.dt_limit,
                conv_bias=c.use_conv_bias,
                proj_bias=c.mamba_proj_bias,
                tp=tp,
            )
        elif kind == "attention":
            self.mixer = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, tp=tp)
        elif kind == "moe":
            shared = ReLU2MLP(
                c.hidden_size, c.moe.shared_intermediate_size, tp, reduce_results=False,
                what="moe_shared_expert_intermediate_size",
            )  # fmt: skip
            self.mixer = MoE(c.hidden_size, c.moe, experts, shared_experts=shared, tp=tp)
        else:
            self.mixer = ReLU2MLP(c.hidden_size, c.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        mamba: MambaMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.norm(x)
        else:
            h, residual = self.norm(x, residual)  # residual <- x + residual
        if self.kind == "mamba":
            return self.mixer(h, mamba, self.cache_index), residual
        if self.kind == "attention":
            # No positional encoding: positions and the RoPE table are not used.
            h = self.mixer(h, None, None, attn, kv_cache[self.cache_index])
            return h, residual
        return self.mixer(h), residual  # MLP or MoE


class NemotronHForCausalLM(nn.Module):
    """`forward` runs one step over T tokens from B sequences (no padding) and returns hidden
    states; `compute_logits` turns chosen rows into fp32 logits (as LlamaForCausalLM).
    `expert_range` (start, count): the experts this rank holds in every `E` layer (default
    all); see ops/moe.py for the combine across ranks. `tp`: this rank's place in its
    tensor-parallel group (every rank runs every step)."""

    def __init__(
        self,
        config: NemotronHConfig,
        expert_range: ExpertRange | tuple[int, int] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.expert_range = ExpertRange.of_model(expert_range, config.moe)
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        counts = {kind: 0 for kind in LAYER_KINDS.values()}
        layers = []
        for ch in config.pattern:
            kind = LAYER_KINDS[ch]
            layers.append(HybridBlock(config, kind, counts[kind], self.expert_range, tp))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)
        rows = self.embeddings.weight.shape[0]  # this rank's vocabulary shard (padded)
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
        mamba: the step's Mamba slots (required: a hybrid has Mamba layers). Returns hidden:
        [T, hidden] after the final norm."""
        if mamba is None:
            raise ValueError("a NemotronH forward needs MambaMetadata (its Mamba state slots)")
        x = self.embeddings(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, attn, kv_cache, mamba)
        x, _ = self.norm_f(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.embeddings.weight if self.lm_head is None else self.lm_head.weight
        return lm_logits(hidden, weight, out, self.tp, self.config.vocab_size)
