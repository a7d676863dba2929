"""StepPlan.prev_rows: a step whose input tokens are the previous step's sampled tokens, taken on
the device (what lets the engine plan a step before the previous one's tokens reach the host).
The worker alone on CPU, then the gpu actor taking the next step before it answers this one;
the CUDA graph path is in tests/test_gpu.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import (
    GpuControl,
    GpuControlReply,
    LoadModel,
    ModelLoaded,
    StepResult,
)
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_ops_logprobs import Seq, make_plan

pytest.importorskip("transformers")

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")), TINY_SHAPE)


def _worker(model_dir) -> ModelWorker:
    w = ModelWorker()
    w.load(LoadModel(model_dir, "float32", "cpu", 16, 8, 1.0, 256, 8, 128))
    return w


def _prefill(w) -> list[int]:
    seqs = [Seq(p, 0, [i + 1], logprobs=True) for i, p in enumerate(PROMPTS)]
    return w.step(make_plan(1, seqs)).token_ids.tolist()


def test_previous_tokens_feed_the_next_step_on_the_device(model_dir):
    """Two identical workers: one told the tokens, one told only where they are. Same tokens
    and log-probs over three decode steps, rows reordered and one row given by id."""
    told, chained = _worker(model_dir), _worker(model_dir)
    first = _prefill(told)
    assert _prefill(chained) == first
    ctx = [len(p) for p in PROMPTS]
    last = first
    order = [[0, 1], [1, 0], [0, 1]]  # rows move between steps: prev_rows names the old row
    prev_order = [0, 1]
    for step, rows in enumerate(order, start=2):
        seqs = [Seq([last[i]], ctx[i], [i + 1], logprobs=True) for i in rows]
        plan = make_plan(step, seqs)
        a = told.step(plan)
        blind = dataclasses.replace(
            plan,
            input_ids=np.zeros_like(plan.input_ids),
            prev_rows=np.asarray([prev_order.index(i) for i in rows], dtype=np.int32),
        )
        b = chained.step(blind)
        assert a.error is None and b.error is None
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=0)
        got = dict(zip(rows, a.token_ids.tolist(), strict=True))
        last = [got[0], got[1]]
        ctx = [c + 1 for c in ctx]
        prev_order = rows


def test_mixed_rows_take_ids_where_prev_rows_is_minus_one(model_dir):
    told, chained = _worker(model_dir), _worker(model_dir)
    first = _prefill(told)
    _prefill(chained)
    seqs = [Seq([first[0]], len(PROMPTS[0]), [1]), Seq([first[1]], len(PROMPTS[1]), [2])]
    plan = make_plan(2, seqs)
    ids = plan.input_ids.copy()
    ids[0] = 0
    half = dataclasses.replace(plan, input_ids=ids, prev_rows=np.asarray([0, -1], np.int32))
    assert told.step(plan).token_ids.tolist() == chained.step(half).token_ids.tolist()


@pytest.mark.parametrize(
    "prev, message",
    [
        ([2, -1], "did not sample"),  # the previous step had two rows
        ([0], "1 entries for 2 input tokens"),
        ([-2, 0], "must be -1 or a row index"),
    ],
)
def test_bad_prev_rows_are_refused(model_dir, prev, message):
    w = _worker(model_dir)
    first = _prefill(w)
    seqs = [Seq([first[0]], len(PROMPTS[0]), [1]), Seq([first[1]], len(PROMPTS[1]), [2])]
    plan = dataclasses.replace(make_plan(2, seqs), prev_rows=np.asarray(prev, np.int32))
    with pytest.raises(ValueError, match=message):
        w.step(plan)


def test_rows_that_did_not_sample_or_a_suspend_leave_nothing_to_read(model_dir):
    w = _worker(model_dir)
    # A prefill chunk that does not reach the prompt's end samples nothing.
    w.step(make_plan(1, [Seq(PROMPTS[1][:5], 0, [1], sample=False)]))
    plan = make_plan(2, [Seq(PROMPTS[1][5:6], 5, [1])])
    with pytest.raises(ValueError, match="did not sample"):
        w.step(dataclasses.replace(plan, prev_rows=np.asarray([0], np.int32)))
    _prefill(w)
    assert w.control(GpuControl("suspend", "persist", None, None)).error is None
    assert w.control(GpuControl("resume", None, None, None)).error is None
    seqs = [Seq([0], len(PROMPTS[0]), [1])]
    with pytest.raises(ValueError, match="did not sample"):
        w.step(dataclasses.replace(make_plan(3, seqs), prev_rows=np.asarray([0], np.int32)))


# --- the gpu actor: the next step launched before this one is answered ----------------------


@contextlib.asynccontextmanager
async def gpu_actor(model_dir):
    ctx = zmq.asyncio.Context()
    addr = f"inproc://gpu-pipeline-{id(ctx)}"
    served = make_socket(ctx, zmq.PAIR, addr, bind=True, name="engine")
    engine = make_socket(ctx, zmq.PAIR, addr, bind=False, name="gpu")
    actor = GpuActor(0, served)
    task = asyncio.create_task(actor.run())
    try:
        await engine.send(LoadModel(model_dir, "float32", "cpu", 16, 8, 1.0, 256, 8, 128))
        assert isinstance((await engine.recv()).msg, ModelLoaded)
        yield engine
    finally:
        actor.stop()
        await asyncio.gather(task, return_exceptions=True)
        served.close()
        engine.close()
        ctx.term()


@pytest.mark.asyncio
async def test_the_gpu_actor_takes_the_next_step_before_answering_and_answers_in_order(
    model_dir,
):
    """As an overlapping engine: plan 2 (its ids from plan 1's tokens, on the device) and a
    control are sent before plan 1's answer is read. Answers come in order, with the tokens a
    serial worker computes; a step after a failed one cannot read its tokens."""
    told = _worker(model_dir)
    first = _prefill(told)
    seqs = [Seq([first[i]], len(PROMPTS[i]), [i + 1], logprobs=True) for i in (0, 1)]
    second = told.step(make_plan(2, seqs))
    blind = dataclasses.replace(
        make_plan(2, seqs),
        input_ids=np.zeros(2, np.int32),
        prev_rows=np.asarray([0, 1], np.int32),
    )
    prefill = make_plan(1, [Seq(p, 0, [i + 1], logprobs=True) for i, p in enumerate(PROMPTS)])
    async with gpu_actor(model_dir) as engine:
        await engine.send(prefill)
        await engine.send(blind)
        await engine.send(GpuControl("suspend", "persist", None, None))
        replies = [(await asyncio.wait_for(engine.recv(), 30)).msg for _ in range(3)]
        assert [type(m) for m in replies] == [StepResult, StepResult, GpuControlReply]
        assert [m.step for m in replies[:2]] == [1, 2] and replies[2].error is None
        assert replies[0].token_ids.tolist() == first
        assert replies[1].token_ids.tolist() == second.token_ids.tolist()
        np.testing.assert_allclose(replies[1].log_probs, second.log_probs, rtol=0, atol=0)
        await engine.send(GpuControl("resume", None, None, None))
        assert (await engine.recv()).msg.error is None
        # A step that fails at launch (a bad prev_rows here) leaves nothing for the next.
        bad = dataclasses.replace(blind, step=3, prev_rows=np.asarray([5, 5], np.int32))
        await engine.send(bad)
        await engine.send(dataclasses.replace(blind, step=4))
        failed = [(await asyncio.wait_for(engine.recv(), 30)).msg for _ in range(2)]
        assert [m.step for m in failed] == [3, 4]
        assert all("did not sample" in m.error for m in failed)
