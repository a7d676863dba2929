"""Where each checkpoint tensor goes among a rank's parameters, and which slice of it the rank
reads.

A checkpoint names its tensors as Hugging Face does, without the leading `model.` / `backbone.`
or a multimodal checkpoint's `model.language_model.` (`checkpoint_name`), q/k/v_proj and
gate/up_proj apart. Our models fuse q, k and v into `qkv_proj` (weights, and
Qwen2's biases alike: column-parallel rows) and gate and up into `gate_up_proj`, stack a MoE
layer's experts into `w1` [E, N, H] (N: gate rows then up rows, or ReLU²'s up rows) and `w2`
[E, H, I], and under tensor parallelism (ops/parallel.py) hold only this rank's shard of the
projections, of every expert's intermediate size (w1 rows, w2 columns; the shared expert's
likewise) and of the vocabulary. Routers, layer norms, Qwen3's per-head q/k norms ([head_dim])
and NemotronH's latent projections are replicated. `placement` maps one checkpoint tensor onto
that layout; the loader (reading files, random weights) and weight updates (state dicts) both
use it, so every path shards the same way and a rank reads only its slices. Builds no tensors
(`take` only joins the two slices it reads of a stacked gate_up tensor).

A NemotronH Mamba layer's in_proj ([z | x | B | C | dt] rows) and conv1d ([x | B | C]
channels) split segment by segment (ops/mamba.py), so on a rank of T > 1 one such checkpoint
tensor fills several row ranges: `placements` gives them all (the loader and weight updates ask
it); `placement` serves every tensor that lands in one piece.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import torch

from taipan.ops.models.nemotron_h import NemotronHConfig
from taipan.ops.models.qwen3_next import Qwen3NextConfig
from taipan.ops.parallel import SINGLE, TPGroup

# Our fused parameter -> the checkpoint parameters stacked into it, in row order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    # NemotronH attention layers (their mixer is the attention)
    "mixer.qkv_proj": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
    # Qwen3-Next's shared expert
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}
_QKV = re.compile(r"^(layers\.\d+\.(?:self_attn|mixer))\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(layers\.\d+\.mlp)\.(gate|up)_proj\.weight$")
_O_PROJ = re.compile(r"^layers\.\d+\.(?:self_attn|mixer)\.o_proj\.weight$")
_DOWN_PROJ = re.compile(r"^layers\.\d+\.mlp\.down_proj\.weight$")
_VOCAB = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")
# A MoE layer's experts (Qwen3-MoE's `mlp`, NemotronH's `mixer`): one tensor per expert and
# matrix, as save_pretrained writes them, or one stacked [E, ...] tensor per matrix (what
# transformers' modules hold; the loader's `w1` / `w2` pieces have the same layout).
_MOE_BLOCK = r"^(layers\.\d+\.(?:mlp|mixer))"
EXPERT_NAME = re.compile(_MOE_BLOCK + r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
STACKED_EXPERTS_NAME = re.compile(_MOE_BLOCK + r"\.experts\.(gate_up|up|down)_proj$")
_OUR_EXPERTS = re.compile(_MOE_BLOCK + r"\.(w1|w2)$")
_SHARED_EXPERT = re.compile(_MOE_BLOCK + r"\.shared_experts\.(up|down)_proj\.weight$")

# The prefixes `checkpoint_name` drops, longest first: a multimodal checkpoint's text model
# (transformers' `model.language_model.`; Gemma 3's first releases, transformers' "llava"
# layout: `language_model.model.`, and `language_model.lm_head`), then a text model's.
_MODEL_PREFIXES = (
    "model.language_model.",
    "language_model.model.",
    "language_model.",
    "model.",
    "backbone.",
)
# A multimodal checkpoint's vision tower and projector (Qwen3.5's `model.visual`, Gemma 3's
# `model.vision_tower` and `model.multi_modal_projector`, or the same without `model.`).
_VISION_PREFIXES = tuple(
    f"{outer}{part}."
    for outer in ("model.", "")
    for part in ("visual", "vision_tower", "multi_modal_projector")
)


def checkpoint_name(hf_name: str) -> str:
    """A Hugging Face tensor name -> the name `placement` reads: without `model.` /
    `backbone.`, or a multimodal checkpoint's text-model prefix (`model.language_model.`)."""
    for prefix in _MODEL_PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return hf_name


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def mtp_name(ours: str, config) -> str | None:
    """A multi-token-prediction tensor's name (`ours`: after `checkpoint_name`) in the model
    of `config`: `mtp.layers.i.*` is layer num_layers + i (ops/models/qwen3_next.py), `mtp.fc`
    and the head's norms keep their names; None when the model has no MTP head (loaded without
    one: the tensor is skipped, as Hugging Face skips it). Any other name is returned as is."""
    if not ours.startswith("mtp."):
        return ours
    if not getattr(config, "num_mtp_layers", 0):
        return None
    layer = _MTP_LAYER.match(ours)
    return (
        ours
        if layer is None
        else f"layers.{config.num_layers + int(layer.group(1))}.{layer.group(2)}"
    )


def mtp_layer_index(ours: str) -> int | None:
    """i of a `mtp.layers.i.*` name, else None."""
    layer = _MTP_LAYER.match(ours)
    return None if layer is None else int(layer.group(1))


def is_vision_tensor(hf_name: str) -> bool:
    """Whether a Hugging Face tensor belongs to a multimodal checkpoint's vision tower or
    projector (we serve its text model only)."""
    return hf_name.startswith(_VISION_PREFIXES)


@dataclass(frozen=True)
class Placement:
    """One checkpoint tensor on one rank: it fills `rows` of our parameter `param` with its
    slice [start, start + length) along `dim` (`dim` None: the whole tensor, replicated).
    `full` is the checkpoint's size along `dim`. `rows` indexes our parameter: a slice of its
    first dim, or (GLOBAL expert id, slice) for one expert's matrix in a stacked w1 / w2 (a
    caller holding a range of experts maps the id onto it).

    `blocks` > 1: `dim` stacks that many equal parts (a stacked gate_up_proj: gate, then up),
    each sliced alike; the rank reads their slices concatenated. `experts`: a slice of dim 0
    read too (the experts an expert-parallel rank holds of a stacked [E, ...] tensor; None:
    all); `placement` never sets it, the loader does for its lazy reads."""

    param: str
    rows: slice | tuple[int, slice]
    dim: int | None = None
    start: int = 0
    length: int = 0
    full: int = 0
    blocks: int = 1
    experts: slice | None = None

    def take(self, tensor):
        """This rank's slice of the whole checkpoint tensor (a torch tensor, a numpy array or a
        safetensors slice: anything indexed by a tuple of slices)."""
        if self.dim is None and self.experts is None:
            return tensor[:]
        lead = [slice(None)] * (1 if self.dim is None else self.dim + 1)
        if self.experts is not None:
            if self.dim == 0:
                raise ValueError(f"{self.param}: experts and the split both on dim 0")
            lead[0] = self.experts
        if self.dim is None:
            return tensor[tuple(lead)]
        block = self.full // self.blocks
        if self.blocks > 1 and self.length == block:  # every part whole: one read, no copy
            return tensor[tuple(lead)]
        parts = []
        for b in range(self.blocks):
            lead[self.dim] = slice(b * block + self.start, b * block + self.start + self.length)
            parts.append(tensor[tuple(lead)])
        return parts[0] if len(parts) == 1 else _concatenate(parts, self.dim)

    def checkpoint_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape, given our (this rank's) parameter's shape (the
        experts dim as `rows` gives it)."""
        if not param_shape:
            return ()
        shape = _indexed_shape(param_shape, self.rows)
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)


def _indexed_shape(shape: tuple[int, ...], index) -> list[int]:
    """The shape of `tensor[index]` for a tensor of `shape` (index: slices and ints)."""
    index = index if isinstance(index, tuple) else (index,)
    out = []
    for i, n in enumerate(shape):
        ix = index[i] if i < len(index) else slice(None)
        if not isinstance(ix, int):
            out.append(len(range(*ix.indices(n))))
    return out


def _concatenate(parts: list, dim: int):
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=dim)
    return torch.cat(parts, dim=dim)


def embedding_name(config) -> str:
    return "embeddings.weight" if isinstance(config, NemotronHConfig) else "embed_tokens.weight"


def placements(name: str, config, tp: TPGroup = SINGLE) -> tuple[Placement, ...]:
    """Every piece of this rank's parameters that checkpoint tensor `name` fills: one
    `placement`, or a Mamba or GDN conv1d's segments and a Mamba in_proj's (T > 1)."""
    pieces = _family_placements(name, config, tp)
    return (placement(name, config, tp),) if pieces is None else pieces


def _family_placements(name: str, config, tp: TPGroup) -> tuple[Placement, ...] | None:
    """The pieces of a hybrid family's own tensors (None: the shared rules place it)."""
    if isinstance(config, NemotronHConfig):
        return _nemotron_h_placements(name, config, tp)
    if isinstance(config, Qwen3NextConfig):
        return _qwen3_next_placements(name, config, tp)
    return None


def placement(name: str, config, tp: TPGroup = SINGLE) -> Placement:
    """Where checkpoint tensor `name` (no `model.` prefix) lands on rank `tp.rank` of a model
    of `config` (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, NemotronH or Qwen3-Next: fields
    num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings, and
    `moe` for experts). A name that is none of the split or fused ones is replicated whole onto the
    parameter of that name (the caller reports a name the model lacks). A tensor that fills
    several pieces (`placements`) is a ValueError."""
    pieces = _family_placements(name, config, tp)
    if pieces is not None:
        if len(pieces) > 1:
            raise ValueError(f"{name} fills {len(pieces)} pieces on this rank: see placements")
        return pieces[0]
    if name in _VOCAB:
        param = name
        if name == "lm_head.weight" and config.tie_word_embeddings:
            param = embedding_name(config)
        shard = tp.vocab(config.vocab_size)
        return Placement(
            param, slice(0, shard.count), 0, shard.start, shard.count, config.vocab_size
        )
    d = config.head_dim
    if match := _QKV.match(name):
        heads = tp.heads(config.num_heads, config.num_kv_heads)
        q, kv = heads.q_count * d, heads.kv_count * d
        param = f"{match.group(1)}.qkv_proj.{match.group(3)}"  # (a bias: the same rows)
        if match.group(2) == "q":
            return Placement(param, slice(0, q), 0, heads.q_start * d, q, config.num_heads * d)
        rows = slice(q, q + kv) if match.group(2) == "k" else slice(q + kv, q + 2 * kv)
        return Placement(param, rows, 0, heads.kv_start * d, kv, config.num_kv_heads * d)
    inter = config.intermediate_size
    if match := _GATE_UP.match(name):
        start, count = tp.even(inter, "intermediate_size")
        rows = slice(0, count) if match.group(2) == "gate" else slice(count, 2 * count)
        return Placement(f"{match.group(1)}.gate_up_proj.weight", rows, 0, start, count, inter)
    if _O_PROJ.match(name):
        heads = tp.heads(config.num_heads, config.num_kv_heads)
        q = heads.q_count * d
        return Placement(name, slice(None), 1, heads.q_start * d, q, config.num_heads * d)
    if _DOWN_PROJ.match(name):
        start, count = tp.even(inter, "intermediate_size")
        return Placement(name, slice(None), 1, start, count, inter)
    moe = getattr(config, "moe", None)
    found = None if moe is None else _expert_placement(name, moe, tp)
    return Placement(name, slice(None)) if found is None else found


def _expert_placement(name: str, moe, tp: TPGroup) -> Placement | None:
    """A MoE tensor's placement: each expert's intermediate size split over the ranks (w1 rows,
    w2 columns; the shared expert's the same way); None for a name that is not one."""
    swiglu = moe.activation == "swiglu"
    inter = moe.intermediate_size
    if match := _SHARED_EXPERT.match(name):
        if swiglu:  # (no SwiGLU model of ours has a shared expert: its names would be fused)
            return None
        shared = moe.shared_intermediate_size
        start, count = tp.even(shared, "moe_shared_expert_intermediate_size")
        dim = 0 if match.group(2) == "up" else 1
        return Placement(name, slice(None), dim, start, count, shared)
    if match := EXPERT_NAME.match(name):
        start, count = tp.even(inter, "moe_intermediate_size")
        prefix, expert, matrix = match.group(1), int(match.group(2)), match.group(3)
        if matrix == "down":
            return Placement(f"{prefix}.w2", (expert, slice(None)), 1, start, count, inter)
        if matrix == "gate" and not swiglu:
            return None  # not a ReLU² expert's: the caller reports it
        rows = slice(count, 2 * count) if swiglu and matrix == "up" else slice(0, count)
        return Placement(f"{prefix}.w1", (expert, rows), 0, start, count, inter)
    match = STACKED_EXPERTS_NAME.match(name) or _OUR_EXPERTS.match(name)
    if match is None:
        return None
    start, count = tp.even(inter, "moe_intermediate_size")
    prefix, matrix = match.group(1), match.group(2)
    if matrix in ("down", "w2"):
        return Placement(f"{prefix}.w2", slice(None), 2, start, count, inter)
    if matrix != "w1" and matrix != ("gate_up" if swiglu else "up"):
        return None  # a stacked matrix these experts lack: the caller reports it
    blocks = 2 if swiglu else 1  # gate rows, then up rows: each split alike
    return Placement(f"{prefix}.w1", slice(None), 1, start, count, blocks * inter, blocks)


# ---- NemotronH mixers (attention's q/k/v/o names are `placement`'s, shared with Llama) -------

_MIXER = re.compile(r"^layers\.(\d+)\.mixer\.(.+)$")
_MAMBA_HEADS = ("A_log", "D", "dt_bias")


def _nemotron_h_placements(name: str, config, tp: TPGroup) -> tuple[Placement, ...] | None:
    """The pieces of a Mamba (`M`) or MLP (`-`) layer's mixer tensor; None for any other name.
    A Mamba in_proj / conv1d splits by segment (z, x by heads; B, C by groups; dt by heads)."""
    match = _MIXER.match(name)
    if match is None or int(match.group(1)) >= len(config.pattern):
        return None
    kind, part = config.pattern[int(match.group(1))], match.group(2)
    if kind == "-" and part in ("up_proj.weight", "down_proj.weight"):
        inter = config.intermediate_size
        start, count = tp.even(inter, "intermediate_size")
        dim = 0 if part == "up_proj.weight" else 1  # column-parallel up, row-parallel down
        return (Placement(name, slice(None), dim, start, count, inter),)
    if kind != "M":
        return None
    P, N = config.mamba_head_dim, config.ssm_state_size
    H, G = config.mamba_num_heads, config.n_groups
    h0, h = tp.even(H, "mamba_num_heads")
    g0, g = tp.even(G, "n_groups")
    x, bc, dt = (h0 * P, h * P, H * P), (g0 * N, g * N, G * N), (h0, h, H)  # (start, count, full)
    segments = {
        "in_proj.weight": (x, x, bc, bc, dt),
        "in_proj.bias": (x, x, bc, bc, dt),
        "conv1d.weight": (x, bc, bc),
        "conv1d.bias": (x, bc, bc),
        "norm.weight": (x,),  # the rank's groups: whole groups of its heads' channels
        **dict.fromkeys(_MAMBA_HEADS, (dt,)),
    }.get(part)
    if part == "out_proj.weight":  # row-parallel: the columns of the rank's x channels
        return (Placement(name, slice(None), 1, *x),)
    if segments is None:
        return None  # out_proj.bias among them: whole (added once, after the all-reduce)
    if tp.size == 1:
        return (Placement(name, slice(None)),)
    total = sum(full for _, _, full in segments)
    pieces, ours, theirs = [], 0, 0
    for start, count, full in segments:
        rows = slice(ours, ours + count)
        pieces.append(Placement(name, rows, 0, theirs + start, count, total))
        ours, theirs = ours + count, theirs + full
    return tuple(pieces)


# ---- Qwen3-Next (ops/models/qwen3_next.py, ops/gated_delta.py) ---------------------------------

_QWEN3_NEXT = re.compile(r"^layers\.(\d+)\.(self_attn|linear_attn|mlp)\.(.+)$")


def _qwen3_next_placements(name: str, config, tp: TPGroup) -> tuple[Placement, ...] | None:
    """An attention layer's q/k/v_proj (q_proj's rows are [q_h | gate_h] per head: a rank's
    heads take twice the rows), a GDN layer's tensors (split by key heads; conv1d by segment)
    and the shared expert's; None for every other name (the shared rules place it)."""
    match = _QWEN3_NEXT.match(name)
    if match is None:
        return None
    block, part = match.group(2), match.group(3)
    prefix = name.removesuffix(part)
    if block == "self_attn" and part in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        heads, d = tp.heads(config.num_heads, config.num_kv_heads), config.head_dim
        q, kv = 2 * heads.q_count * d, heads.kv_count * d
        param = prefix + "qkv_proj.weight"
        if part[0] == "q":
            return (Placement(param, slice(0, q), 0, 2 * heads.q_start * d, q,
                              2 * config.num_heads * d),)  # fmt: skip
        rows = slice(q, q + kv) if part[0] == "k" else slice(q + kv, q + 2 * kv)
        return (Placement(param, rows, 0, heads.kv_start * d, kv, config.num_kv_heads * d),)
    if block == "mlp" and part.startswith("shared_expert."):
        inter = config.shared_expert_intermediate_size
        start, count = tp.even(inter, "shared_expert_intermediate_size")
        if part == "shared_expert.down_proj.weight":
            return (Placement(name, slice(None), 1, start, count, inter),)
        if part in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"):
            rows = slice(0, count) if "gate" in part else slice(count, 2 * count)
            param = prefix + "shared_expert.gate_up_proj.weight"
            return (Placement(param, rows, 0, start, count, inter),)
        return None
    if block == "linear_attn":
        return _gdn_placements(name, part, config, tp)
    return None


def _gdn_placements(name: str, part: str, config, tp: TPGroup) -> tuple[Placement, ...] | None:
    """A GDN mixer's tensor on this rank: whole key-head groups of in_proj_qkvz / in_proj_ba
    rows (Qwen3.5: its value heads' rows of in_proj_z / _b / _a), its value heads' A_log,
    dt_bias and out_proj columns, its q, k and v conv channels (and in_proj_qkv rows)."""
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv, rep = config.linear_key_head_dim, config.linear_value_head_dim, Hv // Hk
    k0, k = tp.even(Hk, "linear_num_key_heads")
    per_head = {  # rows per key head (its value heads' rows where they are per value head)
        "in_proj_qkvz.weight": 2 * Dk + 2 * rep * Dv,
        "in_proj_ba.weight": 2 * rep,
        "in_proj_z.weight": rep * Dv,  # Qwen3.5's split projections
        "in_proj_b.weight": rep,
        "in_proj_a.weight": rep,
        "A_log": rep,
        "dt_bias": rep,
    }
    if part in per_head:
        n = per_head[part]
        return (Placement(name, slice(None), 0, k0 * n, k * n, Hk * n),)
    if part == "out_proj.weight":  # row-parallel: the columns of the rank's value heads
        n = rep * Dv
        return (Placement(name, slice(None), 1, k0 * n, k * n, Hk * n),)
    if part not in ("conv1d.weight", "in_proj_qkv.weight"):
        return None  # norm.weight: [Dv], replicated
    if tp.size == 1:
        return (Placement(name, slice(None)),)
    # conv1d's channels and in_proj_qkv's rows alike: [q | k | v], each head-major
    segments = ((k0 * Dk, k * Dk, Hk * Dk),) * 2 + ((k0 * rep * Dv, k * rep * Dv, Hv * Dv),)
    total = sum(full for _, _, full in segments)
    pieces, ours, theirs = [], 0, 0
    for start, count, full in segments:
        pieces.append(Placement(name, slice(ours, ours + count), 0, theirs + start, count, total))
        ours, theirs = ours + count, theirs + full
    return tuple(pieces)


def checkpoint_names(param: str) -> tuple[str, ...]:
    """The checkpoint tensors that fill our parameter `param` (itself unless it is fused; a
    fused bias, Qwen2's qkv_proj.bias, from the parts' biases)."""
    for target, parts in FUSED.items():
        for kind in ("weight", "bias"):
            suffix = f".{target}.{kind}"
            if param.endswith(suffix):
                layer = param.removesuffix(suffix)
                return tuple(f"{layer}.{part}.{kind}" for part in parts)
    return (param,)


def split_fused(param: str, tensor, config) -> list[tuple[str, object]]:
    """A whole (unsharded) fused parameter -> its checkpoint tensors as row views of it, in
    checkpoint names (itself, for a parameter that is not fused)."""
    return [(name, tensor[placement(name, config).rows]) for name in checkpoint_names(param)]


def with_experts(p: Placement, start: int, count: int) -> Placement:
    """`p` reading only experts [start, start + count) of a stacked [E, ...] tensor."""
    return dataclasses.replace(p, experts=slice(start, start + count))
