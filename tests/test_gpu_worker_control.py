"""The gpu worker's lifecycle controls (GpuControl -> GpuControlReply), the worker alone on CPU.

A small random Llama (tests/random_llama.py) saved as a Hugging Face directory is both what the
worker loads and, through transformers, the oracle for weight updates.

Checks: suspend / resume in each mode (offload keeps the KV bytes and the next decode step's
result, recompute reports kv_valid False, persist keeps the very tensor); a step while suspended
and illegal orders come back as errors naming the state; update_weights from a state dict (a
few matrices, the tied lm_head, a whole `state_dict()`) and from a checkpoint directory gives
exactly Hugging Face's logits for the modified model; bad names, shapes and checkpoints error
and leave the weights alone; weight_version counts successful updates; the actor shell turns
every control, even a failing one, into a GpuControlReply.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from taipan.actors.channel import Envelope
from taipan.actors.gpu import controls
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import GpuControl, GpuControlReply, LoadModel
from taipan.ops.attention import build_attention_metadata
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_ops_logprobs import Seq, make_plan

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101, 32]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")), TINY_SHAPE)


@pytest.fixture
def worker(model_dir):
    w = ModelWorker()
    w.load(LoadModel(model_dir, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 8, 128))
    return w


@pytest.fixture
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def control(worker, command, mode=None, path=None, state=None):
    return worker.control(GpuControl(command, mode, path, state))


def prefill_and_decode(worker) -> tuple[object, object]:
    """Prefill PROMPT, then decode one token (asking its log-prob). Returns both results."""
    first = worker.step(make_plan(1, [Seq(PROMPT, 0, [5, 2])]))
    token = int(first.token_ids[0])
    second = worker.step(make_plan(2, [Seq([token], len(PROMPT), [5, 2], logprobs=True)]))
    return first, second


@torch.no_grad()
def our_logits(worker, ids: list[int]) -> torch.Tensor:
    meta, positions = build_attention_metadata([len(ids)], [len(ids)], [[1, 3]], BLOCK_SIZE)
    hidden = worker.model(torch.tensor(ids), positions, meta, worker.kv_cache)
    return worker.model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def assert_matches_hf(worker, hf_model) -> None:
    torch.testing.assert_close(
        our_logits(worker, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0
    )


def weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in worker.model.state_dict().items()}


def assert_same_weights(worker, before: dict[str, torch.Tensor]) -> None:
    for name, t in worker.model.state_dict().items():
        assert torch.equal(t, before[name]), name


# ---- suspend / resume ---------------------------------------------------------------------------


def test_offload_on_cpu_keeps_the_kv_in_place_and_the_next_step(worker):
    # On a CPU device the KV cache already is host memory: offload must not copy (double) it.
    _, decoded = prefill_and_decode(worker)
    kv, before = worker.kv_cache, worker.kv_cache.clone()
    reply = control(worker, "suspend", "offload")
    assert reply.error is None and reply.kv_valid and reply.weight_version == 0
    assert worker.kv_cache is kv and worker.suspend_mode == "offload"
    assert worker._kv_offloaded is None  # no second copy
    reply = control(worker, "resume")
    assert reply.error is None and reply.kv_valid and worker.kv_cache is kv
    # Compare bits: the never-written slots hold garbage, possibly NaN patterns.
    assert torch.equal(worker.kv_cache.view(torch.int32), before.view(torch.int32))
    token = int(decoded.token_ids[0])
    again = worker.step(make_plan(2, [Seq([token], len(PROMPT), [5, 2], logprobs=True)]))
    assert again.token_ids.tolist() == decoded.token_ids.tolist()
    assert again.log_probs.tolist() == decoded.log_probs.tolist()


def test_device_offload_refuses_when_the_host_lacks_memory(worker, monkeypatch):
    """A device KV cache goes to pinned host memory only if the host has room; else the worker
    refuses and nothing changes. (The copy itself runs on a GPU: tests/test_gpu.py.)"""
    kv = worker.kv_cache
    kv_bytes = kv.numel() * kv.element_size()
    monkeypatch.setattr(worker, "device", torch.device("cuda"))  # never touched: refused first
    monkeypatch.setattr(controls, "available_host_memory", lambda: kv_bytes)
    reply = control(worker, "suspend", "offload")
    assert reply.error is not None and "offload needs" in reply.error and "GiB" in reply.error
    assert "persist or recompute" in reply.error
    assert worker.kv_cache is kv and worker.suspend_mode is None and reply.kv_valid


def test_recompute_drops_the_kv_and_says_so(worker):
    first, _ = prefill_and_decode(worker)
    shape = worker.kv_cache.shape
    reply = control(worker, "suspend", "recompute")
    assert reply.error is None and not reply.kv_valid and worker.kv_cache is None
    reply = control(worker, "resume")
    assert reply.error is None and not reply.kv_valid
    assert worker.kv_cache.shape == shape
    # Re-prefilling (what the engine does on kv_valid False) gives the same token again.
    again = worker.step(make_plan(3, [Seq(PROMPT, 0, [5, 2])]))
    assert again.token_ids.tolist() == first.token_ids.tolist()
    assert control(worker, "suspend", "persist").kv_valid  # valid again after the re-prefill


def test_persist_keeps_the_tensor(worker):
    prefill_and_decode(worker)
    kv = worker.kv_cache
    reply = control(worker, "suspend", "persist")
    assert reply.error is None and reply.kv_valid and worker.kv_cache is kv
    reply = control(worker, "resume")
    assert reply.error is None and reply.kv_valid and worker.kv_cache is kv


def test_step_while_suspended_is_an_error(worker):
    control(worker, "suspend", "persist")
    r = worker.step(make_plan(1, [Seq(PROMPT, 0, [5, 2])]))
    assert r.error == "the gpu worker is suspended" and r.token_ids.tolist() == [-1]


def test_illegal_orders_and_bad_commands_error_and_change_nothing(worker):
    cases = [
        (("resume",), "running"),
        (("update_weights", None, None, None), "exactly one of path, state, buckets and ipc"),
        (("suspend", None), "suspend needs a mode (persist, offload, recompute)"),
    ]
    for args, text in cases:
        reply = control(worker, *args)
        assert reply.error is not None and text in reply.error, (args, reply.error)
        assert worker.suspend_mode is None and worker.kv_cache is not None
    # Commands and modes are enums: a value that is none cannot even be made (nor decoded).
    for args in [("suspend", "hibernate"), ("reload",)]:
        with pytest.raises(ValueError):
            control(worker, *args)
    assert control(worker, "suspend", "recompute").error is None
    reply = control(worker, "suspend", "persist")
    assert "already suspended (mode recompute)" in reply.error
    assert worker.suspend_mode == "recompute" and worker.kv_cache is None
    assert "no model is loaded" in control(ModelWorker(), "resume").error


# ---- update_weights -----------------------------------------------------------------------------


def perturb(hf_model, names: list[str], seed: int) -> dict[str, np.ndarray]:
    """Add noise to `names` of the HF model in place; return them as a state dict."""
    gen = torch.Generator().manual_seed(seed)
    params = hf_model.state_dict(keep_vars=True)  # named_parameters() hides the tied lm_head
    with torch.no_grad():
        for name in names:
            params[name].add_(torch.randn(params[name].shape, generator=gen) * 0.05)
    return {name: params[name].detach().numpy().copy() for name in names}


def test_update_from_a_state_dict_matches_hf(worker, hf_model):
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    state = perturb(hf_model, names, seed=1)
    original = our_logits(worker, PROMPT)
    assert control(worker, "suspend", "persist").error is None
    reply = control(worker, "update_weights", state=state)
    assert reply.error is None and reply.weight_version == 1
    assert control(worker, "resume").weight_version == 1
    assert not torch.allclose(our_logits(worker, PROMPT), original, atol=1e-3)
    assert_matches_hf(worker, hf_model)


def test_a_staged_update_changes_nothing_until_committed(worker, hf_model):
    """The two phases an expert-parallel group uses: stage (every check, nothing copied),
    then commit or discard."""
    state = perturb(hf_model, ["model.layers.0.mlp.up_proj.weight"], seed=4)
    before = weights(worker)
    assert control(worker, "suspend", "persist").error is None
    assert "no weights are staged" in control(worker, "commit_weights").error
    bad = dict(state, **{"model.norm.weight": np.zeros(3, np.float32)})
    assert "model.norm.weight" in control(worker, "stage_weights", state=bad).error
    assert "no weights are staged" in control(worker, "commit_weights").error  # none held
    assert control(worker, "stage_weights", state=state).error is None
    assert_same_weights(worker, before)
    assert control(worker, "discard_weights").error is None
    assert control(worker, "commit_weights").error  # dropped
    assert_same_weights(worker, before)
    assert control(worker, "stage_weights", state=state).error is None
    reply = control(worker, "commit_weights")
    assert reply.error is None and reply.weight_version == 1
    assert control(worker, "resume").error is None
    assert_matches_hf(worker, hf_model)


def test_tied_lm_head_and_a_whole_state_dict(worker, hf_model):
    control(worker, "suspend", "persist")
    (lm_head,) = perturb(hf_model, ["lm_head.weight"], seed=2).values()  # tied: the embedding
    assert control(worker, "update_weights", state={"lm_head.weight": lm_head}).error is None
    assert np.array_equal(worker.model.embed_tokens.weight.numpy(), lm_head)
    perturb(
        hf_model, [f"model.layers.1.{p}.weight" for p in ("self_attn.k_proj", "mlp.gate_proj")], 3
    )
    full = {name: t.numpy() for name, t in hf_model.state_dict().items()}
    assert "lm_head.weight" in full and "model.embed_tokens.weight" in full
    reply = control(worker, "update_weights", state=full)
    assert reply.error is None and reply.weight_version == 2
    control(worker, "resume")
    assert_matches_hf(worker, hf_model)


def test_update_from_a_checkpoint_directory_matches_hf(worker, hf_model, model_dir, tmp_path):
    perturb(hf_model, ["model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"], 4)
    hf_model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{name}", tmp_path / name)
    control(worker, "suspend", "offload")
    reply = control(worker, "update_weights", path=str(tmp_path))
    assert reply.error is None and reply.weight_version == 1
    control(worker, "resume")
    assert_matches_hf(worker, hf_model)


def test_bad_updates_error_and_leave_the_weights(worker, tmp_path):
    control(worker, "suspend", "persist")
    before = weights(worker)
    q = np.zeros((64, 64), dtype=np.float32)  # q_proj is [heads * head_dim, hidden] = [64, 64]
    other = make_random_llama(str(tmp_path / "other"), {**TINY_SHAPE, "intermediate_size": 128})
    cases = [
        ({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.9.mlp.up_proj.weight": q},
         "unknown parameter 'model.layers.9.mlp.up_proj.weight'"),
        ({"model.layers.0.self_attn.q_proj.weight": q,
          "model.layers.1.self_attn.k_proj.weight": q}, "expected (32, 64)"),
        ({"model.norm.weight": np.zeros(64, dtype=np.int32)}, "not a floating-point"),
        ({"lm_head.weight": np.zeros((259, 64), np.float32),
          "model.embed_tokens.weight": np.ones((259, 64), np.float32)}, "differ"),
    ]  # fmt: skip
    for state, text in cases:
        reply = control(worker, "update_weights", state=state)
        assert reply.error is not None and text in reply.error, reply.error
        assert reply.weight_version == 0
    for path, text in [(other, "intermediate_size 128 (loaded: 96)"), ("/no/such", "no such")]:
        reply = control(worker, "update_weights", path=path)
        assert reply.error is not None and text in reply.error, reply.error
    reply = control(worker, "update_weights", path=other, state={})
    assert "exactly one of path, state, buckets and ipc" in reply.error
    assert_same_weights(worker, before)
    assert worker.weight_version == 0 and worker.suspend_mode == "persist"


# ---- the actor shell ----------------------------------------------------------------------------


class FakeChannel:
    """Stands in for the engine's inproc channel: records what the actor sends back."""

    name, routed = "gpu", False

    def __init__(self):
        self.sent = []

    async def send(self, msg, to=None) -> None:
        self.sent.append(msg)


@pytest.mark.asyncio
async def test_actor_answers_every_control_with_a_reply(monkeypatch):
    channel = FakeChannel()
    actor = GpuActor(0, channel)

    async def send(msg) -> None:
        await actor.dispatch(Envelope(channel, None, msg, None, 0.0))

    await send(GpuControl("resume", None, None, None))  # no model: a reply, not a raise

    def broken(msg):
        raise RuntimeError("device lost")

    monkeypatch.setattr(actor.worker, "control", broken)
    await send(GpuControl("suspend", "offload", None, None))
    actor.executor.shutdown()
    first, second = channel.sent
    assert isinstance(first, GpuControlReply) and "no model is loaded" in first.error
    assert isinstance(second, GpuControlReply) and second.command == "suspend"
    assert second.error == "RuntimeError: device lost" and second.weight_version == 0


def test_static_kv_pointers_refuse_every_suspend_but_persist(model_dir):
    w = ModelWorker()
    load = LoadModel(model_dir, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 8, 128)
    w.load(dataclasses.replace(load, static_kv_memory_pointers=True))
    for mode in ("offload", "recompute"):
        reply = control(w, "suspend", mode)
        assert "static_kv_memory_pointers" in reply.error and w.suspend_mode is None
    kv = w.kv_cache
    assert control(w, "suspend", "persist").error is None
    assert control(w, "resume").error is None and w.kv_cache is kv


def test_cuda_graph_sizes_on_cpu_fail_the_load(model_dir):
    load = LoadModel(model_dir, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 8, 128, (1, 2))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelWorker().load(load)


# ---- hybrid (NemotronH) models: Mamba state slots ----------------------------------------------


def test_hybrid_state_follows_every_suspend_mode(tmp_path):
    """A hybrid's Mamba state slots: persist and (CPU) offload keep them, recompute drops them
    and resume brings them back zeroed."""
    from tests.random_nemotron_h import make_random_nemotron_h

    path = make_random_nemotron_h(str(tmp_path / "nh"), pattern="M-*-")
    w = ModelWorker()
    loaded = w.load(LoadModel(path, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 4, 128))
    assert loaded.mamba_slots == 4 and loaded.mamba_slot_bytes > 0
    plan = dataclasses.replace(
        make_plan(1, [Seq(PROMPT, 0, [5, 2])]),
        mamba_init=np.array([-1], np.int32),
        mamba_out=np.array([2], np.int32),
    )
    assert w.step(plan).error is None
    conv, ssm = w.mamba_state
    assert ssm[:, 2].abs().sum() > 0 and ssm[:, [0, 1, 3]].abs().sum() == 0
    saved = [t.clone() for t in w.mamba_state]
    for mode in ("persist", "offload"):
        assert control(w, "suspend", mode).error is None
        assert control(w, "resume").error is None
        assert all(torch.equal(t, s) for t, s in zip(w.mamba_state, saved, strict=True)), mode
    assert control(w, "suspend", "recompute").error is None and w.mamba_state is None
    assert control(w, "resume").error is None
    assert all(t.abs().sum() == 0 for t in w.mamba_state)


def test_hybrid_weight_updates_from_a_checkpoint_and_a_state_dict(tmp_path):
    """update_weights on a hybrid: a checkpoint of another seed (same shape) gives exactly the
    weights a fresh load of it has; a state dict in Hugging Face names (backbone.*, the
    attention mixer's q/k/v parts of our fused qkv_proj) lands in the right rows; another
    pattern, or a name we lack, is refused naming it, and changes nothing."""
    import transformers

    from tests.random_nemotron_h import make_random_nemotron_h

    path = make_random_nemotron_h(str(tmp_path / "a"), pattern="M-*-")
    other = make_random_nemotron_h(str(tmp_path / "b"), pattern="M-*-", seed=1)
    wrong = make_random_nemotron_h(str(tmp_path / "c"), pattern="*-M-")
    load = LoadModel(path, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 4, 128)
    w, fresh = ModelWorker(), ModelWorker()
    w.load(load)
    fresh.load(dataclasses.replace(load, model=other))
    assert control(w, "suspend", "persist").error is None
    before = weights(w)
    reply = control(w, "update_weights", path=wrong)
    assert "pattern" in reply.error and "not the loaded architecture" in reply.error
    reply = control(w, "update_weights", state={"backbone.nope.weight": np.zeros(1, np.float32)})
    assert "unknown parameter 'backbone.nope.weight'" in reply.error
    assert_same_weights(w, before)
    assert control(w, "update_weights", path=other).error is None and w.weight_version == 1
    assert_same_weights(w, weights(fresh))
    # Back to the first model's weights, from its HF state dict with the names of a saved
    # checkpoint (backbone.*; transformers' in-memory model says model.*), q/k/v split.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {
        name.replace("model.", "backbone.", 1): t.numpy() for name, t in hf.state_dict().items()
    }
    assert any(".mixer.k_proj." in n for n in state)
    assert control(w, "update_weights", state=state).error is None and w.weight_version == 2
    assert_same_weights(w, before)


def test_the_step_event_sync_comes_from_the_environment(monkeypatch, tmp_path):
    """$TAIPAN_STEP_EVENT_SYNC: "blocking" (the default) or "spin" (the step's end event, on
    CUDA); any other value fails the load, naming the variable."""
    from taipan.actors.gpu.worker import SYNC_ENV, step_event_blocking

    monkeypatch.delenv(SYNC_ENV, raising=False)
    assert step_event_blocking() is True
    monkeypatch.setenv(SYNC_ENV, "spin")
    assert step_event_blocking() is False
    monkeypatch.setenv(SYNC_ENV, "blocking")
    assert step_event_blocking() is True
    monkeypatch.setenv(SYNC_ENV, "yield")
    with pytest.raises(ValueError, match=SYNC_ENV):
        step_event_blocking()
    w = ModelWorker()
    msg = LoadModel(make_random_llama(str(tmp_path), TINY_SHAPE), "float32", "cpu", 16, 8,
                    0.01, 64, 4, 64)  # fmt: skip
    with pytest.raises(ValueError, match=SYNC_ENV):
        w.load(msg)


def test_which_cuda_steps_launch_inline_and_which_wait():
    """ModelWorker's dispatch rules on CUDA (the worker's fields set by hand: no GPU needed): a
    plain step and one with raw log-probs of its sampled tokens (an RL rollout's, read at
    collect) launch inline; top-n log-probs (a sorted top-k may wait) launch from the worker's
    thread without waiting; verify rows, and a grammar step's log-probs (its rows checked in
    the launch), wait in their launch; a grammar step launches from the thread in either
    grammar mode (it waits for the step before it)."""
    import types

    from taipan.actors.gpu.grammar_masks import GrammarMasks

    w = ModelWorker()
    w.device = torch.device("cuda")

    def plan(logprobs=0, top_n=0, drafts=0, grammar=False):
        return types.SimpleNamespace(
            logprobs=np.array([logprobs, 0], np.int8), top_n=np.array([top_n, 0], np.int32),
            prompt_targets=np.full(3, -1, np.int32), logprobs_mode=np.zeros(0, np.int8),
            temperature=np.ones(2, np.float32), seq_lens=np.ones(2, np.int32),
            num_drafts=np.array([drafts, 0], np.int32),
            grammar_rows=np.array([7, -1] if grammar else [], np.int64),
            grammar_new=[], grammar_drop=np.zeros(0, np.int64),
        )  # fmt: skip

    rules = {
        "plain": (plan(), True, False),
        "raw log-probs": (plan(logprobs=1), True, False),
        "top-n": (plan(logprobs=1, top_n=5), False, False),
        "verify": (plan(drafts=3), False, True),
        "grammar": (plan(grammar=True), False, False),
        "grammar log-probs": (plan(logprobs=1, grammar=True), False, True),
    }
    for name, (p, inline, waits) in rules.items():
        assert (w.launches_inline(p), w.launch_waits(p)) == (inline, waits), name
    w.grammar_masks = GrammarMasks(None, check_greedy=False)  # ("mask")
    assert not w.launches_inline(plan(grammar=True))
    assert not w.launches_inline(plan(logprobs=1, grammar=True))
