"""The engine's request features through the real runtime and the real SmolLM2 model: a KV pool
so small that requests pause and are evicted, staggered admission, stop words across steps, stop
strings on the text (the client aborting the engine), log-probs against Hugging Face, streaming
abort returning every block, events and timings."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.test_e2e_generate import PROMPTS as GENERATE_PROMPTS

PROMPTS = GENERATE_PROMPTS[:6]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
BLOCK = 16


def blocks_gb(hf, n: int) -> float:
    """buffer_size_gb that holds `n` KV blocks of BLOCK tokens (fp32): K and V of every layer."""
    c = hf[0].config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_block = c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * head_dim * 4
    return (n + 0.5) * per_block / 1024**3


def tiny_pool(hf, **extra) -> InferenceConfig:
    """8 blocks of 16 tokens for 6 requests that each grow to 2-3 blocks: they cannot all run,
    so running requests pause, and (nothing else runnable, or over the paused budget) the
    oldest paused ones are evicted and recomputed."""
    return InferenceConfig(
        block_size_tokens=BLOCK,
        buffer_size_gb=blocks_gb(hf, 8),
        max_tokens=24,
        max_requests=8,
        max_sequence_length=512,
        **extra,
    )


@pytest.fixture(scope="module")
def expected(client):
    """Greedy outputs from the shared runtime (a pool large enough that nothing pauses)."""
    return [c.token_ids for c in client.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "chunked, overlap",
    [
        (True, False),
        pytest.param(False, False, marks=pytest.mark.slow),  # (chunked covers the pool rules)
        pytest.param(True, True, marks=pytest.mark.slow),
    ],
    ids=["chunked", "whole", "overlap"],
)
def test_tiny_pool_pauses_and_evicts_with_identical_outputs(
    model_path, hf, expected, chunked, overlap
):
    """Also with steps overlapping (off by default on CPU): pauses, evictions and ends decided
    one step late give the same tokens, and every block comes back."""
    extra = dict(enable_chunked_prefill=chunked, overlap_steps=overlap)
    if chunked:  # and at most one block's worth of paused requests before eviction
        extra["paused_buffer_size_gb"] = blocks_gb(hf, 1)
    with Runtime(model_path, tiny_pool(hf, **extra)) as rt, Client(rt.address) as c:
        done = c.generate(PROMPTS, GREEDY)
        # The last request's blocks come back with the step after its end, which the idle
        # engine runs at once, but a stats query may arrive first: wait for it (stats() is a
        # round trip to the engine, so no sleep).
        finished = time.monotonic()
        while (stats := c.stats().ranks[0]).blocks_free != 8:
            assert time.monotonic() - finished < 5.0, stats
    assert [d.token_ids for d in done] == expected
    assert stats.num_blocks == 8 and stats.blocks_free == 8
    assert stats.paused_total > 0 and stats.evicted_total > 0, stats


@pytest.mark.asyncio
async def test_staggered_admission_gives_the_same_outputs(client, runtime, expected):
    async def staggered():
        async with AsyncClient(runtime.address) as ac:

            async def one(i: int):
                await asyncio.sleep(0.15 * i)
                [done] = await ac.generate([PROMPTS[i]], GREEDY)
                return done.token_ids

            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    assert await staggered() == expected


def _first_index(seq: list[int], word: list[int]) -> int:
    return next(i for i in range(len(seq)) if seq[i : i + len(word)] == word)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_word_spanning_steps(client, expected, include, stream):
    full = expected[1]
    word = full[5:8]  # three tokens: generated over three steps
    at = _first_index(full, word)
    sampling = SamplingParams(
        max_tokens=24, temperature=0.0, stop_word_ids=(tuple(word),), include_stop_word=include
    )
    if stream:
        deltas = list(client.stream(PROMPTS[1], sampling))
        tokens = [t for d in deltas for t in d.token_ids]
        text = "".join(d.text for d in deltas)
        reason = deltas[-1].finish_reason
    else:
        [done] = client.generate([PROMPTS[1]], sampling)
        tokens, text, reason = done.token_ids, done.text, done.finish_reason
    want = full[: at + 3] if include else full[:at]
    assert (tokens, reason) == (want, "stop")
    assert text == client.tokenizer.decode(want)


def _stops_in(tok, ids: list[int]) -> dict[str, str]:
    """Stop strings from the middle of the greedy text of `ids` that start and end inside
    tokens: one over three tokens, one within a single token."""
    text = tok.decode(ids)
    offsets = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert text.isascii() and offsets[-1] == len(text)  # so offsets are token boundaries
    sizes = [offsets[k + 1] - offsets[k] for k in range(len(ids))]
    spanning = next(
        text[offsets[j] + 1 : offsets[j + 2] + 1]
        for j in range(1, len(ids) - 2)
        if sizes[j] >= 2 and sizes[j + 2] >= 2
    )
    inside = next(
        word
        for j in range(1, len(ids))
        if len(word := text[offsets[j] + 1 : offsets[j + 1] - 1]) >= 2
        and text.find(word) > offsets[j]
    )
    return {"spanning": spanning, "inside": inside}


@pytest.mark.parametrize("kind", ["spanning", "inside", "\n\n"])
@pytest.mark.parametrize("stream", [False, True, "slow"])
def test_stop_string_cuts_the_text_and_stops_the_engine(client, expected, kind, stream):
    """`slow`: a reader that takes longer per delta than the engine takes for the whole text;
    the stop still stops the engine early (the client matches as tokens arrive, not as they are
    read)."""
    tok = client.tokenizer
    full = expected[0]
    text = tok.decode(full)
    stop = _stops_in(tok, full).get(kind, kind)  # "\n\n": here two "\n" tokens (issue 11)
    want = text[: text.find(stop)]
    kept = next(k for k in range(len(full) + 1) if stop in tok.decode(full[:k]))
    assert kept + 4 < len(full), "the stop should come early enough to show the engine stop"
    sampling = SamplingParams(max_tokens=24, temperature=0.0, stop=stop)
    step = client.stats().ranks[0].step
    if stream:
        deltas = []
        for d in client.stream(PROMPTS[0], sampling):
            deltas.append(d)
            time.sleep(0.2 if stream == "slow" else 0)
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert len(deltas) > 1  # concatenated below: no delta showed any of the stop string
        done = deltas[-1]
        out_text = "".join(d.text for d in deltas)
        tokens = [t for d in deltas for t in d.token_ids]
    else:
        [done] = client.generate([PROMPTS[0]], sampling)
        out_text, tokens = done.text, done.token_ids
    assert (out_text, done.finish_reason, done.stop_reason) == (want, "stop", stop)
    assert tokens == full[:kept]  # up to the token that completed the stop string
    # The client aborted at once: the engine ran a step or two more (and one to free the
    # blocks), not the len(full) steps of the whole greedy text.
    stats = client.stats().ranks[0]
    assert kept <= stats.step - step <= kept + 4, (kept, stats.step - step)
    assert stats.running == stats.waiting == 0


def test_stop_token_id_is_the_stop_reason(client, expected):
    full = expected[2]
    token = full[6]
    [done] = client.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(token,))
    )
    assert done.token_ids == full[: full.index(token) + 1]
    assert (done.finish_reason, done.stop_reason) == ("stop", token)


def test_log_probs_match_hf(client, hf):
    model, _ = hf
    sampling = SamplingParams(
        max_tokens=6, temperature=0.0, return_log_probs=True, top_n_logprobs=3
    )
    [done] = client.generate([PROMPTS[3]], sampling)
    ids = done.prompt_token_ids + done.token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # row t predicts token t + 1
    p = len(done.prompt_token_ids)
    targets = torch.tensor(ids[1:])
    want = ref[:-1].gather(1, targets[:, None])[:, 0]
    assert np.allclose(done.prompt_log_probs, want[: p - 1].numpy(), atol=1e-4)
    assert np.allclose(done.log_probs, want[p - 1 :].numpy(), atol=1e-4)
    for j, top in enumerate(done.top_n_logprobs):
        values, indices = ref[p - 1 + j].topk(3)
        assert list(top) == indices.tolist()
        assert np.allclose(list(top.values()), values.numpy(), atol=1e-4)
    assert done.prompt_top_n_logprobs is None  # not asked for


def test_abort_of_a_streaming_request_returns_its_blocks(client):
    start = client.stats().ranks[0].blocks_free
    stream = client.stream("Tell me a very long story:", SamplingParams(max_tokens=300))
    got = 0
    for delta in stream:
        got += len(delta.token_ids)
        if got >= 3:
            break
    stream.close()  # the client aborts the request
    deadline = time.monotonic() + 20
    while client.stats().ranks[0].blocks_free != start:
        assert time.monotonic() < deadline, "blocks did not come back"
        time.sleep(0.05)


def test_streaming_interval_groups_tokens(client, expected):
    sampling = SamplingParams(max_tokens=24, temperature=0.0, streaming_interval=5)
    deltas = list(client.stream(PROMPTS[0], sampling))
    sizes = [len(d.token_ids) for d in deltas]
    assert all(n == 5 for n in sizes[:-1]) and 0 < sizes[-1] <= 5, sizes
    assert [t for d in deltas for t in d.token_ids] == expected[0]


def test_completion_carries_events_and_timings(client):
    [done] = client.generate([PROMPTS[5]], SamplingParams(max_tokens=5, temperature=0.0))
    kinds = [e.type for e in done.events]
    assert kinds[:2] == ["ADD_ENGINE", "ADD_CONTEXT"] and kinds[-1] == "FINISH"
    times = [e.timestamp for e in done.events]
    assert times == sorted(times)
    assert done.ttft is not None and done.ttft > 0
    assert done.tpot is not None and done.tpot > 0
