"""Pause modes and the prefix-cache flush (issue 26 items 2 and 6) through the real runtime
(coordinator and engine processes) serving a tiny random Llama on the CPU, with prefix caching,
recorded.

- pause(mode="wait"): admission stops at once; the requests in flight finish normally and the
  pause completes after them; a request submitted meanwhile queues, untouched, and is served
  after the unpause; past its timeout the pause is taken back (the runtime runs again) and the
  error names the rank;
- pause(clear_cache=True) in every mode, and flush_cache() while paused, really drop the cached
  prefix: a prompt that hit the cache before hits nothing after (num_cached_tokens), and a
  request holding shared blocks through the flush still gets its uninterrupted tokens;
  flush_cache() while RUNNING is refused;
- a hybrid (tiny random NemotronH with Mamba snapshots): clear_cache drops the snapshots with
  the KV blocks, and the prompt recomputed from scratch gives the same tokens;
- over HTTP: /flush_cache and /pause with its fields behind --api-key (401 without the key,
  403 from a server without one, 409 while running, 200 paused);
- last, `taipan replay --check` passes over the whole recorded session.

The same modes under data and expert parallelism, under load: tests/test_e2e_pause_parallel.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client, ControlError
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from taipan.server.app import build_app
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.random_nemotron_h import make_random_nemotron_h
from tests.replay_check import replay_check

KEY = "sk-pause"
BLOCK = 16
CONFIG = dict(
    block_size_tokens=BLOCK,
    max_tokens=64,
    max_requests=8,
    max_sequence_length=2048,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
# 70 tokens: 4 complete blocks (64 tokens) to share.
CACHED = [7 + (i * 37) % 240 for i in range(70)]
SHORT = SamplingParams(max_tokens=3, temperature=0.0)
ROLLOUT = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
# Longer than any timeout below, even on a loaded machine (the test ends it with an abort).
ENDLESS = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)
WAIT_S = 120  # every await on the runtime is bounded: a hang fails the test instead


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    path = make_random_llama(str(tmp_path_factory.mktemp("pause") / "tiny"), TINY_SHAPE)
    rec = tmp_path_factory.mktemp("pause-rec")
    with Runtime(path, InferenceConfig(**CONFIG), record_dir=str(rec)) as rt:
        with Client(rt.address) as c:
            yield rt, c, rec


async def _stream(ac: AsyncClient, prompt, sampling, seen: asyncio.Event, n: int = 2):
    """(tokens, finish reason) of a stream; `seen` is set once it has `n` tokens."""
    tokens, last = [], None
    async for d in ac.stream(prompt, sampling):
        tokens += d.token_ids
        last = d
        if len(tokens) >= n:
            seen.set()
    return tokens, str(last.finish_reason)


async def _flowing(ac: AsyncClient, prompts, sampling) -> list[asyncio.Task]:
    """Streams of `prompts`, returned once every one of them has tokens."""
    seen = [asyncio.Event() for _ in prompts]
    tasks = [
        asyncio.create_task(_stream(ac, p, sampling, e)) for p, e in zip(prompts, seen, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), WAIT_S)
    return tasks


# --- mode wait -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_wait_lets_the_requests_in_flight_finish_then_pauses(session):
    rt, c, _ = session
    want = [c.generate([p], ROLLOUT)[0].token_ids for p in ([5, 6, 7], [40, 41])]
    async with AsyncClient(rt.address) as ac:
        streams = await _flowing(ac, [[5, 6, 7], [40, 41]], ROLLOUT)
        pause = asyncio.create_task(ac.pause(mode="wait"))
        await asyncio.sleep(0.05)  # (the pause reaches the engine first: admission is off)
        late = asyncio.create_task(ac.generate([[9, 9, 9]], ROLLOUT))
        ack = await asyncio.wait_for(pause, WAIT_S)
        assert str(ack.state) == "PAUSED"
        # The ack came once both had finished, each normally and in full.
        done = await asyncio.wait_for(asyncio.gather(*streams), 5)
        assert done == [(w, "length") for w in want]
        [rank] = (await ac.stats()).ranks
        assert (rank.running, rank.paused, rank.waiting) == (0, 0, 1)  # the late one queued
        step = rank.step
        await asyncio.sleep(0.3)
        assert (await ac.stats()).ranks[0].step == step and not late.done()  # nothing runs
        assert str((await ac.unpause()).state) == "RUNNING"
        [served] = await asyncio.wait_for(late, WAIT_S)
    assert (
        str(served.finish_reason) == "length"
        and served.token_ids == c.generate([[9, 9, 9]], ROLLOUT)[0].token_ids
    )


def test_wait_with_nothing_in_flight_pauses_at_once(session):
    _, c, _ = session
    start = time.monotonic()
    assert str(c.pause(mode="wait").state) == "PAUSED"
    assert time.monotonic() - start < 10
    assert str(c.unpause().state) == "RUNNING"


@pytest.mark.asyncio
async def test_a_wait_past_its_timeout_is_taken_back_and_serving_goes_on(session):
    rt, c, _ = session
    async with AsyncClient(rt.address) as ac:
        [endless] = await _flowing(ac, [[3, 1, 4, 1, 5]], ENDLESS)
        start = time.monotonic()
        with pytest.raises(ControlError) as err:
            await asyncio.wait_for(ac.pause(mode="wait", timeout=0.5), WAIT_S)
        assert time.monotonic() - start < 30
        text = err.value.text
        assert err.value.code == "control_failed", text
        assert "engine 0 did not answer pause within 0.5 s (pause mode wait" in text, text
        assert "state stays RUNNING" in text and "runs again" in text, text
        stats = await ac.stats()
        assert str(stats.state) == "RUNNING" and str(stats.ranks[0].state) == "RUNNING"
        # Admission is back: a new request is served while the long one still runs.
        [short] = await asyncio.wait_for(ac.generate([[8, 8]], SHORT), WAIT_S)
        assert str(short.finish_reason) == "length" and not endless.done()
        assert str((await ac.pause(mode="abort")).state) == "PAUSED"
        tokens, reason = await asyncio.wait_for(endless, WAIT_S)
        assert reason == "abort" and 2 <= len(tokens) < ENDLESS.max_tokens
        await ac.unpause()
    with pytest.raises(ValueError, match="positive number of seconds"):
        c.pause(mode="wait", timeout=0)


# --- the cache flush -------------------------------------------------------------------------


def _cached(c: Client) -> int:
    return c.generate([CACHED], SHORT)[0].num_cached_tokens


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_pause_with_clear_cache_drops_the_cached_prefix(session, mode):
    _, c, _ = session
    _cached(c)
    assert _cached(c) == 4 * BLOCK  # a hit before
    assert str(c.pause(mode=mode, clear_cache=True).state) == "PAUSED"
    [rank] = c.stats().ranks
    assert rank.blocks_hashed == rank.blocks_evictable == 0  # the allocator holds no hash
    c.unpause()
    assert _cached(c) == 0  # none after
    assert _cached(c) == 4 * BLOCK  # and cached again


def test_flush_cache_while_paused_and_refused_while_running(session):
    _, c, _ = session
    _cached(c)
    assert _cached(c) == 4 * BLOCK
    with pytest.raises(ControlError) as err:
        c.flush_cache()
    assert err.value.code == "illegal_transition" and "pause first" in err.value.text
    c.pause()
    ack = c.flush_cache()
    assert (str(ack.command), str(ack.state)) == ("flush_cache", "PAUSED")
    assert c.stats().ranks[0].blocks_hashed == 0
    c.suspend("persist")
    assert str(c.flush_cache().state) == "SUSPENDED"  # legal suspended too
    c.resume()
    c.unpause()
    assert _cached(c) == 0


@pytest.mark.asyncio
async def test_a_request_holding_shared_blocks_keeps_them_through_a_flush(session):
    rt, c, _ = session
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _cached(c)
    [want] = c.generate([CACHED], sampling)
    assert want.num_cached_tokens == 4 * BLOCK
    async with AsyncClient(rt.address) as ac:
        [stream] = await _flowing(ac, [CACHED], sampling)
        assert str((await ac.pause(clear_cache=True)).state) == "PAUSED"  # (keep)
        assert (await ac.stats()).ranks[0].running == 1
        await ac.unpause()
        tokens, reason = await asyncio.wait_for(stream, WAIT_S)
    assert (tokens, reason) == (want.token_ids, "length")


def test_clear_cache_drops_the_mamba_snapshots_of_a_hybrid(tmp_path):
    from transformers import AutoConfig

    from tests.test_e2e_hybrid_prefix import BASE
    from tests.test_e2e_hybrid_prefix import config as hybrid_config

    path = make_random_nemotron_h(str(tmp_path / "nh"), pattern="M-*-M-")
    cfg = hybrid_config(
        AutoConfig.from_pretrained(path), snapshots=8, max_tokens=24, pressure=False
    )
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Runtime(path, cfg, record_dir=str(tmp_path / "rec")) as rt, Client(rt.address) as c:
        [first] = c.generate([BASE], sampling)
        [hit] = c.generate([BASE], sampling)
        assert hit.num_cached_tokens == 32 and hit.token_ids == first.token_ids  # a snapshot
        assert c.stats().ranks[0].mamba_snapshots > 0
        c.pause(clear_cache=True)
        [rank] = c.stats().ranks
        assert rank.mamba_snapshots == rank.blocks_hashed == 0
        c.unpause()
        [fresh] = c.generate([BASE], sampling)
        assert fresh.num_cached_tokens == 0 and fresh.token_ids == first.token_ids
        assert c.generate([BASE], sampling)[0].num_cached_tokens == 32
    out = replay_check(tmp_path / "rec")
    assert "engine-0: ok" in out and "mamba_cache-0: ok" in out, out


# --- over HTTP -------------------------------------------------------------------------------


async def _http(rt, api_key: str | None = KEY):
    """(AsyncClient, httpx client over the app in this process, with the key sent)."""
    ac = AsyncClient(rt.address)
    await ac.connect()
    app = build_app(ac, served_model_name="tiny", api_key=api_key)
    headers = {"authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers, timeout=60)
    return ac, http


@pytest.mark.asyncio
async def test_flush_cache_and_pause_fields_over_http_behind_the_api_key(session):
    rt, c, _ = session
    ac, http = await _http(rt)
    try:
        assert (await http.post("/flush_cache", headers={"authorization": ""})).status_code == 401
        r = await http.post("/flush_cache")
        assert r.status_code == 409 and r.json()["error"]["code"] == "illegal_transition"
        for body, param in [({"timeout": "soon"}, "timeout"), ({"clear_cache": 1}, "clear_cache")]:
            r = await http.post("/pause", json={"mode": "wait", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = await http.post("/pause", json={"mode": "wait", "timeout": -1})
        assert r.status_code == 400 and "positive" in r.json()["error"]["message"]
        body = {"mode": "wait", "clear_cache": True, "timeout": 60}
        assert (await http.post("/pause", json=body)).json()["state"] == "PAUSED"
        r = await http.post("/flush_cache")
        assert r.status_code == 200 and r.json()["state"] == "PAUSED", r.text
        assert (await http.post("/unpause")).json()["state"] == "RUNNING"
    finally:
        await http.aclose()
        await ac.close()
    ac, http = await _http(rt, api_key=None)  # a server without --api-key
    try:
        r = await http.post("/flush_cache")
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    finally:
        await http.aclose()
        await ac.close()
    assert str(c.stats().state) == "RUNNING"


# --- replay ----------------------------------------------------------------------------------


def test_replay_check_passes_over_the_whole_session(session):
    rt, _, rec = session
    rt.shutdown()
    out = replay_check(rec)
    assert "engine-0: ok" in out and "allocator-0: ok" in out, out
