"""Weight updates in place (the gpu worker's update_weights): whether a checkpoint has the loaded
model's architecture (`check_same_architecture`), and a state dict in Hugging Face names mapped
onto our parameters (`state_updates`: row ranges of the fused qkv_proj / gate_up_proj, one
expert of a stacked w1 / w2, a tensor-parallel rank's shard (ops/sharding.py `placements`, as
the loader splits: experts along their intermediate size, a Mamba in_proj / conv1d one entry per
segment), an expert-parallel rank's experts).
Changes nothing itself: the worker copies what these return.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from taipan.ops.moe import ExpertRange
from taipan.ops.parallel import SINGLE, TPError
from taipan.ops.sharding import (
    EXPERT_NAME,
    STACKED_EXPERTS_NAME,
    Placement,
    checkpoint_name,
    is_vision_tensor,
    mtp_name,
    placement,
    placements,
)

# The hyper-parameters that must agree for new weights to replace the loaded ones in place are
# every field of the model's config but these (a hybrid's layer pattern and Mamba shapes, the
# sliding windows and Gemma's RoPE bases included; the SSM state dtype is a runtime choice,
# mamba_inference_state_config).
_NOT_ARCHITECTURE = ("max_position_embeddings", "bos_token_id", "eos_token_ids", "ssm_state_dtype")


class WeightUpdateError(ValueError):
    """New weights do not fit the loaded model; the message names the parameter or field."""


def check_same_architecture(loaded, new, path: str | Path) -> None:
    """Raise WeightUpdateError naming every hyper-parameter of `new` (a model config) that
    differs from `loaded`."""
    if type(new) is not type(loaded):
        raise WeightUpdateError(
            f"{path}: not the loaded architecture: a {type(new).__name__.removesuffix('Config')} "
            f"model, the loaded one is {type(loaded).__name__.removesuffix('Config')}"
        )
    names = (f.name for f in dataclasses.fields(loaded))
    fields = tuple(n for n in names if n not in _NOT_ARCHITECTURE)
    diffs = [
        f"{f} {getattr(new, f)!r} (loaded: {getattr(loaded, f)!r})"
        for f in fields
        if getattr(new, f) != getattr(loaded, f)
    ]
    if diffs:
        raise WeightUpdateError(f"{path}: not the loaded architecture: {', '.join(diffs)}")


def hf_name_to_ours(name: str, config) -> tuple[str, slice | tuple[int, slice]]:
    """A Hugging Face parameter name -> (our parameter name, the part of it that holds it), for
    the whole (unsharded) model.

    The "model." (a hybrid's "backbone.", a multimodal checkpoint's "model.language_model.")
    prefix is optional; q/k/v_proj (weights and Qwen2's biases) and gate/up_proj are row
    ranges of our fused qkv_proj and gate_up_proj (Hugging Face layout, no un-permuting); norm
    weights are ours as they are (Qwen3's q_norm / k_norm, Gemma's (1 + w) norms: the model
    adds the one); with tied embeddings "lm_head.weight" is the embedding matrix. One expert's
    matrix (`layers.1.mlp.experts.5.up_proj.weight`) is `(expert, rows)` of our stacked w1 /
    w2, with the GLOBAL expert id (`state_updates` maps it onto a rank's range); a stacked one
    (`layers.1.mlp.experts.gate_up_proj`) is all of w1 or w2. A name that matches none of these
    comes back unchanged with all rows (the caller reports it if we have no such parameter).
    """
    p = placement(checkpoint_name(name), config)
    return p.param, p.rows


def state_updates(
    state: dict[str, np.ndarray | torch.Tensor], model, params: dict | None = None
) -> list[tuple[str, object, object]]:
    """Check a (partial) state dict in Hugging Face names, whole tensors (numpy arrays off the
    wire, or torch tensors received from a trainer), against `model`; changes nothing.

    Returns (our parameter name, the index of its part, array) per entry, the array sliced to
    the model's tensor-parallel shard (`model.tp`; the rows are the shard's) and its experts
    (`model.expert_range`: experts another expert-parallel rank holds are skipped, each rank
    takes its own from the same state dict; a multimodal model's vision tensors are skipped).
    Raises WeightUpdateError naming the parameter for an unknown name, a wrong shape, an array
    that is not floating point, or two names for the same rows with different values
    (lm_head.weight and model.embed_tokens.weight of a tied model may both come, equal, as
    `state_dict()` gives them).
    """
    params = model.state_dict() if params is None else params  # (a big model's takes ms)
    tp = getattr(model, "tp", SINGLE)
    experts = getattr(model, "expert_range", None)
    seen: dict[tuple, str] = {}
    out = []
    for name, array in state.items():
        if name.endswith("rotary_emb.inv_freq") or is_vision_tensor(name):
            # A buffer some checkpoints carry (recomputed from rope_theta); a multimodal
            # model's vision tower or projector (we serve its text model only).
            continue
        ours = mtp_name(checkpoint_name(name), model.config)
        if ours is None:
            continue  # the MTP head of a model loaded without it (the loader skips it too)
        try:
            pieces = placements(ours, model.config, tp)
        except TPError as exc:  # (the loaded model already split these, so never in practice)
            raise WeightUpdateError(f"{name}: {exc}") from exc
        if pieces[0].param not in params:
            raise WeightUpdateError(f"unknown parameter {name!r} (not in the loaded model)")
        if not _is_float_array(array):
            kind = getattr(array, "dtype", type(array).__name__)
            raise WeightUpdateError(f"{name}: {kind} is not a floating-point array or tensor")
        if experts is not None and (EXPERT_NAME.match(ours) or STACKED_EXPERTS_NAME.match(ours)):
            local = _local_experts(name, pieces[0], array, experts, model.config.moe.num_experts)
            if local is None:
                continue  # another rank's expert
            pieces, array = (local[0],), local[1]
        p = pieces[0]  # (several pieces: segments of one tensor, each the whole checkpoint shape)
        expected = p.checkpoint_shape(tuple(params[p.param].shape))
        if array.shape != expected:
            raise WeightUpdateError(f"{name}: shape {array.shape}, expected {expected}")
        key = (p.param, _index_key(p.rows))
        if key in seen:
            if not _equal(state[seen[key]], array):
                raise WeightUpdateError(f"{name} and {seen[key]} are the same weights but differ")
            continue
        seen[key] = name
        out += [(piece.param, piece.rows, piece.take(array)) for piece in pieces]
    return out


def direct_view(spec, params: dict, config, tp=SINGLE):
    """Where a whole checkpoint tensor (a TensorSpec: HF name, dtype, shape) can be written
    straight into our parameters: a contiguous view of the same dtype and shape (an unsplit
    tensor, or a fused q/k/v or gate/up part that this rank holds whole), or None (a shard, an
    expert, a conversion: the caller receives it apart and copies it in)."""
    ours = checkpoint_name(spec.name)
    if EXPERT_NAME.match(ours) or STACKED_EXPERTS_NAME.match(ours):
        return None
    try:
        pieces = placements(ours, config, tp)
    except (TPError, ValueError):
        return None
    if len(pieces) != 1 or pieces[0].dim is not None or pieces[0].param not in params:
        return None
    view = params[pieces[0].param][pieces[0].rows]
    if str(view.dtype).removeprefix("torch.") != spec.dtype or tuple(view.shape) != spec.shape:
        return None
    return view if view.is_contiguous() else None


def _local_experts(name: str, p: Placement, array: np.ndarray, experts: ExpertRange, total: int):
    """An expert tensor's (placement, array) in this rank's stacked w1 / w2, or None when it
    belongs to another rank. One expert: rows (global id, rows) -> (local id, rows); a stacked
    [E, ...] array: this rank's experts of it (a view)."""
    if isinstance(p.rows, tuple):
        expert, rows = p.rows
        if not 0 <= expert < total:
            raise WeightUpdateError(f"{name}: expert {expert}, the model has {total} experts")
        if expert not in experts:
            return None
        return dataclasses.replace(p, rows=(expert - experts.start, rows)), array
    if array.ndim != 3 or array.shape[0] != total:
        raise WeightUpdateError(
            f"{name}: shape {array.shape}, expected {total} stacked experts [E, rows, columns]"
        )
    return p, array[experts.start : experts.start + experts.count]


def _is_float_array(array) -> bool:
    if isinstance(array, torch.Tensor):
        return array.is_floating_point()
    return isinstance(array, np.ndarray) and array.dtype.kind == "f"


def _equal(a, b) -> bool:
    if getattr(a, "is_meta", False) or getattr(b, "is_meta", False):
        return True  # a check of names and shapes only (no values yet)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a.to(b.device, b.dtype), b))
    return bool(np.array_equal(a, b))


def _index_key(index) -> tuple:
    """A hashable form of a parameter part (a slice, or (expert, slice))."""
    if isinstance(index, slice):
        return (index.start, index.stop)
    expert, rows = index
    return (expert, rows.start, rows.stop)
