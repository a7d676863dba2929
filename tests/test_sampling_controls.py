"""Sampling controls (issue 28 item 3): presence, frequency and repetition penalties, logit_bias,
min_tokens and bad_words_ids, with vLLM's semantics.

Layers: the math (ops/logit_controls.py) against a plain-Python reference on random logits;
SamplingParams' checks (each error names its key) and wire form, old encodings of
SamplingParams and StepPlan still decoding; the engine's control arrays (actors/engine/
control_arrays.py) read back by the gpu side (actors/gpu/sampling_controls.py) equal the
reference, with the row's last token known or in flight (prev_rows); the Triton sampler with
forbidden (-inf) tokens against its reference; the stop rules under min_tokens; and end to end
through the real runtime on a tiny random Llama, steps overlapped and not, against a greedy
reference from transformers' logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import msgpack
import numpy as np
import pytest
import torch

from taipan.actors.engine.batch import Chunk
from taipan.actors.engine.control_arrays import control_arrays
from taipan.actors.engine.outputs import stop_reason
from taipan.actors.engine.request import EngineRequest
from taipan.actors.gpu.plan_checks import check_sampling_controls
from taipan.actors.gpu.sampling_controls import controlled_logits
from taipan.messages.codec import decode, encode, same_encoding
from taipan.messages.gpu import StepPlan
from taipan.messages.requests import FinishReason, SamplingParams
from taipan.ops.logit_controls import add_biases, apply_penalties
from tests.test_ops_logprobs import Seq, make_plan

EOS = (9,)
V = 40


def reference(logits, prompt, output, s: SamplingParams, eos=EOS) -> list[float]:
    """vLLM's controls on one row of logits, written out token by token."""
    x = [float(v) for v in logits]
    if s.allowed_token_ids is not None:
        x = [v if t in s.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for token, bias in s.logit_bias_ids().items():
        x[token] += bias
    if len(output) < s.min_tokens:
        for token in (() if s.ignore_eos else eos) + tuple(s.stop_token_ids):
            x[token] = -math.inf
    for word in s.bad_words_ids:
        k = len(word) - 1
        if k == 0 or (len(output) >= k and list(output[len(output) - k :]) == list(word[:-1])):
            x[word[-1]] = -math.inf
    seen, counts = set(prompt) | set(output), Counter(output)
    p = s.repetition_penalty
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p if x[t] > 0 else x[t] * p
        x[t] -= s.frequency_penalty * counts[t] + s.presence_penalty * (counts[t] > 0)
    return x


def assert_rows_equal(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)


# ---- the math -----------------------------------------------------------------------------------


def test_penalties_and_biases_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    logits[1, 5] = -math.inf  # a forbidden token stays forbidden under every penalty
    prompts = [[1, 2, 3, 3], [5, 6], [7]]
    outputs = [[3, 4, 4, 4], [6, 6, 8], []]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
        SamplingParams(presence_penalty=-1.0, repetition_penalty=0.7),
        SamplingParams(frequency_penalty=2.0),
    ]
    out = logits.clone()
    biased = [(0, 4, 3.0), (0, 11, -2.0), (2, 7, 100.0), (2, 7, -math.inf)]
    add_biases(
        out,
        torch.tensor([r for r, _, _ in biased]),
        torch.tensor([t for _, t, _ in biased]),
        torch.tensor([b for _, _, b in biased]),
    )
    want_biased = logits.clone()
    for r, t, b in biased:
        want_biased[r, t] += b
    assert torch.equal(out, want_biased)
    # Every output token once (count 1) and every prompt token with count 0, overlaps too.
    seen = [(i, t, 1) for i, o in enumerate(outputs) for t in o]
    seen += [(i, t, 0) for i, p in enumerate(prompts) for t in p]
    apply_penalties(
        out,
        torch.arange(3),
        *(
            torch.tensor([getattr(s, n) for s in params])
            for n in ("presence_penalty", "frequency_penalty", "repetition_penalty")
        ),  # fmt: skip
        torch.tensor([i for i, _, _ in seen]),
        torch.tensor([t for _, t, _ in seen]),
        torch.tensor([c for _, _, c in seen], dtype=torch.int32),
    )
    want = [reference(want_biased[i].tolist(), prompts[i], outputs[i], params[i]) for i in range(3)]
    assert_rows_equal(out, want)
    assert out[1, 5] == -math.inf and out[2, 7] == -math.inf


def test_penalties_touch_only_their_rows():
    logits = torch.randn(4, V)
    out = logits.clone()
    one = torch.ones(1)
    apply_penalties(
        out, torch.tensor([2]), one, one, one * 2, torch.tensor([0]), torch.tensor([3]),
        torch.tensor([2], dtype=torch.int32),
    )  # fmt: skip
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])
    x = logits[2, 3].item()
    assert out[2, 3].item() == pytest.approx((x / 2 if x > 0 else x * 2) - 2 - 1)


# ---- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys"),
        (dict(logit_bias=[1, 2]), "logit_bias must map token ids"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
        (dict(logit_bias={5: 101.0}), "logit_bias values"),
        (dict(logit_bias={5: "1"}), "logit_bias values"),
        (dict(logit_bias={5: 1.0, "5": 2.0}), "logit_bias names token 5 twice"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17, max_tokens=16), r"min_tokens \(17\) must be <= max_tokens \(16\)"),
        (dict(bad_words_ids=((),)), "bad_words_ids"),
        (dict(bad_words_ids=((3, -1),)), "bad_words_ids"),
        (dict(allowed_token_ids=()), r"allowed_token_ids must be a non-empty .* \(None: any"),
        (dict(allowed_token_ids=(3, -1)), "allowed_token_ids"),
        (dict(allowed_token_ids=(3, 1.5)), "allowed_token_ids"),
    ],
)
def test_a_bad_value_is_a_problem_naming_its_key(kw, key):
    problems = SamplingParams(**kw).problems()
    assert len(problems) == 1 and __import__("re").search(key, problems[0]), problems


def test_good_values_have_no_problem_and_switch_controls_on():
    assert not SamplingParams().has_controls
    for kw in (
        dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.5),
        dict(logit_bias={"3": -100, 4: 100.0}), dict(min_tokens=16), dict(bad_words_ids=((1,),)),
        dict(allowed_token_ids=(0,)),
    ):  # fmt: skip
        s = SamplingParams(**kw)
        assert s.problems() == [] and s.has_controls, kw


def test_token_ids_outside_the_vocabulary_are_named():
    s = SamplingParams(logit_bias={"3": 1.0, 300: 2.0}, bad_words_ids=((1, 400),))
    problems = s.token_id_problems(259)
    assert "logit_bias token ids [300]" in problems[0] and "(size 259)" in problems[0]
    assert "bad_words_ids" in problems[1]
    assert SamplingParams(logit_bias={258: 1.0}).token_id_problems(259) == []
    [stops] = SamplingParams(stop_token_ids=(3, 260, 259)).token_id_problems(259)
    assert stops == "stop_token_ids [259, 260] are outside the vocabulary (size 259)"
    [allowed] = SamplingParams(allowed_token_ids=(3, 300, 259)).token_id_problems(259)
    assert allowed == "allowed_token_ids [259, 300] are outside the vocabulary (size 259)"


def test_every_bad_logit_bias_key_is_named():
    with pytest.raises(ValueError, match="got 'bad1', 'bad2'"):
        SamplingParams(logit_bias={"bad1": 1.0, "3": 1.0, "bad2": 2.0}).logit_bias_ids()


def test_wire_form_keys_logit_bias_by_strings_and_round_trips():
    s = SamplingParams(
        max_tokens=8, stop="x", presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={7: 3, "12": -1.5}, min_tokens=2,
        bad_words_ids=((1, 2), (3,)),
    )  # fmt: skip
    wire = s.for_wire()
    assert wire.logit_bias == {"7": 3.0, "12": -1.5} and wire.stop == ("x",)
    assert wire.logit_bias_ids() == s.logit_bias_ids() == {7: 3.0, 12: -1.5}
    from taipan.messages.requests import SubmitRequest

    msg = SubmitRequest(1, np.asarray([1, 2], np.int32), wire, False)
    back = decode(encode(msg))
    assert back.sampling == wire and back.sampling.bad_words_ids == ((1, 2), (3,))


def test_older_encodings_decode_with_the_controls_off():
    """A SamplingParams from before logprobs_mode (16 fields) or before the controls (18), and
    a StepPlan from before the controls (25 fields), decode with every control off."""
    from taipan.messages.requests import SubmitRequest

    msg = SubmitRequest(1, np.asarray([1, 2], np.int32), SamplingParams(max_tokens=3), False)
    frames = encode(msg)
    items = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
    for keep in (16, 18):
        old = list(items)
        old[4] = old[4][:keep]
        back = decode([msgpack.packb(old, use_bin_type=True)])
        assert back.sampling == SamplingParams(max_tokens=3) and not back.sampling.has_controls
    plan = make_plan(1, [Seq([1, 2, 3], 0, [0])])
    items = msgpack.unpackb(bytes(encode(plan)[0]), raw=False, strict_map_key=False)
    old = [msgpack.packb(items[: 2 + 25], use_bin_type=True)]
    back = decode(old)
    assert not len(back.bias_rows) and not len(back.presence_penalty)
    assert same_encoding(plan, old)
    biased = dataclasses.replace(plan, bias_rows=np.zeros(1, np.int32))
    assert not same_encoding(biased, old)


# ---- engine arrays -> gpu logits ----------------------------------------------------------------


def _request(s: SamplingParams, prompt, output, rid=0) -> EngineRequest:
    r = EngineRequest(rid, np.asarray(prompt, np.int32), s, False, 0.0, 1)
    r.generated = list(output)
    return r


def _chunk(r: EngineRequest, in_flight: bool, n: int = 1) -> Chunk:
    c = Chunk(r, n, 0)
    c.samples = True
    c.gen_index = len(r.generated) + in_flight
    return c


def _plan(chunks, arrays, last_ids, prev_rows=None) -> StepPlan:
    """A StepPlan of one-token rows with `last_ids` as input and the control `arrays`."""
    seqs = [Seq([t], 4, [0]) for t in last_ids]
    plan = make_plan(2, seqs)
    if prev_rows is not None:
        plan = dataclasses.replace(plan, prev_rows=np.asarray(prev_rows, np.int32))
    return dataclasses.replace(plan, **arrays)


CASES = [
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(repetition_penalty=1.8, logit_bias={"3": 5.0, "20": -4.0}),
    SamplingParams(min_tokens=6, stop_token_ids=(11,)),
    SamplingParams(bad_words_ids=((2,), (4, 6), (6, 4, 5), (7, 8, 9, 1))),
    SamplingParams(),
    SamplingParams(frequency_penalty=-1.0, bad_words_ids=((4, 4),), min_tokens=1),
    SamplingParams(
        allowed_token_ids=(39, 3, 5, 20, 3), logit_bias={"5": 2.0, "7": 1.0}, frequency_penalty=0.5
    ),  # fmt: skip
]
OUTPUTS = [[4, 6, 4, 4], [6, 4], [1, 2], [7, 8, 6, 4], [4], [2, 4], [5, 3]]
PROMPTS = [[1, 2, 3], [3, 3, 10], [5], [6], [1], [2, 2], [4]]


@pytest.mark.parametrize("in_flight", [False, True], ids=["known", "in_flight"])
def test_engine_arrays_on_the_gpu_equal_the_reference(in_flight):
    """Rows whose last output token the engine knows, or one the step in flight samples (the
    engine plans without it; the gpu reads it from the previous step's tokens)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), V, generator=g) * 2
    known = [o[:-1] if in_flight else o for o in OUTPUTS]
    reqs = [
        _request(s, p, o, i) for i, (s, p, o) in enumerate(zip(CASES, PROMPTS, known, strict=True))
    ]
    chunks = [_chunk(r, in_flight) for r in reqs]
    arrays = control_arrays(chunks, EOS)
    last = [o[-1] for o in OUTPUTS]
    # The previous step had these rows in reverse order, its tokens there.
    sampled = torch.tensor(last[::-1] + [0, 0], dtype=torch.int64)
    prev = [len(CASES) - 1 - i for i in range(len(CASES))] if in_flight else None
    plan = _plan(chunks, arrays, [0] * len(CASES) if in_flight else last, prev)
    check_sampling_controls(plan, V)
    got = controlled_logits(plan, logits, sampled)
    want = [
        reference(logits[i].tolist(), PROMPTS[i], OUTPUTS[i], CASES[i]) for i in range(len(CASES))
    ]
    assert_rows_equal(got, want)
    assert not torch.equal(got, logits)  # a copy: the raw logits stay


def test_no_control_sends_nothing_and_leaves_the_logits():
    reqs = [
        _request(SamplingParams(min_tokens=2), [1], [3, 4]),
        _request(SamplingParams(), [1], []),
    ]
    chunks = [_chunk(r, False) for r in reqs]
    assert control_arrays(chunks, EOS) == {}  # min_tokens reached, the other row has none
    chunks[0].samples = False  # a chunk that does not sample needs no controls either
    reqs[0].generated = []
    assert control_arrays(chunks, EOS) == {}
    plan = _plan(chunks, {}, [1, 1])
    logits = torch.randn(2, V)
    assert controlled_logits(plan, logits, torch.zeros(2, dtype=torch.int64)) is logits


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    s = SamplingParams(min_tokens=3, stop_token_ids=(11, 12))
    r = _request(s, [1], [5])
    arrays = control_arrays([_chunk(r, True)], EOS)  # samples output token 2 (index 2)
    assert sorted(arrays["bias_tokens"].tolist()) == [9, 11, 12]
    assert (arrays["bias_values"] == -np.inf).all()
    ignore = _request(dataclasses.replace(s, ignore_eos=True), [1], [5, 6])
    assert control_arrays([_chunk(ignore, False)], EOS)["bias_tokens"].tolist() == [11, 12]
    r.generated = [5, 6]
    assert control_arrays([_chunk(r, True)], EOS) == {}  # index 3: allowed


def test_bad_word_in_flight_is_conditional_on_the_last_token():
    s = SamplingParams(bad_words_ids=((7, 8, 9),))
    r = _request(s, [1], [3, 7])  # 8 is being sampled: forbid 9 only if it is 8
    arrays = control_arrays([_chunk(r, True)], EOS)
    assert arrays["bias_tokens"].tolist() == [9] and arrays["bias_if_last"].tolist() == [8]
    logits = torch.zeros(2, V)
    for token, forbidden in ((8, True), (5, False)):
        plan = _plan([r, r], {k: np.concatenate([v, v]) for k, v in arrays.items()}, [0, 0], [0, 0])
        plan = dataclasses.replace(plan, bias_rows=np.asarray([0, 1], np.int32))
        got = controlled_logits(plan, logits, torch.tensor([token]))
        assert (got[:, 9] == -math.inf).all() == forbidden and got[:, :9].eq(0).all()
    r.generated = [3, 6]  # the known part does not match: no entry
    assert control_arrays([_chunk(r, True)], EOS) == {}


def test_a_verify_row_gets_min_tokens_and_bad_words_per_scored_position():
    """A verify row's entries follow its drafts: min_tokens' bans at the positions still below
    it, a bad word's last token where the drafts before complete the rest of it; logit_bias at
    every position (offset -1). No entry is conditional: the row's last token is known."""
    s = SamplingParams(min_tokens=3, bad_words_ids=((5, 6),), logit_bias={"4": 1.0})
    r = _request(s, [1], [1, 2])
    c = _chunk(r, False, n=4)
    c.drafts = np.asarray([5, 6, 9], np.int32)
    arrays = control_arrays([c], EOS)
    got = sorted(zip(arrays["bias_tokens"].tolist(), arrays["bias_offsets"].tolist(), strict=True))
    # min_tokens 3 with 2 generated: EOS (9) banned at offset 0 only; after draft 5 (offset 1)
    # the bad word (5, 6) forbids 6; the bias on 4 holds everywhere.
    assert got == [(4, -1), (6, 1), (9, 0)]
    assert (arrays["bias_if_last"] == -1).all()
    plain = control_arrays([_chunk(r, False)], EOS)
    assert "bias_offsets" not in plain and sorted(plain["bias_tokens"].tolist()) == [4, 9]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bias_offsets=np.asarray([1], np.int32)), "bias_offsets"),
        (dict(bias_offsets=np.asarray([-1, -1], np.int32)), "bias_offsets must be empty"),
        (dict(presence_penalty=np.zeros(1, np.float32)), "one entry per sequence"),
        (dict(bias_rows=np.asarray([2], np.int32)), "bias_rows must name sequences"),
        (dict(bias_tokens=np.asarray([V], np.int32)), "bias_tokens must be token ids below"),
        (dict(bias_values=np.asarray([np.nan], np.float32)), "bias_values"),
        (dict(bias_if_last=np.asarray([-2], np.int32)), "bias_if_last"),
        (dict(bias_if_last=np.zeros(2, np.int32)), "one length"),
        (dict(penalty_rows=np.asarray([1], np.int32)), "sequences with a penalty"),
        (dict(penalty_counts=np.asarray([-1], np.int32)), "penalty_counts"),
        (dict(repetition_penalty=np.asarray([1, 0], np.float32)), "repetition_penalty"),
        (dict(allow_rows=np.asarray([2], np.int32)), "allow_rows must name sequences 0..1"),
        (dict(allow_tokens=np.asarray([V], np.int32)), "allow_tokens must be token ids below"),
        (dict(allow_tokens=np.asarray([1, 2], np.int32)), "allow_rows, allow_tokens must"),
        (dict(sample=np.asarray([1, 0], np.int8)), "allow_rows must name sequences that sample"),
    ],
)
def test_malformed_control_arrays_are_refused_before_the_device(change, message):
    good = dict(
        bias_rows=np.asarray([1], np.int32), bias_tokens=np.asarray([3], np.int32),
        bias_values=np.asarray([-np.inf], np.float32), bias_if_last=np.asarray([-1], np.int32),
        presence_penalty=np.asarray([1, 0], np.float32),
        frequency_penalty=np.zeros(2, np.float32), repetition_penalty=np.ones(2, np.float32),
        penalty_rows=np.asarray([0], np.int32), penalty_tokens=np.asarray([5], np.int32),
        penalty_counts=np.asarray([1], np.int32), allow_rows=np.asarray([1], np.int32),
        allow_tokens=np.asarray([4], np.int32),
    )  # fmt: skip
    plan = _plan([], good, [1, 2])
    check_sampling_controls(plan, V)
    with pytest.raises(ValueError, match=message):
        check_sampling_controls(dataclasses.replace(plan, **change), V)


def test_the_triton_sampler_with_forbidden_tokens_equals_its_reference():
    """The CUDA sampler sees -inf logits (min_tokens, bad words): the kernel (CPU interpreter)
    draws what sample_ref draws, and never a forbidden token."""
    from taipan.kernels.sampling import sample_ref
    from tests.test_kernels_sampling import _assert_kernel_matches_ref, _keys, _params

    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        logits = torch.randn(4, 300, generator=g) * 3
        top = logits.topk(5, dim=-1).indices
        logits.scatter_(1, top, -math.inf)  # the best five forbidden
        params = _params(4, [0.0, 1.0, 0.7, 1.5], [0, 20, 0, 3], [1.0, 0.9, 0.5, 1.0])
        keys = _keys(4, g)
        _assert_kernel_matches_ref(logits, params, keys)
        drawn = sample_ref(logits, **params, keys=keys)
        assert not (top == drawn[:, None]).any()


# ---- stop rules under min_tokens ----------------------------------------------------------------


def test_before_min_tokens_only_the_length_ends_a_request():
    from taipan.actors.config import RuntimePlan

    plan = RuntimePlan(8, 16, 4, 64, 256, EOS)
    s = SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=(11,), stop_word_ids=((5,),))
    r = _request(s, [1], [9])
    assert stop_reason(r, 9, plan) is None  # EOS as the first token: not yet
    r.generated = [9, 5]
    assert stop_reason(r, 5, plan) is None
    r.generated = [9, 5, 11]
    assert stop_reason(r, 11, plan) is FinishReason.STOP
    r.generated = [9, 5, 6, 7]
    assert stop_reason(r, 7, plan) is FinishReason.LENGTH


def test_a_stop_string_completed_before_min_tokens_does_not_count():
    from taipan.ops.stop_strings import StopMatcher

    m = StopMatcher(["ab"])
    assert m.feed("xa", match=False) == "x"  # "a" may begin the stop: held back as usual
    assert m.feed("b", match=False) == "ab" and m.matched is None
    assert m.feed("ab") == "" and m.matched == "ab"


# ---- end to end: the real runtime on a tiny random Llama ----------------------------------------

BLOCK = 16
CONFIG = dict(
    block_size_tokens=BLOCK, max_tokens=64, max_requests=8, max_sequence_length=256,
    buffer_size_gb=0.002,
)  # fmt: skip
E2E_PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 3, 250, 9, 9, 12], [72, 101, 108]]
N = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, transformers' model on it: the reference's logits)."""
    transformers = pytest.importorskip("transformers")
    from tests.random_llama import TINY_SHAPE, make_random_llama

    path = make_random_llama(str(tmp_path_factory.mktemp("controls") / "tiny"), TINY_SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def tiny_session(tiny, request, tmp_path_factory):
    """(runtime, client, record dir): a recorded runtime on the tiny model, steps overlapped
    (the engine plans step N+1 before step N's tokens are known) or not."""
    from taipan.actors.config import InferenceConfig
    from taipan.client import Client
    from taipan.launcher import Runtime

    config = InferenceConfig(**CONFIG, overlap_steps=request.param)
    rec = tmp_path_factory.mktemp("controls-rec")
    with Runtime(tiny[0], config, record_dir=str(rec)) as rt, Client(rt.address) as c:
        yield rt, c, rec


@pytest.fixture
def tiny_client(tiny_session):
    return tiny_session[1]


def _eos(model) -> int:
    return int(model.config.eos_token_id)


def hf_greedy(model, prompt, s: SamplingParams, n: int = N) -> tuple[list[int], list[float]]:
    """Greedy decoding from transformers' logits with the reference controls: (tokens, the
    processed log-prob of each)."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        x = torch.tensor(reference(logits.tolist(), prompt, out, s, (_eos(model),)))
        token = int(x.argmax())
        lps.append(float(torch.log_softmax(x, -1)[token]))
        out.append(token)
        ids.append(token)
    return out, lps


def _generate_each(c, pairs):
    """One request per (prompt, sampling), all at once (rows of the same steps)."""
    import asyncio

    async def each():
        return await asyncio.gather(*(c.aio.generate([p], s) for p, s in pairs))

    return [done for [done] in c.run(each())]


def test_greedy_with_a_large_logit_bias_yields_that_token_every_step(tiny_client):
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    first = tiny_client.generate([E2E_PROMPTS[0]], plain)[0].token_ids
    x = (first[0] + 1) % 256
    biased = dataclasses.replace(plain, logit_bias={x: 100.0})
    a, b = _generate_each(tiny_client, [(E2E_PROMPTS[0], biased), (E2E_PROMPTS[0], plain)])
    assert a.token_ids == [x] * N
    assert b.token_ids == first  # the other row of the same steps is untouched


def test_penalties_and_bad_words_equal_the_reference_greedy(tiny, tiny_client):
    """Each row of one batch against transformers' logits with the reference controls; the
    processed log-probs too (the raw ones stay the model's)."""
    check_against_reference(tiny_client, tiny[1])


def check_against_reference(client, model, atol: float = 1e-4) -> None:
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    greedy = [hf_greedy(model, p, plain)[0] for p in E2E_PROMPTS]
    got = [c.token_ids for c in _generate_each(client, [(p, plain) for p in E2E_PROMPTS])]
    assert got == greedy  # (the reference's logits pick what ours do)
    g = greedy[3]  # a bad word of its own greedy tokens 1 and 2: forbids 2 when 1 is sampled
    cases = [
        dataclasses.replace(plain, presence_penalty=2.0),
        dataclasses.replace(
            plain,
            frequency_penalty=1.0,
            logprobs_mode="processed",
            return_log_probs=True,
            skip_prompt_log_probs=True,
        ),  # fmt: skip
        dataclasses.replace(
            plain, repetition_penalty=2.0, return_log_probs=True, skip_prompt_log_probs=True
        ),  # fmt: skip
        dataclasses.replace(plain, bad_words_ids=((g[1], g[2]), (greedy[1][0],))),
    ]
    done = _generate_each(client, list(zip(E2E_PROMPTS, cases, strict=True)))
    for i, (s, c) in enumerate(zip(cases, done, strict=True)):
        want, lps = hf_greedy(model, E2E_PROMPTS[i], s)
        assert c.token_ids == want, (i, s)
        assert c.token_ids != greedy[i], i  # each control changed the output
        if s.logprobs_mode == "processed":
            np.testing.assert_allclose(c.log_probs, lps, atol=atol)
    raw_want = _raw_log_probs(model, E2E_PROMPTS[2], done[2].token_ids)
    np.testing.assert_allclose(done[2].log_probs, raw_want, atol=atol)


def _raw_log_probs(model, prompt, tokens) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_min_tokens_holds_off_eos(tiny, tiny_client):
    eos = _eos(tiny[1])
    s = SamplingParams(max_tokens=N, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5)
    eager, plain = _generate_each(
        tiny_client, [(E2E_PROMPTS[1], s), (E2E_PROMPTS[1], dataclasses.replace(s, min_tokens=0))]
    )
    assert plain.token_ids == [eos] and plain.finish_reason == FinishReason.STOP
    assert eos not in eager.token_ids[:5] and eager.token_ids[5:] == [eos]
    assert eager.finish_reason == FinishReason.STOP


def test_allowed_tokens_equal_the_reference_and_bound_sampling(tiny, tiny_client):
    """allowed_token_ids without plain greedy's first token: greedy picks among the allowed
    as the reference does (the raw log-probs stay the model's), a sampled row never leaves
    them, and a row without the field in the same steps is untouched."""
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    first = hf_greedy(tiny[1], E2E_PROMPTS[2], plain)[0]
    allowed = tuple(t for t in range(7, 250, 9) if t != first[0])
    greedy = dataclasses.replace(
        plain, allowed_token_ids=allowed, return_log_probs=True, skip_prompt_log_probs=True
    )
    sampled = dataclasses.replace(greedy, temperature=1.0, seed=5, return_log_probs=False)
    pairs = [(E2E_PROMPTS[2], greedy), (E2E_PROMPTS[2], sampled), (E2E_PROMPTS[2], plain)]
    a, b, c = _generate_each(tiny_client, pairs)
    assert a.token_ids == hf_greedy(tiny[1], E2E_PROMPTS[2], greedy)[0] != first
    np.testing.assert_allclose(
        a.log_probs, _raw_log_probs(tiny[1], E2E_PROMPTS[2], a.token_ids), atol=1e-4
    )
    assert set(a.token_ids + b.token_ids) <= set(allowed) and c.token_ids == first


def test_sampled_rows_never_draw_a_forbidden_token(tiny_client):
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    banned = set(tiny_client.generate([E2E_PROMPTS[3]], plain)[0].token_ids)
    s = SamplingParams(
        max_tokens=N, temperature=1.0, top_k=3, seed=11, ignore_eos=True,
        bad_words_ids=tuple((t,) for t in sorted(banned)),
    )  # fmt: skip
    [done] = tiny_client.generate([E2E_PROMPTS[3]], s)
    assert len(done.token_ids) == N and not banned & set(done.token_ids)


def test_a_stop_string_counts_only_from_min_tokens(tiny_client):
    """The client's stop strings (runtime/client.py) wait for min_tokens as the engine's stops."""
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    [full] = tiny_client.generate([E2E_PROMPTS[0]], plain)
    assert full.token_ids[:4] == full.token_ids[:1] * 4 and len(full.text) == N  # one char each
    stop = full.text[0]
    [early] = tiny_client.generate([E2E_PROMPTS[0]], dataclasses.replace(plain, stop=stop))
    assert early.text == "" and early.token_ids == full.token_ids[:1]
    s = dataclasses.replace(plain, stop=stop, min_tokens=4)
    [late] = tiny_client.generate([E2E_PROMPTS[0]], s)
    assert late.text == full.text[:3] and late.token_ids == full.token_ids[:4]


def test_token_ids_outside_the_vocabulary_fail_the_request_naming_the_key(tiny_client):
    from taipan.client import RequestError

    with pytest.raises(RequestError, match=r"logit_bias token ids \[100000\]"):
        tiny_client.generate([E2E_PROMPTS[0]], SamplingParams(logit_bias={100000: 1.0}))
    with pytest.raises(RequestError, match=r"presence_penalty must be in \[-2, 2\], got 3.0"):
        tiny_client.generate([E2E_PROMPTS[0]], SamplingParams(presence_penalty=3.0))


def test_replay_check_passes_over_the_session(tiny_session):
    """The engine's control arrays are a function of its inbound messages: `taipan replay
    --check` re-plans every step of the session and finds the StepPlans it sent."""
    from tests.replay_check import replay_check

    rt, _, rec = tiny_session
    rt.shutdown()
    out = replay_check(rec)
    assert "engine-0: ok" in out, out


# ---- on a GPU: CUDA tensors, CUDA graphs and overlapped steps (the defaults there) --------------


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [False, True], ids=["known", "in_flight"])
def test_gpu_controls_on_cuda_equal_the_reference(in_flight):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), V, generator=g) * 2
    known = [o[:-1] if in_flight else o for o in OUTPUTS]
    rows = zip(CASES, PROMPTS, known, strict=True)
    chunks = [_chunk(_request(s, p, o, i), in_flight) for i, (s, p, o) in enumerate(rows)]
    last = [o[-1] for o in OUTPUTS]
    sampled = torch.tensor(last[::-1] + [0, 0], dtype=torch.int64, device="cuda")
    prev = [len(CASES) - 1 - i for i in range(len(CASES))] if in_flight else None
    plan = _plan(chunks, control_arrays(chunks, EOS), [0] * len(CASES) if in_flight else last, prev)
    got = controlled_logits(plan, logits.cuda(), sampled).cpu()
    want = [
        reference(logits[i].tolist(), PROMPTS[i], OUTPUTS[i], CASES[i]) for i in range(len(CASES))
    ]
    assert_rows_equal(got, want)


@pytest.mark.gpu
def test_gpu_graphed_overlapped_steps_equal_the_reference_greedy(tmp_path_factory):
    """The runtime on CUDA with its defaults (decode steps replay CUDA graphs, steps overlap):
    the controls run after the graph, on a copy of its logits."""
    import transformers

    from taipan.actors.config import InferenceConfig
    from taipan.client import Client
    from taipan.launcher import Runtime
    from tests.random_llama import GPU_TINY_SHAPE, make_random_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_random_llama(str(tmp_path_factory.mktemp("controls-gpu") / "m"), GPU_TINY_SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Runtime(path, InferenceConfig(**CONFIG), device="cuda") as rt, Client(rt.address) as c:
        check_against_reference(c, model, atol=1e-3)
        [stats] = c.stats().ranks
    assert stats.steps_graphed > 0
