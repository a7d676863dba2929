"""A steady decode step's StepPlan columns (actors/engine/batch_arrays.py `PlanCache`,
`_steady_arrays`): computed at once from the step before's, they equal the row-by-row build
(`_arrays`) of the same batch, column by column and dtype by dtype, over the scheduler
harness's random workloads (tests/test_scheduler.py: overlap or not, chunked prefill, pauses,
evictions, aborts, stops), and every invariant of those workloads still holds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given

import taipan.actors.engine.batch_arrays as batch_arrays
from tests.fuzz import fuzz_settings
from tests.test_scheduler import Harness, check_workload, make_plan, make_request, workloads


def checking(seen: dict):
    """`_steady_arrays` that checks each steady step's arrays against `_arrays` of the same
    batch (the rows it leaves too) and counts them in `seen["steady"]`."""
    steady_arrays = batch_arrays._steady_arrays

    def checked(batch, block_size, eos_token_ids, cache):
        got = steady_arrays(batch, block_size, eos_token_ids, cache)
        if got is not None:
            seen["steady"] += 1
            rows = [c.request.row for c in batch.chunks]
            want = batch_arrays._arrays(batch, block_size, False, eos_token_ids)
            assert rows == [c.request.row for c in batch.chunks]
            assert sorted(got) == sorted(want)
            for key, value in want.items():
                if isinstance(value, np.ndarray):
                    assert got[key].dtype == value.dtype, key
                    assert np.array_equal(got[key], value), key
                else:
                    assert got[key] == value, key
        return got

    return checked


@pytest.mark.parametrize("overlap", [True, False])
def test_steady_decode_steps_equal_the_row_by_row_build(monkeypatch, overlap):
    """Four requests decoding together, one ending early, through block boundaries: most steps
    take the steady path, each equal to the full build."""
    seen = {"steady": 0}
    monkeypatch.setattr(batch_arrays, "_steady_arrays", checking(seen))
    h = Harness(make_plan(num_blocks=64, block_size=4, max_requests=4), False, overlap)
    for rid in range(4):
        h.add(make_request(rid, 5 + rid, max_tokens=6 if rid == 2 else 20))
    h.run()
    h.check_end()
    assert seen["steady"] >= 10


@fuzz_settings(150)
@given(workloads())
def test_random_workloads_take_steady_steps_equal_to_the_full_build(workload):
    seen = {"steady": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_arrays, "_steady_arrays", checking(seen))
        check_workload(workload)
    event(f"steady steps: {seen['steady'] > 0}")


def test_a_step_that_changes_what_the_columns_assume_is_built_in_full(monkeypatch):
    """Hand-built steps of two requests reading their own generated tokens (no overlap): a
    row of two tokens and a row that samples where it did not (an evicted request recomputing
    its tokens), a request whose block list was replaced by another of the same length, and a
    position inside blocks shared from the cache each leave the steady path or keep to the
    full build's columns."""
    from taipan.actors.engine.batch import Chunk, StepBatch

    seen = {"steady": 0}
    monkeypatch.setattr(batch_arrays, "_steady_arrays", checking(seen))
    a, b = make_request(1, 4, frequency_penalty=0.5), make_request(2, 4)  # (a: a control)
    a.generated, b.generated = [20, 21, 22], [30, 31, 32]
    a.blocks, b.blocks = [1, 2, 11], [3, 4, 12]
    cache = batch_arrays.PlanCache()

    def step(a_start, a_samples, b_start, a_tokens=1):
        chunks = [
            Chunk(a, a_tokens, 0, start=a_start, samples=a_samples, gen_index=a_start - 3),
            Chunk(b, 1, 0, start=b_start, samples=True, gen_index=b_start - 3),
        ]
        batch = StepBatch(0, chunks, [], [])
        return batch_arrays.plan_arrays(batch, 4, False, (), cache)

    step(5, False, 6)  # (a recomputes generated[1] without sampling: stored)
    b.generated.append(33)
    got = step(5, False, 7, a_tokens=2)  # (a recomputes two tokens)
    assert seen["steady"] == 0 and len(got["input_ids"]) == 3
    step(6, False, 7)
    b.generated.append(34)
    got = step(6, True, 8)  # (a samples now: not the stored column)
    assert seen["steady"] == 0 and got["sample"].tolist() == [1, 1]
    a.generated.append(23)
    step(7, True, 8)  # (steady)
    assert seen["steady"] == 1
    b.blocks = [5, 6, 9]  # (new lists of the same length, as a reset gives)
    a.generated.append(24)
    b.generated.append(35)
    step(8, True, 9)
    b.blocks = [7, 8, 10]
    a.generated.append(25)
    b.generated.append(36)
    got = step(9, True, 10)
    assert seen["steady"] == 3 and got["block_tables"][1].tolist() == [7, 8, 10]
    assert got["slot_mapping"].tolist() == [11 * 4 + 1, 10 * 4 + 2]
    a.shared_until = 12  # (a position in a block shared from the cache: never written)
    a.generated.append(26)
    b.generated.append(37)
    got = step(10, True, 11)
    assert seen["steady"] == 4 and got["slot_mapping"][0] == -1
    assert len(got["penalty_rows"]) and not got["penalty_rows"].any()  # (row 0: a's)
