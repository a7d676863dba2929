"""Per-token weight versions (issue 26 item 3) and the token-in/token-out `/generate` endpoint
(item 6) through the real runtime (coordinator and engine processes) serving a tiny random
Llama on the CPU, recorded.

Versions: a keep-mode pause with a weight update in the middle of requests gives two spans at
the right token, streamed (each delta's spans cover its own tokens) and not; requests paused
and evicted for want of KV blocks (recomputed later) keep their tokens' versions; a
pause(mode="abort") returns partial rollouts with theirs, and the rollout resubmitted after an
update gets the new version; in every case the spans agree with `policy_staleness`. The
OpenAI endpoints carry them as the `weight_versions` extension of each choice. `/generate`:
one input and a batch, streamed and not, equal to `Client.generate`; refusals (an unknown
key: 400 naming it; no key sent: 401; a server without --api-key: 403). Last, `taipan replay
--check` passes over the whole recorded session.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client, Completion
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from taipan.outputs import join_versions
from taipan.server.app import build_app
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.replay_check import replay_check

KEY = "sk-versions"
BLOCK = 16
NUM_BLOCKS = 24
# K and V of 2 layers, 2 KV heads of 16 dims, fp32: bytes per block of 16 tokens.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
CONFIG = dict(
    block_size_tokens=BLOCK,
    max_tokens=64,
    max_requests=8,
    max_sequence_length=NUM_BLOCKS * BLOCK,
    buffer_size_gb=(NUM_BLOCKS + 0.5) * BLOCK_BYTES / 1024**3,
)
# Long enough (about 2 ms a step) that a pause lands while it runs.
LONG = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 3, 250, 9, 9, 12]]
# HF initialises RMSNorm weights to ones (make_random_llama randomises only matrices): an
# update with these changes no output, only the version.
SAME_WEIGHTS = {"model.norm.weight": np.ones(TINY_SHAPE["hidden_size"], np.float32)}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A recorded runtime with a 24-block KV pool (6 requests of 100 tokens cannot all run) and
    a client; yields (runtime, client, record dir)."""
    path = make_random_llama(str(tmp_path_factory.mktemp("versions") / "tiny"), TINY_SHAPE)
    rec = tmp_path_factory.mktemp("versions-rec")
    with Runtime(path, InferenceConfig(**CONFIG), record_dir=str(rec)) as rt:
        with Client(rt.address) as c:
            yield rt, c, rec


def check_versions(spans, num_prompt: int, num_tokens: int, policy: list[int]) -> None:
    """`spans` are well formed over `num_tokens` generated tokens and agree with the policy
    staleness (versions grow by one per update here): the spans that start after a token
    count the updates since it was sampled."""
    assert len(policy) == num_prompt + num_tokens
    if num_tokens == 0:
        assert spans == []
        return
    firsts = [f for _, f in spans]
    assert firsts[0] == 0 and firsts == sorted(set(firsts)) and firsts[-1] < num_tokens, spans
    assert all(a[0] != b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    latest = spans[-1][0]
    for j in range(num_tokens):
        version = [v for v, f in spans if f <= j][-1]
        changes_after = sum(1 for _, f in spans if f > j)
        assert policy[num_prompt + j] == changes_after == latest - version, (j, spans)


def check_completion(c: Completion) -> None:
    check_versions(c.weight_versions, len(c.prompt_token_ids), len(c.token_ids), c.policy_staleness)
    assert all(k <= p for k, p in zip(c.kv_cache_staleness, c.policy_staleness, strict=True))


def joined(deltas) -> list[tuple[int, int]]:
    """The spans of a stream's deltas, each checked to cover its own tokens."""
    spans, offset = [], 0
    for d in deltas:
        if d.token_ids:
            firsts = [f for _, f in d.weight_versions]
            assert firsts[0] == offset and firsts[-1] < offset + len(d.token_ids), (d, offset)
        else:
            assert d.weight_versions == []
        offset += len(d.token_ids)
        spans = join_versions(spans, d.weight_versions)
    return spans


async def _stream_until(ac: AsyncClient, prompt, sampling, deltas: list, seen, n: int):
    async for d in ac.stream(prompt, sampling):
        deltas.append(d)
        if sum(len(x.token_ids) for x in deltas) >= n:
            seen.set()


# --- versions ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_update_in_a_keep_pause_starts_a_second_span_where_it_landed(session):
    rt, _, _ = session
    async with AsyncClient(rt.address) as ac:
        deltas, seen = [], asyncio.Event()
        streamed = asyncio.create_task(_stream_until(ac, PROMPTS[0], LONG, deltas, seen, 3))
        whole = asyncio.create_task(ac.generate([PROMPTS[1]], LONG))
        await asyncio.wait_for(seen.wait(), 60)
        v0 = (await ac.pause()).weight_version
        assert (await ac.update_weights(state=SAME_WEIGHTS)).weight_version == v0 + 1
        await ac.unpause()
        await streamed
        [c] = await whole
    spans = joined(deltas)
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == LONG.max_tokens and len(spans) == 2, spans
    assert spans[0] == (v0, 0) and spans[1][0] == v0 + 1 and 3 <= spans[1][1] < len(tokens)
    final = deltas[-1]
    check_versions(spans, len(PROMPTS[0]), len(tokens), final.policy_staleness)
    # The request that did not stream: all its spans in its one output, on its Completion.
    assert len(c.weight_versions) == 2 and c.weight_versions[0] == (v0, 0), c.weight_versions
    assert c.weight_versions[1][0] == v0 + 1
    check_completion(c)


@pytest.mark.asyncio
async def test_requests_preempted_and_recomputed_keep_their_tokens_versions(session):
    rt, c, _ = session
    evicted_before = c.stats().ranks[0].evicted_total
    sampling = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 70, 71, 72, 73 + i] for i in range(6)]  # 6 x 7 blocks > 24 blocks
    async with AsyncClient(rt.address) as ac:
        deltas, seen = [], asyncio.Event()
        streamed = asyncio.create_task(_stream_until(ac, prompts[0], sampling, deltas, seen, 30))
        rest = asyncio.create_task(ac.generate(prompts[1:], sampling))
        await asyncio.wait_for(seen.wait(), 60)
        v0 = (await ac.pause()).weight_version
        await ac.update_weights(state=SAME_WEIGHTS)
        await ac.unpause()
        await streamed
        done = await rest
    assert c.stats().ranks[0].evicted_total > evicted_before  # some were recomputed
    spans = joined(deltas)
    assert spans[0] == (v0, 0) and spans[-1][0] == v0 + 1, spans
    check_versions(spans, len(prompts[0]), 100, deltas[-1].policy_staleness)
    for comp in done:
        assert len(comp.token_ids) == 100 and comp.weight_versions[-1][0] == v0 + 1
        check_completion(comp)
    # A request evicted with tokens of both versions recomputed its KV and kept its versions.
    evicted = [x for x in done if any(str(e.type) == "EVICT" for e in x.events)]
    assert any(len(x.weight_versions) == 2 for x in evicted), [x.weight_versions for x in done]


@pytest.mark.asyncio
async def test_abort_returns_partial_rollouts_with_versions_and_a_resubmission_gets_the_new(
    session,
):
    rt, _, _ = session
    async with AsyncClient(rt.address) as ac:
        deltas, seen = [], asyncio.Event()
        streamed = asyncio.create_task(_stream_until(ac, PROMPTS[0], LONG, deltas, seen, 3))
        whole = asyncio.create_task(ac.generate([PROMPTS[2]], LONG))
        await asyncio.wait_for(seen.wait(), 60)
        v0 = (await ac.pause(mode="abort")).weight_version
        await asyncio.wait_for(streamed, 30)
        [partial] = await asyncio.wait_for(whole, 30)
        assert str(deltas[-1].finish_reason) == str(partial.finish_reason) == "abort"
        tokens = [t for d in deltas for t in d.token_ids]
        assert 3 <= len(tokens) < LONG.max_tokens and joined(deltas) == [(v0, 0)]
        assert 0 < len(partial.token_ids) < LONG.max_tokens
        assert partial.weight_versions == [(v0, 0)]
        check_completion(partial)
        # The trainer updates the weights and resubmits the partial rollout.
        await ac.update_weights(state=SAME_WEIGHTS)
        await ac.unpause()
        rest = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        [more] = await ac.generate([PROMPTS[2] + partial.token_ids], rest)
    total = len(PROMPTS[2]) + len(partial.token_ids) + 8
    assert more.weight_versions == [(v0 + 1, 0)] and more.policy_staleness == [0] * total


# --- HTTP ----------------------------------------------------------------------------------------


def _events(text: str) -> list[dict]:
    lines = [x[len("data: ") :] for x in text.splitlines() if x.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text
    return [json.loads(x) for x in lines[:-1]]


async def _http(rt, api_key: str | None = KEY):
    """(AsyncClient, httpx client over the app in this process, with the key sent)."""
    ac = AsyncClient(rt.address)
    await ac.connect()
    app = build_app(ac, served_model_name="tiny", api_key=api_key)
    headers = {"authorization": f"Bearer {KEY}"}
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=headers, timeout=60
    )
    return ac, http


@pytest.mark.asyncio
async def test_openai_choices_carry_weight_versions(session):
    rt, c, _ = session
    v = c.stats().merged().weight_version
    ac, http = await _http(rt)
    try:
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = await http.post("/v1/completions", json={**body, "prompt": PROMPTS[0]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["weight_versions"] == [[v, 0]]
        chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.json()["choices"][0]["weight_versions"] == [[v, 0]]
        completion = {**body, "prompt": PROMPTS[0]}
        for path, streamed in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
            r = await http.post(path, json={**streamed, "stream": True})
            spans = []  # the chunks' spans, joined
            for e in _events(r.text):
                for choice in e["choices"]:
                    more = [tuple(s) for s in choice.get("weight_versions", [])]
                    spans = join_versions(spans, more)
            assert spans == [(v, 0)], (path, r.text)
    finally:
        await http.aclose()
        await ac.close()


@pytest.mark.asyncio
async def test_generate_takes_and_gives_token_ids(session):
    rt, c, _ = session
    v = c.stats().merged().weight_version
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    want = [x.token_ids for x in c.generate(PROMPTS[:2], greedy)]
    params = {"max_tokens": 7, "temperature": 0, "ignore_eos": True}
    ac, http = await _http(rt)
    try:
        asked = {**params, "return_log_probs": True, "top_n_logprobs": 2}
        r = await http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": asked})
        assert r.status_code == 200, r.text
        one = r.json()
        assert one["output_ids"] == want[0] and one["finish_reason"] == "length"
        assert one["weight_versions"] == [[v, 0]] and one["num_cached_tokens"] == 0
        assert (one["num_prompt_tokens"], one["num_generated_tokens"]) == (len(PROMPTS[0]), 7)
        assert len(one["log_probs"]) == 7 and all(len(t) == 2 for t in one["top_n_logprobs"])
        assert len(one["prompt_log_probs"]) == len(PROMPTS[0]) - 1

        batch = {"input_ids": PROMPTS[:2], "sampling_params": [params, {**params, "seed": 3}]}
        r = await http.post("/generate", json=batch)
        assert [o["output_ids"] for o in r.json()] == want and "log_probs" not in r.json()[0]

        r = await http.post("/generate", json={**batch, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        for i in range(2):
            mine = [e for e in events if e["index"] == i]
            assert [t for e in mine for t in e["output_ids"]] == want[i]
            spans = []
            for e in mine:
                spans = join_versions(spans, [tuple(s) for s in e["weight_versions"]])
            assert spans == [(v, 0)] and mine[-1]["finished"] and not mine[0]["finished"]
            assert mine[-1]["num_generated_tokens"] == 7 and mine[-1]["finish_reason"] == "length"
    finally:
        await http.aclose()
        await ac.close()


@pytest.mark.asyncio
async def test_generate_refuses_what_it_cannot_serve(session):
    rt, _, _ = session
    ac, http = await _http(rt)
    try:
        bad = [
            ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}},
             "sampling_params.max_new_tokens"),
            ({"input_ids": [1, 2], "rid": "x"}, "rid"),
            ({"input_ids": [1, 2], "sampling_params": {"max_tokens": "many"}},
             "sampling_params.max_tokens"),
            ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params"),
            ({"input_ids": [], "sampling_params": {}}, "input_ids"),
            ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
            ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 10_000}}, "input_ids"),
        ]  # fmt: skip
        for body, param in bad:
            r = await http.post("/generate", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = await http.post("/generate", json={"input_ids": [1]}, headers={"authorization": ""})
        assert r.status_code == 401
    finally:
        await http.aclose()
        await ac.close()
    ac, http = await _http(rt, api_key=None)  # a server without --api-key
    try:
        r = await http.post("/generate", json={"input_ids": [1, 2]})
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    finally:
        await http.aclose()
        await ac.close()


# --- replay --------------------------------------------------------------------------------------


def test_replay_check_passes_over_the_whole_session(session):
    rt, _, rec = session
    rt.shutdown()
    out = replay_check(rec)
    assert "engine-0: ok" in out and "coordinator: ok" in out, out
