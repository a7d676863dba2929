"""Speculative decoding (n-gram drafts) through the real runtime on SmolLM2: outputs equal
those without it (greedy, and seeded sampling token for token) with prefix caching, chunked
prefill and a KV pool small enough that requests pause; stops and max_tokens that land inside an
accepted run; the acceptance counters in stats()."""

from __future__ import annotations

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

PASSAGE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
PROMPTS = [
    "Repeat this sentence three times: " + PASSAGE,
    "Copy the code:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Repeat this sentence three times: " + PASSAGE,  # shares the first one's blocks
    "Count: 1, 2, 3, 4, 5, 6, 7, 8,",
]
N = 12


def speculative_config(**extra) -> InferenceConfig:
    """k = 4 drafts, prefix caching, 40-token steps (chunked prefill) and 8 KV blocks of 16
    tokens for 4 requests of up to ~40 + 12 tokens: they pause and resume."""
    return InferenceConfig(
        block_size_tokens=16,
        max_tokens=40,
        max_requests=8,
        buffer_size_gb=0.006,
        max_sequence_length=512,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        num_speculative_tokens=4,
        **extra,
    )


@pytest.fixture(scope="module")
def spec(model_path):
    with Runtime(model_path, speculative_config()) as rt, Client(rt.address) as c:
        yield c


def test_greedy_outputs_equal_plain_decoding_and_drafts_are_accepted(client, spec):
    """The default run's check (two prompts, no pressure; the slow tests add the rest), with
    log-probs and top-n: every accepted token carries what plain decoding gives it."""
    greedy = SamplingParams(max_tokens=N, temperature=0.0, return_log_probs=True, top_n_logprobs=2)
    want = client.generate(PROMPTS[:2], greedy)
    before = spec.stats().merged()
    got = spec.generate(PROMPTS[:2], greedy)
    assert [x.token_ids for x in got] == [x.token_ids for x in want]
    for g, w in zip(got, want, strict=True):
        assert len(g.log_probs) == len(g.token_ids) == len(g.top_n_logprobs)
        np.testing.assert_allclose(g.log_probs, w.log_probs, atol=1e-4)
        for a, b in zip(g.top_n_logprobs, w.top_n_logprobs, strict=True):
            assert list(a) == list(b)
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)
    rank = spec.stats().merged()
    accepted = rank.spec_accepted_tokens - before.spec_accepted_tokens
    assert rank.spec_draft_tokens > before.spec_draft_tokens and accepted > 0, rank
    # Verify forwards (a step's rows verify together: at most one forward a row) and their
    # device time, a share of every step's.
    forwards = rank.spec_verify_steps - before.spec_verify_steps
    rows = rank.spec_verify_rows - before.spec_verify_rows
    assert 0 < forwards <= rows, rank
    assert 0 < rank.spec_verify_device_seconds < rank.device_seconds_total, rank


def test_processed_log_probs_of_sampled_rows_equal_plain_decoding(client, spec):
    """A seeded, filtered request asking for processed log-probs speculates: its tokens and
    the log-probs of the distribution each was drawn from equal plain decoding's."""
    seeded = SamplingParams(
        max_tokens=N, temperature=0.8, top_p=0.9, top_k=40, seed=7, return_log_probs=True,
        top_n_logprobs=2, logprobs_mode="processed",
    )  # fmt: skip
    _speculates_as_plain_decoding(client, spec, seeded)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_and_logit_bias_apply_at_every_verified_position(client, spec, temperature):
    """A request with repetition, frequency and presence penalties and a logit_bias speculates:
    each verified position sees the drafts before it as output tokens, so its tokens and
    log-probs (processed: after the controls) equal plain decoding's."""
    params = SamplingParams(
        max_tokens=N, temperature=temperature, top_p=0.9, seed=3, return_log_probs=True,
        top_n_logprobs=2, logprobs_mode="processed", repetition_penalty=1.1, frequency_penalty=0.2,
        presence_penalty=0.1, logit_bias={13: -2.0, 11: 1.5},
    )  # fmt: skip
    _speculates_as_plain_decoding(client, spec, params)


def test_bad_words_and_min_tokens_follow_the_drafts(client, spec):
    """A bad word taken from the output plain decoding gives without it (so it fires inside
    the run the drafts predict) and min_tokens: the same tokens and log-probs as plain
    decoding."""
    t = client.generate(PROMPTS[1:2], SamplingParams(max_tokens=N, temperature=0.0))[0]
    params = SamplingParams(
        max_tokens=N, temperature=0.0, return_log_probs=True, top_n_logprobs=2,
        logprobs_mode="processed", min_tokens=6, bad_words_ids=((t.token_ids[3], t.token_ids[4]),),
    )  # fmt: skip
    _speculates_as_plain_decoding(client, spec, params)


def test_allowed_tokens_hold_at_every_verified_position(client, spec):
    """allowed_token_ids (the copy prompt's own tokens, less the first one plain decoding
    gives): drafts from the prompt pass the mask, the first plain token never comes; the same
    tokens and processed log-probs as plain decoding under the same mask."""
    ids = client.tokenizer.encode(PROMPTS[1])
    first = client.generate(PROMPTS[1:2], SamplingParams(max_tokens=1, temperature=0.0))[0]
    allowed = tuple(sorted(set(ids) - set(first.token_ids)))
    params = SamplingParams(
        max_tokens=N, temperature=0.0, return_log_probs=True, top_n_logprobs=2,
        logprobs_mode="processed", allowed_token_ids=allowed,
    )  # fmt: skip
    _speculates_as_plain_decoding(client, spec, params)
    [got] = spec.generate(PROMPTS[1:2], params)
    assert set(got.token_ids) <= set(allowed) and got.token_ids[0] != first.token_ids[0]


def _speculates_as_plain_decoding(client, spec, params: SamplingParams) -> None:
    """The repeat prompt under `params`: verify rows ran, and the tokens, log-probs and top-n
    equal plain decoding's."""
    want = client.generate(PROMPTS[1:2], params)
    before = spec.stats().merged()
    got = spec.generate(PROMPTS[1:2], params)
    assert [x.token_ids for x in got] == [x.token_ids for x in want]
    np.testing.assert_allclose(got[0].log_probs, want[0].log_probs, atol=1e-4)
    for a, b in zip(got[0].top_n_logprobs, want[0].top_n_logprobs, strict=True):
        assert list(a) == list(b)
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)
    assert spec.stats().merged().spec_verify_rows > before.spec_verify_rows


@pytest.mark.slow
def test_outputs_equal_plain_decoding(client, spec):
    greedy = SamplingParams(max_tokens=N, temperature=0.0)
    seeded = SamplingParams(max_tokens=N, temperature=0.8, top_p=0.95, seed=7)
    want = [x.token_ids for x in client.generate(PROMPTS, greedy)]
    want_seeded = [x.token_ids for x in client.generate(PROMPTS[:1], seeded)]
    got = spec.generate(PROMPTS, greedy)
    assert [x.token_ids for x in got] == want
    assert [x.token_ids for x in spec.generate(PROMPTS[:1], seeded)] == want_seeded
    rank = spec.stats().merged()
    assert rank.spec_draft_tokens > 0 and rank.spec_accepted_tokens > 0, rank
    assert rank.spec_verify_rows > 0 and sum(rank.spec_accepted_per_position) == (
        rank.spec_accepted_tokens
    )
    assert rank.spec_mean_accepted_length > 1.0
    assert rank.prefix_cached_tokens > 0, rank  # the shared prompt's blocks
    assert rank.paused_total > 0, rank  # KV pressure


@pytest.mark.slow
def test_stops_inside_an_accepted_run(client, spec):
    """A stop token and max_tokens cut a verify row's run where plain decoding stops."""
    greedy = SamplingParams(max_tokens=N, temperature=0.0)
    [ref] = client.generate(PROMPTS[:1], greedy)
    ids = ref.token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 5 and t not in ids[:i])
    cut = ids.index(stop) + 1
    stopped = SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=(stop,))
    short = SamplingParams(max_tokens=7, temperature=0.0)
    [a, b] = [spec.generate(PROMPTS[:1], s)[0] for s in (stopped, short)]
    assert a.token_ids == ids[:cut] and a.finish_reason == "stop"
    assert b.token_ids == ids[:7] and b.finish_reason == "length"
    # A stop string (matched by the client on the text) ends the request there too.
    [c] = spec.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, stop="fox"))
    [d] = client.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, stop="fox"))
    assert c.text == d.text and c.finish_reason == d.finish_reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_speculative_equals_plain_with_graphs_and_overlap(model_path, dtype):
    """On CUDA (graphs and overlapped steps on by default): greedy outputs with n-gram drafts
    equal those without, drafts are accepted, and steps run graphed (verify rows in the mixed
    graphs, which keep every token's hidden state). fp32: every token equal. bf16: a verify
    row's attention (k+1 query tokens, the prefill kernel) rounds differently from a decode
    row's, so near ties pick other tokens and the texts part (an H100 run: 5 of 8 prompts
    differed somewhere); only the lengths are compared."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, return_log_probs=True)
    base = dict(block_size_tokens=16, max_sequence_length=512, max_requests=8)
    outs = {}
    for k in (0, 4):
        cfg = InferenceConfig(**base, num_speculative_tokens=k)
        with Runtime(model_path, cfg, device="cuda", dtype=dtype) as rt, Client(rt.address) as c:
            outs[k] = [x.token_ids for x in c.generate(PROMPTS, greedy)]
            outs[k, "lp"] = c.generate(PROMPTS[:2], with_lp)  # (raw log-probs speculate too)
            outs[k, "stats"] = c.stats().merged()
    for got, want in zip(outs[4, "lp"], outs[0, "lp"], strict=True):
        assert len(got.log_probs) == len(got.token_ids) == 48
        if dtype == "float32":
            assert got.token_ids == want.token_ids
            np.testing.assert_allclose(got.log_probs, want.log_probs, atol=2e-3)
    on = outs[4, "stats"]
    assert on.spec_accepted_tokens > 0 and on.steps_graphed > 0, on
    assert outs[0, "stats"].spec_draft_tokens == 0
    if dtype == "float32":
        assert outs[4] == outs[0]
    else:
        assert [len(o) for o in outs[4]] == [len(o) for o in outs[0]] == [48] * len(PROMPTS)
