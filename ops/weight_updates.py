"""Weight updates in place (the gpu worker's update_weights): whether a checkpoint has the loaded
model's architecture (`check_same_architecture`), and a state dict in Hugging Face names mapped
onto our parameters (`state_updates`: row ranges of the fused qkv_proj / gate_up_proj, one
expert of a stacked w1 / w2, a tensor-parallel rank's shard (a Mamba in_proj's: one entry per
segment), an expert-parallel rank's experts).
Changes nothing itself: the worker copies what these return.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from taipan.ops.loader import EXPERT_NAME, STACKED_EXPERTS_NAME
from taipan.ops.models.llama import LlamaConfig
from taipan.ops.moe import ExpertRange
from taipan.ops.parallel import SINGLE, TPError
from taipan.ops.sharding import placement, placements

# Hyper-parameters that must agree for new weights to replace the loaded ones in place.
_ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)
# A hybrid's are every field but these (its layer pattern and all its Mamba shapes included;
# the SSM state dtype is a runtime choice, mamba_inference_state_config).
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
    fields = _ARCHITECTURE_FIELDS
    if not isinstance(loaded, LlamaConfig):
        names = (f.name for f in dataclasses.fields(loaded))
        fields = tuple(n for n in names if n not in _NOT_ARCHITECTURE)
    diffs = [
        f"{f} {getattr(new, f)!r} (loaded: {getattr(loaded, f)!r})"
        for f in fields
        if getattr(new, f) != getattr(loaded, f)
    ]
    if diffs:
        raise WeightUpdateError(f"{path}: not the loaded architecture: {', '.join(diffs)}")


def _expert_name(name: str, config) -> tuple[str, tuple[int, slice] | slice] | None:
    """An expert tensor's (our stacked w1 / w2, the part of it: (GLOBAL expert id, rows) for
    one expert's matrix, all of it for a stacked [E, ...] tensor); None for any other name."""
    moe = getattr(config, "moe", None)
    expert, stacked = EXPERT_NAME.match(name), STACKED_EXPERTS_NAME.match(name)
    if moe is not None and expert is not None:
        inter, matrix = moe.intermediate_size, expert.group(3)
        rows = slice(None)
        if moe.activation == "swiglu" and matrix != "down":
            rows = slice(0, inter) if matrix == "gate" else slice(inter, 2 * inter)
        param = "w2" if matrix == "down" else "w1"
        return f"{expert.group(1)}.{param}", (int(expert.group(2)), rows)
    if moe is not None and stacked is not None:
        param = "w2" if stacked.group(2) == "down" else "w1"
        return f"{stacked.group(1)}.{param}", slice(None)
    return None


def hf_name_to_ours(name: str, config) -> tuple[str, slice | tuple[int, slice]]:
    """A Hugging Face parameter name -> (our parameter name, the part of it that holds it), for
    the whole (unsharded) model.

    The "model." (a hybrid's "backbone.") prefix is optional; q/k/v_proj and gate/up_proj are
    row ranges of our fused qkv_proj and gate_up_proj (Hugging Face layout, no un-permuting);
    with tied embeddings "lm_head.weight" is the embedding matrix. One expert's matrix
    (`layers.1.mlp.experts.5.up_proj.weight`) is `(expert, rows)` of our stacked w1 / w2, with
    the GLOBAL expert id (`state_updates` maps it onto a rank's range). A name that matches none
    of these (stacked expert tensors included: all of w1 or w2) comes back unchanged with all
    rows (the caller reports it if we have no such parameter).
    """
    ours = name.removeprefix("model.").removeprefix("backbone.")
    found = _expert_name(ours, config)
    if found is not None:
        return found
    p = placement(ours, config)
    return p.param, p.rows


def state_updates(state: dict[str, np.ndarray], model) -> list[tuple[str, object, np.ndarray]]:
    """Check a (partial) state dict in Hugging Face names, whole tensors, against `model`;
    changes nothing.

    Returns (our parameter name, the index of its part, array) per entry, the array sliced to
    the model's tensor-parallel shard (`model.tp`; the rows are the shard's; a tensor split in
    segments gives one entry per segment) and its experts
    (`model.expert_range`: experts another expert-parallel rank holds are skipped, each rank
    takes its own from the same state dict). Raises WeightUpdateError naming the parameter for
    an unknown name, a wrong shape, an array that is not floating point, or two names for the
    same rows with different values (lm_head.weight and model.embed_tokens.weight of a tied
    model may both come, equal, as `state_dict()` gives them).
    """
    params = model.state_dict()
    tp = getattr(model, "tp", SINGLE)
    experts = getattr(model, "expert_range", None)
    seen: dict[tuple, str] = {}
    out = []
    for name, array in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some checkpoints carry; recomputed from rope_theta
        ours = name.removeprefix("model.").removeprefix("backbone.")
        found = _expert_name(ours, model.config)
        pieces = ()
        if found is None:
            try:
                pieces = placements(ours, model.config, tp)
            except TPError as exc:  # (the loaded model already split these, so never in practice)
                raise WeightUpdateError(f"{name}: {exc}") from exc
            param, index = pieces[0].param, pieces[0].rows
        else:
            param, index = found
        if param not in params:
            raise WeightUpdateError(f"unknown parameter {name!r} (not in the loaded model)")
        if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
            kind = getattr(array, "dtype", type(array).__name__)
            raise WeightUpdateError(f"{name}: {kind} is not a floating-point numpy array")
        if not pieces and experts is not None:
            local = _local_experts(name, index, array, experts, model.config.moe.num_experts)
            if local is None:
                continue  # another rank's expert
            index, array = local
        if not pieces:
            expected = tuple(params[param][index].shape)
        else:
            expected = pieces[0].checkpoint_shape(tuple(params[param].shape))
        if array.shape != expected:
            raise WeightUpdateError(f"{name}: shape {array.shape}, expected {expected}")
        key = (param, _index_key(index))
        if key in seen:
            if not np.array_equal(state[seen[key]], array):
                raise WeightUpdateError(f"{name} and {seen[key]} are the same weights but differ")
            continue
        seen[key] = name
        if not pieces:
            out.append((param, index, array))
        out += [(p.param, p.rows, p.take(array)) for p in pieces]
    return out


def _local_experts(name: str, index, array: np.ndarray, experts: ExpertRange, total: int):
    """An expert tensor's (index, array) in this rank's stacked w1 / w2, or None when it
    belongs to another rank. One expert: (global id, rows) -> (local id, rows); a stacked
    [E, ...] array: this rank's slice of it."""
    if isinstance(index, tuple):
        expert, rows = index
        if not 0 <= expert < total:
            raise WeightUpdateError(f"{name}: expert {expert}, the model has {total} experts")
        if expert not in experts:
            return None
        return (expert - experts.start, rows), array
    if array.ndim != 3 or array.shape[0] != total:
        raise WeightUpdateError(
            f"{name}: shape {array.shape}, expected {total} stacked experts [E, rows, columns]"
        )
    return index, array[experts.start : experts.start + experts.count]


def _index_key(index) -> tuple:
    """A hashable form of a parameter part (a slice, or (expert, slice))."""
    if isinstance(index, slice):
        return (index.start, index.stop)
    expert, rows = index
    return (expert, rows.start, rows.stop)
