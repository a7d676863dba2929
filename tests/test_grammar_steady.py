"""GrammarMasks' steady path (actors/gpu/grammar_masks.py `_steady`): a decode step of the same
grammar requests in the same rows as the last launch, every row checked, reuses that launch's
checked rows instead of working them out again. Driven step by step beside a GrammarMasks that
always works them out: the same checked rows, the same tokens kept and replaced, the same void
rows, the same answer to whether a launch may skip waiting for the last check, through a stop,
a row that does not sample, a drop, a void row and a verify row."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from taipan.models import resolve
from taipan.ops.tokenizer import Tokenizer

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(resolve("smollm2")[1])


def test_the_steady_path_checks_as_the_full_one(tok):
    from taipan.actors.gpu.grammar_masks import GrammarMasks
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput

    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    eos = tok.eos_token_ids[0]
    short = StructuredOutput("regex", "(yes|no){2}")  # (stops after two words)
    long = StructuredOutput("regex", "(yes|no){1,40}")
    fast, full = GrammarMasks(tok, optimistic=True), GrammarMasks(tok, optimistic=True)
    full._steady_rows = lambda plan: None  # (always the full path)
    used = []
    steady_rows = fast._steady_rows

    def spy(plan):
        got = steady_rows(plan)
        used.append(got is not None)
        return got

    fast._steady_rows = spy
    ids, gone = np.array([5, 6, 7], np.int64), np.array([5, -1, 7], np.int64)
    # Per step: (grammar rows, new grammars, dropped ids, sample, prev rows, each row's best).
    # Each step's check runs after the next launch, as overlapped steps collect.
    steps = [
        (
            ids,
            [GrammarStart(5, long), GrammarStart(6, short), GrammarStart(7, long)],
            [],
            [1, 1, 1],
            [],
            [yes, no, yes],
        ),
        (ids, [], [], [1, 1, 1], [0, 1, 2], [no, yes, yes]),  # (6 complete)
        (ids, [], [], [1, 1, 1], [0, 1, 2], [yes, eos, no]),  # (6 ends)
        (ids, [], [], [1, 1, 1], [0, 1, 2], [no, yes, yes]),  # (launched before 6 ended)
        (ids, [], [], [1, 1, 1], [0, 1, 2], [yes, 100, yes]),  # (6 ended: masked, end only)
        (gone, [], [6], [1, 0, 1], [0, -1, 2], [no, 1, 100]),  # (6 dropped; 100 refused)
        (gone, [], [], [1, 0, 1], [0, -1, 2], [yes, 1, yes]),  # (row 2 read 100: void)
        (gone, [], [], [1, 0, 1], [0, -1, -1], [no, 1, 100]),  # (7 again: masked)
        (gone, [], [], [1, 0, 1], [0, -1, 2], [yes, 1, yes]),
        (gone, [], [], [1, 0, 1], [0, -1, 2], [no, 1, no]),
        (ids, [GrammarStart(6, long)], [], [1, 1, 1], [0, -1, 2], [yes, yes, yes]),
        (ids, [], [], [1, 1, 1], [0, 1, 2], [no, no, no]),
        (ids, [], [], [1, 1, 1], [0, 1, 2], [yes, yes, yes]),
        (ids, [], [], [1, 1, 1], [0, 1, 2, -1], [no, no, no], {"drafts": [0, 0, 1]}),  # (verify)
        (ids, [], [], [1, 1, 1], [0, 1, 2], [yes, yes, yes]),
        (
            np.array([5, 9, 7]),
            [GrammarStart(9, long)],
            [],
            [1, 1, 1],
            [0, -1, 2],
            [no, no, no],
            {"temperature": [0, 1, 0], "top_k": [0, 5, 0]},
        ),  # (9 draws with a top-k: masked)
    ]
    checks = {id(fast): None, id(full): None}
    seen = []
    for rows, new, drop, sample, prev, best, *more in steps:
        opts = more[0] if more else {}
        num_drafts = np.array(opts.get("drafts", []), np.int32)
        plan = types.SimpleNamespace(
            grammar_rows=rows,
            grammar_new=list(new), grammar_drop=np.array(drop, np.int64),
            temperature=np.array(opts.get("temperature", [0] * 3), np.float32),
            sample=np.array(sample, np.int8),
            top_k=np.array(opts.get("top_k", [0] * 3), np.int32), top_p=np.ones(3, np.float32),
            min_p=np.zeros(3, np.float32), logprobs_mode=np.zeros(0, np.int8),
            num_drafts=num_drafts, prev_rows=np.array(prev, np.int32),
            query_start_loc=np.cumsum([0, 1, 1, 1 + (num_drafts[-1] if len(num_drafts) else 0)]),
        )  # fmt: skip
        got = []
        for masks in (fast, full):
            if masks is full:  # (its launches work every answer out)
                full._steady = None
            skips = masks.skips_wait(plan, False)  # (the worker asks before the launch)
            logits = torch.zeros(3, 49152)
            logits[torch.arange(3), torch.tensor(best)] = 9.0
            logits[:, no] = torch.maximum(logits[:, no], torch.tensor(3.0))
            controlled = masks.masked(plan, logits.clone(), None)
            tokens = controlled.argmax(dim=-1)
            host = tokens.clone()
            masks.sampled(host, None)  # (as the worker: the masked rows' tokens, taken next)
            check = masks.check_later(host, tokens.clone(), controlled)
            masks.launched(check)
            before, checks[id(masks)] = checks[id(masks)], check
            if before is not None:  # (collected after the next launch, as overlapped steps)
                masks.run_check(before)
            got.append(
                (
                    skips,
                    controlled.argmax(dim=-1).tolist(),
                    None if check is None else (check.ids.tolist(), check.rows.tolist()),
                    None if before is None else (before.host.tolist(), before.fixed.tolist(),
                                                 before.void.tolist()),
                )
            )  # fmt: skip
        assert got[0] == got[1], (len(seen), got)
        seen.append(got[0])
    for masks in (fast, full):
        masks.run_check(checks[id(masks)])
    assert checks[id(fast)].host.tolist() == checks[id(full)].host.tolist()
    assert any(used) and not all(used)
    assert any(fixed for *_, (_, fixed, _) in [s for s in seen if s[3] is not None])
    assert any(void for *_, (_, _, void) in [s for s in seen if s[3] is not None])
    assert any(s[0] for s in seen) and not all(s[0] for s in seen)
