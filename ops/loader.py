"""Model loading, the one entry point: a GGUF file, a Hugging Face directory or a random-weight
shape -> (model, config, tokenizer), this rank's shards only under tensor or expert parallelism.

Owns picking the loader for a path and turning every failure into a `ModelLoadError` that names
the path and the cause. The loaders each own one concern:
- ops/gguf_file.py: GGUF reading, dequantization, llama.cpp's Q/K row un-permute and Gemma's
  norm shift;
- ops/hf_dir.py: a Hugging Face directory's config.json and safetensors files;
- ops/hf_configs.py: config.json -> our config, per model family;
- ops/checkpoint.py: `ModelLoadError`, and filling a model from a checkpoint's tensors (the
  TP slices and EP experts a rank reads);
- ops/random_model.py: `random:<shape>`, seeded weights and a byte-level tokenizer.
Weight updates in place (the gpu worker's update_weights) are ops/weight_updates.py's. Does not
allocate the KV cache or pick a block count (the GPU actor does).

The names other modules import from here (the random shapes' among them) are re-exported.
"""

from __future__ import annotations

from pathlib import Path

import torch

from taipan.ops.checkpoint import ModelLoadError, no_experts
from taipan.ops.gguf_file import load_gguf
from taipan.ops.hf_dir import load_hf_dir
from taipan.ops.moe import ExpertRange
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.random_model import (
    RANDOM_PREFIX,
    RANDOM_SEED,
    RANDOM_SHAPES,
    RANDOM_STD,
    load_random_model,
    random_config,
    random_state,
    random_tokenizer,
)
from taipan.ops.tokenizer import TokenizerError

__all__ = [
    "RANDOM_PREFIX",
    "RANDOM_SEED",
    "RANDOM_SHAPES",
    "RANDOM_STD",
    "ModelLoadError",
    "load_model",
    "load_random_model",
    "random_config",
    "random_state",
    "random_tokenizer",
]


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expert_range: tuple[int, int] | ExpertRange | None = None,
    tp: TPGroup = SINGLE,
    mtp: bool = False,
) -> tuple:
    """Load a `.gguf` file or a Hugging Face directory, weights in `dtype` on `device`:
    (model, config, tokenizer); with `tp`, this rank's shards only (the config is the whole
    model's).

    A directory without config.json but with exactly one .gguf file loads that file;
    `random:<shape>` builds a random-weight model of that shape (`load_random_model`).
    `expert_range` (start, count): only those experts of every MoE layer (default: all); a
    model without experts refuses one. `mtp`: with the checkpoint's multi-token-prediction
    head (a Qwen3-Next-style Hugging Face directory only; ops/hf_dir.py).
    """
    if str(path).startswith(RANDOM_PREFIX):
        if mtp:
            raise ModelLoadError(f"{path}: an MTP head loads from a Hugging Face directory only")
        no_experts(path, expert_range)
        return load_random_model(str(path), dtype=dtype, device=device, tp=tp)
    path = _model_file(Path(path))
    if mtp and not path.is_dir():
        raise ModelLoadError(f"{path}: an MTP head loads from a Hugging Face directory only")
    try:
        if path.is_dir():
            return load_hf_dir(path, dtype, device, expert_range, tp, mtp)
        no_experts(path, expert_range)
        return load_gguf(path, dtype, device, tp)
    except TokenizerError as exc:  # its message already names the file
        raise ModelLoadError(str(exc)) from exc


def _model_file(path: Path) -> Path:
    """The directory or file to load: a directory without config.json stands for the one .gguf
    file it holds."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path}: not a Hugging Face model directory (no config.json) and holds "
                f"{len(ggufs)} .gguf files; pass the model file itself"
            )
        return ggufs[0]
    return path
