"""Transformer building blocks shared by the models: RMSNorm (fused with the residual add) and
Gemma's (1 + w) RMSNorm, rotary embedding fused with the KV-cache write, GQA attention over the
paged KV cache (a sliding window per layer), the SwiGLU and GELU-tanh gated MLPs, the
vocabulary-parallel embedding and LM head.

Tensor parallelism (ops/parallel.py `TPGroup`, SINGLE by default): attention and the MLP hold
this rank's output rows of their fused input projections (column-parallel: its query and kv
heads, its share of the intermediate size) and the matching input columns of their output
projections (row-parallel), whose partial sums one all-reduce adds up; the embedding and the LM
head hold a contiguous shard of the vocabulary.

Each op has one dispatch point: on CUDA the Triton kernel of kernels/, elsewhere its torch
reference (`*_ref`, the same contract) — chosen by the tensor's device, never by optional
metadata. Numerics follow Hugging Face transformers (the test oracle): norms and RoPE in fp32,
results cast back to the activation dtype; attention softmax in fp32. Layers never know whether
they run eagerly or under a CUDA graph, and never read the clock, a host tensor or a global
(FUSED_DECODE_ROWS, below, is fixed when the module is imported).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from taipan.kernels import activation, rmsnorm, rope
from taipan.ops.attention import AttentionMetadata, paged_attention
from taipan.ops.parallel import SINGLE, TPGroup


def _fused_decode_rows() -> int:
    """Steps of at most this many token rows run a Llama-family layer through kernels/gemv.py
    (its fused norms, activation and residual adds); TAIPAN_FUSED_GEMV=0 turns that off (to
    compare the two paths), 1 (the default) keeps it on. One row: on an H100 the fused step
    is faster at one row (1B shape 1.31 against 1.40 ms, 8B 5.94 against 6.25) and slower
    than cuBLAS at two and four (tests/perf/NOTES.md, eleventh session)."""
    value = os.environ.get("TAIPAN_FUSED_GEMV", "1")
    if value not in ("0", "1"):
        raise ValueError(f"TAIPAN_FUSED_GEMV must be 0 or 1, got {value!r}")
    return 1 if value == "1" else 0


FUSED_DECODE_ROWS = _fused_decode_rows()  # fixed at import: graphs bake in their path

# On the CPU, products of 2..CPU_SKINNY_ROWS rows by an fp32 weight are taken as W @ x^T: MKL's
# x @ W^T at a few rows reads the weight about twice as slowly (SmolLM2's 30 layers, 2 cores,
# 2026-11-28: 4 rows 83 -> 44 ms, 16 rows 113 -> 81, 64 rows 274 -> 207, 128 rows 1.05x,
# 1 row equal: left to F.linear's gemv).
CPU_SKINNY_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear, but W @ x^T for a few fp32 rows on the CPU (CPU_SKINNY_ROWS says why); the
    result is contiguous either way."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if 2 <= rows <= CPU_SKINNY_ROWS and x.device.type == "cpu" and weight.dtype == torch.float32:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear` (the same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def lm_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    tp: TPGroup = SINGLE,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """hidden: [N, hidden] -> logits [N, vocab_size] float32 through the LM head `weight` (this
    rank's vocabulary shard: its logits are gathered from every rank, the padding cut off, so
    every rank holds the same full logits); written into `out` when given (the product in the
    weights' dtype, converted as it is copied)."""
    logits = tp.all_gather(linear(hidden, weight), dim=-1)[:, :vocab_size]
    if out is None:
        return logits.float()
    return out.copy_(logits)


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary shard (`ops.parallel.vocab_shard`): an id
    outside it embeds to zeros, and the all-reduce sums the one rank's row into every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        shard = tp.vocab(vocab_size)
        self.vocab_start = shard.start
        self.weight = nn.Parameter(torch.empty(shard.padded, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])  # [T] no host branch on it
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~inside[:, None], 0.0))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, tp: TPGroup | None = None
    ):
        """x: [tokens, hidden] -> normalized x; with `residual`, `(normalized, residual)` after
        `residual <- x + residual` in place (the residual stream of the next layer). With `tp`,
        x is this rank's partial sum over that group (a row-parallel projection's output):
        summed first, in one kernel with the add and the norm where the group's custom
        all-reduce takes it (x is then overwritten)."""
        if tp is not None and tp.size > 1:
            fast = tp.fast
            if residual is not None and fast is not None and fast.fits_rows(x):
                return fast.all_reduce_rms_norm_(x, residual, self.weight, self.eps)
            tp.all_reduce(x)
        fn = rmsnorm.rms_norm if x.is_cuda else rmsnorm.rms_norm_ref
        return fn(x, self.weight, self.eps, residual=residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in fp32 and rounded once to x's dtype (HF's
    Gemma3RMSNorm). The weight is the checkpoint's as it is, the +1 added in fp32 (folded into
    a bf16 weight it would round away most of a small weight's bits), so weights under Hugging
    Face names go in unchanged: loading, updates and transfers alike. With `residual`, as
    RMSNorm's: `(normalized, residual)` after `residual <- x + residual` in place. One Triton
    kernel on CUDA (kernels/rmsnorm.py, `gemma=True`), its torch reference elsewhere."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        pre: GemmaRMSNorm | None = None,
    ):
        """`pre` (with `residual`): the norm x passes first, before the add (Gemma 3's
        post-attention norm): one launch for the norm, the add and this norm."""
        fn = rmsnorm.rms_norm if x.is_cuda else rmsnorm.rms_norm_ref  # x: [rows, hidden]
        pre_weight = None
        if pre is not None:
            if pre.eps != self.eps:
                raise ValueError(f"the two norms' eps differ ({pre.eps} and {self.eps})")
            pre_weight = pre.weight
        return fn(x, self.weight, self.eps, residual=residual, gemma=True, pre_weight=pre_weight)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual <- residual + norm(x)` in place (one launch), returned (Gemma 3's
        post-feedforward norm and the layer's last add)."""
        fn = rmsnorm.add_rms_norm_ if x.is_cuda else rmsnorm.add_rms_norm_ref
        return fn(x, self.weight, self.eps, residual, gemma=True)


class Attention(nn.Module):
    """Grouped-query self-attention: rotates q and k, appends this step's K/V to the paged
    cache, then attends over each sequence's context (cached prefix + this step; with
    `sliding_window` W, the query at position p sees keys p - W < k <= p only).
    `num_heads` and `num_kv_heads` are the model's; this rank holds its share (`TPGroup.heads`)
    and its cache layer only those kv heads. `reduce_output` False: return this rank's partial
    sum of the output (the next RMSNorm sums it, see RMSNorm.forward's `tp`). `scale`: the
    softmax scale (default head_dim ** -0.5); `qk_norm`: the class of the per-head q/k norms
    that `qk_norm_eps` turns on (Gemma's GemmaRMSNorm; Qwen3's RMSNorm)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        tp: TPGroup = SINGLE,
        reduce_output: bool = True,
        qkv_bias: bool = False,
        sliding_window: int | None = None,
        scale: float | None = None,
        qk_norm: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        heads = tp.heads(num_heads, num_kv_heads)
        self.tp, self.reduce_output = tp, reduce_output
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # q, k and v projections fused into one matrix (rows: q, then k, then v): one GEMM.
        # `qkv_bias` (Qwen2): their biases, fused alike (column-parallel: this rank's rows).
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.qkv_proj = Linear(hidden_size, qkv_rows, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * head_dim, hidden_size, bias=False)
        # Qwen3, Gemma 3: a norm over each head of q and of k (weights shared by the heads),
        # before RoPE; None: no such norm (Llama, NemotronH).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = qk_norm(head_dim, qk_norm_eps)
            self.k_norm = qk_norm(head_dim, qk_norm_eps)

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
        out = self.o_proj(self.attend(self.qkv_proj(x), positions, cos_sin, attn, layer_cache))
        return self.tp.all_reduce(out) if self.reduce_output else out  # (this rank's heads' part)

    def attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor | None,
        cos_sin: torch.Tensor | None,
        attn: AttentionMetadata,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        """qkv: [tokens, (heads + 2 kv_heads) * head_dim], the fused projection's output ->
        the attention's output [tokens, heads * head_dim], before o_proj (the norms, RoPE and
        the cache write of `forward` in between)."""
        num_tokens = qkv.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # views of the qkv output
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if cos_sin is not None and self._norms_in_rope(qkv):
            # The q/k norms inside the RoPE kernel (one launch instead of three), as the norm
            # kernels would round them.
            return self.attend_rotated(
                rope.rope_and_write_kv(
                    q, k, v, positions, cos_sin, layer_cache, attn.slot_mapping,
                    q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                    norm_eps=self.q_norm.eps, gemma_norm=isinstance(self.q_norm, GemmaRMSNorm),
                ),
                attn,
                layer_cache,
            )  # fmt: skip
        if self.q_norm is not None:  # rows of one head each: [tokens * heads, head_dim]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if cos_sin is None:
            store = rope.write_kv if qkv.is_cuda else rope.write_kv_ref
            store(k, v, layer_cache, attn.slot_mapping)
        else:
            write = rope.rope_and_write_kv if qkv.is_cuda else rope.rope_and_write_kv_ref
            q = write(q, k, v, positions, cos_sin, layer_cache, attn.slot_mapping)  # q rotated
        return self.attend_rotated(q, attn, layer_cache)

    def _norms_in_rope(self, qkv: torch.Tensor) -> bool:
        """Whether the q/k norms run inside the RoPE kernel (on CUDA; the CPU runs the norm
        modules, then the RoPE reference)."""
        return self.q_norm is not None and qkv.is_cuda

    def attend_rotated(
        self, q: torch.Tensor, attn: AttentionMetadata, layer_cache: torch.Tensor
    ) -> torch.Tensor:
        """q: [tokens, heads, head_dim], rotated, this step's K/V already in the cache -> the
        attention's output [tokens, heads * head_dim]."""
        out = paged_attention(q, layer_cache, attn, self.scale, self.sliding_window)
        return out.view(q.shape[0], self.num_heads * self.head_dim)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) over this rank's share of the intermediate size;
    `reduce_output` as for Attention."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup = SINGLE,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        _, inter = tp.even(intermediate_size, "intermediate_size")
        self.tp, self.reduce_output = tp, reduce_output
        # gate and up projections fused (rows: gate, then up): one GEMM.
        self.gate_up_proj = Linear(hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden] -> [tokens, 2 * intermediate] -> [tokens, intermediate] -> hidden
        act = activation.silu_and_mul if x.is_cuda else activation.silu_and_mul_ref
        out = self.down_proj(act(self.gate_up_proj(x)))  # this rank's part of the sum
        return self.tp.all_reduce(out) if self.reduce_output else out


class GeluTanhMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's MLP), laid out and split as SwiGLUMLP: the
    activation rounded to x's dtype before the product, as HF's `gelu_pytorch_tanh` (one
    Triton kernel on CUDA, kernels/activation.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = activation.gelu_tanh_and_mul if x.is_cuda else activation.gelu_tanh_and_mul_ref
        out = self.down_proj(act(self.gate_up_proj(x)))  # [tokens, intermediate] in between
        return self.tp.all_reduce(out) if self.reduce_output else out
