"""A checkpoint's tensors -> this rank's model: the pieces every loader hands over, the one
`build_model` that fills a model from them, and `ModelLoadError`.

A piece is one checkpoint tensor not read yet: its name (Hugging Face's, without `model.` or
`backbone.`: ops/sharding.py `checkpoint_name`), its whole shape and a reader of the slice a
`Placement` (ops/sharding.py) names.
The loaders (ops/gguf_file.py, ops/hf_dir.py, ops/random_model.py) only make pieces; this module
decides what each rank reads of them.

Tensor parallelism (`tp`, ops/parallel.py): every rank builds the model's module tree with its
shards and reads only its slices of each checkpoint tensor (`placements`); a MoE layer's
experts split along their intermediate size (ops/moe.py), a Mamba mixer by heads and groups
(ops/mamba.py). Every model family splits.

Expert parallelism: MoE checkpoints name each expert's matrices (`mlp.experts.3.up_proj.weight`,
what transformers' `save_pretrained` writes) or stack them (`mlp.experts.gate_up_proj`
[E, 2I, H], what its modules hold); `expert_pieces` stacks both into our `w1` / `w2`
(ops/moe.py) for the experts of an `ExpertRange` only: the others' tensors are never read.

Owns no file format and no config mapping; never allocates the KV cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from taipan.ops.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from taipan.ops.models.llama import LlamaConfig, LlamaForCausalLM
from taipan.ops.models.mistral import MistralConfig, MistralForCausalLM
from taipan.ops.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from taipan.ops.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from taipan.ops.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from taipan.ops.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from taipan.ops.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from taipan.ops.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from taipan.ops.moe import ExpertRange
from taipan.ops.parallel import SINGLE, TPError, TPGroup
from taipan.ops.sharding import (
    EXPERT_NAME,
    STACKED_EXPERTS_NAME,
    Placement,
    checkpoint_names,
    placement,
    placements,
    with_experts,
)

# One checkpoint tensor, not read yet: (name without `model.`, its whole shape, a reader of the
# slice a Placement names).
Piece = tuple[str, tuple[int, ...], Callable[[Placement], torch.Tensor]]


class ModelLoadError(Exception):
    """The checkpoint at a path cannot be loaded; the message says which path and why."""


def no_experts(path, expert_range) -> None:
    """Refuse an `expert_range` for a model without experts."""
    if expert_range is not None:
        raise ModelLoadError(f"{path}: expert_range {expert_range!r}: the model has no experts")


_MODELS = {
    LlamaConfig: LlamaForCausalLM,
    Qwen2Config: Qwen2ForCausalLM,
    Qwen3Config: Qwen3ForCausalLM,
    MistralConfig: MistralForCausalLM,
    Gemma3Config: Gemma3ForCausalLM,
    NemotronHConfig: NemotronHForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
    Qwen3NextConfig: Qwen3NextForCausalLM,
    Qwen3_5Config: Qwen3_5ForCausalLM,
}
# Kept in fp32 whatever the model dtype (as Hugging Face keeps them): a bf16 correction bias
# would change which experts are chosen.
_FP32_TENSORS = ("e_score_correction_bias",)


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(_FP32_TENSORS) else dtype


def build_model(
    path: Path,
    config,
    pieces: Iterable[Piece],
    dtype,
    device,
    tp: TPGroup = SINGLE,
    experts: ExpertRange | None = None,
):
    """Instantiate without initializing (meta device), allocate this rank's parameters (zeros:
    the vocabulary padding stays zero), then fill them piece by piece, each checkpoint tensor
    read only as far as this rank's slice of it. `experts`: the MoE experts this rank holds."""
    cls = _MODELS[type(config)]
    kwargs = {"tp": tp} if experts is None else {"tp": tp, "expert_range": experts}
    try:
        with torch.device("meta"):
            model = cls(config, **kwargs)
    except TPError as exc:
        raise ModelLoadError(f"{path}: cannot split over {tp.size} ranks: {exc}") from exc
    params = {
        name: torch.zeros(t.shape, dtype=_param_dtype(name, dtype), device=device)
        for name, t in model.state_dict().items()
    }
    expected = {name for param in params for name in checkpoint_names(param)}
    seen, unexpected, misfits = set(), [], []
    for name, shape, read in pieces:
        if name not in expected:
            unexpected.append(name)
            continue
        seen.add(name)
        for p in placements(name, config, tp):  # (several: a Mamba in_proj's segments)
            want = p.checkpoint_shape(tuple(params[p.param].shape))
            if tuple(shape) != want:
                misfits.append(f"{name} has shape {tuple(shape)}, the config wants {want}")
                break
            if p.dim is None or p.length:  # (a rank past the vocabulary's end reads nothing)
                params[p.param][p.rows].copy_(read(p))
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match the {cls.__name__} layout "
            f"(missing {missing[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    if misfits:
        raise ModelLoadError(f"{path}: weights do not fit the config: {'; '.join(misfits[:5])}")
    model.load_state_dict(params, strict=True, assign=True)
    return model.requires_grad_(False).eval()


# ---- experts (expert parallelism) ---------------------------------------------------------------


def expert_pieces(
    path: Path, config, experts: ExpertRange, pieces: Iterator[Piece], tp: TPGroup
) -> Iterator[Piece]:
    """The pieces with each MoE block's expert tensors replaced by two pieces, our stacked
    `w1` [E_local, N, H] (SwiGLU: gate rows, then up rows; ReLU²: up) and `w2` [E_local, H, I]
    of the local experts, from per-expert or stacked checkpoint tensors; an expert outside
    `experts` is never read, nor (under `tp`) another rank's share of an expert's intermediate
    size. Checked in full before the first piece is handed on."""
    total = config.moe.num_experts
    others, parts = [], {}  # parts[(prefix, matrix, local expert or None: stacked)] = piece
    for piece in pieces:
        name, shape, _ = piece
        one, stacked = EXPERT_NAME.match(name), STACKED_EXPERTS_NAME.match(name)
        if one is not None:
            expert = int(one.group(2))
            if expert >= total:
                raise ModelLoadError(f"{path}: {name}: expert {expert}, but the config has {total}")
            if expert in experts:
                parts[(one.group(1), one.group(3), expert - experts.start)] = piece
        elif stacked is not None:
            if shape[0] != total:
                raise ModelLoadError(
                    f"{path}: {name} stacks {shape[0]} experts, the config has {total}"
                )
            parts[(stacked.group(1), stacked.group(2), None)] = piece
        else:
            others.append(piece)
    return iter(others + _stacked_expert_pieces(path, config, experts, parts, tp))


def _moe_prefixes(config) -> list[str]:
    """The module prefix of every MoE block of the model (`layers.3.mlp`, `layers.1.mixer`)."""
    if isinstance(config, (Qwen3MoeConfig, Qwen3NextConfig)):
        layers = config.num_layers + getattr(config, "num_mtp_layers", 0)  # (MTP layers last)
        return [f"layers.{i}.mlp" for i in range(layers) if config.is_moe_layer(i)]
    return [f"layers.{i}.mixer" for i, kind in enumerate(config.pattern) if kind == "E"]


def _stacked_expert_pieces(
    path: Path, config, experts: ExpertRange, parts: dict, tp: TPGroup
) -> list[Piece]:
    """Per MoE block, the `w1` and `w2` pieces of `expert_pieces`, whole shapes in the layout of
    a stacked checkpoint tensor (so `placement` splits them alike). Their readers, when
    `build_model` reads them, take the local experts' slices of a stacked tensor, or stack this
    rank's slices (`placement` of each per-expert tensor) of the local experts' tensors."""

    def part(piece: Piece) -> torch.Tensor:
        return piece[2](placement(piece[0], config, tp))

    prefixes = _moe_prefixes(config)
    stray = sorted({key[0] for key in parts} - set(prefixes))
    if stray:
        raise ModelLoadError(
            f"{path}: expert tensors for {stray[:3]}, which the config does not make MoE layers"
        )
    out: list[Piece] = []
    for prefix in prefixes:
        mine = {key[1:]: piece for key, piece in parts.items() if key[0] == prefix}
        if any(expert is None for _, expert in mine):
            out += _from_stacked(path, config, experts, prefix, mine)
        else:
            out += _from_per_expert(path, config, experts, prefix, mine, part)
    return out


def _w1_matrices(config) -> tuple[tuple[str, ...], str]:
    """The checkpoint matrices stacked into `w1`: one per expert (SwiGLU: gate, up; ReLU²: up),
    and the one stacked tensor's name."""
    if config.moe.activation == "swiglu":
        return ("gate", "up"), "gate_up"
    return ("up",), "up"


def _from_stacked(path: Path, config, experts: ExpertRange, prefix: str, mine: dict):
    """One block whose checkpoint stacks its experts: `w1` and `w2` read the local experts'
    slices of the stacked tensors."""
    w1_stacked = _w1_matrices(config)[1]
    stacked = {matrix for matrix, expert in mine if expert is None}
    want = {w1_stacked, "down"}
    if stacked != want or len(mine) != len(want):
        raise ModelLoadError(
            f"{path}: {prefix}.experts: expected stacked {sorted(want)} and nothing "
            f"per expert, found {sorted(f'{m}:{e}' for m, e in mine)[:6]}"
        )
    out: list[Piece] = []
    for param, piece in (("w1", mine[w1_stacked, None]), ("w2", mine["down", None])):
        shape = (experts.count, *piece[1][1:])
        read = functools.partial(_read_experts, piece[2], experts)
        out.append((f"{prefix}.{param}", shape, read))
    return out


def _from_per_expert(
    path: Path, config, experts: ExpertRange, prefix: str, mine: dict, part
) -> list[Piece]:
    """One block whose checkpoint names each expert's matrices: `w1` and `w2` stack `part` (this
    rank's slice) of every local expert's tensors; any tensor left over is an error."""
    w1_parts = _w1_matrices(config)[0]
    for e in range(experts.count):
        for matrix in (*w1_parts, "down"):
            if (matrix, e) not in mine:
                raise ModelLoadError(
                    f"{path}: no expert tensors for {prefix}.experts.{experts.start + e}."
                    f"{matrix}_proj.weight (a {config.moe.activation} expert)"
                )
    w1 = [[mine.pop((m, e)) for m in w1_parts] for e in range(experts.count)]
    w2 = [mine.pop(("down", e)) for e in range(experts.count)]
    if mine:
        raise ModelLoadError(
            f"{path}: unexpected expert tensors in {prefix}.experts: "
            f"{sorted(f'{m}_proj' for m, _ in mine)[:4]} ({config.moe.activation} experts)"
        )
    rows = sum(p[1][0] for p in w1[0])
    return [
        (
            f"{prefix}.w1",
            (experts.count, rows, *w1[0][0][1][1:]),
            lambda p: torch.stack([torch.cat([part(x) for x in e]) for e in w1]),
        ),
        (
            f"{prefix}.w2",
            (experts.count, *w2[0][1]),
            lambda p: torch.stack([part(x) for x in w2]),
        ),
    ]


def _read_experts(read, experts: ExpertRange, p: Placement) -> torch.Tensor:
    """A stacked [E, ...] checkpoint tensor's slice `p` of the experts in `experts` only."""
    return read(with_experts(p, experts.start, experts.count))
