"""Tensor parallelism for mixture-of-experts layers on the CPU: T gloo processes, fp32, equal
to T = 1 (tests/test_tp.py's harness).

A tiny random Qwen3-MoE (GQA 4/2 with q/k norms, 8 experts of moe_intermediate_size 32, top 2,
a dense layer) loaded by 2 ranks from one tensor per expert (as save_pretrained writes), from
stacked [E, ...] tensors (as transformers' modules hold them), and with tied embeddings and
every second layer sparse: every token's logits within 1e-5 of T = 1's, the same greedy picks,
each rank holding half of every expert's intermediate size. The gpu worker at T = 2 gives
T = 1's tokens and log-probs, after weight updates from a state dict (per-expert and stacked
names, a router, a q norm) and from a checkpoint. A NemotronH-style block (sigmoid grouped
routing, ReLU² experts in a latent space, a shared expert) at T = 2 equals T = 1 with exactly
one all-reduce. Placement of every expert tensor name; what cannot split is refused naming
moe_intermediate_size (tests/test_tp_ep.py: together with expert parallelism).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.moe import MoE, MoEConfig
from taipan.ops.parallel import SINGLE, TPError, TPGroup
from taipan.ops.sharding import Placement, placement
from tests.random_moe import GPU_HEAD_DIM, QWEN3_MOE_VARIANTS, make_random_qwen3_moe
from tests.test_ops_moe import _rewrite_weights
from tests.test_tp import (
    ATOL,
    assert_ranks_match,
    forward_job,
    load_msg,
    run_batch,
    run_ranks,
    worker_steps,
)

transformers = pytest.importorskip("transformers")
FAKE_GROUP = object()  # a TPGroup of size 2 that is never used for a collective


def fake_tp(rank: int, size: int = 2) -> TPGroup:
    return TPGroup(rank, size, FAKE_GROUP)


# ---- fixtures -----------------------------------------------------------------------------------


def _stacked(path: str) -> str:
    """Rewrite `path`'s experts as one [E, ...] tensor per matrix (transformers' module names)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stacked = {n: t.contiguous() for n, t in hf.state_dict().items() if ".experts." in n}
    assert any(n.endswith("experts.gate_up_proj") for n in stacked)
    _rewrite_weights(path, lambda t: {n: v for n, v in t.items() if ".experts." not in n} | stacked)
    return path


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-moe")
    tied = QWEN3_MOE_VARIANTS["step-2-tied"]
    return {
        "per-expert": make_random_qwen3_moe(str(root / "per-expert")),
        "stacked": _stacked(make_random_qwen3_moe(str(root / "stacked"))),
        "tied-step-2": make_random_qwen3_moe(str(root / "tied"), seed=3, **tied),
        "other": make_random_qwen3_moe(str(root / "other"), seed=2),
    }


FORWARD_CASES = ("per-expert", "stacked", "tied-step-2")


@pytest.fixture(scope="module")
def tp2_forward(moe_checkpoints):
    return run_ranks(forward_job, [moe_checkpoints[c] for c in FORWARD_CASES])


# ---- the model at T = 2 -------------------------------------------------------------------------


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_qwen3_moe_tp2_forward_equals_tp1(moe_checkpoints, tp2_forward, case):
    model, config, _ = load_model(moe_checkpoints[case])
    expected = run_batch(model, config, SINGLE)
    ranks = [outs[FORWARD_CASES.index(case)] for outs in tp2_forward]
    assert_ranks_match(ranks, expected, config.vocab_size)
    assert ranks[0]["sampled"].tolist() == ranks[1]["sampled"].tolist()
    # Every expert, half its intermediate size; the router, q/k norms whole; dense MLP split.
    moe, hidden, d = config.moe, config.hidden_size, config.head_dim
    half = moe.intermediate_size // 2
    sparse = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
    dense = next(i for i in range(config.num_layers) if not config.is_moe_layer(i))
    want = {
        f"layers.{sparse}.mlp.w1": (moe.num_experts, 2 * half, hidden),
        f"layers.{sparse}.mlp.w2": (moe.num_experts, hidden, half),
        f"layers.{sparse}.mlp.gate.weight": (moe.num_experts, hidden),
        f"layers.{sparse}.self_attn.q_norm.weight": (d,),
        f"layers.{sparse}.self_attn.qkv_proj.weight": ((2 + 2 * 1) * d, hidden),
        f"layers.{dense}.mlp.gate_up_proj.weight": (config.intermediate_size, hidden),
        f"layers.{dense}.mlp.down_proj.weight": (hidden, config.intermediate_size // 2),
    }
    for rank in ranks:
        assert {n: rank["shapes"][n] for n in want} == want


def _update(path: str) -> dict[str, np.ndarray]:
    """New values, in Hugging Face names, for each kind of MoE tensor the ranks split or keep
    whole: single experts' matrices (as saved), a layer's stacked experts (as transformers'
    modules hold them), a router, a q norm, a dense layer's up projection."""
    from safetensors.numpy import load_file

    state = load_file(f"{path}/model.safetensors")
    gen = np.random.default_rng(11)

    def noisy(a: np.ndarray) -> np.ndarray:
        return (a + gen.normal(0, 0.05, a.shape)).astype(np.float32)

    names = [
        "model.layers.0.mlp.experts.3.gate_proj.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.0.mlp.experts.6.down_proj.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.2.mlp.up_proj.weight",
    ]
    out = {n: noisy(state[n]) for n in names}
    experts = [f"model.layers.1.mlp.experts.{e}" for e in range(8)]
    gate_up = [
        np.concatenate([state[f"{e}.gate_proj.weight"], state[f"{e}.up_proj.weight"]])
        for e in experts
    ]
    out["model.layers.1.mlp.experts.gate_up_proj"] = noisy(np.stack(gate_up))
    out["model.layers.1.mlp.experts.down_proj"] = noisy(
        np.stack([state[f"{e}.down_proj.weight"] for e in experts])
    )
    return out


def moe_worker_job(tp: TPGroup, path: str, other: str, update: dict) -> dict:
    """Load, step, update from a state dict, step, update from a checkpoint, step."""
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import GpuControl

    torch.backends.cuda.matmul.allow_tf32 = False
    worker = ModelWorker()
    worker.load(load_msg(path, str(tp.device)), tp=tp)
    out = {"loaded": worker_steps(worker, 1)}
    for name, control in [
        ("state", GpuControl("update_weights", None, None, update)),
        ("path", GpuControl("update_weights", None, other, None)),
    ]:
        replies = [
            worker.control(c) for c in (GpuControl("suspend", "recompute", None, None), control)
        ]
        replies.append(worker.control(GpuControl("resume", None, None, None)))
        assert [r.error for r in replies] == [None] * 3, [r.error for r in replies]
        out[name] = worker_steps(worker, 10)
    return out


def check_moe_workers(moe_checkpoints, device: str, atol: float) -> None:
    path, other = moe_checkpoints["per-expert"], moe_checkpoints["other"]
    update = _update(path)
    ranks = run_ranks(moe_worker_job, path, other, update, cuda=device == "cuda")
    single = SINGLE if device == "cpu" else TPGroup(device=torch.device("cuda:0"))
    expected = moe_worker_job(single, path, other, update)
    for rank, got in enumerate(ranks):
        for name in ("loaded", "state", "path"):
            for step, (a, b) in enumerate(zip(got[name], expected[name], strict=True)):
                where = f"rank {rank}, {name}, step {step}"
                assert a["token_ids"].tolist() == b["token_ids"].tolist(), where
                assert a["top_n_ids"].tolist() == b["top_n_ids"].tolist(), where
                for f in ("log_probs", "top_n_log_probs", "prompt_log_probs"):
                    np.testing.assert_allclose(a[f], b[f], atol=atol, rtol=0, err_msg=where)
    logprobs = [expected[n][0]["prompt_log_probs"] for n in ("loaded", "state", "path")]
    assert not np.allclose(logprobs[0], logprobs[1]) and not np.allclose(logprobs[1], logprobs[2])


def test_qwen3_moe_worker_at_tp2_equals_tp1_with_weight_updates(moe_checkpoints):
    check_moe_workers(moe_checkpoints, "cpu", ATOL)


@pytest.mark.gpu
def test_gpu_qwen3_moe_nccl_tp2_equals_tp1(tmp_path):
    """The fused Triton MoE kernel over half of each expert's intermediate size on each of two
    GPUs (the custom all-reduce, NCCL's gather, CUDA graphs on decode steps), fp32 with TF32
    off, against T = 1 on one GPU. head_dim 64: the CUDA attention kernels take 64 or 128."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    paths = {
        name: make_random_qwen3_moe(str(tmp_path / name), seed=seed, head_dim=GPU_HEAD_DIM)
        for name, seed in (("per-expert", 0), ("other", 2))
    }
    check_moe_workers(paths, "cuda", 1e-4)


# ---- a NemotronH-style block: latent projections, a shared expert, one all-reduce ---------------

NH_MOE = MoEConfig(
    num_experts=8,
    top_k=2,
    intermediate_size=32,
    activation="relu2",
    scoring="sigmoid",
    renormalize=True,
    num_groups=4,
    topk_groups=2,
    scaling_factor=2.5,
    latent_size=24,
    shared_intermediate_size=48,
)
HIDDEN = 40
PREFIX = "layers.0.mixer."


class SharedReLU2(nn.Module):
    """A ReLU² shared expert split over `tp` that returns its partial sum (the contract MoE
    asks of a shared expert under tensor parallelism), with NemotronH's parameter names."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        _, inter = tp.even(intermediate, "moe_shared_expert_intermediate_size")
        self.tp, self.reduce_results = tp, False
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


def _nh_checkpoint() -> dict[str, torch.Tensor]:
    """Whole tensors in NemotronH's checkpoint names (stacked experts, as its modules hold)."""
    g = torch.Generator().manual_seed(5)
    E, inter, L, S = NH_MOE.num_experts, NH_MOE.intermediate_size, NH_MOE.latent_size, 48
    shapes = {
        "gate.weight": (E, HIDDEN),
        "experts.up_proj": (E, inter, L),
        "experts.down_proj": (E, L, inter),
        "fc1_latent_proj.weight": (L, HIDDEN),
        "fc2_latent_proj.weight": (HIDDEN, L),
        "shared_experts.up_proj.weight": (S, HIDDEN),
        "shared_experts.down_proj.weight": (HIDDEN, S),
    }
    out = {n: torch.randn(s, generator=g) * 0.2 for n, s in shapes.items()}
    out["gate.e_score_correction_bias"] = torch.rand(E, generator=g) * 0.6 - 0.3
    return out


def _nh_block(tp: TPGroup) -> MoE:
    """The block with this rank's slices of `_nh_checkpoint`, placed by ops/sharding.py."""
    block = MoE(HIDDEN, NH_MOE, shared_experts=SharedReLU2(HIDDEN, 48, tp), tp=tp)
    config = types.SimpleNamespace(head_dim=8, intermediate_size=64, moe=NH_MOE)
    params = block.state_dict()
    filled = set()
    with torch.no_grad():
        for name, tensor in _nh_checkpoint().items():
            p = placement(PREFIX + name, config, tp)
            ours = p.param.removeprefix(PREFIX)
            params[ours][p.rows].copy_(p.take(tensor))
            filled.add(ours)
    assert filled == set(params)
    return block.eval()


def nh_block_job(tp: TPGroup, x: torch.Tensor) -> dict:
    import torch.distributed as dist

    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(t.shape) or all_reduce(t, *a, **k)
    try:
        block = _nh_block(tp)
        with torch.no_grad():
            out = block(x)
    finally:
        dist.all_reduce = all_reduce
    return {"out": out.numpy(), "all_reduces": calls, "w2": tuple(block.w2.shape)}


def test_nemotron_h_style_block_at_tp2_equals_tp1_with_one_all_reduce():
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _nh_block(SINGLE)(x).numpy()
    for rank, got in enumerate(run_ranks(nh_block_job, x)):
        np.testing.assert_allclose(got["out"], want, atol=ATOL, rtol=0, err_msg=f"rank {rank}")
        assert got["all_reduces"] == [(7, HIDDEN)]  # routed + shared, summed once
        assert got["w2"] == (8, NH_MOE.latent_size, 16)  # experts in the latent space, half of I


def test_a_shared_expert_that_reduces_itself_is_refused():
    class Whole(nn.Module):  # no tp, as a model that forgot to split it would build
        pass

    with pytest.raises(ValueError, match="shared experts must be split over the same group"):
        MoE(HIDDEN, NH_MOE, shared_experts=Whole(), tp=fake_tp(0))


# ---- placement, refusals ------------------------------------------------------------------------


def test_placement_of_expert_tensors():
    moe = MoEConfig(8, 2, 32, "swiglu", "softmax", True)
    config = types.SimpleNamespace(head_dim=16, intermediate_size=96, moe=moe)
    tp = fake_tp(1)
    pre = "layers.3.mlp."
    gate = placement(pre + "experts.5.gate_proj.weight", config, tp)
    up = placement(pre + "experts.5.up_proj.weight", config, tp)
    down = placement(pre + "experts.5.down_proj.weight", config, tp)
    assert gate == Placement(pre + "w1", (5, slice(0, 16)), 0, 16, 16, 32)
    assert up == Placement(pre + "w1", (5, slice(16, 32)), 0, 16, 16, 32)
    assert down == Placement(pre + "w2", (5, slice(None)), 1, 16, 16, 32)
    # Our rank's w1 [E, 2 * 16, H]: one expert's rows, and the whole matrix's shape back.
    assert gate.checkpoint_shape((8, 32, 64)) == (32, 64)
    assert down.checkpoint_shape((8, 64, 16)) == (64, 32)
    # Stacked: gate rows 16..31 and up rows 48..63 of [E, 64, H]; down columns 16..31.
    gate_up = np.arange(8 * 64 * 3).reshape(8, 64, 3)
    p = placement(pre + "experts.gate_up_proj", config, tp)
    assert (p.param, p.dim, p.blocks) == (pre + "w1", 1, 2)
    assert p.checkpoint_shape((8, 32, 3)) == (8, 64, 3)
    np.testing.assert_array_equal(p.take(gate_up), gate_up[:, np.r_[16:32, 48:64]])
    assert placement(pre + "w1", config, tp) == p  # the loader's stacked piece, alike
    torch_gate_up = torch.from_numpy(gate_up)
    assert torch.equal(p.take(torch_gate_up), torch_gate_up[:, np.r_[16:32, 48:64]])
    stacked_down = np.arange(8 * 3 * 32).reshape(8, 3, 32)
    p = placement(pre + "experts.down_proj", config, tp)
    np.testing.assert_array_equal(p.take(stacked_down), stacked_down[:, :, 16:])
    assert placement(pre + "w2", config, tp) == p
    # Replicated: the router, the q/k norms.
    for name in (pre + "gate.weight", "layers.3.self_attn.q_norm.weight"):
        assert placement(name, config, tp) == Placement(name, slice(None))
    # Whole at T = 1: all of I, and a stacked gate_up read in one piece (a view, no copy).
    p = placement(pre + "experts.gate_up_proj", config, SINGLE)
    assert np.shares_memory(p.take(gate_up), gate_up) and p.take(gate_up).shape == (8, 64, 3)


def test_placement_of_nemotron_h_expert_tensors():
    """ReLU² experts (w1 = up rows only), the shared expert split alike, latent projections
    and the correction bias replicated; a gate_proj ReLU² experts lack is no placement of ours
    (the loader reports the name)."""
    config = types.SimpleNamespace(head_dim=8, intermediate_size=64, moe=NH_MOE)
    tp = fake_tp(1)
    pre = "layers.1.mixer."
    assert placement(pre + "experts.2.up_proj.weight", config, tp) == Placement(
        pre + "w1", (2, slice(0, 16)), 0, 16, 16, 32
    )
    assert placement(pre + "experts.up_proj", config, tp) == Placement(
        pre + "w1", slice(None), 1, 16, 16, 32
    )
    assert placement(pre + "shared_experts.up_proj.weight", config, tp) == Placement(
        pre + "shared_experts.up_proj.weight", slice(None), 0, 24, 24, 48
    )
    assert placement(pre + "shared_experts.down_proj.weight", config, tp) == Placement(
        pre + "shared_experts.down_proj.weight", slice(None), 1, 24, 24, 48
    )
    replicated = (
        "fc1_latent_proj.weight",
        "fc2_latent_proj.weight",
        "gate.e_score_correction_bias",
    )
    for name in replicated:
        assert placement(pre + name, config, tp) == Placement(pre + name, slice(None))
    name = pre + "experts.2.gate_proj.weight"
    assert placement(name, config, tp).param == name


def test_what_does_not_split_is_refused_naming_it():
    moe = MoEConfig(8, 2, 33, "swiglu", "softmax", True)
    config = types.SimpleNamespace(head_dim=16, intermediate_size=96, moe=moe)
    text = r"moe_intermediate_size \(33\) is not divisible by the tensor-parallel size \(2\)"
    with pytest.raises(TPError, match=text):
        placement("layers.0.mlp.experts.1.up_proj.weight", config, fake_tp(0))
    with pytest.raises(TPError, match=text):
        MoE(64, moe, tp=fake_tp(0))
    nh = MoEConfig(8, 2, 32, "relu2", "sigmoid", True, shared_intermediate_size=30)
    config = types.SimpleNamespace(head_dim=8, intermediate_size=64, moe=nh)
    with pytest.raises(TPError, match=r"moe_shared_expert_intermediate_size \(30\) .* \(4\)"):
        placement("layers.0.mixer.shared_experts.up_proj.weight", config, fake_tp(0, 4))


def test_a_moe_model_that_does_not_split_fails_to_load(tmp_path):
    """(The model's build fails before any collective: a group that is never used will do.)"""
    path = make_random_qwen3_moe(str(tmp_path / "odd"), moe_intermediate_size=33)
    text = "cannot split over 2 ranks: moe_intermediate_size (33) is not divisible by the "
    with pytest.raises(ModelLoadError) as e:
        load_model(path, tp=fake_tp(1))
    assert text + "tensor-parallel size (2)" in str(e.value)
