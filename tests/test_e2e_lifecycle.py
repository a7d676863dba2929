"""The lifecycle through the real runtime and the real SmolLM2 model: pause / unpause, suspend /
resume in every KV mode mid-generation, weight updates checked against Hugging Face with the
same weights, illegal transitions, and `taipan replay --check` over the whole recorded session
(which also pauses and evicts requests: the KV pool is tiny)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from taipan.client import AsyncClient, Client, ControlError
from taipan.launcher import Runtime
from taipan.messages.lifecycle import IpcTensor
from taipan.messages.requests import SamplingParams
from tests.replay_check import replay_check
from tests.test_e2e_engine import PROMPTS, tiny_pool
from tests.test_e2e_generate import hf_greedy

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_path, hf):
    """A recorded runtime with a tiny KV pool and chunked prefill, and its record dir."""
    rec = tmp_path_factory.mktemp("lifecycle-rec")
    config = tiny_pool(hf, enable_chunked_prefill=True, logging_step_interval=5)
    rt = Runtime(model_path, config, record_dir=str(rec))
    with rt, Client(rt.address) as c:
        yield rt, c, rec


@pytest.fixture(scope="module")
def uninterrupted(session):
    _, c, _ = session
    return {
        "greedy": [d.token_ids for d in c.generate(PROMPTS[:3], GREEDY)],
        "sampled": [d.token_ids for d in c.generate(PROMPTS[:3], SAMPLED)],
    }


async def interrupted(
    address: str, sampling: SamplingParams, interrupt, prompts=PROMPTS[:3]
) -> list[list[int]]:
    """Stream `prompts`; once every stream has tokens, run `interrupt(client)`; finish."""
    async with AsyncClient(address) as ac:
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
        await interrupt(ac)
        return await asyncio.gather(*tasks)


SUSPEND_MODES = ("persist", "offload", "recompute")


async def suspended_in_each_mode(address: str, sampling: SamplingParams, prompts) -> dict:
    """{mode: the tokens of `prompts`} when a pause, a suspend in that mode, a resume and an
    unpause interrupt their generation (`interrupted`), for every suspend mode."""
    outs = {}
    for mode in SUSPEND_MODES:

        async def cycle(ac, mode=mode):
            await ac.pause()
            await ac.suspend(mode)
            await ac.resume()
            await ac.unpause()

        outs[mode] = await interrupted(address, sampling, cycle, prompts)
    return outs


@pytest.mark.asyncio
async def test_pause_mid_generation_then_unpause_gives_the_same_tokens(session, uninterrupted):
    rt, c, _ = session
    progress = {}

    async def pause_and_hold(ac: AsyncClient):
        ack = await ac.pause()
        assert ack.state == "PAUSED"
        before = (await ac.stats()).ranks[0].step
        await asyncio.sleep(0.5)  # paused: no step runs, requests keep their KV
        progress["steps while paused"] = (await ac.stats()).ranks[0].step - before
        assert (await ac.unpause()).state == "RUNNING"

    got = await interrupted(rt.address, GREEDY, pause_and_hold)
    assert progress["steps while paused"] == 0
    assert got == uninterrupted["greedy"]


@pytest.mark.asyncio
async def test_submissions_queue_while_paused(session, uninterrupted):
    rt, c, _ = session

    async def scenario():
        async with AsyncClient(rt.address) as ac:
            await ac.pause()
            task = asyncio.create_task(ac.generate(PROMPTS[:1], GREEDY))
            await asyncio.sleep(0.5)
            assert not task.done()
            assert (await ac.stats()).ranks[0].waiting == 1
            await ac.unpause()
            return (await task)[0].token_ids

    assert await scenario() == uninterrupted["greedy"][0]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["persist", "offload", "recompute"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
async def test_suspend_resume_mid_generation_gives_the_same_tokens(
    session, uninterrupted, mode, kind
):
    rt, _, _ = session

    async def suspend_cycle(ac: AsyncClient):
        await ac.pause()
        assert (await ac.suspend(mode)).state == "SUSPENDED"
        assert (await ac.resume()).state == "PAUSED"
        assert (await ac.unpause()).state == "RUNNING"

    sampling = GREEDY if kind == "greedy" else SAMPLED
    got = await interrupted(rt.address, sampling, suspend_cycle)
    assert got == uninterrupted[kind]


def test_illegal_transitions_are_refused_and_serving_goes_on(session, uninterrupted):
    _, c, _ = session
    for call, state in [(c.resume, "RUNNING"), (c.stop, "RUNNING"), (c.unpause, "RUNNING")]:
        with pytest.raises(ControlError) as err:
            call()
        assert err.value.code == "illegal_transition" and state in err.value.text
    with pytest.raises(ControlError, match="RUNNING") as err:  # legal paused or suspended
        c.update_weights(state={"model.norm.weight": torch.ones(576).numpy()})
    assert err.value.code == "illegal_transition"
    c.pause()
    c.unpause()
    assert c.generate(PROMPTS[:1], GREEDY)[0].token_ids == uninterrupted["greedy"][0]


def test_update_weights_while_suspended_changes_what_new_requests_get(session, hf):
    _, c, _ = session
    model, _ = hf
    name = "model.layers.3.mlp.down_proj.weight"
    param = model.get_parameter(name)
    original = param.detach().clone()
    with torch.no_grad():
        param.mul_(0.25)  # the oracle with the same new weights
    try:
        ids = c.tokenizer.encode(PROMPTS[2])
        want = hf_greedy(hf, ids, GREEDY.max_tokens)
        c.pause()
        c.suspend("offload")
        ack = c.update_weights(state={name: param.detach().numpy().copy()})
        assert ack.state == "SUSPENDED" and ack.weight_version == 1
        c.resume()
        c.unpause()
        [done] = c.generate([PROMPTS[2]], GREEDY)
        assert done.token_ids == want
        assert c.stats().ranks[0].weight_version == 1
    finally:
        with torch.no_grad():
            param.copy_(original)
    c.pause()
    c.suspend("persist")
    assert c.update_weights(state={name: original.numpy()}).weight_version == 2
    c.resume()
    c.unpause()
    assert c.generate([PROMPTS[2]], GREEDY)[0].token_ids == hf_greedy(hf, ids, GREEDY.max_tokens)


@pytest.mark.asyncio
async def test_staleness_counts_a_weight_update_a_request_lived_through(session, hf):
    rt, _, _ = session
    name = "model.norm.weight"
    same = hf[0].get_parameter(name).detach().numpy().copy()  # an update that changes nothing

    async def scenario():
        async with AsyncClient(rt.address) as ac:
            deltas, seen = [], asyncio.Event()

            async def consume():
                async for d in ac.stream(PROMPTS[0], GREEDY):
                    deltas.append(d)
                    if sum(len(x.token_ids) for x in deltas) >= 3:
                        seen.set()

            task = asyncio.create_task(consume())
            await seen.wait()
            await ac.pause()
            await ac.suspend("persist")
            await ac.update_weights(state={name: same})
            await ac.resume()
            await ac.unpause()
            await task
            return deltas

    deltas = await scenario()
    final = deltas[-1]
    stale = final.policy_staleness
    n_prompt = len(stale) - sum(len(d.token_ids) for d in deltas)
    assert n_prompt > 0 and len(stale) == len(final.kv_cache_staleness)
    assert set(stale[: n_prompt + 3]) == {1} and stale[-1] == 0  # later tokens are fresh
    assert final.kv_cache_staleness == final.policy_staleness  # "persist" kept that old KV


@pytest.mark.asyncio
async def test_pause_abort_ends_every_request_with_its_tokens_so_far(session, uninterrupted):
    """pause(mode="abort"): every stream in flight ends with finish_reason "abort" and the
    tokens it had (a trainer's partial rollouts); unpause then serves as before."""
    rt, _, _ = session
    async with AsyncClient(rt.address) as ac:
        seen = [asyncio.Event() for _ in range(3)]
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

        async def one(i: int):
            tokens, last = [], None
            async for delta in ac.stream(PROMPTS[i], long):
                tokens += delta.token_ids
                last = delta
                if len(tokens) >= 3:
                    seen[i].set()
            return tokens, last.finish_reason

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 120)
        ack = await ac.pause(mode="abort")
        assert str(ack.state) == "PAUSED"
        done = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for i, (tokens, reason) in enumerate(done):
            assert str(reason) == "abort" and 3 <= len(tokens) < 60, (i, reason, len(tokens))
            n = min(len(tokens), len(uninterrupted["greedy"][i]))
            assert tokens[:n] == uninterrupted["greedy"][i][:n]  # greedy: the same tokens so far
        stats = (await ac.stats()).merged()
        assert stats.running == stats.waiting == stats.paused == 0
        with pytest.raises(ControlError, match="illegal while PAUSED"):
            await ac.pause(mode="wait")
        await ac.unpause()
    assert [c.token_ids for c in session[1].generate(PROMPTS[:1], GREEDY)] == [
        uninterrupted["greedy"][0]
    ]


def test_update_weights_from_ipc_is_refused_on_the_cpu_and_serving_goes_on(session, uninterrupted):
    """CUDA IPC shares GPU memory: a CPU runtime refuses it by name, the weights stay (the
    replay check below reads the control and its GpuControl from the log)."""
    _, c, _ = session
    version = c.stats().merged().weight_version
    record = IpcTensor(
        "model.norm.weight", "float32", [576], [1], 0, 0, "", bytes(64), 2304, 0, b"/torch_0", 0,
        None, False,
    )  # fmt: skip
    c.pause()
    with pytest.raises(ControlError, match="update_weights_from_ipc needs taipan on a CUDA"):
        c.update_weights_from_ipc([record], weight_version=version + 5, stage=True)
    c.unpause()
    assert c.stats().merged().weight_version == version
    assert c.generate(PROMPTS[:1], GREEDY)[0].token_ids == uninterrupted["greedy"][0]


def test_replay_check_passes_over_the_whole_session(session):
    rt, c, rec = session
    c.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))  # 6 in 8 blocks: pauses
    [stats] = c.stats().ranks
    assert stats.paused_total > 0 and stats.evicted_total > 0, stats
    rt.shutdown()
    out = replay_check(rec)
    assert "allocator-0: ok" in out and "engine-0: ok" in out

    def timeline(*args: str) -> str:
        cmd = [sys.executable, "-m", "taipan.cli", "replay", str(rec), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout

    assert "Suspend" in timeline("--type", "Suspend")
    assert "UpdateWeightsFromIpc" in timeline("--type", "UpdateWeightsFromIpc")
    # logging_step_interval=5: the engine reports its stats to the coordinator every 5 steps
    reports = timeline("--actor", "coordinator", "--type", "Stats").splitlines()
    assert len([x for x in reports if "Stats" in x]) >= stats.step // 5
