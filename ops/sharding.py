"""Where each checkpoint tensor goes among a rank's parameters, and which slice of it the rank
reads.

A checkpoint names its tensors as Hugging Face does, without the leading `model.` / `backbone.`
(q/k/v_proj and gate/up_proj apart). Our models fuse q, k and v into `qkv_proj` and gate and up
into `gate_up_proj`, and under tensor parallelism (ops/parallel.py) hold only this rank's shard
of the projections and of the vocabulary. `placement` maps one checkpoint tensor onto that
layout; the loader (reading files, random weights) and weight updates (state dicts) both use
it, so every path shards the same way and a rank reads only its slices. Builds no tensors.

A NemotronH Mamba layer's in_proj ([z | x | B | C | dt] rows) and conv1d ([x | B | C]
channels) split segment by segment (ops/mamba.py), so on a rank of T > 1 one such checkpoint
tensor fills several row ranges: `placements` gives them all (the loader and weight updates ask
it); `placement` serves every tensor that lands in one piece.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from taipan.ops.models.nemotron_h import NemotronHConfig
from taipan.ops.parallel import SINGLE, TPGroup

# Our fused parameter -> the checkpoint parameters stacked into it, in row order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    # NemotronH attention layers (their mixer is the attention)
    "mixer.qkv_proj": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
}
_QKV = re.compile(r"^(layers\.\d+\.(?:self_attn|mixer))\.([qkv])_proj\.weight$")
_GATE_UP = re.compile(r"^(layers\.\d+\.mlp)\.(gate|up)_proj\.weight$")
_O_PROJ = re.compile(r"^layers\.\d+\.(?:self_attn|mixer)\.o_proj\.weight$")
_DOWN_PROJ = re.compile(r"^layers\.\d+\.mlp\.down_proj\.weight$")
_VOCAB = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")


@dataclass(frozen=True)
class Placement:
    """One checkpoint tensor on one rank: it fills `rows` of our parameter `param` with its
    slice [start, start + length) along `dim` (`dim` None: the whole tensor, replicated).
    `full` is the checkpoint's size along `dim`."""

    param: str
    rows: slice
    dim: int | None = None
    start: int = 0
    length: int = 0
    full: int = 0

    def take(self, tensor):
        """This rank's slice of the whole checkpoint tensor (a torch tensor, a numpy array or a
        safetensors slice: anything indexed by a tuple of slices)."""
        if self.dim is None:
            return tensor[:]
        return tensor[(slice(None),) * self.dim + (slice(self.start, self.start + self.length),)]

    def checkpoint_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape, given our (this rank's) parameter's shape."""
        if not param_shape:
            return ()
        shape = [len(range(*self.rows.indices(param_shape[0]))), *param_shape[1:]]
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)


def embedding_name(config) -> str:
    return "embeddings.weight" if isinstance(config, NemotronHConfig) else "embed_tokens.weight"


def placements(name: str, config, tp: TPGroup = SINGLE) -> tuple[Placement, ...]:
    """Every piece of this rank's parameters that checkpoint tensor `name` fills: one
    `placement`, or a Mamba in_proj's or conv1d's segments (T > 1)."""
    if isinstance(config, NemotronHConfig):
        pieces = _nemotron_h_placements(name, config, tp)
        if pieces is not None:
            return pieces
    return (placement(name, config, tp),)


def placement(name: str, config, tp: TPGroup = SINGLE) -> Placement:
    """Where checkpoint tensor `name` (no `model.` prefix) lands on rank `tp.rank` of a model
    of `config` (Llama or NemotronH: fields num_heads, num_kv_heads, head_dim,
    intermediate_size, vocab_size, tie_word_embeddings). A name that is none of the split or
    fused ones is replicated whole onto the parameter of that name (the caller reports a name
    the model lacks). A tensor that fills several pieces (`placements`) is a ValueError."""
    if isinstance(config, NemotronHConfig):
        pieces = _nemotron_h_placements(name, config, tp)
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
        param = f"{match.group(1)}.qkv_proj.weight"
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
    return Placement(name, slice(None))


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


def checkpoint_names(param: str) -> tuple[str, ...]:
    """The checkpoint tensors that fill our parameter `param` (itself unless it is fused)."""
    for target, parts in FUSED.items():
        suffix = f".{target}.weight"
        if param.endswith(suffix):
            layer = param.removesuffix(suffix)
            return tuple(f"{layer}.{part}.weight" for part in parts)
    return (param,)


def split_fused(param: str, tensor, config) -> list[tuple[str, object]]:
    """A whole (unsharded) fused parameter -> its checkpoint tensors as row views of it, in
    checkpoint names (itself, for a parameter that is not fused)."""
    return [(name, tensor[placement(name, config).rows]) for name in checkpoint_names(param)]
