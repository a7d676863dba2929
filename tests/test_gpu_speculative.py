"""The gpu worker's verify path (actors/gpu/speculative.py) on CPU with a tiny random Llama: a
step whose sequences carry draft tokens returns, in StepResult.spec_tokens, exactly the tokens
one-token decoding would produce (greedy and seeded sampling), up to and including the first
token that disagrees with a draft; plans the verify path cannot take are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel, StepPlan
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_ops_logprobs import Seq, make_plan

pytest.importorskip("transformers")

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]
BLOCKS = [[1, 3], [2, 4]]
STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")), TINY_SHAPE)


@pytest.fixture(scope="module")
def worker(model_dir) -> ModelWorker:
    w = ModelWorker()
    w.load(LoadModel(model_dir, "float32", "cpu", 16, 8, 1.0, 256, 8, 128))
    return w


def _with(plan: StepPlan, temperature: float, gen_index: list[int], **extra) -> StepPlan:
    n = len(plan.seq_lens)
    return dataclasses.replace(
        plan,
        temperature=np.full(n, temperature, np.float32),
        seeds=np.asarray([11 + i for i in range(n)], np.int64),
        gen_index=np.asarray(gen_index, np.int32),
        **extra,
    )


def _plain(
    w: ModelWorker, temperature: float, log_probs: list | None = None, **extra
) -> list[list[int]]:
    """Each prompt's first token (prefill), then STEPS tokens one step at a time (`log_probs`:
    a list that gets each prompt's log-probs of them, raw unless `extra` says otherwise)."""
    out = [[] for _ in PROMPTS]
    asked = dict(extra)
    if log_probs is not None:
        asked |= {"logprobs": np.ones(len(PROMPTS), np.int8), "top_n": np.full(2, 3, np.int32)}
        log_probs += [[] for _ in PROMPTS]
    seqs = [Seq(p, 0, BLOCKS[i]) for i, p in enumerate(PROMPTS)]
    for step in range(STEPS + 1):
        if step:
            seqs = [Seq([out[i][-1]], len(p) + step - 1, BLOCKS[i]) for i, p in enumerate(PROMPTS)]
        plan = _with(make_plan(1 + step, seqs), temperature, [step] * 2, **asked)
        res = w.step(plan)
        for i, t in enumerate(res.token_ids.tolist()):
            out[i].append(t)
            if log_probs is not None:
                log_probs[i].append((float(res.log_probs[i]), res.top_n_log_probs[i].copy()))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verify_rows_reproduce_one_token_decoding(worker, temperature):
    want = _plain(worker, temperature)
    seqs = [Seq(p, 0, BLOCKS[i]) for i, p in enumerate(PROMPTS)]
    first = worker.step(_with(make_plan(1, seqs), temperature, [0, 0])).token_ids.tolist()
    assert first == [w[0] for w in want]
    # Row 0 (a plain decode row) rides along; row 1 verifies 4 drafts: the next 2 true
    # tokens, a wrong one, then a true one (never reached).
    t = want[1]
    wrong = (t[3] + 1) % 256
    drafts = [t[1], t[2], wrong, t[4]]
    seqs = [
        Seq([want[0][0]], len(PROMPTS[0]), BLOCKS[0]),
        Seq([t[0], *drafts], len(PROMPTS[1]), BLOCKS[1]),
    ]
    plan = _with(make_plan(2, seqs), temperature, [1, 1], num_drafts=np.asarray([0, 4], np.int32))
    res = worker.step(plan)
    assert res.error is None and res.spec_tokens.shape == (2, 5)
    assert res.spec_tokens[0].tolist() == [-1] * 5
    assert res.spec_tokens[1].tolist() == [t[1], t[2], t[3], -1, -1]
    assert res.token_ids.tolist() == [want[0][1], t[1]]
    # All drafts right: k accepted and the bonus token. Row 1 goes on from position +3
    # (its rejected draft's KV is overwritten).
    start = len(PROMPTS[1]) + 3
    seqs = [
        Seq([want[0][1]], len(PROMPTS[0]) + 1, BLOCKS[0]),
        Seq([t[3], t[4], t[5]], start, BLOCKS[1]),
    ]
    plan = _with(make_plan(3, seqs), temperature, [2, 4], num_drafts=np.asarray([0, 2], np.int32))
    res = worker.step(plan)
    assert res.spec_tokens[1].tolist() == [t[4], t[5], t[6]]
    assert res.token_ids[0] == want[0][2]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verify_rows_carry_the_raw_log_probs_of_one_token_decoding(worker, temperature):
    """A verify row that asks for log-probs gets each new token's raw log-prob in
    spec_log_probs, as one-token decoding computes it; a row that does not ask gets NaN."""
    want_lp: list = []
    want = _plain(worker, temperature, want_lp)
    seqs = [Seq(p, 0, BLOCKS[i]) for i, p in enumerate(PROMPTS)]
    worker.step(_with(make_plan(1, seqs), temperature, [0, 0]))
    t = want[1]
    seqs = [
        Seq([want[0][0]], len(PROMPTS[0]), BLOCKS[0]),
        Seq([t[0], t[1], t[2], (t[3] + 1) % 256], len(PROMPTS[1]), BLOCKS[1]),
    ]
    for asked in ([1, 1], [1, 0]):
        plan = _with(
            make_plan(2, seqs), temperature, [1, 1],
            num_drafts=np.asarray([0, 3], np.int32), logprobs=np.asarray(asked, np.int8),
            top_n=np.asarray(asked, np.int32) * 3,
        )  # fmt: skip
        res = worker.step(plan)
        assert res.spec_tokens[1].tolist() == [t[1], t[2], t[3], -1]
        if asked[1]:
            lps = [lp for lp, _ in want_lp[1][1:4]]
            np.testing.assert_allclose(res.spec_log_probs[1, :3], lps, atol=1e-4)
            assert np.isnan(res.spec_log_probs[1, 3]) and np.isnan(res.spec_log_probs[0]).all()
            tops = np.stack([top for _, top in want_lp[1][1:4]])
            np.testing.assert_allclose(res.spec_top_n_log_probs[1, :3], tops, atol=1e-4)
            assert (res.spec_top_n_ids[1, 3] == -1).all() and (res.spec_top_n_ids[0] == -1).all()
        else:
            assert res.spec_log_probs.shape == (0, 0) or np.isnan(res.spec_log_probs).all()
            assert res.spec_top_n_ids.size == 0
        np.testing.assert_allclose(res.log_probs[0], want_lp[0][1][0], atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verify_rows_carry_the_processed_log_probs_of_one_token_decoding(worker, temperature):
    """A verify row of a sequence that asks for processed log-probs (top-k and top-p filters,
    logprobs_mode 1) gets, for each new token, what one-token decoding computes for it; the
    plain row beside it keeps its raw ones."""
    filters = {
        "top_k": np.full(2, 20, np.int32),
        "top_p": np.full(2, 0.8, np.float32),
        "logprobs_mode": np.asarray([0, 1], np.int8),
    }
    want_lp: list = []
    want = _plain(worker, temperature, want_lp, **filters)
    seqs = [Seq(p, 0, BLOCKS[i]) for i, p in enumerate(PROMPTS)]
    worker.step(_with(make_plan(1, seqs), temperature, [0, 0], **filters))
    t = want[1]
    seqs = [
        Seq([want[0][0]], len(PROMPTS[0]), BLOCKS[0]),
        Seq([t[0], t[1], t[2], (t[3] + 1) % 256], len(PROMPTS[1]), BLOCKS[1]),
    ]
    plan = _with(
        make_plan(2, seqs), temperature, [1, 1], num_drafts=np.asarray([0, 3], np.int32),
        logprobs=np.ones(2, np.int8), top_n=np.full(2, 3, np.int32), **filters,
    )  # fmt: skip
    res = worker.step(plan)
    assert res.spec_tokens[1].tolist() == [t[1], t[2], t[3], -1]
    lps = [lp for lp, _ in want_lp[1][1:4]]
    np.testing.assert_allclose(res.spec_log_probs[1, :3], lps, atol=1e-4)
    tops = np.stack([top for _, top in want_lp[1][1:4]])
    np.testing.assert_allclose(res.spec_top_n_log_probs[1, :3], tops, atol=1e-4)
    np.testing.assert_allclose(res.log_probs[0], want_lp[0][1][0], atol=1e-4)


def test_a_plan_without_drafts_has_no_spec_tokens(worker):
    seqs = [Seq(PROMPTS[0], 0, BLOCKS[0])]
    res = worker.step(make_plan(1, seqs))
    assert res.spec_tokens.shape == (0, 0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt_targets": np.asarray([-1, 5, -1], np.int32)}, "prompt log-probs"),
        (
            {
                "bias_rows": np.asarray([0], np.int32),
                "bias_tokens": np.asarray([5], np.int32),
                "bias_values": np.asarray([-np.inf], np.float32),
                "bias_if_last": np.asarray([3], np.int32),
            },
            "conditional bias",
        ),
        ({"num_drafts": np.asarray([3], np.int32)}, "query length"),
        ({"num_drafts": np.asarray([1, 1], np.int32)}, "2 entries for 1 sequences"),
        ({"sample": np.asarray([0], np.int8)}, "must sample"),
        ({"prev_rows": np.asarray([-1, 0, -1], np.int32)}, "previous step"),
    ],
)
def test_plans_the_verify_path_cannot_take_are_refused(worker, change, message):
    seqs = [Seq(PROMPTS[0][:3], 0, BLOCKS[0])]
    plan = dataclasses.replace(make_plan(1, seqs), num_drafts=np.asarray([2], np.int32))
    with pytest.raises(ValueError, match=message):
        worker.step(dataclasses.replace(plan, **change))


def test_mixed_graph_bodies_keep_hidden_states_only_where_the_config_speculates(tmp_path):
    """What a mixed CUDA graph records and a replay returns, run on the CPU (the graph body is
    the eager code it captures): without the kept buffer (a config that does not speculate)
    only the logits, and a replayed step has no hidden states; with it, every token's hidden
    state, which a replayed mixed step returns for its verify rows (a decode bucket: none)."""
    import types

    import torch

    from taipan.actors.gpu.forward import plan_arrays
    from taipan.actors.gpu.graphs import Bucket

    w = ModelWorker()
    w.load(LoadModel(make_random_llama(str(tmp_path), TINY_SHAPE), "float32", "cpu", 16, 64,
                     0.01, 256, 8, 256))  # fmt: skip
    mixed, decode = Bucket(8, 8, False), Bucket(8, 8, True)
    hidden_size = w.config.hidden_size
    states = torch.arange(8 * hidden_size, dtype=torch.float32).view(8, hidden_size) / 1e4
    # (the model's forward as a CUDA graph records it needs the CUDA kernels' attention: its
    # output stands in here; the forward itself is every other test's)
    w._run_model = lambda ids, inputs, attn, inner_snaps=None, static_snaps=False: states
    w._logits = torch.empty(8, w.config.vocab_size)
    w._neutral_step(mixed)
    w._graph_body(mixed)  # (no kept buffer: a config that does not speculate)
    w._graph_hidden = torch.full((8, hidden_size), float("nan"))
    w._graph_body(decode)
    assert w._graph_hidden.isnan().all()  # (a decode graph keeps nothing)
    w._graph_body(mixed)
    assert torch.equal(w._graph_hidden, states)
    plan = make_plan(1, [Seq([5, 6, 7], 0, [0])])
    staged = w.buffers.stage(plan_arrays(plan), num_tokens=8, num_seqs=8)
    w.graphs = types.SimpleNamespace(replay=lambda bucket: None)  # (what a replay leaves)
    assert torch.equal(w._forward_logits(plan, staged, mixed, {})[2], states[:3])
    assert w._forward_logits(plan, staged, decode, {})[2] is None
    w._graph_hidden = None
    assert w._forward_logits(plan, staged, mixed, {})[2] is None


@pytest.mark.parametrize("seed", range(8))
def test_greedy_verification_on_the_host_equals_the_device_rule(seed):
    """The worker's greedy verify (`_greedy_on_host`: argmax to the host, prefixes there) and
    ops/speculative.py `verify_greedy` agree on random rows with ties, no-draft rows between
    verifying ones, and drafts that match the argmax some of the way."""
    import types

    import torch

    from taipan.actors.gpu.speculative import _greedy_on_host, _log_prob_arrays
    from taipan.ops.speculative import verify_greedy

    rng = np.random.default_rng(seed)
    batch, vocab = 5, 7
    num_drafts = rng.integers(0, 4, size=batch)
    num_drafts[rng.integers(batch)] = 3  # at least one verifying row
    query = num_drafts + 1 + rng.integers(0, 2, size=batch)  # (a row may hold more before)
    qsl = np.concatenate([[0], np.cumsum(query)]).astype(np.int32)
    rows = np.flatnonzero(num_drafts > 0)
    counts = num_drafts[rows] + 1
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    scored = np.repeat(qsl[1:][rows] - counts, counts) + offsets
    logits = torch.from_numpy(rng.integers(0, 3, size=(len(scored), vocab)).astype(np.float32))
    target = logits.argmax(-1).numpy()
    input_ids = rng.integers(0, vocab, size=int(qsl[-1])).astype(np.int32)
    # Drafts that follow the argmax for a while, then maybe not.
    for i, s in enumerate(scored):
        if offsets[i] > 0 and rng.random() < 0.7:
            input_ids[s] = target[i - 1]
    asked = (rng.random(batch) < 0.5).astype(np.int8)
    plan = types.SimpleNamespace(
        input_ids=input_ids, seq_lens=query.astype(np.int32), logprobs=asked,
        top_n=asked.astype(np.int32) * 2, logprobs_mode=np.zeros(0, np.int8),
        temperature=np.zeros(batch, np.float32), grammar_rows=np.zeros(0, np.int64),
    )  # fmt: skip
    tokens = torch.full((batch,), 99, dtype=torch.int64)
    nd = num_drafts[rows].astype(np.int64)
    got_tokens, spec, chosen = _greedy_on_host(plan, rows, nd, scored, offsets > 0, logits, tokens)
    arrays = _log_prob_arrays(plan, rows, nd, (logits, logits), chosen, spec)
    lp = arrays.get("spec_log_probs")
    drafts = torch.from_numpy(input_ids[scored[offsets > 0]].astype(np.int64))
    want = verify_greedy(logits, drafts, torch.from_numpy(num_drafts[rows].astype(np.int64)))
    req_of_row = np.repeat(np.arange(len(rows)), counts)
    for j, row in enumerate(rows):
        mine = want.tokens.numpy()[req_of_row == j]
        assert spec[row][: len(mine)].tolist() == mine.tolist()
        assert (spec[row][len(mine) :] == -1).all()
        assert got_tokens[row] == mine[0]
        if asked[row]:  # raw log-probs of the kept tokens: log-softmax at the argmax
            kept = mine[mine >= 0]
            rows_of = np.flatnonzero(req_of_row == j)[: len(kept)]
            raw = torch.log_softmax(logits, -1)[rows_of, torch.from_numpy(kept)].numpy()
            np.testing.assert_allclose(lp[row][: len(kept)], raw, atol=1e-5)
            assert np.isnan(lp[row][len(kept) :]).all()
            top = torch.log_softmax(logits, -1)[rows_of].topk(2, dim=-1)
            np.testing.assert_allclose(
                arrays["spec_top_n_log_probs"][row][: len(kept)], top.values.numpy(), atol=1e-5
            )
            assert (arrays["spec_top_n_ids"][row][len(kept) :] == -1).all()
        elif lp is not None:
            assert np.isnan(lp[row]).all()
    others = np.setdiff1d(np.arange(batch), rows)
    assert (spec[others] == -1).all() and (got_tokens[others] == 99).all()


def test_scored_controls_equal_plain_controls_with_the_drafts_counted():
    """`scored_controls` of a verify row equals sampling_controls' `controlled_logits` of a
    plain plan whose j-th sequence has seen the row's tokens plus its first j drafts: the
    biases at every position, the penalties with the drafts before each counted."""
    import torch

    from taipan.actors.gpu.sampling_controls import controlled_logits
    from taipan.actors.gpu.speculative import scored_controls

    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.normal(size=(4, 32)).astype(np.float32))
    drafts, seen, counts = [4, 9, 4], np.array([4, 7, 11], np.int32), np.array([1, 1, 0], np.int32)
    pen = {"presence": 0.5, "frequency": 0.3, "repetition": 1.3}
    bias = {"bias_tokens": [9, 2], "bias_values": [2.0, -1.0]}

    def controls(n: int, rows: list[int], entries: list) -> dict:
        """Penalty and bias fields for `n` sequences, `rows` of them controlled, each with
        its (tokens, counts) of `entries`."""
        each = [len(t) for t, _ in entries]
        penalised = np.isin(np.arange(n), rows)
        return {
            "presence_penalty": np.where(penalised, pen["presence"], 0).astype(np.float32),
            "frequency_penalty": np.where(penalised, pen["frequency"], 0).astype(np.float32),
            "repetition_penalty": np.where(penalised, pen["repetition"], 1).astype(np.float32),
            "penalty_rows": np.repeat(rows, each).astype(np.int32),
            "penalty_tokens": np.concatenate([t for t, _ in entries]).astype(np.int32),
            "penalty_counts": np.concatenate([c for _, c in entries]).astype(np.int32),
            "bias_rows": np.repeat(rows, 2).astype(np.int32),
            "bias_tokens": np.tile(bias["bias_tokens"], len(rows)).astype(np.int32),
            "bias_values": np.tile(bias["bias_values"], len(rows)).astype(np.float32),
            "bias_if_last": np.full(2 * len(rows), -1, np.int32),
        }

    # Sequence 0 decodes plainly, sequence 1 verifies three drafts.
    verify = dataclasses.replace(
        make_plan(1, [Seq([3], 5, [0]), Seq([2, *drafts], 5, [1])]),
        num_drafts=np.array([0, 3], np.int32),
        **controls(2, [1], [(seen, counts)]),
    )
    got = scored_controls(verify, np.array([1]), np.array([3]), np.arange(1, 5), raw)
    entries = [
        (np.concatenate([seen, drafts[:j]]), np.concatenate([counts, np.ones(j, np.int32)]))
        for j in range(4)
    ]
    plain = dataclasses.replace(
        make_plan(1, [Seq([1], 5, [j]) for j in range(4)]), **controls(4, [0, 1, 2, 3], entries)
    )
    none = torch.zeros(8, dtype=torch.int64)
    torch.testing.assert_close(got, controlled_logits(plain, raw, none))
    # (The drafts matter: without them every position would get position 0's controls.)
    first_only = dataclasses.replace(plain, **controls(4, [0, 1, 2, 3], [(seen, counts)] * 4))
    assert not torch.allclose(got[1:], controlled_logits(first_only, raw, none)[1:])


def test_scored_controls_put_an_offset_entry_at_its_position_only():
    import torch

    from taipan.actors.gpu.speculative import scored_controls

    raw = torch.zeros(3, 16)
    plan = dataclasses.replace(
        make_plan(1, [Seq([2, 7, 8], 5, [0])]),
        num_drafts=np.array([2], np.int32),
        bias_rows=np.zeros(3, np.int32),
        bias_tokens=np.array([3, 4, 5], np.int32),
        bias_values=np.array([-np.inf, -np.inf, 1.0], np.float32),
        bias_if_last=np.full(3, -1, np.int32),
        bias_offsets=np.array([0, 2, -1], np.int32),
    )
    got = scored_controls(plan, np.array([0]), np.array([2]), np.arange(3), raw)
    assert torch.isinf(got[:, 3]).tolist() == [True, False, False]
    assert torch.isinf(got[:, 4]).tolist() == [False, False, True]
    assert got[:, 5].tolist() == [1.0, 1.0, 1.0]
