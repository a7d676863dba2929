"""The engine's side of an MTP head (speculative_method "mtp"; actors/engine/wire.py
`mtp_arrays`, speculation.py `take_drafts`): a scheduler driven step by step without processes
(as tests/perf/host_step_bench.py drives it), the gpu's result made by hand."""

from __future__ import annotations

import numpy as np

from taipan.actors.config import RuntimePlan
from taipan.actors.engine import wire
from taipan.actors.engine.flow import apply_block_reply
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.engine.speculation import Speculation
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.gpu import StepResult
from taipan.messages.requests import SamplingParams

BLOCKS, K = 64, 3


def _scheduler() -> Scheduler:
    plan = RuntimePlan(BLOCKS, 16, max_requests=4, max_tokens=16, max_sequence_length=256,
                       eos_token_ids=(), max_paused_blocks=None)  # fmt: skip
    sched = Scheduler(plan, enable_chunked_prefill=True)
    sched.spec = Speculation(K, 1, 3, mtp=True)
    return sched


def _step(sched: Scheduler, taken: list[int], tokens, drafts=None, spec=None):
    """Plan a step, give it blocks, and apply a result with `tokens` (per row), `drafts`
    (StepResult.next_drafts) and `spec` (spec_tokens). Returns its StepPlan."""
    batch = sched.schedule(1.0)
    n = sum(c.new_blocks for c in batch.chunks)
    ids = np.arange(taken[0], taken[0] + n, dtype=np.int32)
    taken[0] += n
    apply_block_reply(sched, batch, BlockOpsReply(batch.step, True, ids, BLOCKS - taken[0], None))
    plan = wire.step_plan(sched, batch)
    extra = {} if drafts is None else {"next_drafts": np.asarray(drafts, np.int32)}
    if spec is not None:
        extra["spec_tokens"] = np.asarray(spec, np.int32)
    result = StepResult(batch.step, np.asarray(tokens, np.int32), None, 0.0, **extra)
    sched.update(batch, result, 1.0)
    return plan


def test_chunks_hand_the_next_prompt_token_and_drafts_come_back_as_verify_rows():
    sched, taken = _scheduler(), [0]
    prompt = (np.arange(40) % 50 + 3).astype(np.int32)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    r = EngineRequest(1, prompt, greedy, True, arrival_time=0.0, seed=1)
    sched.add(r, 0.0)
    plan = _step(sched, taken, [-1])  # prompt tokens 0..15, not sampled
    assert plan.mtp_next.tolist() == [int(prompt[16])] and plan.mtp_draft.tolist() == [0]
    plan = _step(sched, taken, [-1])  # 16..31
    assert plan.mtp_next.tolist() == [int(prompt[32])]
    plan = _step(sched, taken, [90], drafts=[[91, 92, 93]])  # the last chunk samples 90
    assert plan.mtp_next.tolist() == [-1] and plan.mtp_draft.tolist() == [1]
    assert r.mtp_drafts.tolist() == [91, 92, 93] and r.mtp_at == 41
    # Its next row verifies them: 90 then the drafts; two pass, then 95 is drawn.
    plan = _step(sched, taken, [91], drafts=[[96, -1, -1]], spec=[[91, 92, 95, -1]])
    assert plan.num_drafts.tolist() == [3] and plan.input_ids.tolist() == [90, 91, 92, 93]
    assert r.generated == [90, 91, 92, 95] and r.mtp_drafts.tolist() == [96]
    plan = _step(sched, taken, [96], drafts=[[-1, -1, -1]], spec=[[96, 97]])
    assert plan.num_drafts.tolist() == [1] and plan.input_ids.tolist() == [95, 96]
    # No drafts came: a plain row, which asks for drafts again.
    plan = _step(sched, taken, [98], drafts=[[99, 100, 101]])
    assert not len(plan.num_drafts) and plan.mtp_draft.tolist() == [1]
    assert r.mtp_drafts.tolist() == [99, 100, 101] and r.mtp_at == r.num_tokens


def test_stale_drafts_are_not_verified():
    """Drafts kept for a token count the request has left behind (a later step gave it tokens
    another way) are not planned."""
    sched, taken = _scheduler(), [0]
    r = EngineRequest(2, np.arange(5, dtype=np.int32) + 3,
                      SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), True,
                      arrival_time=0.0, seed=2)  # fmt: skip
    sched.add(r, 0.0)
    _step(sched, taken, [40], drafts=[[41, 42, 43]])
    r.mtp_at -= 1  # (as if they followed an earlier token)
    plan = _step(sched, taken, [44], drafts=[[-1, -1, -1]])
    assert not len(plan.num_drafts) and plan.input_ids.tolist() == [40]
    # Drafts never asked for are no miss (a back-off counts misses); an empty answer is one.
    assert r.spec_backoff is None
    _step(sched, taken, [45], drafts=[[-1, -1, -1]])
    assert r.spec_backoff is not None and r.spec_backoff.misses == 1


def test_above_the_batch_limit_the_head_is_asked_for_no_drafts():
    """speculative_disable_by_batch_size 1 with two requests running: their rows are plain and
    ask the head for nothing (StepPlan.mtp_draft 0); alone again, the one left asks."""
    sched, taken = _scheduler(), [0]
    sched.spec = Speculation(K, 1, 3, mtp=True, off_above=1)
    for rid, max_tokens in ((1, 3), (2, 8)):
        prompt = (np.arange(8) + 3 * rid).astype(np.int32)
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sched.add(EngineRequest(rid, prompt, greedy, True, arrival_time=0.0, seed=rid), 0.0)
    plan = _step(sched, taken, [40, 50])  # both prompts (planned while none ran)
    assert plan.mtp_draft.tolist() == [1, 1]
    plan = _step(sched, taken, [41, 51])  # two running: no drafts asked
    assert plan.mtp_draft.tolist() == [0, 0] and not len(plan.num_drafts)
    plan = _step(sched, taken, [42, 52])  # request 1 ends with this step's token
    assert plan.mtp_draft.tolist() == [0, 0]
    plan = _step(sched, taken, [53], drafts=[[54, 55, 56]])  # alone: it asks again
    assert plan.mtp_draft.tolist() == [1]
    assert sched.spec.steps_off == 2
