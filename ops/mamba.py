"""The Mamba2 mixer of a hybrid model over a flat varlen batch, and the Mamba state it reads.

Owns `MambaMetadata` (one step's view of its sequences' Mamba state slots), the state layout
(`MambaStateShape`, `allocate_mamba_state`) and `Mamba2Mixer` (in_proj -> depthwise causal conv1d
+ SiLU -> SSD with A = -exp(A_log), D, dt_bias, softplus dt -> gated group RMSNorm -> out_proj).
Each stage has one dispatch point: on CUDA the Triton kernel of kernels/, elsewhere its torch
reference (the same contract). Decode rows (the step's leading one-token rows, `num_decodes`) take
the one-token update kernels; the other rows the varlen prefill kernels.

State: every Mamba layer keeps, per slot, a conv state `[K - 1, conv_dim]` (the last K - 1 conv
inputs, model dtype) and an SSM state `[H, P, N]` (fp32 by default). Slots are numbered over one
pool (live slots of running requests and prefix snapshots alike); which slot a sequence reads and
which it writes comes from the plan (`init_slots`, `out_slots`): a sequence that starts at
position 0 reads zeros (-1), a continuing one reads and writes its live slot, a restored one reads
a snapshot and writes its live slot (no copy before the forward). A prefill row may also store
its states at positions inside its chunk into snapshot slots (`snap_pos`, `snap_slots`: the
conv and scan kernels emit them), so chunks need not end where prefix snapshots are taken.
Never decides which slot.

Tensor parallel (`tp`, ops/parallel.py), Megatron style: a rank holds H/T consecutive heads and
the G/T groups they read (TPError naming mamba_num_heads or n_groups unless T divides both):
its rows of each in_proj segment (z and x by heads, B and C by groups, dt by heads), the
matching conv1d channels, A_log, D and dt_bias of its heads, the norm weight of its groups (the
gated norm is per group, so it needs no collective), and its columns of out_proj, whose partial
sums one all-reduce adds up. Its state slots hold only its shard (`MambaStateShape` of the
rank: conv_dim/T channels, H/T heads); the kernels never know.

dt clamp: [time_step_limit] of the config in both prefill and decode (mamba_ssm's meaning). Hugging
Face's NemotronH clamps prefill dt below at time_step_min and decode dt not at all; the two agree
with us whenever softplus(dt + dt_bias) >= time_step_min, which the tests' models ensure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from taipan.kernels import causal_conv1d, gated_rmsnorm, selective_state, ssd_scan
from taipan.ops.parallel import SINGLE, TPGroup

# Snapshot entries a sequence may have in one step (the varlen kernels' bound).
MAX_SNAPS = ssd_scan.MAX_SNAPS


@dataclass(frozen=True)
class MambaStateShape:
    """Per-slot state sizes of one model (all its recurrent layers) on one rank: under tensor
    parallelism conv_dim and num_heads are the rank's share. A Gated-DeltaNet layer
    (ops/gated_delta.py) keeps its state in the same layout: num_heads = value heads,
    head_dim = key head dim, state_size = value head dim."""

    num_layers: int  # recurrent layers (Mamba2 or GDN)
    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_size: int

    def bytes_per_slot(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = (self.conv_kernel - 1) * self.conv_dim * _itemsize(conv_dtype)
        ssm = self.num_heads * self.head_dim * self.state_size * _itemsize(ssm_dtype)
        return self.num_layers * (conv + ssm)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def allocate_mamba_state(
    shape: MambaStateShape,
    num_slots: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [L, S, K - 1, conv_dim], ssm [L, S, H, P, N]), zeroed: a slot is always written
    before it is read, but zeros keep a bug from reading NaN garbage into a live request."""
    conv = torch.zeros(
        (shape.num_layers, num_slots, shape.conv_kernel - 1, shape.conv_dim),
        dtype=conv_dtype,
        device=device,
    )
    ssm = torch.zeros(
        (shape.num_layers, num_slots, shape.num_heads, shape.head_dim, shape.state_size),
        dtype=ssm_dtype,
        device=device,
    )
    return conv, ssm


@dataclass
class MambaMetadata:
    """One step's Mamba view of its B sequences (laid out as in AttentionMetadata): the state
    tensors of every Mamba layer, and per sequence the slot it reads and the slot it writes."""

    conv_states: torch.Tensor  # [L, S, K - 1, conv_dim]
    ssm_states: torch.Tensor  # [L, S, H, P, N]
    init_slots: torch.Tensor  # [B] int32, -1 = zeros (a sequence that starts here)
    out_slots: torch.Tensor  # [B] int32, -1 = not stored (padding)
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int  # the leading one-token rows (host value, as AttentionMetadata's)
    # Snapshots inside prefill chunks (prefix caching), for the B - num_decodes prefill rows:
    # the state after the first snap_pos[i, k] tokens of row num_decodes + i goes to slot
    # snap_slots[i, k] (-1: no entry); None: no snapshot this step.
    snap_pos: torch.Tensor | None = None  # [B - num_decodes, E] int32/int64, E entries a row
    snap_slots: torch.Tensor | None = None  # [B - num_decodes, E] int32/int64

    def __post_init__(self) -> None:
        nd = self.num_decodes
        # The prefill rows' own query starts (they begin after the nd one-token decode rows).
        self.prefill_query_start = self.query_start_loc[nd:] - nd


class Mamba2Mixer(nn.Module):
    """`num_heads` and `n_groups` are the model's; the module holds this rank's share of them
    (`tp`), and its attributes (num_heads, n_groups, inner, conv_dim) are the rank's."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        conv_bias: bool = True,
        proj_bias: bool = False,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_num_heads ({num_heads}) must be a multiple of n_groups")
        _, num_heads = tp.even(num_heads, "mamba_num_heads")
        _, n_groups = tp.even(n_groups, "n_groups")  # the groups this rank's heads read
        self.tp = tp
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.chunk_size, self.eps = chunk_size, eps
        self.dt_min, self.dt_max = float(dt_limit[0]), float(dt_limit[1])
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        # in_proj rows: z (the gate), then x, B, C (the conv's input), then dt.
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + num_heads, proj_bias)
        # Hugging Face's Conv1d layout [conv_dim, 1, K] (weight updates keep its names).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, bias=conv_bias,
                                groups=self.conv_dim)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = _GatedNormWeight(self.inner)
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=proj_bias)

    def forward(self, x: torch.Tensor, meta: MambaMetadata, layer: int) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; reads and writes the layer's slots of `meta`."""
        num_tokens, nd = x.shape[0], meta.num_decodes
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        proj = self.in_proj(x)
        z = proj[:, : self.inner]
        xbc = proj[:, self.inner : self.inner + self.conv_dim]
        dt = proj[:, self.inner + self.conv_dim :]
        conv_states, ssm_states = meta.conv_states[layer], meta.ssm_states[layer]
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # [conv_dim, K]
        cuda = x.is_cuda
        init, dest = meta.init_slots, meta.out_slots
        snaps = {}
        if meta.snap_slots is not None:
            snaps = {"snap_pos": meta.snap_pos, "snap_slots": meta.snap_slots}

        conv_out = torch.empty((num_tokens, self.conv_dim), dtype=x.dtype, device=x.device)
        if nd:
            fn = _op(causal_conv1d, "causal_conv1d_update", cuda)
            conv_out[:nd] = fn(xbc[:nd], weight, bias, conv_states, init[:nd], dest[:nd])
        if num_tokens > nd:
            fn = _op(causal_conv1d, "causal_conv1d_varlen", cuda)
            conv_out[nd:] = fn(xbc[nd:], weight, bias, meta.prefill_query_start, conv_states,
                               init[nd:], dest[nd:], **snaps)  # fmt: skip

        xs = conv_out[:, : self.inner].view(num_tokens, H, P)
        B = conv_out[:, self.inner : self.inner + G * N].view(num_tokens, G, N)
        C = conv_out[:, self.inner + G * N :].view(num_tokens, G, N)
        A = -torch.exp(self.A_log.float())
        limits = {"dt_min": self.dt_min, "dt_max": self.dt_max}
        y = torch.empty((num_tokens, H, P), dtype=x.dtype, device=x.device)
        if nd:
            fn = _op(selective_state, "selective_state_update", cuda)
            y[:nd] = fn(xs[:nd], dt[:nd], A, B[:nd], C[:nd], self.D, self.dt_bias, ssm_states,
                        init[:nd], dest[:nd], **limits)  # fmt: skip
        if num_tokens > nd:
            fn = _op(ssd_scan, "ssd_scan_varlen", cuda)
            y[nd:] = fn(xs[nd:], dt[nd:], A, B[nd:], C[nd:], self.D, self.dt_bias,
                        meta.prefill_query_start, ssm_states, init[nd:], dest[nd:],
                        chunk_size=self.chunk_size, **limits, **snaps)  # fmt: skip

        norm = _op(gated_rmsnorm, "gated_rms_norm", cuda)
        gated = norm(y.view(num_tokens, self.inner), z, self.norm.weight, self.eps,
                     self.inner // G)  # fmt: skip
        out = self.tp.all_reduce(F.linear(gated, self.out_proj.weight))
        # The bias after the sum: added on every rank before it, it would count T times.
        return out if self.out_proj.bias is None else out + self.out_proj.bias


def _op(module, name: str, cuda: bool):
    """A kernel module's launcher on CUDA, its torch reference elsewhere."""
    return getattr(module, name if cuda else f"{name}_ref")


class _GatedNormWeight(nn.Module):
    """Holds the gated norm's weight under Hugging Face's name (`mixer.norm.weight`)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
