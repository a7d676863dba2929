"""The scheduler under structured outputs' "check" mode (actors/gpu/grammar_masks.py): a fake
gpu that replaces a sampled token after the next step was launched reading the old one
(StepResult.grammar_fixed), through tests/test_scheduler.py's harness. The engine drops the
void row's token and plans its position again; outputs, blocks and every invariant are those
of a run without fixes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from tests.test_scheduler import Harness, check_workload, make_plan, make_request, workloads


class GrammarFixes(Harness):
    """The fake gpu as the worker's "check" grammar mode (actors/gpu/grammar_masks.py): where
    `fixes(request, position)`, a sampled row's device token (what the next step's prev_rows
    read) is not the one the step reports (the check replaced it after the next step was
    launched); its row is in StepResult.grammar_fixed, and the next step's row that read it is
    void (its token junk)."""

    def __init__(self, *args, fixes=lambda rid, pos: (rid + pos) % 3 == 0, **kw):
        super().__init__(*args, **kw)
        self.fixes = fixes
        self.fixed: set[int] = set()  # (rows of the last step)
        self.num_void = 0  # (rows the fake gpu found void)

    def void_rows(self, a):
        prev, qsl = a["prev_rows"], a["query_start_loc"]
        if not len(prev):
            return set()
        return {i for i in range(len(qsl) - 1) if int(prev[qsl[i]]) in self.fixed}

    def gpu(self, batch, a):
        void = self.void_rows(a)
        self.num_void += len(void)
        result = super().gpu(batch, a)
        fixed = [
            i
            for i, c in enumerate(batch.chunks)
            if a["sample"][i] and i not in void
            and self.fixes(c.request.request_id, int(a["seq_lens"][i]))
        ]  # fmt: skip
        self.device_sampled[fixed] += 1000  # (the unchecked token the next step reads)
        result.token_ids[sorted(void)] = 1  # (junk: the engine drops it)
        self.fixed = set(fixed)
        return dataclasses.replace(result, grammar_fixed=np.array(fixed, np.int32))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_row_that_read_a_replaced_token_is_void_and_computed_again(overlap):
    """StepResult.grammar_fixed (structured outputs, "check" mode): with overlap, the request's
    row in the step already planned read the old token; the engine drops that row's token and
    plans its position again with the new one (its KV slot written again). Outputs are those
    of a run without fixes, every block comes back, grammar_void_rows counts the void rows;
    without overlap no row is ever void."""
    plan = make_plan(num_blocks=12, block_size=2, max_tokens=16, max_requests=4)
    h = GrammarFixes(plan, chunked=True, overlap=overlap)
    for rid in range(1, 6):
        h.add(make_request(rid, 3 + rid, max_tokens=9, stream=rid % 2 == 0))
    h.run()
    h.check_end()
    void = h.sched.stats()["grammar_void_rows"]
    assert void == h.num_void and (void > 0) == overlap, (void, h.num_void)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_with_grammar_fixes_keep_every_invariant(workload):
    """As above, the fake gpu replacing every third sampled token after the next step read it
    (GrammarFixes): the same outputs; the engine counts the void rows of requests the fixed
    token did not end."""
    h = check_workload(workload, GrammarFixes)
    assert h.sched.stats()["grammar_void_rows"] <= h.num_void
