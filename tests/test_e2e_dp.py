"""Data parallelism (issue 12 item 1) through real processes: `LLM(data_parallel_size=2)` starts
two engine ranks behind one coordinator, each pinned to its own share of the cores.

- greedy outputs on held-out prompts and seeded samples equal one rank's (the session runtime);
  both ranks serve, stats come per rank and merged;
- prefix routing follows the true table: prompts sharing a cached prefix all go to the rank that
  holds it, and only that rank reports the hits;
- the lifecycle (pause, suspend, update_weights, resume, unpause) reaches every rank;
- `taipan replay --check` re-drives the coordinator and both ranks' engines and allocators.
The SIGKILL of one rank under load is in tests/test_e2e_failures.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from taipan import LLM, SamplingParams
from taipan.actors.config import InferenceConfig
from taipan.client import ControlError
from taipan.launcher import LaunchError, Runtime
from taipan.messages.lifecycle import LifecycleState
from taipan.placement import rank_cpu_sets, rank_device
from tests.conftest import TEST_CONFIG
from tests.test_e2e_replay import replay

HELD_OUT = [
    "A lighthouse keeper wrote in his log that",
    "The three primary colors are",
    "def fibonacci(n):",
    "In 1969, the first person to walk on the Moon",
    "Translate to French: good morning",
    "The recipe calls for two cups of",
    "Photosynthesis converts sunlight into",
    "The quick brown fox",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
# Prefix caching on, routed by longest prefix (the true table of each rank's cached hashes).
DP_CONFIG = dict(TEST_CONFIG, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def dp2(model_path, tmp_path_factory):
    rec = tmp_path_factory.mktemp("dp2")
    with LLM(model_path, data_parallel_size=2, record_dir=str(rec), **DP_CONFIG) as llm:
        yield llm, rec


def test_outputs_equal_one_rank_and_both_ranks_serve(dp2, client):
    llm, _ = dp2
    want = client.generate(HELD_OUT, GREEDY)
    got = llm.generate(HELD_OUT, GREEDY, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # Seeded samples do not depend on the rank that drew them (nor on its batch).
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i) for i in range(4)]
    want = [client.generate([p], s)[0] for p, s in zip(HELD_OUT, seeded, strict=False)]
    got = llm.generate(HELD_OUT[:4], seeded, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = llm.stats()
    assert [(r.rank, r.alive) for r in stats.ranks] == [(0, True), (1, True)]
    assert all(r.steps_total > 0 and r.prefix_prompt_tokens > 0 for r in stats.ranks)
    merged = stats.merged()
    assert merged.rank == -1 and merged.alive
    assert merged.steps_total == sum(r.steps_total for r in stats.ranks)
    assert merged.num_blocks == sum(r.num_blocks for r in stats.ranks)
    assert merged.prefix_prompt_tokens == sum(r.prefix_prompt_tokens for r in stats.ranks)


def test_prefix_routing_sends_shared_prompts_to_the_rank_that_caches_them(dp2):
    llm, _ = dp2
    prefix = "You are a careful assistant. Answer briefly and cite the source. " * 5
    [first] = llm.generate([prefix + "Question 0?"], GREEDY, use_tqdm=False)
    cached_blocks = len(first.prompt_token_ids) // TEST_CONFIG["block_size_tokens"]
    assert cached_blocks >= 3
    before = llm.stats().ranks
    done = llm.generate([prefix + f"Question {i}?" for i in range(1, 5)], GREEDY, use_tqdm=False)
    after = llm.stats().ranks
    prompt_delta = [
        a.prefix_prompt_tokens - b.prefix_prompt_tokens for a, b in zip(after, before, strict=True)
    ]
    cached_delta = [
        a.prefix_cached_tokens - b.prefix_cached_tokens for a, b in zip(after, before, strict=True)
    ]
    # Every request went to the one rank holding the prefix, and hit it there.
    assert sorted(d > 0 for d in prompt_delta) == [False, True], prompt_delta
    assert sorted(cached_delta)[0] == 0 and sum(cached_delta) == sum(
        c.num_cached_tokens for c in done
    )
    assert all(c.num_cached_tokens >= 3 * TEST_CONFIG["block_size_tokens"] for c in done)


def test_lifecycle_reaches_every_rank(dp2, model_path):
    import torch

    from taipan.ops.loader import load_model

    llm, _ = dp2
    [before] = llm.generate(HELD_OUT[:1], GREEDY, use_tqdm=False)
    model, _, _ = load_model(model_path, dtype=torch.float32, device="cpu")
    same = model.norm.weight.detach().numpy().copy()  # an update that changes nothing
    assert llm.pause().state == LifecycleState.PAUSED
    assert [r.state for r in llm.stats().ranks] == [LifecycleState.PAUSED] * 2
    # Without asking the engines: the coordinator's state and the reports it holds.
    cached = llm.stats(fresh=False)
    assert cached.state == LifecycleState.PAUSED and len(cached.ranks) == 2
    assert llm.suspend("offload").state == LifecycleState.SUSPENDED
    assert llm.update_weights(state={"model.norm.weight": same}).weight_version == 1
    # Staged on both ranks and committed on both (all or none); refused on both, none moves.
    with pytest.raises(ControlError, match="engine 0.*engine 1|engine 1.*engine 0"):
        llm.update_weights(state={"model.norm.weight": same[:-1]})
    llm.resume()
    llm.unpause()
    stats = llm.stats()
    assert [(r.state, r.weight_version) for r in stats.ranks] == [("RUNNING", 1)] * 2
    again = llm.generate(HELD_OUT[:4], GREEDY, use_tqdm=False)
    assert again[0].token_ids == before.token_ids
    # Both ranks serve the committed version, and say so for every token.
    assert all(c.weight_versions == [(1, 0)] for c in again), [c.weight_versions for c in again]
    assert all(r.steps_total > 0 for r in llm.stats().ranks)
    # In flight: no pause; staged on both ranks, committed on both, the runtime stays RUNNING.
    with pytest.raises(ControlError, match="in_flight=True"):
        llm.update_weights(state={"model.norm.weight": same})
    ack = llm.update_weights(state={"model.norm.weight": same}, weight_version=9, in_flight=True)
    assert ack.weight_version == 9 and ack.state == LifecycleState.RUNNING
    assert [(r.state, r.weight_version) for r in llm.stats().ranks] == [("RUNNING", 9)] * 2
    with pytest.raises(ControlError, match="engine 0.*engine 1|engine 1.*engine 0"):
        llm.update_weights(state={"model.norm.weight": same[:-1]}, in_flight=True)
    [after] = llm.generate(HELD_OUT[:1], GREEDY, use_tqdm=False)
    assert after.token_ids == before.token_ids and after.weight_versions == [(9, 0)]


def test_replay_checks_both_ranks(dp2):
    llm, rec = dp2
    llm.shutdown()  # the logs are complete once every process has exited
    names = sorted(p.stem for p in rec.glob("*.tplog"))
    assert names == [
        "allocator-0", "allocator-1", "coordinator", "engine-0", "engine-1", "gpu-0", "gpu-1",
    ]  # fmt: skip
    done = replay(rec, "--check", "--allow-unchecked")
    assert done.returncode == 0, done.stdout + done.stderr
    for actor in ("coordinator", "engine-0", "engine-1", "allocator-0", "allocator-1"):
        assert f"{actor}: ok" in done.stdout, done.stdout


def test_ranks_get_their_own_cores_and_devices():
    assert rank_cpu_sets(1, [0, 1]) == [None]
    assert rank_cpu_sets(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert rank_cpu_sets(3, [4, 5]) == [[4], [5], [4]]  # more ranks than cores: shared
    assert [rank_device("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [rank_device("cuda:2", r, 2) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert rank_device("cuda:1", 0, 1) == "cuda:1" and rank_device("cpu", 1, 2) == "cpu"
    cores = sorted(os.sched_getaffinity(0))
    sets = [s for s in rank_cpu_sets(2, cores) if s is not None]
    assert sum(len(s) for s in sets) >= min(2, len(cores))
    assert np.concatenate(sets).tolist() == cores or len(cores) < 2


def test_refusals(model_path):
    for kw, text in [
        (dict(data_parallel_size=0), "data_parallel_size must be an int >= 1"),
        (dict(expert_parallel_size=2), "must divide data_parallel_size=1"),
        (dict(data_parallel_size=4, expert_parallel_size=3), "must divide data_parallel_size=4"),
        (
            dict(config=InferenceConfig(ep_consensus_interval=5)),
            "ep_consensus_interval=5 applies to expert-parallel groups only",
        ),
        (dict(data_parallel_size=2, direct=True), "direct mode drives one engine rank"),
    ]:
        with pytest.raises(LaunchError, match=text):
            Runtime(model_path, **kw)
    with pytest.raises(ValueError, match="parallel sizes"):
        LLM(address="ipc:///nowhere", data_parallel_size=2)
