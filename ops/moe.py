"""Mixture-of-experts blocks over a flat batch of tokens: the routers (Qwen3-MoE's softmax top-k,
NemotronH's sigmoid grouped top-k) as plain torch functions, and `MoE`, the sparse MLP a model
puts where a dense MLP would go. Numerics follow Hugging Face transformers 5.23 (the oracle).

Expert parallelism. Every rank of an expert-parallel group holds the router (all experts' rows),
the shared experts and the latent projections, and only its local experts
`[expert_start, expert_start + num_local_experts)` (`ExpertRange`; the loader reads no other
expert's tensors). Its routed output is then a partial sum (kernels/moe.py): the choices of
experts it does not hold contribute nothing. Two hooks the runtime fills turn the partial into
the whole: `MoE.dispatch` runs the experts (by default on this rank's tokens alone; with
data-parallel attention, ops/expert_parallel.py's exchange brings every rank's tokens to every
rank's experts and their sums back), and `MoE.combine` (the identity at size 1; with several
ranks seeing the same tokens, an all-reduce (sum) over the group). The shared experts are added
after both, on every rank: each rank computes them (replicated), but they enter the sum exactly
once because they never take part in it.

Tensor parallelism (`tp`, ops/parallel.py). Every rank of a tensor-parallel group holds every
expert, but only its share of each one's intermediate size: w1's gate and up rows and w2's
columns of those intermediate channels (column- then row-parallel, as a dense MLP), and the
shared expert split the same way; the router (replicated, on the same hidden states, so every
rank picks the same experts) and the latent projections stay whole on every rank (replicated:
the simplest correct choice; fc2_latent_proj is linear without bias, so it maps a partial sum to
a partial sum). Each rank's output is then a partial sum over its intermediate channels, of the
routed experts and the shared one together, and ONE all-reduce per layer adds them up. With
expert parallelism too, a rank holds its share of the experts, each split the same way, and its
dispatch (the exchange among the processes holding the same slice) returns a partial sum of
that slice: the same one all-reduce completes it (ops/expert_parallel.py `init_tp_ep`).

Routed experts (an RL trainer replays them): with `record_routing` each block also writes its
router's top-k ids, before any exchange, into its column of a buffer the caller owns, in place
(a CUDA graph captured meanwhile does so at every replay).

Owns no scheduling and no communication of its own: `dispatch` and `combine` are hooks, and
the tensor-parallel all-reduce is `TPGroup`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from taipan.kernels.moe import ACTIVATIONS, fused_moe, fused_moe_ref
from taipan.ops.parallel import SINGLE, TPGroup

SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block's hyper-parameters (every MoE layer of a model shares them)."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of each routed expert
    activation: str  # "swiglu" (Qwen3-MoE) or "relu2" (NemotronH): kernels/moe.py
    scoring: str  # "softmax" (Qwen3-MoE) or "sigmoid" (NemotronH)
    renormalize: bool  # norm_topk_prob: the k weights of a token sum to 1
    num_groups: int = 1  # n_group (sigmoid scoring only)
    topk_groups: int = 1  # topk_group: the groups a token may choose its experts from
    scaling_factor: float = 1.0  # routed_scaling_factor, after renormalization
    latent_size: int | None = None  # moe_latent_size: experts work in this smaller space
    shared_intermediate_size: int = 0  # one shared expert of this size (0: none)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.scoring not in SCORING:
            raise ValueError(f"MoE scoring {self.scoring!r} is not one of {SCORING}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})"
            )
        groups, chosen = self.num_groups, self.topk_groups
        if groups < 1 or self.num_experts % groups or not 1 <= chosen <= groups:
            raise ValueError(
                f"n_group ({groups}) must divide num_experts ({self.num_experts}) and "
                f"topk_group ({chosen}) must be in 1..n_group"
            )
        if chosen < groups:
            if self.scoring != "sigmoid":
                raise ValueError("expert groups (topk_group < n_group) need sigmoid scoring")
            if self.num_experts // groups < 2:
                raise ValueError("grouped routing scores a group by its top 2: >= 2 experts each")
            if chosen * (self.num_experts // groups) < self.top_k:
                raise ValueError(
                    f"topk_group ({chosen}) groups of {self.num_experts // groups} experts "
                    f"cannot supply num_experts_per_tok ({self.top_k}) experts"
                )


@dataclass(frozen=True)
class ExpertRange:
    """The experts one rank holds: global ids `start .. start + count - 1`."""

    start: int
    count: int

    @classmethod
    def of(cls, value, num_experts: int) -> ExpertRange:
        """`(start, count)`, an ExpertRange, None (all experts), or a function of the model's
        expert count giving one of those (a rank's share, known once the config is read),
        checked against the model."""
        if callable(value):
            value = value(num_experts)
        if value is None:
            return cls(0, num_experts)
        start, count = (value.start, value.count) if isinstance(value, cls) else value
        if not (isinstance(start, int) and isinstance(count, int)):
            raise ValueError(f"expert_range must be two ints (start, count), got {value!r}")
        if start < 0 or count < 1 or start + count > num_experts:
            raise ValueError(
                f"expert_range (start {start}, count {count}) must lie in the model's "
                f"{num_experts} experts, with count >= 1"
            )
        return cls(start, count)

    @classmethod
    def of_model(cls, value, moe) -> ExpertRange | None:
        """`of` for a model whose MoE settings are `moe` (None: no MoE layers, where any range
        but None is a ValueError); None for such a model."""
        if moe is not None:
            return cls.of(value, moe.num_experts)
        if value is not None:
            raise ValueError(f"expert_range {value!r}: the model has no MoE layers")
        return None

    def __contains__(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.count


# ---- routers -------------------------------------------------------------------------------------


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing. logits: [T, E] -> (weights [T, k] in logits' dtype, ids [T, k]):
    softmax over all experts in fp32, the k largest, optionally rescaled to sum to 1."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NemotronH's (DeepSeek-V3-style) routing. logits: [T, E] -> (weights [T, k] fp32, ids).

    Scores are sigmoid(logits) in fp32. The bias only steers the choice: experts are picked by
    score + bias, within the `topk_groups` groups whose two best biased scores sum highest;
    their weights are the unbiased scores, renormalized, then scaled."""
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + correction_bias.float()
    if topk_groups < num_groups:
        grouped = choice.view(choice.shape[0], num_groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        groups = group_scores.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


class ExpertGate(nn.Module):
    """The gate: a linear map to every expert's logit (all E rows on every rank) and the
    routing rule. Parameter names are Hugging Face's (`gate.weight`, and for sigmoid scoring
    the buffer `gate.e_score_correction_bias`, kept in fp32 by the loader)."""

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        if config.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (topk_weights [T, k], topk_ids [T, k] int64, global ids)."""
        c = self.config
        if c.scoring == "softmax":
            return softmax_topk(F.linear(x, self.weight), c.top_k, c.renormalize)
        return sigmoid_grouped_topk(
            F.linear(x.float(), self.weight.float()),  # fp32 logits, as Hugging Face
            self.e_score_correction_bias,
            c.top_k,
            num_groups=c.num_groups,
            topk_groups=c.topk_groups,
            renormalize=c.renormalize,
            scaling_factor=c.scaling_factor,
        )


# ---- experts -------------------------------------------------------------------------------------


def fused_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str,
    expert_start: int,
) -> torch.Tensor:
    """The routed experts' weighted sum over the local experts (kernels/moe.py's contract):
    the one dispatch point of the experts. On CUDA the Triton kernel (sync-free, so CUDA graphs
    capture it); elsewhere its torch reference."""
    fn = fused_moe if x.is_cuda else fused_moe_ref
    return fn(x, w1, w2, topk_ids, topk_weights, activation=activation, expert_start=expert_start)


def _identity(partial: torch.Tensor) -> torch.Tensor:
    return partial


def _local(x, ids, weights, experts):
    return experts(x, ids, weights)


class MoE(nn.Module):
    """gate -> [latent down-projection] -> local experts -> combine -> [latent up-projection]
    -> + shared experts. x: [T, hidden] -> [T, hidden].

    Parameters: `gate` (ExpertGate), `w1` [E_local, N, H_in] and `w2` [E_local, H_in, I]
    (kernels/moe.py layout, H_in = latent_size or hidden; I = this rank's share of
    moe_intermediate_size under `tp`), optional `fc1_latent_proj` / `fc2_latent_proj` (hidden
    <-> latent, replicated) and `shared_experts` (the model builds it: its MLP class and names;
    under `tp` built with the same group and returning its partial sum, `reduce_results=False`:
    this block's one all-reduce adds it with the routed experts').

    `dispatch(x, topk_ids, topk_weights, experts)`: runs `experts` (this rank's, on the rows
    given) for the tokens x [T, H_in] and returns their routed output [T, H_in]; by default on
    x alone, under expert parallelism through the group's exchange (`set_expert_dispatch`).
    `combine`: partial routed output [T, H_in] -> the group's sum (module docstring). Both run
    in the latent space when there is one (smaller; fc2_latent_proj has no bias, so it commutes
    with the sum). Set it on every MoE of a model with `set_expert_combine`."""

    def __init__(
        self,
        hidden_size: int,
        config: MoEConfig,
        expert_range: ExpertRange | tuple[int, int] | None = None,
        shared_experts: nn.Module | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.expert_range = ExpertRange.of(expert_range, config.num_experts)
        self.gate = ExpertGate(hidden_size, config)
        inner = config.latent_size or hidden_size
        _, inter = tp.even(config.intermediate_size, "moe_intermediate_size")
        rows = inter * (2 if config.activation == "swiglu" else 1)
        count = self.expert_range.count
        self.w1 = nn.Parameter(torch.empty(count, rows, inner))
        self.w2 = nn.Parameter(torch.empty(count, inner, inter))
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.latent_size is not None:
            self.fc1_latent_proj = nn.Linear(hidden_size, config.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(config.latent_size, hidden_size, bias=False)
        if (shared_experts is None) != (config.shared_intermediate_size == 0):
            raise ValueError(
                f"shared_intermediate_size {config.shared_intermediate_size} needs a shared "
                "experts module exactly when it is > 0"
            )
        if tp.size > 1 and shared_experts is not None:
            split = getattr(shared_experts, "tp", SINGLE) is tp
            if not split or getattr(shared_experts, "reduce_results", True):
                raise ValueError(
                    "under tensor parallelism the shared experts must be split over the same "
                    "group (tp) and return their partial sum (reduce_results=False): the MoE "
                    "block's one all-reduce adds it to the routed experts'"
                )
        self.shared_experts = shared_experts
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.dispatch = _local
        # Routed experts (`record_routing`): where the gate's ids go, [rows, k] at a fixed
        # address (a CUDA graph writes it in place); None: not recorded.
        self.routing: torch.Tensor | None = None

    def experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts over rows h [N, H_in] with their choices [N, k]."""
        return fused_experts(
            h,
            self.w1,
            self.w2,
            ids,
            weights,
            activation=self.config.activation,
            expert_start=self.expert_range.start,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, k] each, global expert ids
        if self.routing is not None:  # (this rank's own tokens: before any exchange)
            self.routing[: topk_ids.shape[0]].copy_(topk_ids)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.dispatch(h, topk_ids, topk_weights, self.experts)
        routed = self.combine(routed)  # the partial sum of this rank's experts -> the whole
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        if self.shared_experts is not None:  # after the combine: counted once
            routed = routed + self.shared_experts(x)
        # Under tensor parallelism both terms are partial sums over this rank's intermediate
        # channels: one all-reduce for the two (a no-op at size 1).
        return self.tp.all_reduce(routed)


def exchange_rows(block: MoE, dtype: torch.dtype, device) -> None:
    """A dispatch with no token of this rank (a dummy forward under expert parallelism: the
    exchange still serves the other ranks' rows)."""
    inner, k = block.config.latent_size or block.gate.weight.shape[1], block.config.top_k
    empty = torch.empty(0, inner, dtype=dtype, device=device)
    ids = torch.empty(0, k, dtype=torch.int64, device=device)
    block.dispatch(empty, ids, torch.empty(0, k, device=device), block.experts)


def _blocks(model: nn.Module) -> list[MoE]:
    """The MoE blocks of the model's own layers: an MTP head's layers (after the model's in
    `layers`, ops/models/qwen3_next.py) run outside its forward, so they record no routing
    and join no expert exchange of a model step."""
    mtp = getattr(getattr(model, "config", None), "num_mtp_layers", 0)
    outside = {id(m) for layer in model.layers[-mtp:] for m in layer.modules()} if mtp else set()
    return [m for m in model.modules() if isinstance(m, MoE) and id(m) not in outside]


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE blocks of `model`'s own layers, in forward order (layer order)."""
    return _blocks(model)


def mtp_moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE blocks of `model`'s multi-token-prediction layers (none without a head): each
    head pass (ops/mtp.py) calls them once, outside the model's forward."""
    mtp = getattr(getattr(model, "config", None), "num_mtp_layers", 0)
    if not mtp:
        return []
    return [m for layer in model.layers[-mtp:] for m in layer.modules() if isinstance(m, MoE)]


def routing_buffer(blocks: list[MoE], rows: int, device) -> torch.Tensor | None:
    """A buffer for `record_routing`: [rows, len(blocks), top_k], int16 (int32 past 32767
    experts); None for a model without MoE blocks."""
    if not blocks:
        return None
    c = blocks[0].config
    dtype = torch.int16 if c.num_experts <= torch.iinfo(torch.int16).max else torch.int32
    return torch.full((rows, len(blocks), c.top_k), -1, dtype=dtype, device=device)


def record_routing(blocks: list[MoE], buffer: torch.Tensor | None) -> None:
    """Routed experts: each block's forward writes its router's top-k ids for its T tokens
    into rows [0, T) of its column of `buffer` (block i: `buffer[:, i]`), in place, so a
    CUDA graph captured meanwhile writes them at every replay; None: nothing is recorded."""
    for i, block in enumerate(blocks):
        block.routing = None if buffer is None else buffer[:, i]


def set_expert_dispatch(model: nn.Module, dispatch) -> int:
    """Install `dispatch` (e.g. the exchange of an expert-parallel group) in every MoE block of
    `model`; returns how many there are."""
    blocks = _blocks(model)
    for block in blocks:
        block.dispatch = dispatch
    return len(blocks)


def set_expert_combine(model: nn.Module, combine: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Install `combine` (e.g. an all-reduce over the expert-parallel group) in every MoE block
    of `model`; returns how many there are."""
    blocks = _blocks(model)
    for block in blocks:
        block.combine = combine
    return len(blocks)
