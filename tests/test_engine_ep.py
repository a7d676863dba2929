"""Engines of one expert-parallel group in one process (tests/ep_harness.py: real engine and
allocator actors, real consensus sockets, fake gpu actors whose forwards must meet like the MoE
exchange's collectives): they step in lockstep, an idle rank runs dummy steps while its peer
works and consults every step, busy ranks consult every `ep_consensus_interval` steps, pausing
mid-generation completes on both ranks, and nothing deadlocks.
"""

from __future__ import annotations

import asyncio

import pytest

from taipan.actors.config import InferenceConfig
from taipan.messages.common import ErrorReply
from taipan.messages.lifecycle import ControlAck, Pause, Unpause
from taipan.messages.requests import FinishReason
from taipan.messages.stats import GetStats, Stats
from tests.ep_harness import ep_group, expected_tokens

CONFIG = dict(block_size_tokens=16, max_sequence_length=256, buffer_size_gb=0.01)


def _config(**kw) -> InferenceConfig:
    return InferenceConfig(**(CONFIG | kw))


def _votes(group) -> list[int]:
    return [e.ep.rounds for e in group.engines]


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", [False, True])
async def test_a_busy_rank_and_an_idle_one_step_in_lockstep_for_200_steps(overlap):
    """Rank 0 decodes 200 tokens, rank 1 has nothing: rank 1 runs one dummy forward per step
    of rank 0, both consult every step (a rank is idle), and both go idle after; also with
    overlapping steps (a dummy step is in flight like any other). (Synchronous rounds block
    their event loop, which these ranks share: tests/test_e2e_ep.py runs them.)"""
    async with ep_group(_config(ep_consensus_interval=20, overlap_steps=overlap)) as g:
        rounds_before = _votes(g)
        await g.submit(0, 1, max_tokens=200)
        [out] = (await g.terminal({1}, timeout=60)).values()
        assert out.finish_reason is FinishReason.LENGTH
        assert out.new_token_ids.tolist() == expected_tokens(6, 200)
        await g.idle()
        assert not g.lockstep.stalls
        # With overlap, the step after the last is planned before the last one's result shows
        # the request done: one more forward (a dummy) on both ranks.
        steps = 201 if overlap else 200
        assert g.lockstep.kinds(0) == ["real"] * 200 + ["dummy"] * (steps - 200)
        assert g.lockstep.kinds(1) == ["dummy"] * steps
        # One round before each step (rank 1 idle: every step), one to find the group idle.
        rounds = [after - before for after, before in zip(_votes(g), rounds_before, strict=True)]
        assert rounds[0] == rounds[1] and steps <= rounds[0] <= steps + 2
        assert g.engines[1].steps.dummy_steps == steps
        # Stats count dummy forwards apart from real steps.
        busy, idle = (g.engines[r].stats().ranks[0] for r in (0, 1))
        assert (busy.steps_total, busy.dummy_steps_total) == (200, steps - 200)
        assert (idle.steps_total, idle.dummy_steps_total) == (0, steps)
        assert idle.device_seconds_total == 0.0


@pytest.mark.asyncio
async def test_busy_ranks_consult_every_interval_steps():
    interval = 7
    async with ep_group(_config(ep_consensus_interval=interval)) as g:
        await g.send(0, Pause(""))
        await g.send(1, Pause(""))
        await g.recv(ControlAck, rank=0)
        await g.recv(ControlAck, rank=1)
        before = _votes(g)
        await g.submit(0, 1, max_tokens=70)
        await g.submit(1, 2, max_tokens=70)
        await g.send(0, Unpause(""))
        await g.send(1, Unpause(""))
        done = await g.terminal({1, 2}, timeout=60)
        assert all(o.new_token_ids.tolist() == expected_tokens(6, 70) for o in done.values())
        await g.idle()
        assert g.lockstep.kinds(0) == g.lockstep.kinds(1) == ["real"] * 70
        rounds = [after - before for after, before in zip(_votes(g), before, strict=True)]
        # 70 busy steps: a round every 7 (10), plus the rounds that find work and then idleness.
        assert rounds[0] == rounds[1] and 70 // interval <= rounds[0] <= 70 // interval + 3
        assert not g.lockstep.stalls


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", [False, True])
async def test_pause_mid_generation_completes_on_both_ranks_and_unpause_finishes(overlap):
    config = _config(ep_consensus_interval=5, overlap_steps=overlap)
    async with ep_group(config, step_delay=0.004) as g:
        await g.submit(0, 1, max_tokens=120)
        await g.submit(1, 2, max_tokens=40)
        await asyncio.sleep(0.2)  # mid-generation
        await g.send(0, Pause(""))
        await asyncio.sleep(0.1)  # rank 1 hears of it later: the group waits for it
        await g.send(1, Pause(""))
        acks = [await g.recv(ControlAck, rank=r) for r in (0, 1)]
        assert [a.state for _, a in acks] == ["PAUSED", "PAUSED"]
        steps = list(g.lockstep.count.values())
        await asyncio.sleep(0.3)
        assert list(g.lockstep.count.values()) == steps  # nothing steps while paused
        assert steps[0] == steps[1] and 0 < steps[0] < 120  # stopped together, mid-way
        await g.send(0, GetStats())
        _, stats = await g.recv(Stats, rank=0)
        assert stats.state == "PAUSED" and stats.ranks[0].running == 1
        await g.send(0, Unpause(""))
        await g.send(1, Unpause(""))
        done = await g.terminal({1, 2}, timeout=60)
        assert done[1].new_token_ids.tolist() == expected_tokens(6, 120)
        assert done[2].new_token_ids.tolist() == expected_tokens(6, 40)
        assert not g.lockstep.stalls


@pytest.mark.asyncio
async def test_an_idle_group_pauses_at_once_and_a_second_pause_is_refused():
    async with ep_group(_config()) as g:
        await g.send(0, Pause(""))
        await g.send(0, Pause(""))
        _, refused = await g.recv(ErrorReply, rank=0)
        assert refused.code == "illegal_transition"
        await g.send(1, Pause(""))
        for r in (0, 1):
            _, ack = await g.recv(ControlAck, rank=r)
            assert ack.state == "PAUSED"
        assert g.lockstep.log == []  # an idle group never forwards


@pytest.mark.asyncio
async def test_work_arriving_at_either_rank_wakes_the_group():
    async with ep_group(_config()) as g:
        for rank, rid in ((1, 5), (0, 6), (1, 7)):
            await g.submit(rank, rid, max_tokens=3)
            [out] = (await g.terminal({rid})).values()
            assert out.new_token_ids.tolist() == expected_tokens(6, 3)
        kinds = list(zip(g.lockstep.kinds(0), g.lockstep.kinds(1), strict=True))
        assert kinds == [("dummy", "real")] * 3 + [("real", "dummy")] * 3 + [("dummy", "real")] * 3


@pytest.mark.asyncio
async def test_with_consensus_disabled_idle_ranks_run_dummy_steps_and_pause_still_agrees():
    async with ep_group(_config(disable_ep_consensus=True, ep_consensus_interval=4)) as g:
        await g.submit(0, 1, max_tokens=10)
        [out] = (await g.terminal({1})).values()
        assert out.new_token_ids.tolist() == expected_tokens(6, 10)
        await asyncio.sleep(0.1)
        assert g.lockstep.count[0] > 10  # kept stepping (dummy) after its work ran out
        await g.send(0, Pause(""))
        await g.send(1, Pause(""))
        for r in (0, 1):
            _, ack = await g.recv(ControlAck, rank=r)
            assert ack.state == "PAUSED"
        counts = dict(g.lockstep.count)
        await asyncio.sleep(0.2)
        assert g.lockstep.count == counts and counts[0] == counts[1]
        assert not g.lockstep.stalls


def test_synchronous_rounds_refuse_overlapping_steps():
    from taipan.actors.config import ConfigError

    with pytest.raises(ConfigError, match="overlap_steps"):
        _config(use_synchronous_zmq_collectives=True, overlap_steps=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", [False, True])
async def test_replay_check_follows_the_consensus_rounds(tmp_path, overlap):
    """Both ranks' engine logs, with their rounds, dummy steps and a pause mid-generation,
    replay without divergence (steps overlapping or not); a log missing one peer vote diverges
    (at the next step the schedule needed it for, or where a later round completes)."""
    import json

    from taipan.actors.record import Recorder, read_log
    from taipan.replay import check_engine

    config = _config(ep_consensus_interval=3, overlap_steps=overlap)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    recorders = {r: Recorder(str(tmp_path), f"engine-{r}") for r in (0, 1)}
    try:
        async with ep_group(config, record=recorders, step_delay=0.003) as g:
            await g.submit(0, 1, max_tokens=60)
            await g.submit(1, 2, max_tokens=8)
            await asyncio.sleep(0.05)
            for r in (0, 1):
                await g.send(r, Pause(""))
            for r in (0, 1):
                await g.recv(ControlAck, rank=r)
            await g.submit(1, 3, max_tokens=5)  # queued while paused
            for r in (0, 1):
                await g.send(r, Unpause(""))
            await g.terminal({1, 2, 3}, timeout=60)
            await g.idle()
    finally:
        for rec in recorders.values():
            rec.close()
    for r in (0, 1):
        records = list(read_log(tmp_path / f"engine-{r}.tplog"))
        div, note = check_engine(records, tmp_path)
        assert div is None, div
        assert "steps re-planned" in note
        assert any(rec.channel == "ep" for rec in records)
    records = list(read_log(tmp_path / "engine-1.tplog"))
    from taipan.messages import decode
    from taipan.messages.consensus import EpVote

    votes = [i for i, rec in enumerate(records) if rec.channel == "ep" and rec.direction == "in"
             and isinstance(decode(rec.frames), EpVote)]  # fmt: skip
    # every peer vote but the last round's is needed (that one may have no later round)
    for i in votes[:-1]:
        div, _ = check_engine(records[:i] + records[i + 1 :], tmp_path)
        assert div is not None, i
        assert "consensus round" in div.what or "agreed to" in div.what, div


async def _control_all(g, msg) -> list:
    for r in (0, 1):
        await g.send(r, msg)
    return [(await g.recv(ControlAck | ErrorReply, rank=r))[1] for r in (0, 1)]


@pytest.mark.asyncio
async def test_suspend_resume_and_update_weights_apply_to_every_rank_or_to_none():
    from taipan.messages.lifecycle import Resume, Suspend, UpdateWeights

    async with ep_group(_config()) as g:
        assert all(isinstance(a, ControlAck) for a in await _control_all(g, Pause("")))
        g.gpus[1].fail_control = "offload needs more host memory"
        first, second = await _control_all(g, Suspend("", "offload"))
        assert first.code == second.code == "control_failed"
        assert "engine 1: offload needs more host memory" in first.text  # rank 0: undone
        assert "undone here" in first.text and "offload needs more host memory" in second.text
        assert [c.command for c in g.gpus[0].controls] == ["suspend", "resume"]
        assert [c.command for c in g.gpus[1].controls] == ["suspend"]
        # The group is PAUSED on both ranks: a suspend that works now works everywhere.
        acks = await _control_all(g, Suspend("", "persist"))
        assert [a.state for a in acks] == ["SUSPENDED", "SUSPENDED"]
        # A weight update: staged on every rank, committed only if every rank staged it.
        g.gpus[0].fail_control = "model.norm.weight: shape (3,), expected (64,)"
        first, second = await _control_all(g, UpdateWeights("", "/nowhere", None))
        assert "shape (3,)" in first.text and "engine 0: model.norm.weight" in second.text
        assert [c.command for c in g.gpus[1].controls[-2:]] == ["stage_weights", "discard_weights"]
        acks = await _control_all(g, UpdateWeights("", "/new", None))
        assert [a.weight_version for a in acks] == [1, 1]
        assert [c.command for c in g.gpus[0].controls[-2:]] == ["stage_weights", "commit_weights"]
        g.gpus[0].fail_control = "cannot allocate the KV cache"
        first, second = await _control_all(g, Resume(""))
        assert "engine 0: cannot allocate" in second.text
        assert [c.command for c in g.gpus[1].controls[-2:]] == ["resume", "suspend"]
        assert g.gpus[1].controls[-1].mode == "persist"  # suspended again as it was
        acks = await _control_all(g, Resume(""))
        assert [a.state for a in acks] == ["PAUSED", "PAUSED"]
        assert all(isinstance(a, ControlAck) for a in await _control_all(g, Unpause("")))
        await g.submit(1, 9, max_tokens=4)
        [out] = (await g.terminal({9})).values()
        assert out.new_token_ids.tolist() == expected_tokens(6, 4)


@pytest.mark.asyncio
async def test_a_staged_update_from_ipc_is_staged_then_committed_once_on_every_rank():
    """update_weights_from_ipc(stage=True) in a group: every rank stages the records, and the
    group's round commits them once (the engine adds no second commit of its own)."""
    from taipan.messages.lifecycle import IpcTensor, UpdateWeightsFromIpc

    record = IpcTensor(
        "model.norm.weight", "float32", [64], [1], 0, 0, "", bytes(64), 256, 0, b"/torch_0", 0,
        None, False,
    )  # fmt: skip
    async with ep_group(_config()) as g:
        assert all(isinstance(a, ControlAck) for a in await _control_all(g, Pause("")))
        acks = await _control_all(g, UpdateWeightsFromIpc("", [record], 7, True))
        assert all(isinstance(a, ControlAck) for a in acks), acks
        for gpu in g.gpus:
            assert [c.command for c in gpu.controls] == ["stage_weights", "commit_weights"]
            assert [t.name for t in gpu.controls[0].ipc] == ["model.norm.weight"]
            assert gpu.controls[0].weight_version == 7


@pytest.mark.asyncio
async def test_a_failed_forward_ends_the_rank_and_its_requests_name_the_group(monkeypatch):
    """The group's collectives cannot be trusted after a failed forward: the rank fails every
    request it holds, naming its group, and ends (FatalError); with no peer found gone within
    the grace period, the error is the forward's own."""
    from taipan.actors.engine import ep

    monkeypatch.setattr(ep, "PEER_GONE_GRACE_S", 0.2)
    async with ep_group(_config()) as g:
        g.gpus[0].fail_step = "Read error: connection reset by peer"
        await g.submit(0, 1, max_tokens=5)
        await g.submit(0, 2, max_tokens=5)
        done = await g.terminal({1, 2})
        for out in done.values():
            assert out.finish_reason is FinishReason.ERROR
            assert out.error.startswith("expert-parallel group [0, 1]: step 1 failed: ")
            assert "connection reset by peer" in out.error
        with pytest.raises(ExceptionGroup) as info:
            await asyncio.wait_for(g.tasks[0], 5)
        assert "expert-parallel group [0, 1]" in str(info.value.exceptions[0])
