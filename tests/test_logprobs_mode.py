"""SamplingParams.logprobs_mode (issue 26 item 5): "raw" log-probs are of the model's logits,
"processed" ones of the distribution the token was drawn from (logits / temperature, min-p,
top-k, top-p; dropped tokens -inf; greedy: raw). Prompt log-probs are always raw.

Layers: ops.logprobs against a plain-Python reference on random fp32 logits (several
temperature / top-k / top-p / min-p combinations, greedy, chunking) and the draws of sample_ref
and the Triton kernel (CPU interpreter) always landing in the kept set; the wire (old
SamplingParams and StepPlan still decode, a bad mode is refused by name); end to end through the
real runtime on SmolLM2 against Hugging Face's logits (processed, raw, greedy), and the HTTP
extension field on the real app over that runtime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import msgpack
import numpy as np
import pytest
import torch

from taipan.actors.gpu.plan_checks import check_logprobs_mode
from taipan.kernels.sampling import row_keys, sample, sample_ref
from taipan.messages.codec import MessageError, decode, encode, same_encoding
from taipan.messages.gpu import StepPlan
from taipan.messages.requests import LogprobsMode, SamplingParams, SubmitRequest
from taipan.ops.logprobs import log_probs_and_top_n, processed_log_probs_and_top_n
from taipan.ops.sampling import processed_logits

ATOL = 1e-5  # ops, fp32 against a float64 reference
MODEL_ATOL = 2e-4  # ours (fp32, CPU) against Hugging Face's fp32 logits

# (temperature, top_k, top_p, min_p)
COMBOS = [
    (0.7, 0, 1.0, 0.0),  # temperature only
    (1.0, 5, 1.0, 0.0),  # top-k
    (1.3, 0, 0.8, 0.0),  # top-p
    (0.5, 12, 0.9, 0.0),  # top-k then top-p
    (1.0, 0, 1.0, 0.05),  # min-p
    (0.9, 30, 0.7, 0.02),  # all of them
    (0.0, 5, 0.5, 0.1),  # greedy: raw, whatever the filters
]


def processed_ref(logits: list[float], temperature, top_k, top_p, min_p) -> list[float]:
    """kernels/sampling.py's semantics for one row, written out in float64 Python: the log-probs
    of the distribution sampled from, -inf where a filter drops the token."""
    if temperature < 1e-5:
        top = max(logits)
        z = math.log(sum(math.exp(x - top) for x in logits))
        return [x - top - z for x in logits]
    s = [x / temperature for x in logits]
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    top = s[order[0]]
    k = top_k if 0 < top_k < len(s) else len(s)
    kept = [i for r, i in enumerate(order) if r < k and math.exp(s[i] - top) >= min(min_p, 1.0)]
    z = sum(math.exp(s[i] - top) for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if nucleus and top_p < 1.0 and mass >= top_p:
            break
        nucleus.append(i)
        mass += math.exp(s[i] - top) / z
    log_z = math.log(sum(math.exp(s[i] - top) for i in nucleus))
    out = [-math.inf] * len(s)
    for i in nucleus:
        out[i] = s[i] - top - log_z
    return out


def _rows(params: list[tuple], dtype=None) -> tuple[torch.Tensor, ...]:
    temperature, top_k, top_p, min_p = zip(*params, strict=True)
    return (
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(min_p, dtype=torch.float32),
    )


# ---- ops ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS, ids=[str(c) for c in COMBOS])
def test_processed_log_probs_match_the_reference(combo):
    gen = torch.Generator().manual_seed(7)
    rows, vocab, n = 6, 80, 20
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    params = _rows([combo] * rows)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[0] = logits[0].argmax()  # the top token is always kept
    counts = torch.tensor([n, 3, 0, n, 1, n], dtype=torch.int32)
    picked, ids, values = processed_log_probs_and_top_n(
        logits, tokens, counts, n, *params, chunk_rows=4
    )
    for r in range(rows):
        want = torch.tensor(processed_ref(logits[r].double().tolist(), *combo), dtype=torch.float64)
        assert _close(picked[r], want[tokens[r]]), (r, picked[r], want[tokens[r]])
        count = int(counts[r])
        top_values, top_ids = want.topk(n)
        for j in range(n):
            if j >= count:
                assert ids[r, j] == -1 and values[r, j].isnan()
            elif math.isinf(top_values[j]):
                assert values[r, j] == -math.inf  # past the kept tokens
            else:
                assert _close(values[r, j], top_values[j]) and _close(want[ids[r, j]], values[r, j])
    if combo[0] == 0.0:  # greedy: processed is raw
        raw = log_probs_and_top_n(logits, tokens, counts, n)
        for a, b in zip((picked, ids, values), raw, strict=True):
            torch.testing.assert_close(a, b, equal_nan=True)


def _close(a, b) -> bool:
    a, b = float(a), float(b)
    return a == b if math.isinf(a) or math.isinf(b) else abs(a - b) < ATOL


def test_processed_log_probs_are_the_same_in_any_chunking_and_batch():
    """A row's processed log-probs depend on that row alone (and its own parameters)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(COMBOS), 64, generator=gen) * 3
    params = _rows(COMBOS)
    tokens = logits.argmax(-1)
    counts = torch.full((len(COMBOS),), 8, dtype=torch.int32)
    whole = processed_log_probs_and_top_n(logits, tokens, counts, 8, *params, chunk_rows=100)
    one = processed_log_probs_and_top_n(logits, tokens, counts, 8, *params, chunk_rows=1)
    for a, b in zip(whole, one, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)
    empty = processed_log_probs_and_top_n(
        logits[:0], tokens[:0], counts[:0], 8, *(p[:0] for p in params), chunk_rows=4
    )
    assert [tuple(t.shape) for t in empty] == [(0,), (0, 8), (0, 8)]


def test_processed_logits_softmax_is_the_distribution_drawn_from():
    """The draws of sample_ref and of the Triton kernel (CPU interpreter) always land on a
    token with a finite processed log-prob: the mask is the sampler's own."""
    gen = torch.Generator().manual_seed(11)
    vocab = 300
    for trial in range(4):
        logits = torch.randn(len(COMBOS), vocab, generator=gen) * (1 + trial)
        params = _rows(COMBOS)
        names = ("temperature", "top_k", "top_p", "min_p")
        kw = dict(zip(names, params, strict=True))
        keys = row_keys(torch.arange(len(COMBOS)) + 100 * trial, torch.zeros(len(COMBOS)))
        kept = processed_logits(logits, *params)  # [B, V]
        for tokens in (sample_ref(logits, **kw, keys=keys), sample(logits, **kw, keys=keys,
                                                                   block=128)):  # fmt: skip
            assert torch.isfinite(kept.gather(1, tokens[:, None])).all(), tokens


def test_greedy_and_unfiltered_rows_pass_through():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    out = processed_logits(logits, *_rows([(0.0, 1, 0.1, 0.9), (2.0, 0, 1.0, 0.0)]))
    torch.testing.assert_close(out[0], logits[0])  # greedy: the raw logits
    torch.testing.assert_close(out[1], logits[1] / 2)  # no filter: only the temperature


# ---- the wire and validation -------------------------------------------------------------------


def test_sampling_params_validate_the_mode_by_name():
    assert SamplingParams().logprobs_mode is LogprobsMode.RAW
    assert SamplingParams(logprobs_mode="processed").logprobs_mode is LogprobsMode.PROCESSED
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw' or 'processed', got 'soft'"):
        SamplingParams(logprobs_mode="soft")


def test_old_sampling_params_and_step_plans_still_decode():
    """A SubmitRequest whose SamplingParams has the 16 fields from before logprobs_mode (an
    older client, or a recorded log) decodes as raw; a StepPlan without it too."""
    sp = SamplingParams(max_tokens=3, top_k=4, logprobs_mode="processed")
    msg = SubmitRequest(1, np.arange(5, dtype=np.int32), sp, False)
    assert decode(encode(msg)).sampling == sp
    tag, version, rid, ids, fields, *rest = msgpack.unpackb(encode(msg)[0], strict_map_key=False)
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    # (the fields after logprobs_mode are at their defaults: the encoder leaves them off)
    assert names.index("logprobs_mode") == 16 and len(fields) == 17 < len(names)
    old = msgpack.packb([tag, version, rid, ids, fields[:16], *rest])
    assert decode([old]).sampling == dataclasses.replace(sp, logprobs_mode="raw")
    with pytest.raises(MessageError, match="SamplingParams takes 16 to"):
        decode([msgpack.packb([tag, version, rid, ids, fields[:15], *rest])])
    bad = msgpack.packb([tag, version, rid, ids, [*fields[:16], "soft", *fields[17:]], *rest])
    with pytest.raises(MessageError, match="'soft' is not a LogprobsMode"):
        decode([bad])

    plan = _plan(np.asarray([0, 1], dtype=np.int8))
    assert decode(encode(plan)).logprobs_mode.tolist() == [0, 1]
    frame = msgpack.unpackb(encode(plan)[0], strict_map_key=False)
    old_plan = decode([msgpack.packb(frame[: 2 + 23])])  # the 23 fields before logprobs_mode
    assert len(old_plan.logprobs_mode) == 0 and np.array_equal(old_plan.top_k, plan.top_k)


def test_replay_check_accepts_messages_recorded_before_a_trailing_field():
    """`taipan replay --check` compares what it re-plans with what was recorded: a log recorded
    before logprobs_mode (fewer fields, here and in a nested SamplingParams) matches a replayed
    message that has it at its default, and only then."""
    raw = _plan(np.zeros(0, np.int8))
    frame = msgpack.unpackb(encode(raw)[0], strict_map_key=False)
    old = [msgpack.packb(frame[: 2 + 23])]
    assert same_encoding(raw, old) and same_encoding(raw, encode(raw))
    assert not same_encoding(_plan(np.asarray([1, 0], np.int8)), old)
    assert not same_encoding(dataclasses.replace(raw, step=2), old)
    assert not same_encoding(raw, [b"\xc1"])

    msg = SubmitRequest(1, np.arange(5, dtype=np.int32), SamplingParams(top_k=4), False)
    tag, version, rid, ids, fields, *rest = msgpack.unpackb(encode(msg)[0], strict_map_key=False)
    old = [msgpack.packb([tag, version, rid, ids, fields[:16], *rest])]
    assert same_encoding(msg, old)
    processed = dataclasses.replace(
        msg, sampling=SamplingParams(top_k=4, logprobs_mode="processed")
    )
    assert not same_encoding(processed, old)


def _plan(mode: np.ndarray) -> StepPlan:
    i32, f32 = np.zeros(2, np.int32), np.zeros(2, np.float32)
    return StepPlan(
        step=1, input_ids=i32, positions=i32, slot_mapping=np.zeros(2, np.int64),
        query_start_loc=np.arange(3, dtype=np.int32), seq_lens=i32 + 1,
        block_tables=np.zeros((2, 1), np.int32), sample=np.ones(2, np.int8), temperature=f32,
        top_k=i32 + 3, top_p=f32 + 1, min_p=f32, seeds=np.zeros(2, np.int64), gen_index=i32,
        logprobs=np.ones(2, np.int8), top_n=i32, prompt_targets=i32 - 1, logprobs_mode=mode,
    )  # fmt: skip


def test_the_worker_refuses_a_malformed_logprobs_mode():
    check_logprobs_mode(_plan(np.zeros(0, np.int8)))
    check_logprobs_mode(_plan(np.asarray([1, 0], np.int8)))
    with pytest.raises(ValueError, match="logprobs_mode has 1 entries for 2 sequences"):
        check_logprobs_mode(_plan(np.asarray([1], np.int8)))
    with pytest.raises(ValueError, match=r"logprobs_mode must be 0 \(raw\) or 1"):
        check_logprobs_mode(_plan(np.asarray([2, 0], np.int8)))


# ---- end to end: the real runtime on SmolLM2 against Hugging Face --------------------------------

PROMPT = "The best thing about a quiet morning is"
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9, seed=1234)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Hugging Face's fp32 logits for `ids`; row t predicts token t + 1. [len, V]"""
    model, _ = hf
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _generate(client, mode: str, prompt_log_probs: bool = False, **kw):
    sampling = SamplingParams(
        max_tokens=5, ignore_eos=True, return_log_probs=True, top_n_logprobs=5,
        skip_prompt_log_probs=not prompt_log_probs, logprobs_mode=mode, **kw,
    )  # fmt: skip
    [done] = client.generate([PROMPT], sampling)
    return done


def test_processed_log_probs_of_sampled_tokens_match_hf(client, hf):
    """Seeded sampling with temperature, top-k and top-p: the same tokens in both modes (the
    mode changes no draw); raw log-probs are HF's log-softmax, processed ones HF's logits through
    the reference filters, sampled token and top-n; prompt log-probs raw in both modes."""
    processed = _generate(client, "processed", prompt_log_probs=True, **SAMPLED)
    raw = _generate(client, "raw", prompt_log_probs=True, **SAMPLED)
    assert processed.token_ids == raw.token_ids
    p = len(processed.prompt_token_ids)
    logits = _hf_logits(hf, processed.prompt_token_ids + processed.token_ids)
    raw_ref = torch.log_softmax(logits, dim=-1)
    for j, token in enumerate(processed.token_ids):
        row = logits[p - 1 + j]
        want = processed_ref(row.double().tolist(), *_combo(SAMPLED))
        assert math.isfinite(processed.log_probs[j])  # the drawn token was kept
        assert abs(processed.log_probs[j] - want[token]) < MODEL_ATOL
        assert abs(raw.log_probs[j] - float(raw_ref[p - 1 + j, token])) < MODEL_ATOL
        for top, ref in ((processed.top_n_logprobs[j], want), (raw.top_n_logprobs[j], None)):
            values = ref if ref is not None else raw_ref[p - 1 + j].tolist()
            best = sorted(values, reverse=True)[:5]
            assert np.allclose(list(top.values()), best, atol=MODEL_ATOL)
            # (past the kept tokens, processed top-n entries are -inf, of any dropped ids)
            assert all(v == values[i] or abs(values[i] - v) < MODEL_ATOL for i, v in top.items())
    assert np.allclose(processed.prompt_log_probs, raw.prompt_log_probs, atol=1e-6)
    want_prompt = raw_ref[: p - 1].gather(1, torch.tensor(processed.prompt_token_ids[1:])[:, None])
    assert np.allclose(processed.prompt_log_probs, want_prompt[:, 0].numpy(), atol=MODEL_ATOL)


def _combo(kw: dict) -> tuple:
    return (kw["temperature"], kw["top_k"], kw["top_p"], kw.get("min_p", 0.0))


def test_greedy_processed_log_probs_are_raw(client):
    processed = _generate(client, "processed", temperature=0.0, top_k=3)
    raw = _generate(client, "raw", temperature=0.0, top_k=3)
    assert processed.prompt_log_probs is None
    assert processed.token_ids == raw.token_ids
    assert np.allclose(processed.log_probs, raw.log_probs, atol=1e-6)
    for a, b in zip(processed.top_n_logprobs, raw.top_n_logprobs, strict=True):
        assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-6)


def test_http_logprobs_mode_extension_field(runtime, client):
    """/v1/completions and /v1/chat/completions take logprobs_mode; processed log-probs equal
    the Python API's for the same seeded request; a bad value is a 400 naming the field."""
    import httpx

    from taipan.client import AsyncClient
    from taipan.server import build_app

    want = _generate(client, "processed", **SAMPLED)
    body = dict(model="M", prompt=PROMPT, max_tokens=5, ignore_eos=True, logprobs=5, **SAMPLED)
    chat = dict(model="M", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                logprobs=True, top_logprobs=2, logprobs_mode="processed", **SAMPLED)  # fmt: skip

    async def run() -> list:
        c = AsyncClient(runtime.address)
        await c.connect()
        try:
            transport = httpx.ASGITransport(app=build_app(c, served_model_name="M"))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return [
                    await http.post("/v1/completions", json={**body, "logprobs_mode": "processed"}),
                    await http.post("/v1/completions", json=body),
                    await http.post("/v1/chat/completions", json=chat),
                    await http.post("/v1/completions", json={**body, "logprobs_mode": "soft"}),
                ]
        finally:
            await c.close()

    processed, raw, chat, bad = asyncio.run(run())
    assert processed.status_code == raw.status_code == chat.status_code == 200
    got = processed.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want.log_probs, abs=1e-6)
    default = raw.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert not np.allclose(got, default, atol=1e-3)  # raw when not set
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content and all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in content)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs_mode"


def test_which_log_prob_steps_only_queue_work():
    """actors/gpu/logprobs.py `log_probs_never_wait`: raw log-probs of the sampled tokens (an
    RL rollout's) only queue work, so such a step may launch inline; top-n (a sorted top-k)
    and processed rows of a sampled request (sort-based filters) may wait for the stream;
    a greedy row's processed log-probs are its controlled logits' (no sort)."""
    import types

    import numpy as np

    from taipan.actors.gpu.logprobs import log_probs_never_wait

    def plan(top_n=(0, 0), mode=(), temperature=(1.0, 0.0)):
        return types.SimpleNamespace(
            top_n=np.asarray(top_n, np.int32), logprobs_mode=np.asarray(mode, np.int8),
            temperature=np.asarray(temperature, np.float32), seq_lens=np.ones(2, np.int32),
        )  # fmt: skip

    assert log_probs_never_wait(plan())
    assert not log_probs_never_wait(plan(top_n=(0, 5)))
    assert not log_probs_never_wait(plan(mode=(1, 0)))
    assert log_probs_never_wait(plan(mode=(0, 1)))  # (the greedy row's: no sort)
