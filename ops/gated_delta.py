"""The Gated-DeltaNet mixer of a Qwen3-Next-style hybrid (its "linear attention" layers) over a
flat varlen batch, reading and writing its recurrent state through the same `MambaMetadata` and
state tensors as the Mamba2 mixer (ops/mamba.py): one cache serves every recurrent layer kind
(DESIGN.md §6).

`GatedDeltaNet`: in_proj_qkvz and in_proj_ba -> depthwise causal conv1d + SiLU over [q | k | v]
-> the gated delta rule (kernels/gated_delta.py: q and k L2-normalised inside, g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)) -> a per-head RMSNorm gated by silu(z) -> out_proj.
Each stage has one dispatch point: on CUDA the Triton kernel, elsewhere its torch reference.
Decode rows (the step's leading one-token rows, `num_decodes`) take the one-token update
kernels, the other rows the varlen prefill kernels (with the in-chunk snapshots of the plan).

State, per slot and GDN layer, in the Mamba tensors (`MambaStateShape` with num_heads = Hv,
head_dim = Dk, state_size = Dv): the conv state [K - 1, conv_dim] (conv_dim = 2 * key_dim +
value_dim, model dtype) and the recurrent state [Hv, Dk, Dv] (fp32 by default). Which slot a
sequence reads and writes comes from the plan (ops/mamba.py's contract); never decides it.

Weights keep Hugging Face's names and layouts (weight updates and transfers go in unchanged),
one of two input layouts (`split`). Qwen3-Next's: in_proj_qkvz's rows are grouped by key head,
[q_h | k_h | v_h | z_h] for key head h (its Hv / Hk value heads' v and z), in_proj_ba's likewise
[b_h | a_h]; the forward un-interleaves the projection's output (one copy of the conv input).
Qwen3.5's (`split=True`): in_proj_qkv (rows [q | k | v], each head-major: the conv input as
is), in_proj_z (head-major by value head), in_proj_b and in_proj_a (one row per value head).
conv1d's channels are [q | k | v], each head-major (the conv's own layout), norm.weight is [Dv]
(shared by the heads).

Tensor parallel (`tp`): a rank holds Hk/T consecutive key heads and the Hv/T value heads that
read them (TPError naming linear_num_key_heads unless T divides it): its contiguous rows of
in_proj_qkvz and in_proj_ba (whole key-head groups), its conv1d channels of q, k and v, its
heads' A_log and dt_bias (split: its q, k and v row segments of in_proj_qkv, its value heads'
rows of in_proj_z, in_proj_b and in_proj_a), and its columns of out_proj, whose partial sums
one all-reduce adds up. The gated norm is per head: no collective. Its state slots hold its
heads only.

The gated norm is a torch path (not kernels/gated_rmsnorm.py): Qwen3-Next gates after the norm,
norm(y) * w * silu(z), where NemotronH's kernel normalises the gated product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taipan.kernels import causal_conv1d, gated_delta
from taipan.ops.mamba import MambaMetadata, _GatedNormWeight, _op
from taipan.ops.parallel import SINGLE, TPGroup


class GatedDeltaNet(nn.Module):
    """`num_k_heads` and `num_v_heads` are the model's; the module holds this rank's share of
    them (`tp`), and its attributes (num_k_heads, num_v_heads, key_dim, value_dim, conv_dim)
    are the rank's. `split`: Qwen3.5's separate in_proj_qkv / _z / _b / _a (module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        tp: TPGroup = SINGLE,
        split: bool = False,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({num_k_heads})"
            )
        self.rep = num_v_heads // num_k_heads  # value heads per key head
        _, num_k_heads = tp.even(num_k_heads, "linear_num_key_heads")
        self.tp, self.eps, self.split = tp, eps, split
        self.num_k_heads, self.num_v_heads = num_k_heads, num_k_heads * self.rep
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # One key head's rows of in_proj_qkvz: q, k (Dk each), then its value heads' v and z.
        self.group = 2 * head_k_dim + 2 * self.rep * head_v_dim
        if split:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(hidden_size, num_k_heads * self.group, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, num_k_heads * 2 * self.rep, bias=False)
        # Hugging Face's Conv1d layout [conv_dim, 1, K], no bias.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, bias=False,
                                groups=self.conv_dim)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = _GatedNormWeight(head_v_dim)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: MambaMetadata, layer: int) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; reads and writes the layer's slots of `meta`."""
        T, Hk, Hv, rep = x.shape[0], self.num_k_heads, self.num_v_heads, self.rep
        mixed, z = self._conv_input(x)  # [T, conv_dim], [T, Hk, rep, Dv]
        if self.split:
            b, a = self.in_proj_b(x), self.in_proj_a(x)  # [T, Hv] each
        else:
            ba = self.in_proj_ba(x).view(T, Hk, 2, rep)
            b, a = ba[:, :, 0].reshape(T, Hv), ba[:, :, 1].reshape(T, Hv)
        conv_out = self._conv(mixed, meta, layer)
        q = conv_out[:, : self.key_dim].view(T, Hk, self.head_k_dim)
        k = conv_out[:, self.key_dim : 2 * self.key_dim].view(T, Hk, self.head_k_dim)
        v = conv_out[:, 2 * self.key_dim :].view(T, Hv, self.head_v_dim)
        beta = b.sigmoid()  # (in the model dtype, as Hugging Face)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias)  # [T, Hv] fp32
        y = self._delta_rule(q, k, v, g, beta, meta, layer)  # [T, Hv, Dv]
        gated = self._gated_norm(y.view(T, Hk, rep, self.head_v_dim), z)
        return self.tp.all_reduce(self.out_proj(gated.view(T, self.value_dim)))

    def _conv(self, mixed: torch.Tensor, meta: MambaMetadata, layer: int) -> torch.Tensor:
        """silu(causal conv1d) of [q | k | v] over the layer's conv state slots (decode rows by
        the update kernel, the rest by the varlen one, with the plan's in-chunk snapshots)."""
        nd, weight = meta.num_decodes, self.conv1d.weight.squeeze(1)  # [conv_dim, K]
        states, init, dest = meta.conv_states[layer], meta.init_slots, meta.out_slots
        out = torch.empty_like(mixed)
        if nd:
            fn = _op(causal_conv1d, "causal_conv1d_update", mixed.is_cuda)
            out[:nd] = fn(mixed[:nd], weight, None, states, init[:nd], dest[:nd])
        if mixed.shape[0] > nd:
            fn = _op(causal_conv1d, "causal_conv1d_varlen", mixed.is_cuda)
            out[nd:] = fn(mixed[nd:], weight, None, meta.prefill_query_start, states, init[nd:],
                          dest[nd:], **_snapshots(meta))  # fmt: skip
        return out

    def _delta_rule(self, q, k, v, g, beta, meta: MambaMetadata, layer: int) -> torch.Tensor:
        """The gated delta rule over the layer's recurrent state slots -> o [T, Hv, Dv]."""
        nd, states = meta.num_decodes, meta.ssm_states[layer]
        init, dest = meta.init_slots, meta.out_slots
        y = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if nd:
            fn = _op(gated_delta, "gated_delta_update", v.is_cuda)
            fn(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states, init[:nd], dest[:nd],
               out=y[:nd])  # fmt: skip
        if v.shape[0] > nd:
            fn = _op(gated_delta, "gated_delta_varlen", v.is_cuda)
            fn(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], meta.prefill_query_start, states,
               init[nd:], dest[nd:], out=y[nd:], **_snapshots(meta))  # fmt: skip
        return y

    def _conv_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv input [T, conv_dim] (q, k, v, each head-major) and z [T, Hk, rep, Dv]:
        split, the projections as they are; else in_proj_qkvz(x) un-interleaved (the conv input
        a new tensor, z a view)."""
        num_tokens, Hk, Dk = x.shape[0], self.num_k_heads, self.head_k_dim
        if self.split:
            z = self.in_proj_z(x).view(num_tokens, Hk, self.rep, self.head_v_dim)
            return self.in_proj_qkv(x), z
        vz = self.rep * self.head_v_dim  # one key head's v (or z) rows
        proj = self.in_proj_qkvz(x).view(num_tokens, Hk, self.group)
        mixed = torch.empty((num_tokens, self.conv_dim), dtype=x.dtype, device=x.device)
        mixed[:, : self.key_dim].view(num_tokens, Hk, Dk).copy_(proj[..., :Dk])
        mixed[:, self.key_dim : 2 * self.key_dim].view(num_tokens, Hk, Dk).copy_(
            proj[..., Dk : 2 * Dk]
        )
        mixed[:, 2 * self.key_dim :].view(num_tokens, Hk, vz).copy_(proj[..., 2 * Dk : 2 * Dk + vz])
        z = proj[..., 2 * Dk + vz :].unflatten(-1, (self.rep, self.head_v_dim))
        return mixed, z

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Hugging Face's Qwen3NextRMSNormGated per value head: RMSNorm(y) in fp32, rounded to
        y's dtype, times the weight, times silu(z) in fp32, rounded once more."""
        y32 = y.float()
        normed = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + self.eps)).to(y.dtype)
        return ((self.norm.weight * normed) * F.silu(z.float())).to(y.dtype)


def _snapshots(meta: MambaMetadata) -> dict:
    """The plan's in-chunk snapshot arguments of the varlen kernels (none: no entries)."""
    if meta.snap_slots is None:
        return {}
    return {"snap_pos": meta.snap_pos, "snap_slots": meta.snap_slots}
