"""Expert parallelism end to end (issue 12 items 3 and 4): real coordinator and engine processes
with `--data-parallel-size 2 --expert-parallel-size 2`, real sockets, real gloo collectives, the
tiny random Qwen3-MoE and NemotronH-with-`E` models of tests/random_moe.py. Each rank holds half
the experts; every MoE layer exchanges tokens between the ranks; the engines agree over ZMQ
before stepping.

- greedy tokens equal Hugging Face's, at EP=1 and EP=2, for both model families;
- one rank given a long request, the other nothing, for 150 steps: it completes (the idle rank
  runs dummy steps), with synchronous consensus rounds (`use_synchronous_zmq_collectives`);
- pausing mid-generation completes on both ranks, nothing steps while paused, and after the
  unpause the tokens are those of an uninterrupted run;
- an update_weights that fails on one rank only (an expert it alone holds, with a wrong shape)
  leaves both ranks on the old weights, and the error names that rank; a good one lands on both;
- `taipan replay --check` passes over both engines' logs, consensus rounds included;
- SIGKILL of one rank: the other's requests fail within 5 s naming the group, and it exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client, ControlError
from taipan.launcher import Runtime
from taipan.messages.requests import FinishReason, SamplingParams
from tests.random_moe import make_random_nemotron_h_moe, make_random_qwen3_moe, router_margin
from tests.replay_check import replay_check
from tests.test_ops_moe import hf_greedy

transformers = pytest.importorskip("transformers")
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
MODELS = {
    "qwen3_moe": lambda path: make_random_qwen3_moe(path),
    "nemotron_h_moe": lambda path: make_random_nemotron_h_moe(path, "M-*E-ME"),
}
CONFIG = dict(
    block_size_tokens=16,
    max_tokens=48,
    max_requests=4,
    buffer_size_gb=0.05,
    max_sequence_length=256,
    enable_chunked_prefill=True,
)
EP2 = dict(data_parallel_size=2, expert_parallel_size=2)


def _prompts(seed: int, lengths=(5, 16, 55, 100, 7, 33)) -> list[list[int]]:
    """Token 0 is never drawn: hf_greedy's generate() takes it for padding."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = MODELS[name](str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def _hf(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "name", ["qwen3_moe", pytest.param("nemotron_h_moe", marks=pytest.mark.slow)]
)  # (the hybrid's EP run is in tests/test_tp_ep.py's slow set too; the default run stays lean)
def test_greedy_tokens_equal_hf_at_ep1_and_ep2(made, name):
    path = made(name)
    prompts = _prompts(3)
    hf = _hf(path)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    for p, tokens in zip(prompts, want, strict=True):
        assert router_margin(hf, p + tokens) > 1e-5, "test data near a routing tie"
    config = InferenceConfig(**CONFIG)
    for sizes in ({}, EP2):
        with Runtime(path, config, **sizes) as rt, Client(rt.address) as c:
            got = [d.token_ids for d in c.generate(prompts, GREEDY)]
            ranks = c.stats().ranks
        assert got == want, sizes
        assert all(r.steps_total > 0 for r in ranks)  # both ranks served requests


@pytest.fixture(scope="module")
def session(made, tmp_path_factory):
    """The Qwen3-MoE at EP=2 with synchronous consensus rounds, recorded."""
    rec = tmp_path_factory.mktemp("ep-rec")
    config = InferenceConfig(
        **CONFIG, ep_consensus_interval=4, use_synchronous_zmq_collectives=True
    )
    path = made("qwen3_moe")
    rt = Runtime(path, config, record_dir=str(rec), **EP2)
    with rt, Client(rt.address) as c:
        yield rt, c, rec, _hf(path)


def test_one_rank_busy_for_150_steps_while_the_other_idles(session):
    _, c, _, hf = session
    before = [(r.steps_total, r.dummy_steps_total) for r in c.stats().ranks]
    prompt = _prompts(5, (12,))[0]
    sampling = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    [done] = c.generate([prompt], sampling)
    assert done.finish_reason == FinishReason.LENGTH
    assert done.token_ids == hf_greedy(hf, prompt, 150)
    ranks = c.stats().ranks
    steps = [r.steps_total - b for r, (b, _) in zip(ranks, before, strict=True)]
    assert sorted(steps) == [0, 150]  # the idle rank ran dummy steps only (counted apart)
    idle = ranks[steps.index(0)]
    dummies = idle.dummy_steps_total - before[steps.index(0)][1]
    assert 150 <= dummies <= 152 and idle.dummy_device_seconds_total > 0
    assert time.monotonic() - start < 120


@pytest.mark.asyncio
async def test_pause_mid_generation_completes_on_both_ranks(session):
    rt, c, _, _ = session
    prompts = _prompts(7, (9, 20))
    sampling = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [d.token_ids for d in c.generate(prompts, sampling)]
    held = {}
    async with AsyncClient(rt.address) as ac:
        seen = [asyncio.Event() for _ in prompts]

        async def one(i: int) -> list[int]:
            tokens = []
            async for delta in ac.stream(prompts[i], sampling):
                tokens += delta.token_ids
                if len(tokens) >= 3:
                    seen[i].set()
            return tokens

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        await asyncio.gather(*(e.wait() for e in seen))
        assert (await ac.pause()).state == "PAUSED"
        stats = await ac.stats()
        await asyncio.sleep(0.5)
        again = await ac.stats()
        held["steps"] = [r.step for r in stats.ranks]
        held["after"] = [r.step for r in again.ranks]
        held["running"] = [r.running for r in again.ranks]
        assert (await ac.unpause()).state == "RUNNING"
        got = await asyncio.gather(*tasks)
    assert held["steps"] == held["after"]  # nothing steps while paused
    assert held["running"] == [1, 1]  # both ranks paused mid-generation, requests held
    assert got == want


def test_a_weight_update_failing_on_one_rank_leaves_both_on_the_old_weights(session):
    _, c, _, hf = session
    prompts = _prompts(11, (8, 30))
    before = [d.token_ids for d in c.generate(prompts, GREEDY)]
    embed = hf.get_parameter("model.embed_tokens.weight").detach().numpy()
    good = {"model.embed_tokens.weight": (embed * 1.5).astype(np.float32)}
    # Expert 6 of layer 0 lives on rank 1 only (experts 4..7): only rank 1 can see the shape
    # is wrong (64 x 32 transposed); rank 0 stages the embedding and must drop it again.
    bad = dict(good, **{"model.layers.0.mlp.experts.6.down_proj.weight": np.zeros((32, 64))})
    c.pause()
    c.suspend("persist")
    with pytest.raises(ControlError) as err:
        c.update_weights(state=bad)
    assert err.value.code == "control_failed"
    text = err.value.text
    assert "engine 1: control_failed: update_weights: " in text and "experts.6" in text
    assert "engine 0: control_failed: update_weights: undone here" in text
    assert "state stays SUSPENDED" in text
    assert [r.weight_version for r in c.stats().ranks] == [0, 0]
    c.resume()
    c.unpause()
    assert [d.token_ids for d in c.generate(prompts, GREEDY)] == before
    # The same update without the bad entry lands on both ranks.
    same = {"model.norm.weight": hf.get_parameter("model.norm.weight").detach().numpy()}
    c.pause()
    c.suspend("persist")
    assert c.update_weights(state=same).weight_version == 1
    c.resume()
    c.unpause()
    assert [r.weight_version for r in c.stats().ranks] == [1, 1]
    after = c.generate(prompts, GREEDY)
    assert [d.token_ids for d in after] == before
    # Every token of both ranks carries the version the group committed (per-token versions).
    assert all(d.weight_versions == [(1, 0)] for d in after), [d.weight_versions for d in after]


def test_replay_check_passes_over_both_engines_with_their_rounds(session):
    rt, c, rec, _ = session
    c.generate(_prompts(13), GREEDY)
    rt.shutdown()
    out = replay_check(rec)
    for rank in (0, 1):
        assert f"engine-{rank}: ok" in out and f"allocator-{rank}: ok" in out
    timeline = [sys.executable, "-m", "taipan.cli", "replay", str(rec), "--type", "EpVote"]
    assert "EpVote" in subprocess.run(timeline, capture_output=True, text=True).stdout


def test_sigkill_of_one_rank_fails_the_others_requests_naming_the_group(made):
    config = InferenceConfig(**CONFIG)
    rt = Runtime(made("qwen3_moe"), config, **EP2)
    with rt, Client(rt.address) as c:
        ended: dict[int, tuple[float, object]] = {}
        started = threading.Barrier(3)
        sampling = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

        def consume(i: int) -> None:
            for n, d in enumerate(c.stream(_prompts(i, (10,))[0], sampling)):
                if n == 1:
                    started.wait(60)
                if d.finished:
                    ended[i] = (time.monotonic(), d)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait(60)  # one stream per rank, both flowing
        pids = rt.engine_pids
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert sorted(ended) == [0, 1]
        errors = sorted(d.error for _, d in ended.values())
        for at, d in ended.values():
            assert d.finish_reason == FinishReason.ERROR, d.error
            assert at - killed < 5.0, (at - killed, errors)
        assert "engine rank 1 died" in errors[0], errors
        assert "expert-parallel group [0, 1]: peer engine 1 is gone" in errors[1], errors
        deadline = time.monotonic() + 15
        # (the launcher's watcher thread lists an exit just after the process is gone: a poll
        # here can see the process end first)
        while time.monotonic() < deadline and (
            rt.engines_alive() or ("engine-0", 3) not in rt.unexpected_exits
        ):
            time.sleep(0.05)
        assert rt.engines_alive() == 0, rt.unexpected_exits  # rank 0 ended too, loudly
        assert ("engine-0", 3) in rt.unexpected_exits, rt.unexpected_exits


def test_cli_generate_with_expert_parallelism_and_consensus_disabled(made):
    """`taipan generate --data-parallel-size 2 --expert-parallel-size 2`: Hugging Face's greedy
    tokens; with `disable_ep_consensus` the idle rank steps dummy forwards until shutdown,
    whose pause still stops the group together."""
    import json

    from taipan.ops.tokenizer import Tokenizer

    path = made("nemotron_h_moe")
    cmd = [sys.executable, "-m", "taipan.cli", "generate", "--model", path, "--json"]
    cmd += ["--prompt", "Hello", "--prompt", "expert parallel", "--temperature", "0"]
    cmd += ["--max-tokens", "6", "--ignore-eos", "--data-parallel-size", "2"]
    cmd += ["--expert-parallel-size", "2", "--set", "disable_ep_consensus=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    hf, tokenizer = _hf(path), Tokenizer.from_hf_dir(path)
    for r in rows:
        assert r["token_ids"] == hf_greedy(hf, tokenizer.encode(r["prompt"]), 6), r["prompt"]


def test_the_launcher_wires_each_group_apart(made):
    """Four ranks in groups of two (nothing started): each rank its own inbox, each group its
    own meeting point; --role engine needs every inbox and its group's meeting point, and is
    given them (tests/test_e2e_hosts_peers.py runs such engines)."""
    from taipan.launcher import LaunchError

    rt = Runtime(made("qwen3_moe"), data_parallel_size=4, expert_parallel_size=2)
    dense = Runtime(made("qwen3_moe"), data_parallel_size=2)
    try:
        spec = rt._spec().expert_parallel
        assert spec.groups == [[0, 1], [2, 3]]
        assert len(set(spec.inboxes)) == 4 and len(set(spec.inits)) == 2
        assert dense._spec().expert_parallel is None
    finally:
        rt.shutdown()
        dense.shutdown()
    engine = dict(role="engine", engine_address="ipc:///nowhere", data_parallel_rank=2)
    with pytest.raises(LaunchError, match="needs --ep-inboxes"):
        Runtime(made("qwen3_moe"), data_parallel_size=4, expert_parallel_size=2, **engine)
    inboxes = [f"tcp://127.0.0.1:{7000 + r}" for r in range(4)]
    rt = Runtime(made("qwen3_moe"), data_parallel_size=4, expert_parallel_size=2, **engine,
                 ep_inboxes=",".join(inboxes), ep_init="tcp://127.0.0.1:7010")  # fmt: skip
    try:
        spec = rt._spec().expert_parallel
        assert spec.groups == [[0, 1], [2, 3]] and spec.inboxes == inboxes
        assert spec.inits == [None, "tcp://127.0.0.1:7010"]  # rank 2's group only
    finally:
        rt.shutdown()
