"""Speculative decoding in the engine's scheduler (actors/engine/speculation.py): draft planning,
the verify rows of a StepPlan, what a verify result does to a request (stop checks inside an
accepted run, block accounting), the acceptance counters, and random workloads whose outputs
equal plain decoding's. Driven by tests/test_scheduler.py's harness, with a fake gpu that
verifies drafts against its known next tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given

import tests.test_scheduler as ts
from taipan.actors.engine import speculation as spec
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.speculation import Speculation
from taipan.messages.gpu import StepResult
from taipan.messages.requests import SamplingParams
from tests.fuzz import fuzz_settings

PERIOD = 5  # the fake gpu's tokens repeat with this period here: the drafter finds them


@pytest.fixture(autouse=True)
def periodic_tokens():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts, "fake_token", lambda position: position % PERIOD + 10)
        yield


class SpecHarness(ts.Harness):
    """The scheduler harness with speculation on (k drafts): its fake gpu accepts a draft
    while it equals the token it would sample there, and returns the accepted drafts and one
    more token in spec_tokens."""

    def __init__(self, plan, chunked: bool, overlap: bool = False, k: int = 4):
        super().__init__(plan, chunked, overlap)
        self.sched.spec = Speculation(k, 1, 3)
        self.k = k
        self.verify_rows: list[tuple[int, int, int]] = []  # (request, drafts, accepted)

    def check_plan(self, batch, a):
        nd = a["num_drafts"]
        if not len(nd):
            return super().check_plan(batch, a)
        qsl = a["query_start_loc"]
        for i, c in enumerate(batch.chunks):
            r, d = c.request, int(nd[i])
            assert d == (0 if c.drafts is None else len(c.drafts))
            if c.drafts is None:
                continue
            assert r.speculates and a["sample"][i] == 1 and c.num_new_tokens == 1 + d
            assert d <= self.k and c.start == r.num_tokens - 1
            assert len(r.generated) + d + 1 <= r.sampling.max_tokens
            assert r.num_tokens + d + 1 <= self.plan.max_sequence_length
            ids = a["input_ids"][qsl[i] : qsl[i + 1]]
            assert ids[0] == r.token_slice(c.start, c.start + 1)[0]
            assert np.array_equal(ids[1:], c.drafts)
            assert np.array_equal(
                a["positions"][qsl[i] : qsl[i + 1]], np.arange(c.start, c.start + d + 1)
            )
            assert a["seq_lens"][i] == c.start + d + 1
            assert a["gen_index"][i] == len(r.generated)
            assert not len(a["prev_rows"]) or (a["prev_rows"][qsl[i] : qsl[i + 1]] == -1).all()

    def gpu(self, batch, a):
        nd = a["num_drafts"] if len(a["num_drafts"]) else np.zeros(len(batch.chunks), np.int32)
        # The base fake gpu checks reads against the true tokens: drafts are not (yet) true.
        truth = ts.true_tokens
        qsl, ids = a["query_start_loc"], a["input_ids"]

        def known(req: EngineRequest, n: int) -> np.ndarray:
            out = truth(req, n).copy()
            for i, c in enumerate(batch.chunks):
                if c.request is req and nd[i]:
                    out[n - nd[i] :] = ids[qsl[i + 1] - nd[i] : qsl[i + 1]]
            return out

        ts.true_tokens = known
        try:
            result = super().gpu(batch, a)
        finally:
            ts.true_tokens = truth
        if not nd.any():
            return result
        self.device_rows[nd > 0] = False  # (as the worker: a verify row's tokens are several)
        spec = np.full((len(batch.chunks), int(nd.max()) + 1), -1, np.int32)
        spec_lp = np.full(spec.shape, np.nan, np.float32)  # (the real gpu's, as plain decoding's)
        n_top = int(a["top_n"].max(initial=0))
        top_ids = np.full((*spec.shape, n_top), -1, np.int32)  # (the base fake's: 0..n-1)
        tokens = result.token_ids.copy()
        for i, c in enumerate(batch.chunks):
            d = int(nd[i])
            if not d:
                continue
            start = c.start
            drafts = ids[qsl[i + 1] - d : qsl[i + 1]]
            accepted = 0
            while accepted < d and drafts[accepted] == ts.fake_token(start + 1 + accepted):
                accepted += 1
            new = [ts.fake_token(start + 1 + j) for j in range(accepted + 1)]
            spec[i, : len(new)] = new
            if a["logprobs"][i]:
                spec_lp[i, : len(new)] = [ts.fake_log_prob(start + 1 + j) for j in range(len(new))]
            top_ids[i, : len(new)] = np.arange(n_top)
            tokens[i] = new[0]
            self.verify_rows.append((c.request.request_id, d, accepted))
        fields = {f: getattr(result, f) for f in result.__dataclass_fields__}
        extra = {"token_ids": tokens, "spec_tokens": spec, "spec_log_probs": spec_lp}
        extra |= {"spec_top_n_ids": top_ids, "spec_top_n_log_probs": -top_ids.astype(np.float32)}
        return StepResult(**(fields | extra))

    def check_after_update(self):
        bs = self.plan.block_size
        for r in self.sched.running:
            if not self.overlap:  # (below num_tokens - 1: a prompt or a recompute in chunks)
                assert r.num_computed_tokens < r.num_tokens and not r.num_pending
            # Blocks of rejected drafts stay, at most k tokens' worth past the sequence.
            assert len(r.blocks) <= -(-(r.num_computed_tokens + self.k + 1) // bs)
            assert len(r.generated) < r.sampling.max_tokens


def periodic_request(rid: int, prompt_len: int, max_tokens: int, **sampling) -> EngineRequest:
    """A request whose prompt is the fake gpu's own token sequence: every draft is right."""
    prompt = np.asarray([ts.fake_token(p) for p in range(prompt_len)], np.int32)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return EngineRequest(rid, prompt, params, False, arrival_time=float(rid), seed=rid)


def test_drafts_are_planned_verified_and_counted():
    h = SpecHarness(ts.make_plan(), chunked=False, k=4)
    h.add(periodic_request(1, 12, max_tokens=14))
    h.run()
    h.check_end()
    r = h.ended[1]
    assert r.generated == [ts.fake_token(12 + j) for j in range(14)]
    # Prefill samples one token; then verify rows of 4 drafts, all accepted (5 tokens each),
    # cut at the end so that the last row's tokens stay within max_tokens.
    assert [d for _, d, _ in h.verify_rows] == [4, 4, 2]
    assert all(a == d for _, d, a in h.verify_rows)
    assert len([s for s in h.history if s]) == 4  # the prefill and three verify steps
    stats = h.sched.stats()
    assert stats["spec_draft_tokens"] == 10 and stats["spec_accepted_tokens"] == 10
    assert stats["spec_verify_rows"] == 3
    assert stats["spec_accepted_per_position"] == (3, 3, 2, 2)


def test_a_wrong_draft_is_rejected_and_decoding_goes_on():
    h = SpecHarness(ts.make_plan(), chunked=False, k=3)
    req = periodic_request(1, 12, max_tokens=10)
    req.prompt[-2] = 99  # a suffix seen nowhere else: no draft until the pattern recurs
    h.add(req)
    h.run()
    h.check_end()
    assert h.ended[1].generated == [ts.fake_token(12 + j) for j in range(10)]
    assert h.verify_rows and h.sched.spec.draft_tokens >= h.sched.spec.accepted_tokens


@pytest.mark.parametrize("where", ["eos", "stop_token", "stop_word", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_there(where):
    # Generated tokens of a 10-token prompt: fake_token(10), (11), ... = 10, 11, 12, 13, 14, 10.
    eos = (13,) if where == "eos" else ()
    h = SpecHarness(ts.make_plan(eos=eos), chunked=False, k=4)
    extra = {}
    if where == "stop_token":
        extra = {"stop_token_ids": (13,)}
    if where == "stop_word":
        extra = {"stop_word_ids": ((12, 13),)}
    max_tokens = 3 if where == "max_tokens" else 20
    h.add(periodic_request(1, 10, max_tokens=max_tokens, **extra))
    h.run()
    if where != "stop_word":  # (the harness's expected outputs know no stop words)
        h.check_end()
    assert h.pool.held == {} and not h.sched.requests
    r = h.ended[1]
    # The prefill samples 10, then one verify row of 4 drafts (11, 12, 13, 14) accepts all
    # (max_tokens: 2 drafts), and its tokens after the stop are dropped.
    want = {"eos": [10, 11, 12, 13], "stop_token": [10, 11, 12, 13], "stop_word": [10, 11]}
    assert r.generated == want.get(where, [10, 11, 12])
    assert r.finish_reason == ("length" if where == "max_tokens" else "stop")
    assert len(h.verify_rows) == 1


def test_only_requests_that_opt_out_do_not_speculate():
    """Log-probs (processed too), every logit control and grammars (greedy or sampled)
    speculate; speculative=False does not; with a draft model, bad words do not."""
    from taipan.actors.engine.speculation import Speculation
    from taipan.messages.requests import StructuredOutput

    regex = StructuredOutput("regex", "[a-z]+")
    spec, on_gpu = Speculation(4, 1, 4), Speculation(4, 1, 4, on_gpu=True)
    assert spec.eligible(periodic_request(7, 12, 8, structured=regex))
    sampled = SamplingParams(max_tokens=8, temperature=0.7, structured=regex)
    prompt = np.arange(12, dtype=np.int32)
    assert spec.eligible(EngineRequest(7, prompt, sampled, False, 0.0, seed=7))
    assert on_gpu.eligible(EngineRequest(7, prompt, sampled, False, 0.0, seed=7))
    # A draft model's drafts are unknown while planning, and bad words' biases follow them.
    bad = periodic_request(3, 12, 8, bad_words_ids=((7, 8),))
    assert spec.eligible(bad) and not on_gpu.eligible(bad)
    h = SpecHarness(ts.make_plan(), chunked=False)
    reqs = [
        periodic_request(1, 12, 8, speculative=False),
        periodic_request(2, 12, 8, return_log_probs=True, logprobs_mode="processed"),
        periodic_request(3, 12, 8, bad_words_ids=((7, 8),)),
        periodic_request(4, 12, 8),
        periodic_request(5, 12, 8, presence_penalty=0.5, logit_bias={9: -1.0}),
        periodic_request(6, 12, 8, min_tokens=4),
    ]
    for r in reqs:
        h.add(r)
    assert [r.speculates for r in reqs] == [False, True, True, True, True, True]
    h.run()
    h.check_end()
    assert {rid for rid, _, _ in h.verify_rows} == {2, 3, 4, 5, 6}
    for rid in (1, 2, 3, 4, 5, 6):
        assert h.ended[rid].generated == [ts.fake_token(12 + j) for j in range(8)]


def test_a_request_with_log_probs_speculates_and_gets_one_per_token():
    """Log-probs and top-n, raw or processed, ride along: each accepted token gets what plain
    decoding gives it (check_end compares the log-probs)."""
    h = SpecHarness(ts.make_plan(), chunked=False, k=4)
    h.add(periodic_request(1, 12, 14, return_log_probs=True, top_n_logprobs=2))
    h.add(periodic_request(2, 12, 6, return_log_probs=True, logprobs_mode="processed"))
    assert h.sched.requests[1].speculates and h.sched.requests[2].speculates
    h.run()
    h.check_end()
    assert {rid for rid, _, _ in h.verify_rows} == {1, 2}
    r = h.ended[1]
    assert len(r.log_probs) == len(r.top_n) == 14
    for ids, lps in r.top_n:  # (the fake gpu's top-n: ids 0, 1 at log-probs 0, -1)
        assert ids.tolist() == [0, 1] and lps.tolist() == [0.0, -1.0]


def test_drafts_fit_the_token_budget_and_the_free_blocks():
    # max_tokens 8 for 3 decode rows: each later row keeps a token, so drafts are cut.
    h = SpecHarness(ts.make_plan(max_tokens=8, num_blocks=64), chunked=False, k=6)
    for rid in range(1, 4):
        h.add(periodic_request(rid, 7, max_tokens=12))
    h.run()
    h.check_end()
    assert all(sum(n for _, n, _ in step) <= 8 for step in h.history)
    # A pool with no block to spare: drafts shrink to what the free blocks hold.
    plan = ts.make_plan(num_blocks=5, block_size=4)
    h = SpecHarness(plan, chunked=True, k=6)
    h.add(periodic_request(1, 6, max_tokens=14))
    h.run()
    h.check_end()
    assert h.ended[1].generated == [ts.fake_token(6 + j) for j in range(14)]


def test_overlap_runs_a_speculative_request_only_when_its_token_is_known():
    h = SpecHarness(ts.make_plan(), chunked=False, overlap=True, k=4)
    h.add(periodic_request(1, 12, max_tokens=12))
    h.add(periodic_request(2, 12, max_tokens=12, speculative=False))
    h.run()
    h.check_end()
    for rid in (1, 2):
        assert h.ended[rid].generated == [ts.fake_token(12 + j) for j in range(12)]
    assert h.verify_rows


def test_a_request_that_gains_nothing_backs_off_and_comes_back():
    """No draft while nothing repeats (a prompt of distinct tokens): after MISSES such rows the
    request decodes plainly (with overlap) for BACKOFF tokens, then speculates again, and by
    then its own periodic output gives drafts that are accepted."""
    h = SpecHarness(ts.make_plan(), chunked=False, overlap=True, k=4)
    prompt = np.arange(100, 112, dtype=np.int32)  # nothing the fake gpu's tokens repeat
    params = SamplingParams(max_tokens=40, temperature=0.0)
    h.add(EngineRequest(1, prompt, params, False, arrival_time=0.0, seed=1))
    h.run()
    h.check_end()
    assert h.ended[1].generated == [ts.fake_token(12 + j) for j in range(40)]
    assert h.sched.stats()["spec_backoffs"] == 1
    # Its first verify row comes after the back-off's plain tokens, and it is accepted.
    assert h.verify_rows and h.verify_rows[0][2] > 0
    decode = h.history[1:]  # (after the prompt's step)
    first = next(i for i, step in enumerate(decode) if any(n > 1 for _, n, _ in step))
    assert sum(1 for step in decode[:first] if step) >= spec.MISSES + spec.BACKOFF


def test_back_off_doubles_without_an_accepted_draft_and_resets_with_one():
    s = Speculation(4, 1, 3)
    r = periodic_request(1, 12, 100)
    r.speculates = True
    lengths = []
    for _ in range(4):  # MISSES misses each, nothing accepted in between
        for _ in range(spec.MISSES):
            s._missed(r)
        assert not r.speculates
        lengths.append(r.spec_backoff.length)
        s.resume(r)
        assert not r.speculates  # not before its tokens are decoded
        r.generated.extend([0] * r.spec_backoff.length)
        s.resume(r)
        assert r.speculates
    assert lengths == [spec.BACKOFF * 2**i for i in range(4)]
    s._hit(r)
    for _ in range(spec.MISSES):
        s._missed(r)
    assert r.spec_backoff.length == spec.BACKOFF and s.backoffs == 5
    for _ in range(20):
        s._missed(r)
        s._missed(r)
    assert r.spec_backoff.length == spec.BACKOFF_MAX


def test_no_request_speculates_while_more_run_than_the_batch_limit():
    """speculative_disable_by_batch_size 1 (Speculation.active): while two requests run no row
    verifies drafts and both take a row in every step, overlapped as plain requests are; once
    the short one ends, the long tail speculates again. Outputs stay plain decoding's."""
    h = SpecHarness(ts.make_plan(), chunked=False, overlap=True, k=4)
    h.sched.spec = Speculation(4, 1, 3, off_above=1)
    h.add(periodic_request(1, 12, max_tokens=10))
    h.add(periodic_request(2, 12, max_tokens=40))
    h.run()
    h.check_end()
    for rid, n in ((1, 10), (2, 40)):
        assert h.ended[rid].generated == [ts.fake_token(12 + j) for j in range(n)]
    both = [step for step in h.history if {rid for rid, _, _ in step} == {1, 2}]
    assert len(both) >= 9  # (the prompts' step, then a row of each in every step)
    assert all(n == 1 for step in both[1:] for _, n, _ in step)  # (no verify row)
    assert h.verify_rows and {rid for rid, _, _ in h.verify_rows} == {2}
    assert h.sched.spec.stats()["spec_batch_off_steps"] >= 9
    # The first steps after the prompts': the prompt's step speculated (nothing ran when it was
    # planned), so the next one waits for its tokens; from then on every step has both rows.
    decode = [step for step in h.history[1:] if step]
    first_both = next(i for i, step in enumerate(decode) if len(step) == 2)
    assert all(len(step) == 2 for step in decode[first_both : first_both + 8])


def test_a_request_whose_verify_row_is_in_flight_waits_when_the_batch_grows():
    """A request speculates alone; a second is admitted in the step that plans its verify
    row, so the step after is planned with speculation off (2 running > 1) while that row is
    in flight: the request still waits for the row's tokens (how many it gained is not known
    yet), then runs plain rows beside the newcomer."""
    h = SpecHarness(ts.make_plan(), chunked=False, overlap=True, k=4)
    h.sched.spec = Speculation(4, 1, 3, off_above=1)
    h.add(periodic_request(2, 12, max_tokens=40))
    while not (h.running and any(c.drafts is not None for c in h.running[0].chunks)):
        assert h.step()
    assert h.step()  # (its verify row collected; it waited: its next row is a verify row)
    h.add(periodic_request(1, 12, max_tokens=10))
    assert h.step()  # (the verify row and the newcomer's prompt)
    assert h.running and {c.request.request_id: c.drafts is not None
                          for c in h.running[0].chunks} == {2: True, 1: False}  # fmt: skip
    h.run()
    h.check_end()
    for rid, n in ((1, 10), (2, 40)):
        assert h.ended[rid].generated == [ts.fake_token(12 + j) for j in range(n)]
    assert h.sched.spec.stats()["spec_batch_off_steps"] > 0


@fuzz_settings(60)
@given(ts.workloads())
def test_random_workloads_equal_plain_decoding(workload):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts, "fake_token", lambda position: position % PERIOD + 10)
        plan, chunked, requests, overlap = workload
        h = SpecHarness(plan, chunked, overlap, k=3)
        off_above = (None, 1, 2)[len(requests) % 3]  # (speculative_disable_by_batch_size)
        h.sched.spec = Speculation(3, 1, 3, off_above=off_above)
        ts.drive(h, requests)
        h.check_end()  # every output (and reason) is plain decoding's
        event(f"verify rows: {bool(h.verify_rows)}, overlap: {overlap}")
        event(f"some accepted: {any(a for _, _, a in h.verify_rows)}")
        event(f"batch limit {off_above}: off in some step {h.sched.spec.steps_off > 0}")
        event(f"paused: {h.sched.num_paused_total > 0}, evicted: {h.sched.num_evicted_total > 0}")


def test_replay_check_of_a_speculative_engine_has_no_divergence():
    """actors/engine/check.py re-plans every step of a speculative engine's log (drafts, verify
    results, pauses under a 6-block pool) and finds what the engine sent."""
    import dataclasses

    from taipan.actors.engine import wire
    from taipan.actors.engine.check import EngineReplay
    from taipan.messages.codec import encode
    from tests.test_engine_check import CONFIG, RecordingHarness

    config = dataclasses.replace(CONFIG, num_speculative_tokens=3)

    class SpecRecording(SpecHarness, RecordingHarness):
        def __init__(self):
            RecordingHarness.__init__(self)
            self.sched.spec, self.k, self.verify_rows = wire.speculation(config), 3, []

    h = SpecRecording()
    for rid in (1, 2):
        h.submit(periodic_request(rid, 4, max_tokens=6))
    h.run()
    assert h.verify_rows and h.sched.num_paused_total > 0
    checker = EngineReplay(config)
    for direction, channel, msg, time in h.records:
        if direction == "in":
            what = checker.inbound(channel, msg, time)
        else:
            what = checker.outbound(msg, tuple(encode(msg)))
        assert what is None, what
    assert checker.steps_checked > 3


def test_the_disable_policy_ends_speculation_at_the_first_weight_update():
    """draft_weight_policy "disable": once new weights land, no request speculates again
    (those running, those admitted later, and those coming back from a back-off), and the
    tokens are the same."""
    h = SpecHarness(ts.make_plan(), chunked=False)
    h.sched.spec = Speculation(4, 1, 3, disable_on_update=True)
    h.add(periodic_request(1, 12, 60))
    for _ in range(4):
        h.step()
    assert h.verify_rows and not h.sched.spec.disabled
    rows = len(h.verify_rows)
    h.sched.new_weights(1)
    assert h.sched.spec.disabled and not h.sched.requests[1].speculates
    h.add(periodic_request(2, 12, 8))
    assert not h.sched.requests[2].speculates
    h.run()
    h.check_end()
    assert len(h.verify_rows) == rows
    assert h.ended[1].generated == [ts.fake_token(12 + j) for j in range(60)]
    assert h.sched.spec.stats()["spec_draft_disabled"] == 1
    kept = Speculation(4, 1, 3)  # ("keep": nothing changes)
    kept.new_weights([])
    assert not kept.disabled and kept.stats()["spec_draft_disabled"] == 0


def test_the_config_picks_the_drafter_and_its_policy():
    from taipan.actors.config import InferenceConfig
    from taipan.actors.engine.wire import speculation

    assert speculation(InferenceConfig()) is None
    ngram = speculation(InferenceConfig(num_speculative_tokens=3))
    assert not ngram.on_gpu and not ngram.disable_on_update
    draft = dict(num_speculative_tokens=3, speculative_method="draft_model")
    cases = [("/d", "keep", False), ("/d", "disable", True), ("/d", "refuse", False)]
    for model, policy, disables in cases + [("self:1", "keep", False)]:
        config = InferenceConfig(**draft, speculative_model=model, draft_weight_policy=policy)
        s = speculation(config)
        assert s.on_gpu and s.disable_on_update == disables


def test_the_batch_limit_comes_from_the_config_and_bad_ones_are_refused():
    from taipan.actors.config import ConfigError, InferenceConfig
    from taipan.actors.engine.wire import speculation

    s = speculation(InferenceConfig(num_speculative_tokens=3, speculative_disable_by_batch_size=8))
    assert s.off_above == 8 and s.active(8) and not s.active(9) and s.steps_off == 0
    assert speculation(InferenceConfig(num_speculative_tokens=3)).off_above is None
    for bad in (dict(num_speculative_tokens=3, speculative_disable_by_batch_size=0),
                dict(speculative_disable_by_batch_size=4)):  # fmt: skip
        with pytest.raises(ConfigError, match="speculative_disable_by_batch_size"):
            InferenceConfig(**bad)
