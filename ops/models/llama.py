"""Llama-family decoder (Llama 2/3, SmolLM, ...) over a flat varlen batch and a paged KV cache.

Owns the model's structure and its forward pass. Weights come from ops/loader.py; block tables,
slots and positions from the GPU actor (via `AttentionMetadata`); the cache tensor is allocated
here but owned and kept by the GPU actor. Parameter names are Hugging Face's without the leading
`model.` (`layers.0.self_attn.o_proj.weight`), except that q/k/v and gate/up are fused at load
(`qkv_proj`, `gate_up_proj`).

Tensor parallel (a `TPGroup` of size T, ops/parallel.py): every rank builds the same module tree
with its shards (ops/checkpoint.py shards the checkpoint as it reads it): column-parallel
qkv_proj and gate_up_proj, row-parallel o_proj and down_proj (their partial sums are added up by
the RMSNorm after them, see DecoderLayer), and the embedding / LM head over a vocabulary shard,
the logits gathered so every rank holds them all.
The config stays the whole model's; the KV cache of a rank holds only its kv heads
(`allocate_kv_cache(..., tp=...)`). A one-row step of a rank may instead sum a row-parallel
product inside its own launch and apply the next norm there (`DecoderLayer._fused_tp_forward`):
its output is then NORMALIZED, the next layer's input as that layer's input norm leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from taipan.kernels.gemv import gemv, gemv_qkv_rope
from taipan.ops.attention import AttentionMetadata
from taipan.ops.layers import (
    FUSED_DECODE_ROWS,
    Attention,
    RMSNorm,
    SwiGLUMLP,
    VocabParallelEmbedding,
    lm_logits,
)
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.rope_scaling import RopeScaling, rope_table

# A layer's output kind (DecoderLayer.forward): already the next layer's normalized input.
NORMALIZED = "normalized"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    # The attention window of the layers that have one (Mistral, Qwen2/3 with
    # use_sliding_window): the query at position p sees keys p - W < k <= p. None: every layer
    # sees its whole context.
    sliding_window: int | None = None
    # The layers the window applies to (Qwen2/3 window only some); None: all of them.
    sliding_layers: tuple[int, ...] | None = None
    # Llama 3.1's "llama3", Qwen's "yarn", or "linear" (ops/rope_scaling.py); None: plain RoPE.
    rope_scaling: RopeScaling | None = None

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (all of them)."""
        return self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: its whole context)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. `mlp`: another MLP in place of the dense SwiGLU (Qwen3-MoE's
    sparse layers); `qk_norm`: RMSNorm each head of q and k before RoPE (Qwen3, Qwen3-MoE);
    `qkv_bias`: q, k and v projections with biases (Qwen2); `sliding_window`: this layer's
    attention window (`LlamaConfig.layer_window`); `tp`: this rank's share of the heads and of
    the MLP (tensor parallel).

    Under tensor parallelism the attention's output, and the dense MLP's, leave this layer as
    this rank's partial sums: the norm after each sums them (one kernel with the add and the
    norm, ops/layers.RMSNorm). `partial_output` says whether this layer's output is one (the
    next layer's input norm, or the model's final norm, must sum it)."""

    def __init__(
        self,
        config,
        mlp: nn.Module | None = None,
        qk_norm: bool = False,
        tp: TPGroup = SINGLE,
        qkv_bias: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qk_norm_eps=c.rms_norm_eps if qk_norm else None,
            tp=tp,
            reduce_output=False,
            qkv_bias=qkv_bias,
            sliding_window=sliding_window,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if mlp is None:
            mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, tp, reduce_output=False)
        self.mlp, self.tp = mlp, tp
        self.partial_output = isinstance(mlp, SwiGLUMLP) and not mlp.reduce_output

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
        partial_input: bool | str = False,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool | str]:
        """x: [tokens, hidden], the previous layer's output (None residual: the embeddings),
        a partial sum over the TP group when `partial_input` is True (the previous layer's
        output kind), or, when it is NORMALIZED, already this layer's normalized input (the
        residual already added). `next_norm`: the norm the next layer (or the model's end)
        applies first, which a TP rank's fused path may apply itself. Returns this layer's
        output, the residual stream before it (fused adds), and the output's kind (True: a
        partial sum, `partial_output`; NORMALIZED: the next norm already applied)."""
        if self._fused(x):
            if self.tp.size > 1:
                return self._fused_tp_forward(
                    x, residual, positions, cos_sin, attn, layer_cache, partial_input, next_norm
                )
            return (*self._fused_forward(x, residual, positions, cos_sin, attn, layer_cache),
                    self.partial_output)  # fmt: skip
        if partial_input == NORMALIZED:
            h = x
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:  # residual <- x + residual
            h, residual = self.input_layernorm(x, residual, self.tp if partial_input else None)
        h = self.self_attn(h, positions, cos_sin, attn, layer_cache)  # partial under TP
        h, residual = self.post_attention_layernorm(h, residual, self.tp)
        return self.mlp(h), residual, self.partial_output

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether this step takes the fused few-row path (decode at small batch, CUDA, the
        dense SwiGLU MLP; under TP too, `_fused_tp_forward`); decided by the shape, so each
        CUDA graph bakes in one path."""
        return x.is_cuda and x.shape[0] <= FUSED_DECODE_ROWS and type(self.mlp) is SwiGLUMLP

    def _fused_forward(self, x, residual, positions, cos_sin, attn, layer_cache):
        """The layer in four kernels around the attention (kernels/gemv.py): input norm + qkv
        (+ RoPE and the cache write, unless q/k norms come between), o_proj + residual add,
        post-attention norm + gate_up + SiLU, down_proj + residual add.
        The residual stream is updated in place and returned as this layer's output, with None
        for the residual (the next layer, or the final norm, then adds nothing)."""
        if residual is not None:  # (after an unfused layer: its output still to be added)
            x = residual.add_(x)
        attn_mod, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_w, qkv_b = attn_mod.qkv_proj.weight, attn_mod.qkv_proj.bias
        if attn_mod.q_norm is None and cos_sin is not None:  # RoPE and the cache write too
            q = gemv_qkv_rope(
                x, qkv_w, num_heads=attn_mod.num_heads, num_kv_heads=attn_mod.num_kv_heads,
                positions=positions, cos_sin_cache=cos_sin, kv_cache=layer_cache,
                slot_mapping=attn.slot_mapping, bias=qkv_b, norm_weight=norm1.weight,
                eps=norm1.eps,
            )  # fmt: skip
            out = attn_mod.attend_rotated(q, attn, layer_cache)
        else:  # (q/k norms between the product and RoPE: Qwen3)
            qkv = gemv(x, qkv_w, bias=qkv_b, norm_weight=norm1.weight, eps=norm1.eps)
            out = attn_mod.attend(qkv, positions, cos_sin, attn, layer_cache)
        gemv(out, attn_mod.o_proj.weight, residual=x)
        w = mlp.gate_up_proj.weight
        act = gemv(x, w, norm_weight=norm2.weight, eps=norm2.eps, gated=True)
        gemv(act, mlp.down_proj.weight, residual=x)
        return x, None

    def _fused_tp_forward(
        self, x, residual, positions, cos_sin, attn, layer_cache, partial, next_norm
    ):
        """The fused path of a tensor-parallel rank: the layer's interface and sums are the
        unfused path's (its output this rank's partial sum, the norms after the row-parallel
        products summing them with the residual add, one kernel where the group's custom
        all-reduce takes it), the rest in the products (kernels/gemv.py): qkv with RoPE and the
        cache write, gate_up with SiLU. Two kernels fewer a layer, and the GEMV for the narrow
        matrices of a rank's shard. Where the custom all-reduce takes a row-parallel product
        with its sum (`fits_gemv`, TAIPAN_TP_GEMV_SUM=1), o_proj and down_proj run with the sum,
        the add and the norm after them in their own launch (kernels/gemv_all_reduce.py): down's
        norm is `next_norm`, and the output is then NORMALIZED."""
        attn_mod, mlp, tp = self.self_attn, self.mlp, self.tp
        fast = tp.fast
        if partial == NORMALIZED:
            h = x
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual, tp if partial else None)
        qkv_w, qkv_b = attn_mod.qkv_proj.weight, attn_mod.qkv_proj.bias
        if attn_mod.q_norm is None and cos_sin is not None:
            q = gemv_qkv_rope(
                h, qkv_w, num_heads=attn_mod.num_heads, num_kv_heads=attn_mod.num_kv_heads,
                positions=positions, cos_sin_cache=cos_sin, kv_cache=layer_cache,
                slot_mapping=attn.slot_mapping, bias=qkv_b,
            )  # fmt: skip
            out = attn_mod.attend_rotated(q, attn, layer_cache)
        else:
            out = attn_mod.attend(gemv(h, qkv_w, bias=qkv_b), positions, cos_sin, attn, layer_cache)
        o_w, norm2 = attn_mod.o_proj.weight, self.post_attention_layernorm
        if fast is not None and fast.fits_gemv(out, o_w):
            h, residual = fast.gemv_all_reduce_rms_norm_(
                out, o_w, residual, norm2.weight, norm2.eps
            )
        else:
            h, residual = norm2(gemv(out, o_w), residual, tp)
        act = gemv(h, mlp.gate_up_proj.weight, gated=True)
        down_w = mlp.down_proj.weight
        if next_norm is not None and fast is not None and fast.fits_gemv(act, down_w):
            h, residual = fast.gemv_all_reduce_rms_norm_(
                act, down_w, residual, next_norm.weight, next_norm.eps
            )
            return h, residual, NORMALIZED
        return gemv(act, down_w), residual, self.partial_output


class LlamaForCausalLM(nn.Module):
    """`forward` runs one step over T tokens from B sequences (no padding) and returns hidden
    states; `compute_logits` turns the rows the caller wants (usually each sequence's last
    token) into fp32 logits, so the [T, vocab] matrix of a long prefill is never built.

    `make_layer(index)` builds each decoder layer (default: Llama's, with the config's window
    for that layer); models of the same skeleton (Qwen2, Qwen3, Qwen3-MoE, Gemma 3) pass their
    own. `tp`: this rank's place in its tensor-parallel group (every rank runs every step)."""

    def __init__(
        self, config, make_layer: Callable[[int], nn.Module] | None = None, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        make_layer = make_layer or (
            lambda index: DecoderLayer(config, tp=tp, sliding_window=config.layer_window(index))
        )
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._rope_caches: dict[torch.device, torch.Tensor] = {}
        # Tied models reuse the embedding matrix (its vocabulary shard) as the output projection.
        rows = self.embed_tokens.weight.shape[0]
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int32 or int64; kv_cache: see `allocate_kv_cache`, or a
        WindowedKV (written in place). Returns hidden: [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)  # x: [T, hidden]
        cos_sin = self.rope_cache(x.device)
        residual, partial = None, False
        layers = self.layers
        for i, layer in enumerate(layers):
            after = layers[i + 1] if i + 1 < len(layers) else None
            next_norm = self.norm if after is None else after.input_layernorm
            # (a windowed layer's own pool under per-layer-group KV: WindowedKV)
            layer_attn = attn.for_window(layer.self_attn.sliding_window)
            x, residual, partial = layer(
                x, residual, positions, cos_sin, layer_attn, kv_cache[i], partial, next_norm
            )
        if partial == NORMALIZED:  # (the last product applied the final norm)
            return x
        if residual is None:  # (the fused path's layers leave the stream itself, added up)
            return self.norm(x)
        x, _ = self.norm(x, residual, self.tp if partial else None)
        return x

    def rope_cache(self, device: torch.device) -> torch.Tensor:
        """cos/sin for every position, fp32 [max_position_embeddings, head_dim] with the config's
        RoPE scaling, built once per device (a plain attribute, not a buffer: `.to(dtype)` must
        not round it)."""
        cache = self._rope_caches.get(device)
        if cache is None:
            c = self.config
            max_pos, scaling = c.max_position_embeddings, c.rope_scaling
            cache = rope_table(max_pos, c.head_dim, c.rope_theta, scaling, device)
            self._rope_caches[device] = cache
        return cache

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> logits: [N, vocab] float32, the whole vocabulary on every rank
        (written into `out` when given: the product in the weights' dtype, converted as it is
        copied)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_logits(hidden, weight, out, self.tp, self.config.vocab_size)


def kv_heads_per_rank(config, tp: TPGroup = SINGLE) -> int:
    """The kv heads one rank's cache holds (all of them at size 1)."""
    return tp.heads(config.num_heads, config.num_kv_heads).kv_count


def allocate_kv_cache(
    config,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE,
) -> torch.Tensor:
    """An uninitialised cache: [num_kv_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    (index 0 of dim 1 holds keys, 1 holds values; kv_heads: this rank's, `kv_heads_per_rank`).
    `config`: any model config with `num_kv_layers`, `num_heads`, `num_kv_heads` and `head_dim`
    (Llama, NemotronH).

    Not zeroed: attention reads only slots this request wrote, and on the CPU untouched pages of
    a large pool then cost no memory. A read of an unwritten slot shows up as garbage, not as a
    plausible zero."""
    heads = kv_heads_per_rank(config, tp)
    shape = (config.num_kv_layers, 2, num_blocks, block_size, heads, config.head_dim)
    return torch.empty(shape, dtype=dtype, device=device)


class WindowedKV:
    """The KV cache of a model whose windowed layers keep their keys in a pool of their own
    (per-layer-group KV, actors/engine/local_kv.py): one allocation `flat`, the other layers'
    cache [G, 2, num_blocks, ...] first, then the windowed layers' [L, 2, num_local, ...].
    Indexed by layer as the one-pool cache is (`kv[i]`: layer i's [2, blocks, block_size,
    kv_heads, head_dim] view), so the model's loop reads it alike; which block table and slots
    a layer's attention uses is the metadata's (`AttentionMetadata.for_window`)."""

    def __init__(
        self, flat: torch.Tensor, windowed: tuple[bool, ...], num_blocks: int, num_local: int,
        per_block: tuple[int, int, int],
    ):  # fmt: skip
        num_windowed = sum(windowed)
        num_global = len(windowed) - num_windowed
        size = 2 * per_block[0] * per_block[1] * per_block[2]  # one block, keys and values
        split = num_global * num_blocks * size
        self.global_ = flat[:split].view(num_global, 2, num_blocks, *per_block)
        self.local = flat[split:].view(num_windowed, 2, num_local, *per_block)
        g = w = 0
        self._layers: list[torch.Tensor] = []
        for is_windowed in windowed:
            self._layers.append(self.local[w] if is_windowed else self.global_[g])
            w, g = w + is_windowed, g + (not is_windowed)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._layers[layer]

    def __len__(self) -> int:
        return len(self._layers)

    @staticmethod
    def numel(
        windowed: tuple[bool, ...], num_blocks: int, num_local: int, per_block: tuple[int, ...]
    ) -> int:
        size = 2 * per_block[0] * per_block[1] * per_block[2]
        num_windowed = sum(windowed)
        return ((len(windowed) - num_windowed) * num_blocks + num_windowed * num_local) * size


def kv_cache_bytes_per_block(
    config, block_size: int, dtype: torch.dtype, tp: TPGroup = SINGLE
) -> int:
    """Bytes one block takes on one rank across all KV layers, keys and values (for sizing the
    pool)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    heads = kv_heads_per_rank(config, tp)
    per_token = config.num_kv_layers * 2 * heads * config.head_dim * element_size
    return block_size * per_token
