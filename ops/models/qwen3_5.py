"""Qwen3.5 text models (Qwen3_5ForCausalLM, dense MLPs; Qwen3_5MoeForCausalLM, a sparse MoE
with a shared expert in every layer): Qwen3-Next's hybrid (ops/models/qwen3_next.py) with the
Gated-DeltaNet input projections split, in_proj_qkv / in_proj_z / in_proj_b / in_proj_a
(ops/gated_delta.py, `split=True`), instead of the interleaved in_proj_qkvz / in_proj_ba.

Everything else is Qwen3-Next's, as transformers' qwen3_5 and qwen3_5_moe modules compute it:
the gated attention (q_proj with the output gate, zero-centred q/k norms), zero-centred
RMSNorms, partial RoPE, the softmax top-k experts (always renormalised) with a sigmoid-gated
shared expert. Their "mrope" rotary embedding gives each of its three sections (temporal,
height, width) its own position id; a text-only sequence has the same id in all three, so it is
plain partial RoPE over `rotary_dim` channels (tests/test_ops_qwen3_5.py checks it against
transformers). Multi-token-prediction weights (`mtp.*`) are skipped at load (ops/hf_dir.py).

Owns only the subclasses; the structure, loader placements (ops/sharding.py) and state slots
are Qwen3-Next's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from taipan.ops.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    """Qwen3NextConfig with Qwen3.5's separate GDN input projections."""

    gdn_split: ClassVar[bool] = True


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3NextForCausalLM over a Qwen3_5Config (its GDN layers take the split projections);
    serves both Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM directories."""
