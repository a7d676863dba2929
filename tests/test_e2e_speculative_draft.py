"""Speculative decoding with a draft model (speculative_method "draft_model", issue 29 items 2
and 4) through real processes on the CPU. The target: the looping tiny Llama of
tests/looping.py (greedy outputs follow cycles of its head, with departures).
Each runtime serves PROMPTS twice (the second time from cached prefixes), takes a weight update
that gives the head other cycles (paused, then unpaused), and serves them again, plus a seeded
sampled request and one with a grammar (a regex). Drafts:

- a copy of the target, a model of its own: before the update every greedy draft is accepted
  (the draft's KV cache follows the target's through prefill chunks, plain rows and verify rows
  whose drafts were all accepted, the last of which reaches the draft in the next step); after
  it the draft keeps its old weights and drafts the old cycles: almost nothing is accepted, and
  the outputs are still exact;
- "self:1", the target's first layer and head sharing its weights, at tensor_parallel_size=2
  (the draft sharded as the target): drafts accepted in part before the update and, since the
  draft follows the update, after it too; `taipan replay --check` re-drives the engine's verify
  rows with their placeholder drafts.

Every output equals the runtime's without drafts given the same update.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

from taipan import rl
from taipan.actors.config import ConfigError, InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams, StructuredOutput
from taipan.models import ModelNotFoundError
from tests.looping import (
    BASE,
    GREEDY,
    PROMPTS,
    make_looping,
    make_looping_llama,
)
from tests.ports import free_port
from tests.replay_check import replay_check

K = 3
EMBEDDING = "model.embed_tokens.weight"
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
# A grammar: the gpu walks it over the draft model's drafts as over n-gram ones.
SHAPED = SamplingParams(
    max_tokens=20, temperature=0.0, structured=StructuredOutput("regex", "[a-z ]+[.]")
)


def config(draft: str | None) -> InferenceConfig:
    if draft is None:
        return InferenceConfig(**BASE)
    return InferenceConfig(
        **BASE,
        num_speculative_tokens=K,
        speculative_method="draft_model",
        speculative_model=draft,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, a copy of it, the new head of the update); the target with that head is
    `updated` below."""
    root = tmp_path_factory.mktemp("spec-draft")
    target = make_looping_llama(str(root / "target"))
    # The update's head: other cycles over the same embedding.
    other = make_looping(shutil.copytree(target, str(root / "other")), EMBEDDING, (), 9, 1.0)
    return target, shutil.copytree(target, str(root / "same")), _head_of(other)


@pytest.fixture(scope="module")
def updated(models):
    """A checkpoint of the target after the update (the copy the update's head came from)."""
    return os.path.join(os.path.dirname(models[0]), "other")


def _head_of(path: str) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))["lm_head.weight"]


def _serve(path: str, draft: str | None, head, record_dir=None, tp: int = 1):
    """(outputs, spec counters [drafted, accepted] of the greedy rounds before the update and
    after it)."""
    runtime = Runtime(path, config(draft), record_dir=record_dir, tensor_parallel_size=tp)
    with runtime as rt, Client(rt.address) as c:
        first = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
        again = [list(x.token_ids) for x in c.generate(PROMPTS[::-1], GREEDY)]
        before = c.stats().merged()
        assert c.pause().state == "PAUSED"
        c.update_weights(state={"lm_head.weight": head})
        assert c.unpause().state == "RUNNING"
        updated = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
        after = c.stats().merged()
        sampled = list(c.generate([PROMPTS[1]], SAMPLED)[0].token_ids)
        shaped = list(c.generate([PROMPTS[0]], SHAPED)[0].token_ids)
    counts = [
        (before.spec_draft_tokens, before.spec_accepted_tokens),
        (
            after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens,
        ),
    ]
    return (first, again[::-1], updated, sampled, shaped), counts, after


@pytest.fixture(scope="module")
def plain(models):
    target, _, head = models
    got, _, _ = _serve(target, None, head)
    assert got[2] != got[0]  # the update changed the outputs
    return got


def test_a_copy_of_the_target_drafts_all_then_keeps_its_old_weights(models, plain):
    target, same, head = models
    got, ((drafted, accepted), (drafted2, accepted2)), _ = _serve(target, same, head)
    assert got == plain
    # (349 of 349 when written; a KV hole after a fully accepted row gave 341 of 363)
    assert drafted > 100 and accepted >= 0.99 * drafted, (drafted, accepted)
    assert drafted2 > 0 and accepted2 < 0.2 * drafted2, (drafted2, accepted2)


def test_a_self_draft_at_tp2_follows_the_update(models, plain, tmp_path):
    target, _, head = models
    got, ((drafted, accepted), (drafted2, accepted2)), stats = _serve(
        target, "self:1", head, record_dir=tmp_path, tp=2
    )
    assert got == plain
    assert 0 < accepted < drafted, (drafted, accepted)
    assert drafted2 > 0 and accepted2 > 0.4 * drafted2, (drafted2, accepted2)
    assert (np.asarray(stats.spec_accepted_per_position) > 0).all(), stats
    replay_check(tmp_path)


def test_the_refuse_policy_refuses_updates_and_serves_on(models):
    target, same, head = models
    cfg = dataclasses.replace(config(same), draft_weight_policy="refuse")
    with Runtime(target, cfg) as rt, Client(rt.address) as c:
        assert c.pause().state == "PAUSED"
        with pytest.raises(Exception, match="draft_weight_policy='refuse'"):
            c.update_weights(state={"lm_head.weight": head})
        assert c.unpause().state == "RUNNING"
        assert c.stats().merged().weight_version == 0
        [done] = c.generate([PROMPTS[0]], GREEDY)
        assert len(done.token_ids) == GREEDY.max_tokens


def test_the_disable_policy_stops_speculation_until_the_draft_is_updated(
    models, updated, plain, tmp_path
):
    """draft_weight_policy "disable": the target's update ends speculation; the draft's own
    update (from a checkpoint path, `draft=True`) leaves the target's weights and version as
    they are and starts speculation again, every draft accepted (the draft equals the target
    once more). At tensor_parallel_size=2: the draft is whole on both processes, and both
    take its update. Outputs equal plain decoding's throughout; `taipan replay --check`
    re-plans the engine's steps through both updates."""
    target, same, head = models
    cfg = dataclasses.replace(config(same), draft_weight_policy="disable")
    runtime = Runtime(target, cfg, record_dir=tmp_path, tensor_parallel_size=2)
    with runtime as rt, Client(rt.address) as c:
        assert [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)] == plain[0]
        assert c.pause().state == "PAUSED"
        assert c.update_weights(state={"lm_head.weight": head}).weight_version == 1
        assert c.unpause().state == "RUNNING"
        before = c.stats().merged()
        assert before.spec_draft_disabled == 1
        assert [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)] == plain[2]
        stopped = c.stats().merged()
        assert stopped.spec_draft_tokens == before.spec_draft_tokens  # nothing drafted
        assert c.pause().state == "PAUSED"
        ack = c.update_weights(updated, draft=True)
        assert ack.weight_version == 1  # (the target's, as it was)
        assert c.unpause().state == "RUNNING"
        assert c.stats().merged().spec_draft_disabled == 0
        assert [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)] == plain[2]
        after = c.stats().merged()
        drafted = after.spec_draft_tokens - stopped.spec_draft_tokens
        accepted = after.spec_accepted_tokens - stopped.spec_accepted_tokens
        assert drafted > 50 and accepted >= 0.95 * drafted, (drafted, accepted)
        # A draft's update from a state dict, in flight, under any policy; never with the
        # target's version, and never on a runtime without a draft of its own.
        ack = c.update_weights(state={"lm_head.weight": head}, draft=True, in_flight=True)
        assert ack.weight_version == 1
        with pytest.raises(ValueError, match="takes no weight_version"):
            c.update_weights(updated, draft=True, weight_version=5)
        # The draft's weights from a trainer's process (gloo; both tensor-parallel processes
        # join and take the draft whole): the target's first head back into the draft, which
        # then drafts the old cycles, few accepted; the target's version stays.
        assert c.has_draft_weights()
        group = rl.join(c, "127.0.0.1", free_port())
        with pytest.raises(ValueError, match="takes no weight_version"):
            c.update_weights_from_distributed([], draft=True, weight_version=5)
        assert c.pause().state == "PAUSED"
        old_head = {"lm_head.weight": torch.from_numpy(_head_of(target))}
        assert rl.push_weights(c, old_head, group, draft=True).weight_version == 1
        assert c.unpause().state == "RUNNING"
        assert [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)] == plain[2]
        pushed = c.stats().merged()
        drafted = pushed.spec_draft_tokens - after.spec_draft_tokens
        accepted = pushed.spec_accepted_tokens - after.spec_accepted_tokens
        assert drafted > 0 and accepted < 0.3 * drafted, (drafted, accepted)
        assert pushed.weight_version == 1
        c.close_weight_transfer()
        group.close()
    replay_check(tmp_path)
    with Runtime(target, config("self:1")) as rt, Client(rt.address) as c:
        assert not c.has_draft_weights()
        assert c.pause().state == "PAUSED"
        with pytest.raises(Exception, match="needs a draft model with weights of its own"):
            c.update_weights(updated, draft=True)
        # (a trainer's push is refused before its first broadcast, which would wait out the
        # group's timeout)
        with pytest.raises(RuntimeError, match="needs a draft model with weights of its own"):
            rl.push_weights(c, {"lm_head.weight": torch.zeros(1)}, None, draft=True)


def test_draft_model_settings_are_checked(models, tmp_path):
    target = models[0]
    with pytest.raises(ConfigError, match="needs speculative_model"):
        InferenceConfig(num_speculative_tokens=2, speculative_method="draft_model")
    with pytest.raises(ConfigError, match="'self:N' needs N >= 1"):
        config("self:0")
    with pytest.raises(ModelNotFoundError, match="no such file"):  # (before any process)
        Runtime(target, config(str(tmp_path / "nothing")))
    with pytest.raises(Exception, match="N must be in 1..1"):
        with Runtime(target, config("self:2")):
            pass
    # A draft of another vocabulary fails the start, naming why.
    from safetensors.numpy import load_file, save_file

    other = shutil.copytree(models[1], str(tmp_path / "other"))
    weights = os.path.join(other, "model.safetensors")
    state = load_file(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = np.concatenate([state[name], state[name][:1]])
    save_file(state, weights, metadata={"format": "pt"})
    with open(os.path.join(other, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(cfg | {"vocab_size": cfg["vocab_size"] + 1}, f)
    with pytest.raises(Exception, match="needs the same tokenizer"):
        with Runtime(target, config(other)):
            pass


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """The GPU tests' (target, a copy of it, the target with another head): a looping model
    of GPU_TINY_SHAPE (head dims the CUDA kernels serve)."""
    import torch

    from tests.random_llama import GPU_TINY_SHAPE, make_random_llama

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("gpu-draft")
    target = make_random_llama(str(root / "target"), GPU_TINY_SHAPE)
    make_looping(target, EMBEDDING, ("o_proj.weight", "down_proj.weight"), 0, 0.7)
    same = shutil.copytree(target, str(root / "same"))
    other = make_looping(shutil.copytree(target, str(root / "other")), EMBEDDING, (), 9, 1.0)
    return target, same, other


@pytest.mark.gpu
def test_gpu_draft_models_with_graphs_and_overlap(gpu_models):
    """On CUDA (fp32; the target's steps in CUDA graphs, overlapped; the draft's one-token
    forwards in its own graphs, actors/gpu/draft_graphs.py): a copy
    of the target and a self:1 draft give the tokens plain decoding gives, with drafts
    accepted (all of them for the copy)."""
    target, same, _ = gpu_models
    outs, stats = {}, {}
    for name, draft in (("plain", None), ("same", same), ("self", "self:1")):
        with Runtime(target, config(draft), device="cuda") as rt, Client(rt.address) as c:
            outs[name] = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
            stats[name] = c.stats().merged()
    assert outs["same"] == outs["plain"] and outs["self"] == outs["plain"]
    same_stats, self_stats = stats["same"], stats["self"]
    assert same_stats.spec_accepted_tokens >= 0.99 * same_stats.spec_draft_tokens > 0
    assert 0 < self_stats.spec_accepted_tokens < self_stats.spec_draft_tokens
    assert stats["plain"].steps_graphed > 0 and self_stats.steps_graphed > 0


@pytest.mark.gpu
def test_gpu_a_draft_update_reaches_its_graphed_forwards(gpu_models):
    """On CUDA, the draft's forwards in CUDA graphs: its weights updated in place
    (update_weights(path, draft=True)) are what the graphs read next. A copy of the target
    drafts all; updated to another head it drafts the wrong cycles (few accepted); updated back
    it drafts all again; that other head again, from a trainer's CUDA tensor by IPC handle
    (rl.push_weights_ipc(draft=True)), few accepted again. The outputs stay plain decoding's
    throughout."""
    target, same, other = gpu_models
    rounds = []
    ipc_head = {"lm_head.weight": torch.from_numpy(_head_of(other)).cuda()}
    with Runtime(target, config(same), device="cuda") as rt, Client(rt.address) as c:
        for draft in (None, other, same, "ipc"):
            if draft is not None:
                assert c.pause().state == "PAUSED"
                if draft == "ipc":
                    ack = rl.push_weights_ipc(c, ipc_head, draft=True)
                else:
                    ack = c.update_weights(draft, draft=True)
                assert ack.weight_version == 0
                assert c.unpause().state == "RUNNING"
            got = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
            s = c.stats().merged()
            rounds.append((got, s.spec_draft_tokens, s.spec_accepted_tokens, s.steps_graphed))
    assert all(r[0] == rounds[0][0] for r in rounds)
    (_, d0, a0, graphed), (_, d1, a1, _), (_, d2, a2, _), (_, d3, a3, _) = rounds
    assert graphed > 0 and a0 >= 0.99 * d0 > 0, rounds[0][1:]
    assert a1 - a0 < 0.5 * (d1 - d0), (d1 - d0, a1 - a0)
    assert a2 - a1 >= 0.99 * (d2 - d1) > 0, (d2 - d1, a2 - a1)
    assert a3 - a2 < 0.5 * (d3 - d2), (d3 - d2, a3 - a2)
