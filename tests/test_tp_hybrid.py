"""Tensor parallelism for NemotronH hybrids on the CPU: T = 2 gloo processes, fp32, equal to T = 1.

Each rank loads the same Hugging Face checkpoint sharded (Mamba2 mixers by heads and groups,
attention by heads, the ReLU² MLP by its intermediate size, the vocabulary) and runs one script
through the production forward (tests/test_ops_nemotron_h.py's HybridRunner: paged KV, Mamba
state slots): a chunked prefill whose second and third chunks start from the state the first
left, decode rows beside prefills, snapshots the kernels store inside a chunk and one copied at
a chunk's end, two prefills restored from them, then greedy decode steps that carry the state.
Every rank's logits equal T = 1's within 1e-5 (same greedy picks), and every rank's Mamba state
slots hold exactly its shard of T = 1's (conv channels of its x, B and C; SSM state of its heads).

Checkpoints: "M-*-M-" with 2 groups of 4 heads (one group per rank) and 2 kv heads; "*-M-M-"
with 4 groups, in_proj / out_proj biases (out_proj's added once, after the all-reduce) and one
kv head (replicated). The gpu worker at T = 2 with Mamba prefix snapshots on: slot counts agree,
each rank's slot bytes are half of T = 1's, tokens and log-probs equal T = 1's, also after a
weight update from a state dict (in_proj, conv1d, A_log, norm, out_proj, MLP, embedding).
`placements` unit tests; refusals: heads or groups that do not divide. A hybrid with `E`
layers (ops/moe.py's split) equal to T = 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from taipan.actors.gpu.sizing import GIB
from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import GpuControl
from taipan.ops.loader import load_model
from taipan.ops.models.nemotron_h import NemotronHForCausalLM
from taipan.ops.parallel import SINGLE, TPError, TPGroup
from taipan.ops.sharding import placement, placements
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h
from tests.test_ops_nemotron_h import HybridRunner, _prompt
from tests.test_tp import refusal_job, run_ranks

pytest.importorskip("transformers")

ATOL = 1e-5
DECODES = 4
CASES = {
    "groups2": ("M-*-M-", TINY_HYBRID),
    "groups4-bias-kv1": (
        "*-M-M-",
        TINY_HYBRID | {"n_groups": 4, "use_bias": True, "num_key_value_heads": 1},
    ),
}


def shape_only(rank: int, size: int) -> TPGroup:
    """A rank of a group no collective is run on: for shapes and placements only."""
    return TPGroup(rank, size, group=object())


def make_checkpoint(path: str, pattern: str, shape: dict) -> str:
    """tests/random_nemotron_h.py's model with its norm weights and projection biases redrawn
    (it leaves them ones and zeros, under which a misplaced shard would not show)."""
    from safetensors.numpy import load_file, save_file

    make_random_nemotron_h(path, pattern, shape)
    state = load_file(f"{path}/model.safetensors")
    gen = np.random.default_rng(11)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = gen.uniform(0.5, 1.5, t.shape).astype(t.dtype)
        elif name.endswith(("in_proj.bias", "out_proj.bias")):
            state[name] = gen.normal(0.0, 0.1, t.shape).astype(t.dtype)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-hybrid")
    return {
        name: make_checkpoint(str(root / name), pattern, shape)
        for name, (pattern, shape) in CASES.items()
    }


# ---- what every rank runs -----------------------------------------------------------------------


@torch.no_grad()
def run_script(model, config, tp: TPGroup) -> dict:
    """Five sequences over 4 + DECODES steps (see the module docstring); per step each
    sequence's logits, and the Mamba state slots at the end."""
    runner = HybridRunner(model, config, seed=3, tp=tp)
    base, other = _prompt(40, 1), _prompt(23, 2)
    prompts = {
        0: base,  # prefilled in three chunks: 11, 21 (to a block edge), 8
        1: other,  # whole, its state after 16 tokens stored inside the chunk (slot 9)
        2: base[:32] + _prompt(9, 3),  # restored from seq 0's state at 32 (slot 8)
        3: _prompt(3, 4),
        4: other[:16] + _prompt(6, 5),  # restored from slot 9
    }
    for seq, p in prompts.items():
        runner.add(seq, len(p) + DECODES + 1, slot=seq)
    steps, picks = [], {}

    def run(chunks, **kwargs) -> None:
        logits = runner.step(chunks, **kwargs)
        steps.append({s: x.numpy() for s, x in logits.items()})
        picks.update({s: int(x[-1].argmax()) for s, x in logits.items()})

    run({0: base[:11], 1: other, 3: prompts[3]}, snaps={1: [(16, 9)]})
    run({0: base[11:32], 1: [picks[1]], 3: [picks[3]]})
    runner.snapshot(0, slot=8)
    run({0: base[32:], 1: [picks[1]], 3: [picks[3]]})
    runner.share(2, source=0, tokens=32)
    runner.share(4, source=1, tokens=16)
    chunks = {2: prompts[2][32:], 4: prompts[4][16:]} | {s: [picks[s]] for s in (0, 1, 3)}
    run(chunks, restore={2: 8, 4: 9})
    for _ in range(DECODES):
        run({s: [picks[s]] for s in prompts})
    return {"steps": steps, "conv": runner.conv.numpy(), "ssm": runner.ssm.numpy()}


def forward_job(tp: TPGroup, paths: list[str]) -> list[dict]:
    outs = []
    for path in paths:
        model, config, _ = load_model(path, tp=tp)
        out = run_script(model, config, tp)
        out["shapes"] = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def tp2_forward(checkpoints):
    return run_ranks(forward_job, [checkpoints[c] for c in CASES])


def state_shard(conv: np.ndarray, ssm: np.ndarray, config, rank: int, size: int):
    """T = 1's state slots cut to rank's share: conv channels of its x, B, C; its heads."""
    P, N = config.mamba_head_dim, config.ssm_state_size
    h, g = config.mamba_num_heads // size, config.n_groups // size
    inner, gn = config.mamba_num_heads * P, config.n_groups * N
    x = np.arange(rank * h * P, (rank + 1) * h * P)
    b = inner + np.arange(rank * g * N, (rank + 1) * g * N)
    channels = np.concatenate([x, b, b + gn])
    return conv[..., channels], ssm[:, :, rank * h : (rank + 1) * h]


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_tp2_hybrid_forward_and_state_equal_tp1(checkpoints, tp2_forward, case):
    model, config, _ = load_model(checkpoints[case])
    expected = run_script(model, config, SINGLE)
    ranks = [outs[list(CASES).index(case)] for outs in tp2_forward]
    for rank, got in enumerate(ranks):
        assert len(got["steps"]) == len(expected["steps"]) == 4 + DECODES
        for step, (a, b) in enumerate(zip(got["steps"], expected["steps"], strict=True)):
            assert sorted(a) == sorted(b)
            for seq in b:
                where = f"rank {rank}, step {step}, sequence {seq}"
                assert a[seq].shape == b[seq].shape == (b[seq].shape[0], config.vocab_size)
                np.testing.assert_allclose(a[seq], b[seq], atol=ATOL, rtol=0, err_msg=where)
                assert a[seq][-1].argmax() == b[seq][-1].argmax(), where
        conv, ssm = state_shard(expected["conv"], expected["ssm"], config, rank, 2)
        assert got["conv"].shape == conv.shape and got["ssm"].shape == ssm.shape
        np.testing.assert_allclose(got["conv"], conv, atol=ATOL, rtol=0, err_msg=f"rank {rank}")
        np.testing.assert_allclose(got["ssm"], ssm, atol=ATOL, rtol=0, err_msg=f"rank {rank}")
    assert np.abs(expected["ssm"][:, 8]).sum() > 0  # the snapshot slots were written
    # Each rank holds its shards: half the Mamba heads and groups, half the attention heads (at
    # least one kv head), half the MLP, half the vocabulary (rounded up), whole block norms.
    c, hidden = config, config.hidden_size
    P, N, h, g = c.mamba_head_dim, c.ssm_state_size, c.mamba_num_heads // 2, c.n_groups // 2
    conv_dim = h * P + 2 * g * N
    kv = max(c.num_kv_heads // 2, 1)
    m, a, mlp = c.pattern.index("M"), c.pattern.index("*"), c.pattern.index("-")
    want = {
        "embeddings.weight": (-(-c.vocab_size // 2), hidden),
        "lm_head.weight": (-(-c.vocab_size // 2), hidden),
        f"layers.{m}.mixer.in_proj.weight": (h * P + conv_dim + h, hidden),
        f"layers.{m}.mixer.conv1d.weight": (conv_dim, 1, c.conv_kernel),
        f"layers.{m}.mixer.A_log": (h,),
        f"layers.{m}.mixer.norm.weight": (h * P,),
        f"layers.{m}.mixer.out_proj.weight": (hidden, h * P),
        f"layers.{a}.mixer.qkv_proj.weight": ((c.num_heads // 2 + 2 * kv) * c.head_dim, hidden),
        f"layers.{a}.mixer.o_proj.weight": (hidden, c.num_heads // 2 * c.head_dim),
        f"layers.{mlp}.mixer.up_proj.weight": (c.intermediate_size // 2, hidden),
        f"layers.{mlp}.mixer.down_proj.weight": (hidden, c.intermediate_size // 2),
        f"layers.{m}.norm.weight": (hidden,),
    }
    if c.mamba_proj_bias:
        want[f"layers.{m}.mixer.in_proj.bias"] = (h * P + conv_dim + h,)
        want[f"layers.{m}.mixer.out_proj.bias"] = (hidden,)  # whole: added once
    for rank in ranks:
        assert {n: rank["shapes"][n] for n in want} == want


def test_placements_of_mamba_and_mlp_tensors(checkpoints):
    """Rank 1 of 2 on "M-*-M-" (H 8, P 8, G 2, N 16: in_proj rows z 64 | x 64 | B 32 | C 32 |
    dt 8): every segment its own slice, and over both ranks every row read exactly once."""
    _, config, _ = load_model(checkpoints["groups2"])
    tp = shape_only(1, 2)
    got = [(p.rows, p.start, p.length) for p in placements("layers.0.mixer.in_proj.weight",
                                                             config, tp)]  # fmt: skip
    assert got == [
        (slice(0, 32), 32, 32),  # z: heads 4..7
        (slice(32, 64), 64 + 32, 32),  # x
        (slice(64, 80), 128 + 16, 16),  # B: group 1
        (slice(80, 96), 160 + 16, 16),  # C
        (slice(96, 100), 192 + 4, 4),  # dt: heads 4..7
    ]
    assert {p.full for p in placements("layers.0.mixer.in_proj.weight", config, tp)} == {200}
    conv = placements("layers.0.mixer.conv1d.weight", config, tp)
    assert [(p.rows, p.start) for p in conv] == [
        (slice(0, 32), 32), (slice(32, 48), 64 + 16), (slice(48, 64), 96 + 16)
    ]  # fmt: skip
    for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                 "norm.weight", "out_proj.weight"):  # fmt: skip
        full = {"in_proj.weight": 200, "conv1d.weight": 128, "conv1d.bias": 128,
                "norm.weight": 64, "out_proj.weight": 64}.get(name, 8)  # fmt: skip
        read = [
            i
            for r in range(2)
            for p in placements(f"layers.4.mixer.{name}", config, shape_only(r, 2))
            for i in range(p.start, p.start + p.length)
        ]
        assert sorted(read) == list(range(full)), name

    def where(name: str) -> tuple:
        p = placement(name, config, tp)
        return p.dim, p.start, p.length, p.full

    assert where("layers.0.mixer.A_log") == (0, 4, 4, 8)
    assert where("layers.0.mixer.norm.weight") == (0, 32, 32, 64)  # group 1's channels
    assert where("layers.0.mixer.out_proj.weight") == (1, 32, 32, 64)
    assert where("layers.1.mixer.up_proj.weight") == (0, 48, 48, 96)
    assert where("layers.1.mixer.down_proj.weight") == (1, 48, 48, 96)
    assert where("layers.0.norm.weight")[0] is None  # a block's norm: whole
    with pytest.raises(ValueError, match="fills 5 pieces on this rank"):
        placement("layers.0.mixer.in_proj.weight", config, tp)
    # At size 1 each is one whole piece (what weight updates of the unsharded model map).
    assert placements("layers.0.mixer.in_proj.weight", config) == (
        placement("layers.0.mixer.in_proj.weight", config),
    )
    assert placement("layers.0.mixer.in_proj.weight", config).dim is None


def test_heads_or_groups_that_do_not_divide_and_moe_layers_are_refused(checkpoints):
    _, config, _ = load_model(checkpoints["groups2"])
    assert config.mamba_state_for(shape_only(0, 2)).conv_dim == config.mamba_state.conv_dim // 2
    with torch.device("meta"):
        with pytest.raises(TPError, match=r"n_groups \(2\) is not divisible .* size \(4\)"):
            NemotronHForCausalLM(config, tp=shape_only(0, 4))
        odd = dataclasses.replace(config, mamba_num_heads=6, n_groups=3)
        with pytest.raises(TPError, match=r"mamba_num_heads \(6\) is not divisible .* \(4\)"):
            NemotronHForCausalLM(odd, tp=shape_only(0, 4))
        with pytest.raises(TPError, match=r"n_groups \(3\) is not divisible .* \(2\)"):
            NemotronHForCausalLM(odd, tp=shape_only(1, 2))
    with pytest.raises(TPError, match=r"n_groups \(3\)"):
        odd.mamba_state_for(shape_only(0, 2))
    with pytest.raises(TPError, match=r"n_groups \(3\)"):
        placements("layers.0.mixer.in_proj.weight", odd, shape_only(0, 2))


def test_loader_refusal_and_moe_layers_at_tp2(tmp_path):
    """Groups that do not split are refused at load; a hybrid with `E` layers (latent
    projections, a shared expert) splits its experts' intermediate sizes (ops/moe.py) and runs
    the script equal to T = 1, its Mamba state a shard of T = 1's."""
    from tests.random_moe import make_random_nemotron_h_moe

    moe = make_random_nemotron_h_moe(str(tmp_path / "moe"), pattern="M-*E-ME", latent_size=16)
    odd = make_random_nemotron_h(str(tmp_path / "odd"), shape=TINY_HYBRID | {"n_groups": 1})
    for [odd_error] in run_ranks(refusal_job, [odd]):
        assert "cannot split over 2 ranks" in odd_error
        assert "n_groups (1) is not divisible by the tensor-parallel size (2)" in odd_error
    model, config, _ = load_model(moe)
    expected = run_script(model, config, SINGLE)
    for rank, [got] in enumerate(run_ranks(forward_job, [moe])):
        for a, b in zip(got["steps"], expected["steps"], strict=True):
            for seq in b:
                np.testing.assert_allclose(a[seq], b[seq], atol=ATOL, rtol=0)
                assert a[seq][-1].argmax() == b[seq][-1].argmax()
        conv, ssm = state_shard(expected["conv"], expected["ssm"], config, rank, 2)
        np.testing.assert_allclose(got["conv"], conv, atol=ATOL, rtol=0)
        np.testing.assert_allclose(got["ssm"], ssm, atol=ATOL, rtol=0)
        e = config.pattern.index("E")
        inter = config.moe.intermediate_size // 2
        assert got["shapes"][f"layers.{e}.mixer.w2"][2] == inter
        assert got["shapes"][f"layers.{e}.mixer.fc1_latent_proj.weight"] == (16, 64)


# ---- the gpu worker -----------------------------------------------------------------------------


def worker_job(tp: TPGroup, path: str, update: dict) -> dict:
    """Load with 3 snapshot slots' worth of T = 1 bytes; steps with snapshots (inside a chunk
    and at a chunk's end), restores and decodes; a weight update from a state dict; the steps
    again. On a CUDA device (`tp.device`) with CUDA graphs: the mixed and the decode step replay
    one."""
    from tests.test_gpu_worker_mamba import OTHER, PROMPT, hybrid_plan, load_msg
    from tests.test_ops_logprobs import Seq

    torch.backends.cuda.matmul.allow_tf32 = False
    worker = ModelWorker()
    _, config, _ = load_model(path)
    slot_bytes = config.mamba_state.bytes_per_slot(torch.float32, torch.float32)  # T = 1's
    msg = load_msg(path, mamba_snapshot_gb=3 * slot_bytes / GIB)
    if tp.device.type == "cuda":
        graphs = {"cuda_graph_decode_sizes": (1, 2, 4), "cuda_graph_mixed_sizes": (32,)}
        msg = dataclasses.replace(msg, device=str(tp.device), **graphs)
    loaded = worker.load(msg, tp=tp)
    out = {
        "slots": (loaded.mamba_slots, loaded.mamba_snapshot_slots),
        "slot_bytes": loaded.mamba_slot_bytes,
        "state_shapes": [tuple(t.shape) for t in worker.mamba_state],
    }

    def steps(step: int) -> list:
        live = loaded.mamba_slots
        first = hybrid_plan(
            step,
            [Seq(PROMPT, 0, [1, 2], logprobs=True, top_n=3), Seq(OTHER[:16], 0, [3])],
            init=[-1, -1], out=[0, 1], snaps=[(0, 16, live), (1, 16, live + 1)],
        )  # fmt: skip
        a = worker.step(first)
        seqs = [Seq([int(a.token_ids[0])], 30, [1, 2], logprobs=True),
                Seq(PROMPT[16:], 16, [1, 4], logprobs=True),
                Seq(OTHER[16:], 16, [3, 5], logprobs=True, top_n=3)]  # fmt: skip
        b = worker.step(hybrid_plan(step + 1, seqs, init=[0, live, live + 1], out=[0, 2, 1]))
        done = [(31, [1, 2]), (30, [1, 4]), (30, [3, 5])]  # (tokens so far, blocks) per row
        seqs = [Seq([int(t)], n, blocks, logprobs=True)
                for t, (n, blocks) in zip(b.token_ids, done, strict=True)]  # fmt: skip
        c = worker.step(hybrid_plan(step + 2, seqs, init=[0, 2, 1], out=[0, 2, 1]))
        fields = ("token_ids", "log_probs", "top_n_ids", "top_n_log_probs", "error", "graphed")
        return [{f: getattr(r, f) for f in fields} for r in (a, b, c)]

    out["loaded"] = steps(1)
    for control in (
        GpuControl("suspend", "persist", None, None),
        GpuControl("update_weights", None, None, update),
        GpuControl("resume", None, None, None),
    ):
        assert worker.control(control).error is None
    out["updated"] = steps(10)
    return out


def update_state(path: str) -> dict[str, np.ndarray]:
    """New values for whole tensors of every kind the ranks split, in Hugging Face names."""
    from safetensors.numpy import load_file

    state = load_file(f"{path}/model.safetensors")
    names = [
        f"backbone.layers.{i}.mixer.{n}"
        for i, n in [(0, "in_proj.weight"), (0, "conv1d.weight"), (0, "conv1d.bias"),
                     (4, "A_log"), (4, "dt_bias"), (4, "norm.weight"), (0, "out_proj.weight"),
                     (1, "up_proj.weight"), (3, "down_proj.weight"), (2, "k_proj.weight")]
    ] + ["backbone.embeddings.weight", "lm_head.weight"]  # fmt: skip
    gen = np.random.default_rng(3)
    return {n: state[n] + gen.normal(0, 0.05, state[n].shape).astype(np.float32) for n in names}


def check_workers(path: str, device: str, atol: float) -> None:
    """Workers at T = 2 (`device` "cpu", or "cuda": rank r on cuda:r) against one at T = 1 on
    the same kind of device."""
    update = update_state(path)
    ranks = run_ranks(worker_job, path, update, cuda=device == "cuda")
    single = SINGLE if device == "cpu" else TPGroup(device=torch.device("cuda:0"))
    expected = worker_job(single, path, update)
    # Each rank's slot is half of T = 1's, so the same budget holds twice the snapshot slots;
    # the ranks agree on every count.
    assert expected["slots"] == (4, 3)
    for got in ranks:
        assert got["slots"] == (4, 6) and got["slot_bytes"] * 2 == expected["slot_bytes"]
        (L, S, K, C), (_, _, H, P, N) = expected["state_shapes"]
        assert got["state_shapes"] == [(L, 10, K, C // 2), (L, 10, H // 2, P, N)]
        for phase in ("loaded", "updated"):
            for step, (a, b) in enumerate(zip(got[phase], expected[phase], strict=True)):
                where = f"{phase}, step {step}"
                assert a["error"] is b["error"] is None, (where, a["error"])
                # Step 0 stores snapshots inside a chunk (eager); 1 is mixed, 2 decodes: graphs.
                assert a["graphed"] == b["graphed"] == (device == "cuda" and step > 0), where
                assert a["token_ids"].tolist() == b["token_ids"].tolist(), where
                assert a["top_n_ids"].tolist() == b["top_n_ids"].tolist(), where
                for f in ("log_probs", "top_n_log_probs"):
                    np.testing.assert_allclose(a[f], b[f], atol=atol, rtol=0, err_msg=where)
    before, after = (expected[p][1]["log_probs"] for p in ("loaded", "updated"))
    assert not np.allclose(before, after)  # the update reached the weights


def test_worker_at_tp2_with_snapshots_and_a_weight_update_equals_tp1(checkpoints):
    check_workers(checkpoints["groups2"], "cpu", ATOL)


@pytest.mark.gpu
def test_gpu_nccl_worker_at_tp2_with_cuda_graphs_equals_tp1(tmp_path):
    """NCCL between two GPUs, fp32 (TF32 off for matmuls; the scan kernels' dots may still
    use it, hence the looser bound): the Triton Mamba kernels on each rank's shard, the mixed
    and decode steps CUDA graphs that captured the mixers' all-reduces."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    shape = TINY_HYBRID | {"head_dim": 64}  # the attention kernels take head_dim 64 or 128
    check_workers(make_checkpoint(str(tmp_path / "nh"), "M-*-M-", shape), "cuda", 2e-3)
