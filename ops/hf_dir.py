"""A Hugging Face model directory (config.json, *.safetensors, tokenizer files) -> (model, config,
tokenizer).

Owns reading the directory: config.json (mapped by ops/hf_configs.py), the tokenizer, and every
safetensors tensor as a piece read lazily through the file's memory map, so a rank reads only its
slices (ops/checkpoint.py decides which). Skips what checkpoints carry beyond our modules (RoPE's
saved inv_freq, the multi-token-prediction heads of NemotronH and Qwen3.5, a tied LM head's copy,
and a multimodal checkpoint's vision tower and projector: of Qwen3.5's and Gemma 3's we serve the
text model, never reading the rest). With `mtp=True` a Qwen3-Next-style checkpoint's MTP head is
read too: its decoder layers `mtp.layers.i.*` as layers num_layers + i of the model (so they
are fused, sharded and their experts placed as any layer's), its `mtp.fc` and norms as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from taipan.ops.checkpoint import ModelLoadError, Piece, build_model, expert_pieces, no_experts
from taipan.ops.hf_configs import (
    hf_config,
    hf_family,
    multimodal_architecture,
    text_model_config,
)
from taipan.ops.models.qwen3_next import Qwen3NextConfig
from taipan.ops.moe import ExpertRange
from taipan.ops.parallel import TPGroup
from taipan.ops.sharding import (
    Placement,
    checkpoint_name,
    is_vision_tensor,
    mtp_layer_index,
    mtp_name,
)
from taipan.ops.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_hf_dir(
    path: Path, dtype: torch.dtype, device, expert_range, tp: TPGroup, mtp: bool = False
) -> tuple:
    """(model, config, tokenizer) of the directory, this rank's shards and experts only;
    `mtp`: with the checkpoint's multi-token-prediction head (Qwen3-Next-style only)."""
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: cannot read ({exc})") from exc
    multimodal = multimodal_architecture(hf)
    if multimodal is not None:
        hf = text_model_config(path, hf)
        log.info("%s: a %s checkpoint: serving its text model only", path, multimodal)
    family = hf_family(path, hf)
    tokenizer = Tokenizer.from_hf_dir(path)
    config = hf_config(path, hf, family, tokenizer)
    moe = getattr(config, "moe", None)
    if moe is None:
        no_experts(path, expert_range)
        experts = None
    else:
        try:
            experts = ExpertRange.of(expert_range, moe.num_experts)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
    files = _weight_files(path)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    if mtp:  # (under expert parallelism its MoE layer takes its share as any other's)
        config = _with_mtp(path, config, files)
    with contextlib.ExitStack() as files_open:
        pieces = _safetensors_pieces(files, files_open, config)
        if experts is not None:
            pieces = expert_pieces(path, config, experts, pieces, tp)
        model = build_model(path, config, pieces, dtype, device, tp, experts)
    return model, config, tokenizer


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, as transformers picks them: those its index names,
    else model.safetensors, else every *.safetensors (Mistral's repositories also hold a
    consolidated.safetensors in Mistral's own tensor names, which neither reads)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: cannot read the weight map ({exc!r})") from exc
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _with_mtp(path: Path, config, files: list[Path]):
    """`config` with num_mtp_layers: as many as the checkpoint's `mtp.layers.i` (ModelLoadError
    for a family without MTP support here, or a checkpoint without the head)."""
    if not isinstance(config, Qwen3NextConfig):
        raise ModelLoadError(
            f"{path}: an MTP head is served for Qwen3-Next-style checkpoints only, not "
            f"{type(config).__name__}"
        )
    from safetensors import safe_open

    layers = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                found = (mtp_layer_index(checkpoint_name(name)) for name in f.keys())
                layers |= {i for i in found if i is not None}
        except Exception as exc:  # safetensors raises its own untyped errors
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
    if not layers or layers != set(range(len(layers))):
        raise ModelLoadError(
            f"{path}: the checkpoint has no multi-token-prediction head (mtp.layers.0.*, "
            f"found layers {sorted(layers)}): load it without mtp"
        )
    if len(layers) > 1:
        raise ModelLoadError(
            f"{path}: the multi-token-prediction head has {len(layers)} layers; heads of more "
            "than one layer are not served (Qwen3-Next's and Qwen3.5's have one)"
        )
    return dataclasses.replace(config, num_mtp_layers=1)


def _safetensors_pieces(files: list[Path], files_open, config) -> Iterator[Piece]:
    """Every tensor of the files, not read yet (a piece reads its slice through the file's
    memory map); the MTP head's only when `config` has MTP layers (sharding.mtp_name)."""
    tied = config.tie_word_embeddings
    from safetensors import safe_open

    for file in files:
        try:
            f = files_open.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        except Exception as exc:  # safetensors raises its own untyped errors
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
        for name in f.keys():
            ours = mtp_name(checkpoint_name(name), config)
            if ours is None or ours.endswith("rotary_emb.inv_freq"):
                # The multi-token-prediction head of a model loaded without it (Hugging Face
                # ignores it too); a buffer older checkpoints saved (recomputed from
                # rope_theta).
                continue
            if is_vision_tensor(name):
                continue  # a multimodal checkpoint's vision tower or projector
            if tied and ours == "lm_head.weight":
                continue  # the embedding is the LM head
            tensor = f.get_slice(name)
            yield ours, tuple(tensor.get_shape()), functools.partial(_read_slice, file, tensor)


def _read_slice(file: Path, tensor, p: Placement) -> torch.Tensor:
    try:
        return p.take(tensor)
    except Exception as exc:  # safetensors raises its own untyped errors
        raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
