"""Chained verify steps in the gpu worker (actors/gpu/chain.py), on the host: the inner plans
it builds (positions, KV slots, drafts by the n-gram rule, stops, limits, capacity) against a
target whose greedy continuation is known, and the plans it refuses. The real model through
the runtime: tests/test_e2e_speculative_chain.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.gpu.chain import CHAIN_MISSES, check_chain, run_chain
from taipan.messages.gpu import StepPlan, StepResult
from taipan.ops.ngram import NgramDrafter

BS = 4
TRUTH = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8] * 3


def plan_of(histories, drafts, limits, capacities, stops=None, chain_steps=8, k=3):
    """A chain plan of one verify row per history (its last token, then its drafts), block
    tables of consecutive blocks from 100 * row."""
    ids, pos, qsl, tables = [], [], [0], []
    for i, (h, d) in enumerate(zip(histories, drafts, strict=True)):
        ids += [h[-1], *d]
        pos += range(len(h) - 1, len(h) + len(d))
        qsl.append(qsl[-1] + 1 + len(d))
        tables.append(np.arange(16) + 100 * i)
    tables = np.asarray(tables, np.int32)
    pos = np.asarray(pos, np.int64)
    owner = np.repeat(np.arange(len(drafts)), [1 + len(d) for d in drafts])
    stops = stops or [[] for _ in histories]
    b = len(histories)
    return StepPlan(
        step=7,
        input_ids=np.asarray(ids, np.int32),
        positions=pos.astype(np.int32),
        slot_mapping=tables[owner, pos // BS].astype(np.int64) * BS + pos % BS,
        query_start_loc=np.asarray(qsl, np.int32),
        seq_lens=np.asarray(
            [len(h) + len(d) for h, d in zip(histories, drafts, strict=True)], np.int32
        ),
        block_tables=tables,
        sample=np.ones(b, np.int8),
        temperature=np.zeros(b, np.float32),
        top_k=np.zeros(b, np.int32),
        top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32),
        seeds=np.arange(b, dtype=np.int64),
        gen_index=np.zeros(b, np.int32),
        logprobs=np.zeros(b, np.int8),
        top_n=np.zeros(b, np.int32),
        prompt_targets=np.full(len(ids), -1, np.int32),
        num_drafts=np.asarray([len(d) for d in drafts], np.int32),
        chain_steps=chain_steps,
        chain_ngram=np.asarray([1, 3, k], np.int32),
        chain_history=np.asarray([t for h in histories for t in h], np.int32),
        chain_history_loc=np.cumsum([0] + [len(h) for h in histories]).astype(np.int32),
        chain_limit=np.asarray(limits, np.int32),
        chain_capacity=np.asarray(capacities, np.int32),
        chain_stops=np.asarray([t for s in stops for t in s], np.int32),
        chain_stops_loc=np.cumsum([0] + [len(s) for s in stops]).astype(np.int32),
    )


class Target:
    """A greedy target whose continuation of every sequence is TRUTH (a sequence is a prefix
    of it): checks each inner plan's layout and verifies its drafts."""

    def __init__(self, truth=TRUTH):
        self.plans: list[StepPlan] = []
        self.truth = truth

    def __call__(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        assert plan.chain_steps == 0 and not len(plan.chain_history)
        qsl = plan.query_start_loc
        b = len(plan.seq_lens)
        nd = plan.num_drafts if len(plan.num_drafts) else np.zeros(b, np.int32)
        spec = np.full((b, int(nd.max()) + 1), -1, np.int32)
        tokens = np.zeros(b, np.int32)
        for s in range(b):
            pos = plan.positions[qsl[s] : qsl[s + 1]].astype(np.int64)
            ids = plan.input_ids[qsl[s] : qsl[s + 1]]
            assert (np.diff(pos) == 1).all() and plan.seq_lens[s] == pos[-1] + 1
            slots = plan.block_tables[s][pos // BS].astype(np.int64) * BS + pos % BS
            assert plan.slot_mapping[qsl[s] : qsl[s + 1]].tolist() == slots.tolist()
            assert ids[0] == self.truth[pos[0]]  # (its last known token sits at its position)
            new = []
            for j in range(len(ids)):
                new.append(self.truth[pos[0] + 1 + j])
                if j + 1 == len(ids) or ids[j + 1] != new[-1]:
                    break
            spec[s, : len(new)] = new
            tokens[s] = new[0]
        extra = {"spec_tokens": spec} if nd.any() else {}
        if plan.logprobs.any():  # (a token's "log-prob": -token / 100, NaN where not asked)
            lps = np.where(spec >= 0, -spec / 100, np.nan).astype(np.float32)
            lps[plan.logprobs == 0] = np.nan
            extra["spec_log_probs"] = lps
            extra["log_probs"] = np.where(plan.logprobs != 0, -tokens / 100, np.nan)
        return StepResult(plan.step, tokens, None, 0.001, device_seconds=0.0005, **extra)


def test_a_chain_gains_the_targets_tokens_with_the_ngram_rules_drafts():
    history = TRUTH[:10]
    plan = plan_of([history], [[8, 5, 6]], limits=[40], capacities=[64])
    target = Target()
    result = run_chain(plan, BS, target)
    assert result.spec_tokens.shape[0] == 1
    gained = result.spec_tokens[0][result.spec_tokens[0] >= 0].tolist()
    assert gained == TRUTH[10 : 10 + len(gained)]
    assert result.token_ids.tolist() == [gained[0]]
    drafter = NgramDrafter(1, 3, 3)
    counts = result.spec_chain[0]
    ran = counts[counts[:, 0] >= 0]
    assert len(ran) == len(target.plans) <= 8
    assert int(ran[:, 1].sum()) + len(ran) == len(gained)  # (accepted + one each)
    misses = 0
    for j, step in enumerate(target.plans[1:], start=1):  # (drafted by the n-gram rule)
        misses = 0 if ran[j - 1][1] else misses + 1
        known = TRUTH[: int(step.positions[0]) + 1]
        want = drafter.propose(known).tolist() if misses < CHAIN_MISSES else []
        assert step.input_ids[1:].tolist() == want and want  # (no plain inner step)
    if len(ran) < 8:  # (it ended where its next row had no drafts)
        misses = misses + 1 if not ran[-1][1] else 0
        known = TRUTH[: 10 + len(gained)]
        assert misses >= CHAIN_MISSES or not len(drafter.propose(known))
    assert result.forward_seconds == pytest.approx(0.001 * len(ran))
    # A target the n-gram rule predicts: every draft accepted, k + 1 tokens a step.
    easy = [5, 6, 7, 8] * 30
    plan = plan_of([easy[:10]], [[7, 8, 5]], limits=[40], capacities=[64])
    result = run_chain(plan, BS, Target(easy))
    assert result.spec_tokens[0].tolist() == easy[10:42]
    assert result.spec_chain[0].tolist() == [[3, 3]] * 8


def test_a_row_whose_drafts_keep_failing_stops_drafting():
    """CHAIN_MISSES inner steps in a row with every draft rejected: no drafts after them, and
    with no row drafting, no inner step more."""
    history = TRUTH[:10]
    plan = plan_of([history], [[1, 2, 3]], limits=[40], capacities=[64])
    target = Target()

    def wrong_drafts(p):  # (the first steps' drafts replaced by tokens that always fail)
        if len(target.plans) < CHAIN_MISSES and len(p.num_drafts):
            ids = p.input_ids.copy()
            ids[1:] = 1
            p = dataclasses.replace(p, input_ids=ids)
        return target(p)

    result = run_chain(plan, BS, wrong_drafts)
    counts = result.spec_chain[0].tolist()
    assert [a for _, a in counts[:CHAIN_MISSES]] == [0] * CHAIN_MISSES
    # Then the chain ends (a plain row goes back to the engine's overlapped steps).
    assert len(target.plans) == CHAIN_MISSES
    assert counts[CHAIN_MISSES:] == [[-1, -1]] * (8 - CHAIN_MISSES)
    gained = result.spec_tokens[0][result.spec_tokens[0] >= 0].tolist()
    assert gained == TRUTH[10 : 10 + len(gained)] and len(gained) == CHAIN_MISSES


def test_rows_stop_at_a_stop_token_their_limit_or_their_capacity():
    truth = [5, 6, 7, 8] * 5 + [9] + [5, 6, 7, 8] * 20  # (the n-gram rule's drafts pass)
    drafts = [[7, 8, 5]] * 3
    plan = plan_of([truth[:10]] * 3, drafts, [30, 5, 30], [64, 64, 18], stops=[[9], [], []])
    target = Target(truth)
    result = run_chain(plan, BS, target)
    rows = [r[r >= 0].tolist() for r in result.spec_tokens]
    assert rows[0] == truth[10:21] and rows[0][-1] == 9  # (up to its stop token, kept)
    assert rows[1] == truth[10:15]  # (its limit: 5 tokens)
    # Capacity 18: no row is planned whose positions reach 18.
    assert max(int(p.positions.max()) for p in target.plans if len(p.seq_lens) == 3) < 18
    assert rows[2] == truth[10 : 10 + len(rows[2])] and 10 + len(rows[2]) <= 19
    for p in target.plans:
        assert p.positions.max() < 64


def test_a_refused_inner_step_ends_the_chain_with_what_it_gained():
    plan = plan_of([TRUTH[:10]], [[8, 5, 6]], limits=[30], capacities=[64])
    target = Target()

    def refuse_third(p):
        if len(target.plans) == 2:
            return StepResult(p.step, np.full(len(p.sample), -1, np.int32), "suspended", 0.0)
        return target(p)

    result = run_chain(plan, BS, refuse_third)
    assert result.error is None and len(target.plans) == 2
    first = run_chain(plan, BS, lambda p: StepResult(p.step, np.zeros(1, np.int32), "no", 0.0))
    assert first.error == "no"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chain_ngram": np.asarray([1, 3], np.int32)}, "chain_ngram"),
        ({"chain_limit": np.zeros(0, np.int32)}, "chain_limit"),
        ({"chain_history_loc": np.asarray([0, 3], np.int32)}, "chain_history_loc"),
        ({"top_n": np.ones(1, np.int32)}, "top-n"),
        ({"logprobs_mode": np.ones(1, np.int8)}, "logprobs_mode"),
        ({"num_drafts": np.zeros(1, np.int32)}, "verifies drafts"),
        ({"penalty_rows": np.zeros(1, np.int32)}, "penalty_rows"),
        ({"chain_history": np.asarray(TRUTH[:9] + [1], np.int32)}, "last known token"),
        ({"chain_steps": 65}, "at most 64"),
        ({"mamba_init": np.zeros(1, np.int32)}, "live Mamba slot"),
        ({"mamba_snap_row": np.zeros(1, np.int32)}, "mamba_snap_row"),
    ],
)
def test_plans_outside_the_contract_are_refused(change, message):
    plan = plan_of([TRUTH[:10]], [[8, 5, 6]], limits=[30], capacities=[64])
    with pytest.raises(ValueError, match=message):
        check_chain(dataclasses.replace(plan, **change))


def test_the_log_probs_of_the_gained_tokens_come_where_asked():
    """Row 0 asks for log-probs, row 1 does not. Row 0's limit leaves it no room for drafts
    in the second inner step (a plain row beside row 1's verify row: its token and log-prob
    come from token_ids and log_probs)."""
    easy = [5, 6, 7, 8] * 30
    plan = plan_of([easy[:10]] * 2, [[7, 8, 5]] * 2, limits=[5, 30], capacities=[64] * 2)
    plan = dataclasses.replace(plan, logprobs=np.asarray([1, 0], np.int8))
    target = Target(easy)
    result = run_chain(plan, BS, target)
    assert target.plans[1].num_drafts.tolist() == [0, 3]
    gained = result.spec_tokens[0][result.spec_tokens[0] >= 0]
    assert gained.tolist() == easy[10:15]
    np.testing.assert_allclose(result.spec_log_probs[0, : len(gained)], -gained / 100, atol=1e-6)
    assert np.isnan(result.spec_log_probs[1]).all() and np.isnan(result.log_probs).all()
