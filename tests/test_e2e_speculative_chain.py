"""Chained verify steps (InferenceConfig.speculative_chain_steps, actors/gpu/chain.py) through
the real runtime on SmolLM2: greedy outputs equal plain decoding's, with stops, max_tokens and
stop strings inside a chain, a KV pool that runs short, seeded sampling with log-probs (an RL
rollout's rows), requests a chain cannot carry (top-n) beside chained ones, streamed chains
and a reader that leaves mid-chain; the chains show in stats(); the configs refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from taipan.actors.config import ConfigError, InferenceConfig
from taipan.client import Client
from taipan.launcher import LaunchError, Runtime
from taipan.messages.requests import SamplingParams
from tests.test_e2e_speculative import PROMPTS

N = 40
GREEDY = SamplingParams(max_tokens=N, temperature=0.0)


def chain_config(**extra) -> InferenceConfig:
    return InferenceConfig(
        block_size_tokens=16,
        max_requests=8,
        max_sequence_length=512,
        enable_prefix_caching=True,
        num_speculative_tokens=4,
        speculative_chain_steps=6,
        **extra,
    )


@pytest.fixture(scope="module")
def chained_runtime(model_path):
    with Runtime(model_path, chain_config()) as rt:
        yield rt


@pytest.fixture(scope="module")
def chained(chained_runtime):
    with Client(chained_runtime.address) as c:
        yield c


def test_chained_greedy_outputs_equal_plain_decoding(client, chained):
    want = [x.token_ids for x in client.generate(PROMPTS, GREEDY)]
    before = chained.stats().merged()
    got = [chained.generate([p], GREEDY)[0].token_ids for p in PROMPTS]  # (one at a time)
    assert got == want
    together = chained.generate(PROMPTS, GREEDY)  # (4 rows: speculative_chain_max_rows)
    assert [x.token_ids for x in together] == want
    rank = chained.stats().merged()
    assert rank.spec_chains > before.spec_chains
    assert rank.spec_verify_rows > rank.spec_chains  # (several inner steps a chain)
    assert rank.spec_verify_steps > rank.spec_chains  # (each inner step a forward)
    assert sum(rank.spec_accepted_per_position) == rank.spec_accepted_tokens > 0


def test_stops_max_tokens_and_stop_strings_inside_a_chain(client, chained):
    code = PROMPTS[1]  # (its 40 greedy tokens copy code: long accepted runs)
    [ref] = client.generate([code], GREEDY)
    ids = ref.token_ids
    assert len(ids) == N
    stop = next(t for i, t in enumerate(ids) if i >= 9 and t not in ids[:i])
    cut = ids.index(stop) + 1
    stopped = SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=(stop,))
    short = SamplingParams(max_tokens=13, temperature=0.0)
    worded = SamplingParams(max_tokens=N, temperature=0.0, stop="pow")
    [a, b, c] = [chained.generate([code], s)[0] for s in (stopped, short, worded)]
    assert a.token_ids == ids[:cut] and a.finish_reason == "stop"
    assert b.token_ids == ids[:13] and b.finish_reason == "length"
    [d] = client.generate([code], worded)
    assert c.text == d.text and c.finish_reason == d.finish_reason == "stop"


def test_seeded_sampling_with_log_probs_equals_plain_decoding(client, chained):
    """Sampled rows chain too (an RL rollout's: temperature 1, raw log-probs): the drafts are
    point masses, so a seeded request draws what plain decoding draws, and each gained
    token carries its log-prob."""
    seeded = SamplingParams(
        max_tokens=N, temperature=1.0, top_p=0.95, seed=7, return_log_probs=True
    )
    want = client.generate(PROMPTS[:2], seeded)
    before = chained.stats().merged()
    got = [chained.generate([p], seeded)[0] for p in PROMPTS[:2]]
    assert [x.token_ids for x in got] == [x.token_ids for x in want]
    for g, w in zip(got, want, strict=True):
        assert len(g.log_probs) == len(g.token_ids)
        assert g.log_probs == pytest.approx(w.log_probs, abs=1e-4)
    assert chained.stats().merged().spec_chains > before.spec_chains


def test_a_request_with_top_n_runs_unchained_beside_chained_ones(client, chained_runtime):
    topped = SamplingParams(max_tokens=N, temperature=0.0, return_log_probs=True, top_n_logprobs=2)
    [want] = client.generate(PROMPTS[1:2], topped)
    [plain] = client.generate(PROMPTS[3:4], GREEDY)
    with Client(chained_runtime.address) as a, Client(chained_runtime.address) as b:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(a.generate, PROMPTS[1:2], topped)
            second = pool.submit(b.generate, PROMPTS[3:4], GREEDY)
            [got], [other] = first.result(), second.result()
    assert got.token_ids == want.token_ids and other.token_ids == plain.token_ids
    assert got.log_probs == pytest.approx(want.log_probs, abs=1e-4)
    assert [list(t) for t in got.top_n_logprobs] == [list(t) for t in want.top_n_logprobs]


def test_a_streamed_chain_and_one_its_reader_leaves(client, chained):
    """Streaming: a chain's tokens come as deltas of several tokens, in order, as plain
    decoding's; a reader that stops after the first delta aborts the request (the chain in
    flight ends with it) and the runtime serves the next request as before."""
    code = PROMPTS[1]
    [want] = client.generate([code], GREEDY)
    deltas = list(chained.stream(code, GREEDY))
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert deltas[-1].finished and max(len(d.token_ids) for d in deltas) > 1
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for delta in chained.stream(code, long):
        assert delta.token_ids
        break  # (the generator's close aborts the request)
    assert chained.generate([code], GREEDY)[0].token_ids == want.token_ids


def test_a_request_with_logit_controls_runs_unchained(client, chained):
    """A penalty (a logit control) keeps a request's verify steps one per plan: its outputs
    are plain decoding's with the penalty, and no chain is planned for it."""
    penalised = SamplingParams(max_tokens=N, temperature=0.0, presence_penalty=0.5)
    [want] = client.generate(PROMPTS[1:2], penalised)
    before = chained.stats().merged()
    [got] = chained.generate(PROMPTS[1:2], penalised)
    after = chained.stats().merged()
    assert got.token_ids == want.token_ids
    assert (
        after.spec_chains == before.spec_chains and after.spec_verify_rows > before.spec_verify_rows
    )


@pytest.mark.slow
def test_chains_under_kv_pressure_equal_plain_decoding(client, model_path):
    """8 blocks of 16 tokens for 4 requests of ~40 + 40 tokens: chains get fewer blocks than
    they could use (the gpu stops a row at its last slot) and requests pause."""
    config = chain_config(buffer_size_gb=0.006, max_tokens=40)
    want = [x.token_ids for x in client.generate(PROMPTS, GREEDY)]
    with Runtime(model_path, config) as rt, Client(rt.address) as c:
        assert [x.token_ids for x in c.generate(PROMPTS, GREEDY)] == want
        rank = c.stats().merged()
    assert rank.spec_chains > 0 and rank.paused_total > 0, rank


def test_chains_are_refused_where_they_are_not_built(model_path):
    with pytest.raises(ConfigError, match="speculative_method='ngram'"):
        InferenceConfig(num_speculative_tokens=0, speculative_chain_steps=4)
    with pytest.raises(ConfigError, match="speculative_chain_steps must be in"):
        InferenceConfig(num_speculative_tokens=2, speculative_chain_steps=0)
    with pytest.raises(LaunchError, match="expert parallelism"):
        Runtime(model_path, chain_config(), data_parallel_size=2, expert_parallel_size=2)


@pytest.mark.gpu
def test_gpu_chained_equals_plain_with_graphs(model_path):
    """On CUDA in fp32 (graphs and overlapped steps, the defaults there): chained verify steps
    give plain decoding's greedy tokens, one request at a time and four together, and their
    inner steps replay the mixed graphs."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    base = dict(block_size_tokens=16, max_sequence_length=512, max_requests=8)
    outs = {}
    for chain in (0, 8):
        spec = dict(num_speculative_tokens=4, speculative_chain_steps=chain) if chain else {}
        cfg = InferenceConfig(**base, **spec)
        with Runtime(model_path, cfg, device="cuda", dtype="float32") as rt:
            with Client(rt.address) as c:
                outs[chain] = [c.generate([p], greedy)[0].token_ids for p in PROMPTS]
                outs[chain, "together"] = [x.token_ids for x in c.generate(PROMPTS, greedy)]
                outs[chain, "stats"] = c.stats().merged()
    assert outs[8] == outs[0] and outs[8, "together"] == outs[0]
    rank = outs[8, "stats"]
    assert rank.spec_chains > 0 and rank.spec_accepted_tokens > 0 and rank.steps_graphed > 0
