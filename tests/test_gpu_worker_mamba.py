"""The gpu worker's Mamba state slots for hybrid (NemotronH) models, the worker alone on CPU.

A tiny random NemotronH (tests/random_nemotron_h.py, TINY_HYBRID, pattern "M-*-M-": two Mamba
layers and one attention layer), fp32, built once per module.

Checks: LoadModel's sizing of the live slots (max_requests by default; with mamba_memory_ratio
the share of the KV budget, at most max_requests, the KV blocks getting the rest) and of the
snapshot slots (mamba_snapshot_gb // one slot's bytes), at their exact boundaries, and the
ConfigErrors for a budget too small for one slot or for a model without Mamba layers; one slot's
bytes from the model's shape; the state tensors' slot count (live, then snapshots). A step's
snapshots at a chunk's end (mamba_snap_row, mamba_snap_pos = its query length ->
mamba_snap_dst: copies of the out slot after the forward) duplicate every layer's conv and SSM
state, and a continuation that starts from the snapshot computes exactly what the one continuing
its live slot does (tokens, log-probs, final states; and close to one prefill of the whole
prompt). Snapshots inside a chunk (the kernels store them) equal the state of a prefill that
stops there, beside decode rows and a chunk-end snapshot, and restore to the same tokens.
Every malformed slot in a plan is a ValueError naming what is wrong, raised
before the step touches anything (the worker runs the next valid step as if nothing happened),
and the gpu actor answers it as a StepResult with `error`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
import torch

from taipan.actors.channel import Envelope
from taipan.actors.config import ConfigError, mamba_snapshot_slots
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.sizing import GIB
from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel, StepPlan, StepResult
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h
from tests.test_ops_logprobs import Seq, make_plan

pytest.importorskip("transformers")

BLOCK_SIZE = 16
PATTERN = "M-*-M-"
MAX_REQUESTS = 4
# "The quick brown fox jumps over" as bytes: 30 tokens, the first 16 one full block.
PROMPT = list(b"The quick brown fox jumps over")
OTHER = list(b"Hello, world! It is a fine day")
PREFIX = 16


def expected_slot_bytes() -> int:
    """One slot over every Mamba layer, from the model's shape (fp32 conv and SSM states)."""
    s = TINY_HYBRID
    inner = s["mamba_num_heads"] * s["mamba_head_dim"]
    conv_dim = inner + 2 * s["n_groups"] * s["ssm_state_size"]
    conv = (s["conv_kernel"] - 1) * conv_dim * 4
    ssm = s["mamba_num_heads"] * s["mamba_head_dim"] * s["ssm_state_size"] * 4
    return PATTERN.count("M") * (conv + ssm)


SLOT = expected_slot_bytes()  # 2 * (3 * 128 * 4 + 8 * 8 * 16 * 4) = 11264


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    path = make_random_nemotron_h(str(tmp_path_factory.mktemp("random-nemotron-h")), PATTERN)
    # Warm up once per module: the first forward pays one-off imports and allocator growth.
    w, _ = load(path)
    w.step(hybrid_plan(0, [Seq([1], 3, [3]), Seq(PROMPT, 0, [1, 2])], [0, -1], [0, 1]))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")), TINY_SHAPE)


def load_msg(
    path: str, budget_bytes: int = 1 << 20, max_requests: int = MAX_REQUESTS, **mamba
) -> LoadModel:
    """A LoadModel of `budget_bytes` of KV budget (exact: an integer over a power of two), no
    block cap."""
    gb = budget_bytes / GIB
    msg = LoadModel(path, "float32", "cpu", BLOCK_SIZE, 0, gb, 256, max_requests, 128)
    return dataclasses.replace(msg, **mamba)


def load(path: str, budget_bytes: int = 1 << 20, max_requests: int = MAX_REQUESTS, **mamba):
    w = ModelWorker()
    return w, w.load(load_msg(path, budget_bytes, max_requests, **mamba))


def slots_in_state(w: ModelWorker) -> int:
    conv, ssm = w.mamba_state
    assert conv.shape[1] == ssm.shape[1]
    return conv.shape[1]


def hybrid_plan(step: int, seqs: list[Seq], init, out, snaps=()) -> StepPlan:
    """`snaps`: (row, tokens into its chunk, snapshot slot) triples."""
    rows, pos, dst = (list(x) for x in zip(*snaps, strict=True)) if snaps else ([], [], [])
    return dataclasses.replace(
        make_plan(step, seqs, BLOCK_SIZE),
        mamba_init=np.asarray(init, np.int32),
        mamba_out=np.asarray(out, np.int32),
        mamba_snap_row=np.asarray(rows, np.int32),
        mamba_snap_pos=np.asarray(pos, np.int32),
        mamba_snap_dst=np.asarray(dst, np.int32),
    )


def state_of(w: ModelWorker, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot `slot` of every Mamba layer: (conv [L, K-1, conv_dim], ssm [L, H, P, N]), copied."""
    conv, ssm = w.mamba_state
    return conv[:, slot].clone(), ssm[:, slot].clone()


def assert_same_state(a, b, what: str) -> None:
    for name, x, y in zip(("conv", "ssm"), a, b, strict=True):
        assert torch.equal(x, y), f"{what}: {name} states differ"


# ---- sizing: live slots -------------------------------------------------------------------------


def test_default_live_slots_one_per_request_no_snapshots(hybrid_dir):
    w, loaded = load(hybrid_dir)
    assert loaded.mamba_slots == MAX_REQUESTS and loaded.mamba_snapshot_slots == 0
    assert loaded.mamba_slot_bytes == SLOT == 11264
    assert w.config.mamba_state.bytes_per_slot(torch.float32, torch.float32) == SLOT
    # Besides the KV budget: every byte of it still goes to KV blocks.
    assert loaded.num_blocks == (1 << 20) // loaded.block_bytes
    conv, ssm = w.mamba_state
    k, h, p, n = (TINY_HYBRID[k] for k in ("conv_kernel", "mamba_num_heads", "mamba_head_dim",
                                           "ssm_state_size"))  # fmt: skip
    assert conv.shape == (2, MAX_REQUESTS, k - 1, 128) and conv.dtype == torch.float32
    assert ssm.shape == (2, MAX_REQUESTS, h, p, n) and ssm.dtype == torch.float32
    assert conv.abs().sum() == 0 and ssm.abs().sum() == 0
    # The bytes ModelLoaded reports are the bytes the slots really take.
    per_slot = sum(t[:, 0].numel() * t.element_size() for t in (conv, ssm))
    assert per_slot == SLOT


def test_memory_ratio_splits_the_kv_budget(hybrid_dir):
    budget = 1 << 20
    # r = 1/16: 65536 bytes, 5 slots (< max_requests 8); the blocks get the other 15/16.
    w, loaded = load(hybrid_dir, budget, 8, mamba_memory_ratio=0.0625)
    share = int(budget * 0.0625)
    assert share == 65536 and share // SLOT == 5
    assert loaded.mamba_slots == 5 and loaded.mamba_snapshot_slots == 0
    assert loaded.num_blocks == (budget - share) // loaded.block_bytes == 240
    assert slots_in_state(w) == 5
    # r = 1/4: 23 slots fit, capped at max_requests 8; the KV still gets only 3/4.
    w, loaded = load(hybrid_dir, budget, 8, mamba_memory_ratio=0.25)
    assert loaded.mamba_slots == 8 and slots_in_state(w) == 8
    assert loaded.num_blocks == (budget - budget // 4) // loaded.block_bytes == 192


def test_memory_ratio_exact_boundary_and_too_small(hybrid_dir):
    # A share of exactly one slot: 1 live slot; the rest (3 slots' bytes) holds 8 blocks.
    w, loaded = load(hybrid_dir, 4 * SLOT, mamba_memory_ratio=0.25)
    assert loaded.mamba_slots == 1 and slots_in_state(w) == 1
    assert loaded.num_blocks == (3 * SLOT) // loaded.block_bytes
    # One byte short of a slot: a ConfigError naming the ratio, the share and the slot.
    with pytest.raises(ConfigError, match="mamba_memory_ratio=0.25") as e:
        load(hybrid_dir, 4 * SLOT - 4, mamba_memory_ratio=0.25)
    assert f"{SLOT - 1} bytes" in str(e.value) and f"one live Mamba slot ({SLOT} bytes)" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="less than one live Mamba slot"):
        load(hybrid_dir, 1 << 20, mamba_memory_ratio=0.01)


# ---- sizing: snapshot slots ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_snapshot_budget_exact_boundaries(hybrid_dir, k):
    w, loaded = load(hybrid_dir, mamba_snapshot_gb=k * SLOT / GIB)
    assert loaded.mamba_snapshot_slots == k and loaded.mamba_slots == MAX_REQUESTS
    assert slots_in_state(w) == MAX_REQUESTS + k
    # Snapshots come besides the KV budget.
    assert loaded.num_blocks == (1 << 20) // loaded.block_bytes
    assert w.mamba_state[0].abs().sum() == 0 and w.mamba_state[1].abs().sum() == 0
    if k > 1:
        w, loaded = load(hybrid_dir, mamba_snapshot_gb=(k * SLOT - 1) / GIB)
        assert loaded.mamba_snapshot_slots == k - 1
        assert slots_in_state(w) == MAX_REQUESTS + k - 1


def test_snapshot_budget_too_small_or_disabled(hybrid_dir):
    with pytest.raises(ConfigError, match="prefix_caching_mamba_gb") as e:
        load(hybrid_dir, mamba_snapshot_gb=(SLOT - 1) / GIB)
    assert f"({SLOT - 1} bytes)" in str(e.value) and f"takes {SLOT} bytes" in str(e.value)
    for disabled in (0.0, -1.0):  # <= 0: no snapshots (negative is Megatron's "disabled")
        w, loaded = load(hybrid_dir, mamba_snapshot_gb=disabled)
        assert loaded.mamba_snapshot_slots == 0 and slots_in_state(w) == MAX_REQUESTS
    assert mamba_snapshot_slots(3 * SLOT, SLOT) == 3
    assert mamba_snapshot_slots(3 * SLOT - 1, SLOT) == 2
    with pytest.raises(ConfigError, match=">= 1 byte"):
        mamba_snapshot_slots(100, 0)


def test_ratio_and_snapshots_together(hybrid_dir):
    w, loaded = load(hybrid_dir, 4 * SLOT, mamba_memory_ratio=0.5, mamba_snapshot_gb=3 * SLOT / GIB)
    assert (loaded.mamba_slots, loaded.mamba_snapshot_slots) == (2, 3)
    assert loaded.num_blocks == (2 * SLOT) // loaded.block_bytes
    assert slots_in_state(w) == 5


@pytest.mark.parametrize(
    "mamba", [{"mamba_memory_ratio": 0.5}, {"mamba_snapshot_gb": 0.001}, {"mamba_snapshot_gb": 0.0}]
)
def test_non_hybrid_model_refuses_mamba_settings(llama_dir, mamba):
    with pytest.raises(ConfigError, match="are for hybrid models") as e:
        load(llama_dir, **mamba)
    assert "has no Mamba layers" in str(e.value) and llama_dir in str(e.value)
    w, loaded = load(llama_dir)  # without them: no Mamba state at all
    assert w.mamba_state is None and loaded.mamba_slots == loaded.mamba_slot_bytes == 0
    assert loaded.mamba_snapshot_slots == 0


# ---- snapshot copies ----------------------------------------------------------------------------


def test_snapshot_copy_and_restore_match_the_live_continuation(hybrid_dir):
    """Step 1 prefills two prompts' first block into live slots 0 and 1 and snapshots them into
    snapshot slots 5 and 4 (crossed); step 2 continues PROMPT from its live slot 0, step 3 from
    snapshot slot 4 into live slot 2: the same tokens, log-probs and final states."""
    w, loaded = load(hybrid_dir, mamba_snapshot_gb=2 * SLOT / GIB)
    live = loaded.mamba_slots
    snap_a, snap_b = live + 1, live  # 5, 4
    first = hybrid_plan(
        1,
        [Seq(PROMPT[:PREFIX], 0, [1]), Seq(OTHER[:PREFIX], 0, [5])],
        init=[-1, -1], out=[0, 1], snaps=[(1, PREFIX, snap_b), (0, PREFIX, snap_a)],
    )  # fmt: skip
    assert w.step(first).error is None
    prompt_state, other_state = state_of(w, 0), state_of(w, 1)
    assert all(t.abs().sum() > 0 for t in (*prompt_state, *other_state))  # after the forward
    assert_same_state(state_of(w, snap_a), prompt_state, "snapshot of slot 0")
    assert_same_state(state_of(w, snap_b), other_state, "snapshot of slot 1")
    for untouched in (2, 3):
        assert all(t.abs().sum() == 0 for t in state_of(w, untouched))

    rest = PROMPT[PREFIX:]
    from_live = w.step(hybrid_plan(2, [Seq(rest, PREFIX, [1, 2], logprobs=True, top_n=3)],
                                   init=[0], out=[0]))  # fmt: skip
    from_snap = w.step(hybrid_plan(3, [Seq(rest, PREFIX, [1, 3], logprobs=True, top_n=3)],
                                   init=[snap_a], out=[2]))  # fmt: skip
    assert from_live.error is None and from_snap.error is None
    assert from_snap.token_ids.tolist() == from_live.token_ids.tolist()
    np.testing.assert_array_equal(from_snap.log_probs, from_live.log_probs)
    np.testing.assert_array_equal(from_snap.top_n_ids, from_live.top_n_ids)
    assert_same_state(state_of(w, 2), state_of(w, 0), "continued from the snapshot vs live")
    assert not torch.equal(state_of(w, 0)[1], prompt_state[1])  # the live slot moved on
    # Reading a snapshot leaves it as it was (it can be restored again).
    assert_same_state(state_of(w, snap_a), prompt_state, "snapshot after a restore")

    # Oracle: the whole prompt in one prefill (another chunking: close, same token).
    whole = w.step(hybrid_plan(4, [Seq(PROMPT, 0, [6, 7], logprobs=True)], init=[-1], out=[3]))
    assert whole.token_ids.tolist() == from_live.token_ids.tolist()
    np.testing.assert_allclose(whole.log_probs, from_live.log_probs, atol=1e-4)
    for x, y in zip(state_of(w, 3), state_of(w, 0), strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_snapshot_of_a_decode_step(hybrid_dir):
    """A decode row's state is snapshotted after its update too (the copy follows the forward
    whatever kind of row wrote the live slot)."""
    w, loaded = load(hybrid_dir, mamba_snapshot_gb=SLOT / GIB)
    snap = loaded.mamba_slots
    r = w.step(hybrid_plan(1, [Seq(PROMPT[:PREFIX], 0, [1])], init=[-1], out=[3]))
    before = state_of(w, 3)
    plan = hybrid_plan(2, [Seq([int(r.token_ids[0])], PREFIX, [1, 2])], [3], [3], [(0, 1, snap)])
    assert w.step(plan).error is None
    after = state_of(w, 3)
    assert not torch.equal(after[1], before[1])
    assert_same_state(state_of(w, snap), after, "snapshot after a decode")


def test_snapshots_inside_a_chunk(hybrid_dir):
    """One step: a decode row (snapshotted at its end), PROMPT whole from zeros with its states
    after 8 and 16 tokens stored by the kernels, and OTHER. The inner snapshots equal the
    states of prefills that stop there; restoring the one at 16 continues exactly as the live
    continuation of a 16-token prefill does. The step ran eagerly (no CUDA graph on CPU anyway),
    and the slots nobody named are untouched."""
    w, loaded = load(hybrid_dir, mamba_snapshot_gb=3 * SLOT / GIB)
    live = loaded.mamba_slots  # snapshot slots 4, 5, 6
    r = w.step(hybrid_plan(1, [Seq(OTHER[:5], 0, [1])], init=[-1], out=[3]))
    seqs = [Seq([int(r.token_ids[0])], 5, [1]), Seq(PROMPT, 0, [2, 3]), Seq(OTHER, 0, [4, 5])]
    snaps = [(1, 8, live + 1), (0, 1, live), (1, PREFIX, live + 2)]
    assert w.step(hybrid_plan(2, seqs, init=[3, -1, -1], out=[3, 0, 1], snaps=snaps)).error is None
    assert_same_state(state_of(w, live), state_of(w, 3), "the decode row's chunk-end snapshot")
    for n, slot, scratch in ((8, live + 1, 2), (PREFIX, live + 2, 2)):
        plan = hybrid_plan(3, [Seq(PROMPT[:n], 0, [6])], init=[-1], out=[scratch])
        assert w.step(plan).error is None
        for x, y in zip(state_of(w, slot), state_of(w, scratch), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"state after {n}")
    rest = PROMPT[PREFIX:]
    from_live = w.step(hybrid_plan(4, [Seq(rest, PREFIX, [6, 7], logprobs=True)], [2], [2]))
    from_snap = w.step(hybrid_plan(5, [Seq(rest, PREFIX, [6, 7], logprobs=True)], [live + 2], [1]))
    assert from_snap.token_ids.tolist() == from_live.token_ids.tolist()
    np.testing.assert_allclose(from_snap.log_probs, from_live.log_probs, atol=1e-5)


# ---- slot checks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checked(hybrid_dir):
    """A worker with live slots 0..3 and snapshot slots 4..5."""
    w, loaded = load(hybrid_dir, mamba_snapshot_gb=2 * SLOT / GIB)
    assert (loaded.mamba_slots, loaded.mamba_snapshot_slots) == (4, 2)
    return w


BAD_PLANS = [
    # (init, out, snapshots (row, position, slot), message); the one sequence has 16 tokens
    ([-2], [0], [], r"mamba_init names slots outside -1\.\.5: \[-2\]"),
    ([6], [0], [], r"mamba_init names slots outside -1\.\.5: \[6\]"),
    ([-1], [6], [], r"mamba_out names slots outside -1\.\.5: \[6\]"),
    ([-1], [-2], [], r"mamba_out names slots outside -1\.\.5"),
    ([-1], [0], [(1, 16, 4)], r"mamba_snap_row must name sequences 0\.\.0"),
    ([-1], [0], [(-1, 16, 4)], r"mamba_snap_row must name sequences 0\.\.0"),
    ([-1], [0], [(0, 0, 4)], r"mamba_snap_pos must lie in 1\.\.the query length"),
    ([-1], [0], [(0, 17, 4)], r"mamba_snap_pos must lie in 1\.\.the query length"),
    ([-1], [-1], [(0, 16, 4)], "a snapshot at a chunk's end copies its out slot: a live slot"),
    ([-1], [5], [(0, 16, 4)], "a snapshot at a chunk's end copies its out slot: a live slot"),
    ([-1], [0], [(0, 16, 3)], r"mamba_snap_dst must name distinct snapshot slots 4\.\.5"),
    ([-1], [0], [(0, 8, 6)], r"mamba_snap_dst must name distinct snapshot slots 4\.\.5"),
    ([-1], [0], [(0, 8, 4), (0, 16, 4)], r"mamba_snap_dst must name distinct snapshot slots"),
    ([4], [0], [(0, 8, 4)], "a snapshot slot the step writes cannot be one it reads"),
    ([], [], [], "mamba_init and mamba_out need one slot per sequence"),
    ([-1, -1], [0, 1], [], "mamba_init and mamba_out need one slot per sequence"),
    ([-1], [], [], "mamba_init and mamba_out need one slot per sequence"),
]


def test_bad_slots_raise_before_anything_runs(checked):
    w = checked
    kv = w.kv_cache.clone()
    state = tuple(t.clone() for t in w.mamba_state)
    for init, out, snaps, message in BAD_PLANS:
        plan = hybrid_plan(1, [Seq(PROMPT[:PREFIX], 0, [1])], init, out, snaps)
        with pytest.raises(ValueError, match=message):
            w.launch(plan)
        with pytest.raises(ValueError, match=message):
            w.step(plan)
    # Nothing was written: not a state slot, not a KV byte (bitwise: unwritten KV may be NaN).
    assert all(torch.equal(t, s) for t, s in zip(w.mamba_state, state, strict=True))
    assert torch.equal(w.kv_cache.view(torch.int32), kv.view(torch.int32))
    # And the worker runs a valid step (with a snapshot) afterwards.
    good = hybrid_plan(2, [Seq(PROMPT[:PREFIX], 0, [1])], [-1], [0], [(0, PREFIX, 5)])
    r = w.step(good)
    assert r.error is None and r.token_ids[0] >= 0
    assert_same_state(state_of(w, 5), state_of(w, 0), "snapshot after the refused plans")


def test_mamba_slots_for_a_model_without_mamba_layers(llama_dir):
    w, _ = load(llama_dir)
    seqs = [Seq(PROMPT[:PREFIX], 0, [1])]
    cases = [([-1], [0], []), ([], [], [(0, 1, 1)]), ([0], [], []), ([], [0], [])]
    for init, out, snaps in cases:
        with pytest.raises(ValueError, match="the plan names Mamba slots, but the model has no"):
            w.launch(hybrid_plan(1, seqs, init, out, snaps))
    r = w.step(make_plan(2, seqs, BLOCK_SIZE))
    assert r.error is None and r.token_ids[0] >= 0


class FakeChannel:
    """Stands in for the engine's inproc channel: records what the actor sends back."""

    name, routed = "gpu", False

    def __init__(self):
        self.sent = []

    async def send(self, msg, to=None) -> None:
        self.sent.append(msg)


@pytest.mark.asyncio
async def test_actor_answers_a_bad_slot_plan_with_an_error_then_keeps_stepping(checked):
    channel = FakeChannel()
    actor = GpuActor(0, channel)
    actor.worker = checked
    answers = asyncio.create_task(actor._answer_steps())
    try:
        seqs = [Seq(PROMPT[:PREFIX], 0, [1])]
        for step, plan in enumerate(
            [hybrid_plan(1, seqs, [6], [0]), hybrid_plan(2, seqs, [-1], [0], [(0, PREFIX, 4)])], 1
        ):
            await actor.dispatch(Envelope(channel, None, dataclasses.replace(plan, step=step),
                                          None, 0.0))  # fmt: skip
            await asyncio.wait_for(actor.launched.join(), 10)
    finally:
        answers.cancel()
        actor.executor.shutdown()
        actor.collector.shutdown()
    bad, good = channel.sent
    assert isinstance(bad, StepResult) and bad.step == 1 and bad.token_ids.tolist() == [-1]
    assert bad.error.startswith("ValueError: mamba_init names slots outside -1..5")
    assert isinstance(good, StepResult) and good.step == 2 and good.error is None
    assert good.token_ids[0] >= 0


def test_bfloat16_conv_state_is_in_the_model_dtype(hybrid_dir):
    """The conv state is kept in the model's dtype and the SSM state in fp32, whatever the worker
    loaded before (a bf16 load once allocated fp32 conv state: the H200 bench found it)."""
    w = ModelWorker()
    msg = dataclasses.replace(load_msg(hybrid_dir, 1 << 20, MAX_REQUESTS), dtype="bfloat16")
    w.load(msg)
    conv, ssm = w.mamba_state
    assert conv.dtype == torch.bfloat16 and ssm.dtype == torch.float32


# ---- mamba_inference_state_config ------------------------------------------------------------


def test_state_config_chooses_the_ssm_dtype_and_checks_the_shapes(hybrid_dir):
    """The SSM state dtype may be chosen (bf16 halves it); the conv state stays in the model
    dtype; the layer pattern, shapes (ours or Megatron's conv layout) and chunk size must be the
    model's own, else a ConfigError names the key."""
    conv_dim = 8 * 8 + 2 * 2 * 16
    good = {
        "layer_type_list": list("M-*-M-"),
        "conv_states_shape": [conv_dim, 3],  # Megatron's [conv_dim, K-1]
        "ssm_states_shape": [8, 8, 16],
        "mamba_chunk_size": 16,
        "conv_states_dtype": "float32",
        "ssm_states_dtype": "bfloat16",
    }
    w, loaded = load(hybrid_dir, mamba_state_config=json.dumps(good))
    conv, ssm = w.mamba_state
    assert conv.dtype == torch.float32 and ssm.dtype == torch.bfloat16
    assert loaded.mamba_slot_bytes == 2 * (3 * conv_dim * 4 + 8 * 8 * 16 * 2)
    r = w.step(hybrid_plan(1, [Seq(PROMPT[:PREFIX], 0, [1])], init=[-1], out=[0]))
    assert r.error is None and r.token_ids[0] >= 0 and ssm[:, 0].abs().sum() > 0
    w, _ = load(hybrid_dir, mamba_state_config=json.dumps({"conv_states_shape": [3, conv_dim]}))
    assert w.mamba_state[1].dtype == torch.float32  # unset: the model's mamba_ssm_cache_dtype
    for key, value in [
        ("layer_type_list", "M-M-*-"),
        ("conv_states_shape", [4, conv_dim]),
        ("ssm_states_shape", [8, 16, 8]),
        ("mamba_chunk_size", 128),
        ("conv_states_dtype", "bfloat16"),
    ]:
        with pytest.raises(ConfigError, match=f"mamba_inference_state_config.{key}"):
            load(hybrid_dir, mamba_state_config=json.dumps({key: value}))


def test_state_config_on_a_model_without_mamba_layers_is_refused(llama_dir):
    with pytest.raises(ConfigError, match="mamba_inference_state_config is for hybrid models"):
        load(llama_dir, mamba_state_config=json.dumps({"ssm_states_dtype": "float32"}))
