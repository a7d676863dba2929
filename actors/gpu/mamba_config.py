"""A model's Mamba settings at load: LoadModel's mamba_inference_state_config checked against a
hybrid model (recurrent layers: NemotronH's Mamba2, Qwen3-Next's Gated-DeltaNet; its config has
`mamba_state_for`) and applied to its config, and refused, like every Mamba setting, by a model
without recurrent layers (ConfigError naming the key).

Must not touch: tensors or the worker's state. It allocates nothing: the worker allocates the
slots, actors/gpu/sizing.py counts them.
"""

from __future__ import annotations

import dataclasses
import json

from taipan.actors.config import ConfigError
from taipan.messages.gpu import LoadModel
from taipan.ops.parallel import SINGLE, TPGroup


def has_recurrent_layers(config) -> bool:
    """Whether the model keeps per-request recurrent state in slots (Mamba2 or GDN layers): its
    config says how much a slot holds on a rank (`mamba_state_for(tp)`, a MambaStateShape)."""
    return callable(getattr(config, "mamba_state_for", None))


def mamba_config_for(config, msg: LoadModel, dtype, tp: TPGroup = SINGLE):
    """The config to run: a hybrid's with mamba_state_config applied; a model without Mamba
    layers as it is, after refusing LoadModel's Mamba settings."""
    if has_recurrent_layers(config):
        return mamba_state_config(config, msg, dtype, tp)
    if msg.mamba_memory_ratio is not None or msg.mamba_snapshot_gb is not None:
        raise ConfigError(
            "mamba_memory_ratio and prefix_caching_mamba_gb are for hybrid models; "
            f"{msg.model} has no Mamba layers"
        )
    if msg.mamba_state_config:
        raise ConfigError(
            f"mamba_inference_state_config is for hybrid models; {msg.model} has no Mamba layers"
        )
    return config


def mamba_state_config(config, msg: LoadModel, dtype, tp: TPGroup = SINGLE):
    """The model's config with `mamba_inference_state_config` applied (LoadModel's JSON): the
    SSM state dtype may be chosen; the conv state stays in the model's dtype (the conv kernels
    read and write it in place); layer_type_list, the shapes (per layer and slot: conv [K-1,
    conv_dim] or Megatron's [conv_dim, K-1], SSM [heads, head_dim, state]; a tensor-parallel
    rank's own, as Megatron's) and mamba_chunk_size must be the model's own. Anything else is a
    ConfigError naming the key."""
    if not msg.mamba_state_config:
        return config
    state = json.loads(msg.mamba_state_config)
    _check_layout(state, config, tp)
    name = str(dtype).removeprefix("torch.")
    conv_dtype = str(state.get("conv_states_dtype") or name).removeprefix("torch.")
    if conv_dtype != name:
        raise ConfigError(
            f"mamba_inference_state_config.conv_states_dtype {conv_dtype} differs from the model "
            f"dtype {name}: taipan keeps the conv state in the model dtype"
        )
    ssm = state.get("ssm_states_dtype")
    if ssm is None:
        return config
    return dataclasses.replace(config, ssm_state_dtype=str(ssm).removeprefix("torch."))


def _check_layout(state: dict, config, tp: TPGroup) -> None:
    """The layer pattern, state shapes and chunk size `state` names must be the model's."""
    shape = config.mamba_state_for(tp)
    conv = [shape.conv_kernel - 1, shape.conv_dim]
    expected = {
        "layer_type_list": config.pattern,
        "conv_states_shape": (conv, conv[::-1]),
        "ssm_states_shape": ([shape.num_heads, shape.head_dim, shape.state_size],),
        "mamba_chunk_size": config.chunk_size,
    }
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            continue
        if key == "layer_type_list":
            got = "".join(got)
        ok = list(got) in want if isinstance(want, tuple) else got == want
        if not ok:
            model = want[0] if isinstance(want, tuple) else want
            raise ConfigError(
                f"mamba_inference_state_config.{key} {got!r} is not the model's ({model!r})"
            )
