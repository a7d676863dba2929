"""Pause modes under data and expert parallelism (issue 26 item 2): real coordinator and engine
processes, two ranks, under load. `DP=2`: a tiny random Llama on two independent ranks;
`EP=2`: the tiny random Qwen3-MoE with its experts split over two ranks (gloo collectives,
consensus rounds over ZMQ). Both with prefix caching, recorded.

- each mode (keep, abort, wait), with and without clear_cache, pauses every rank while requests
  stream and more arrive: no hang (every wait is bounded), every rank PAUSED and still, every
  request gets its one terminal output with the finish reason its mode allows (wait: the
  requests in flight finish in full before the pause completes), and after the unpause the
  runtime serves again; three rounds of each mode;
- all or none: a wait that one rank cannot finish within its timeout fails naming that rank,
  and the rank that had paused (or, in a group, was pausing) runs again;
- a rank killed during a wait fails the pause naming it, at once, and the other runs again;
- `taipan replay --check` passes over every rank's logs (no request got two terminal outputs).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, ControlError
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.random_moe import make_random_qwen3_moe
from tests.replay_check import replay_check

transformers = pytest.importorskip("transformers")
CONFIG = dict(
    block_size_tokens=16,
    max_tokens=48,
    max_requests=4,
    max_sequence_length=2048,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
)
KINDS = {
    "dp2": (lambda path: make_random_llama(path, TINY_SHAPE), dict(data_parallel_size=2)),
    "ep2": (make_random_qwen3_moe, dict(data_parallel_size=2, expert_parallel_size=2)),
}
# Expert parallel: consult the group every 4 busy steps (a pause waits at most that long).
EP_CONFIG = {"ep2": dict(ep_consensus_interval=4)}
MODES = ("keep", "abort", "wait")
WAIT_S = 180  # every await on the runtime is bounded: a hang fails the test instead
ENDLESS = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)


def _sampling(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + 7 * (i % 4), temperature=0.0, ignore_eos=True)


def _prompt(i: int, n: int = 0) -> list[int]:
    return [1 + (i * 13 + k * 7) % 250 for k in range(n or 3 + (i * 5) % 20)]


@pytest.fixture(scope="module", params=list(KINDS))
def runtime(request, tmp_path_factory):
    make, sizes = KINDS[request.param]
    path = make(str(tmp_path_factory.mktemp(request.param) / "model"))
    rec = tmp_path_factory.mktemp(f"{request.param}-rec")
    config = InferenceConfig(**CONFIG, **EP_CONFIG.get(request.param, {}))
    with Runtime(path, config, record_dir=str(rec), **sizes) as rt:
        yield rt, rec, request.param


async def _collect(ac: AsyncClient, prompt, sampling, seen: asyncio.Event | None = None):
    """(tokens, finish reason, terminal outputs seen) of one streamed request."""
    tokens, reasons = [], []
    async for d in ac.stream(prompt, sampling):
        tokens += d.token_ids
        if d.finished:
            reasons.append(str(d.finish_reason))
        if seen is not None and tokens:
            seen.set()
    return tokens, reasons


async def _round(ac: AsyncClient, mode: str, clear: bool, salt: int) -> None:
    """Pause in `mode` while 6 requests stream and 2 more arrive; unpause; check everything."""
    seen = [asyncio.Event() for _ in range(6)]
    flying = [
        asyncio.create_task(_collect(ac, _prompt(salt + i), _sampling(i), seen[i]))
        for i in range(6)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen[:2])), WAIT_S)
    pause = asyncio.create_task(ac.pause(mode=mode, clear_cache=clear))
    await asyncio.sleep(0.02)
    late = [
        asyncio.create_task(_collect(ac, _prompt(salt + 50 + i), _sampling(i))) for i in range(2)
    ]
    ack = await asyncio.wait_for(pause, WAIT_S)
    assert str(ack.state) == "PAUSED", (mode, ack)
    stats = await asyncio.wait_for(ac.stats(), WAIT_S)
    assert [str(r.state) for r in stats.ranks] == ["PAUSED", "PAUSED"], (mode, stats)
    if mode in ("abort", "wait"):  # nothing that started is left
        assert all(r.running == r.paused == 0 for r in stats.ranks), (mode, stats)
    if mode == "wait":
        # Every request that had started finished (in full) before the pause completed: their
        # outputs are here; those that had not started wait, with the late ones.
        done, queued = await asyncio.wait(flying, timeout=3)
        assert len(done) >= 2, (len(done), stats)
        for t in done:
            tokens, reasons = t.result()
            assert reasons == ["length"] and len(tokens) == _sampling(flying.index(t)).max_tokens
        assert sum(r.waiting for r in stats.ranks) == len(queued) + len(late), stats
    if clear:
        assert all(r.blocks_hashed == 0 for r in stats.ranks), stats
    await asyncio.sleep(0.2)
    again = await asyncio.wait_for(ac.stats(), WAIT_S)
    assert [r.step for r in again.ranks] == [r.step for r in stats.ranks]  # nothing steps
    assert str((await asyncio.wait_for(ac.unpause(), WAIT_S)).state) == "RUNNING"
    results = await asyncio.wait_for(asyncio.gather(*flying, *late), WAIT_S)
    allowed = {"keep": {"length"}, "wait": {"length"}, "abort": {"length", "abort"}}[mode]
    for i, (tokens, reasons) in enumerate(results):
        assert len(reasons) == 1 and reasons[0] in allowed, (mode, i, reasons)
        if reasons[0] == "length":
            assert len(tokens) == _sampling(i % 6).max_tokens, (mode, i, len(tokens))
    # Serving again, on both ranks.
    served = await asyncio.wait_for(
        asyncio.gather(*(ac.generate([_prompt(salt + 90 + i)], _sampling(0)) for i in range(2))),
        WAIT_S,
    )
    assert [str(c.finish_reason) for [c] in served] == ["length", "length"]


async def _rounds(rt: Runtime, rounds: int) -> None:
    async with AsyncClient(rt.address) as ac:
        for n in range(rounds):
            for k, mode in enumerate(MODES):
                await _round(ac, mode, clear=(n + k) % 2 == 1, salt=100 * n + 10 * k)


def test_each_mode_pauses_both_ranks_under_load_repeatedly(runtime):
    """Three rounds of every mode (about 3 s at DP=2, 6 s at EP=2 on the 2-core dev box)."""
    rt, _, _ = runtime
    asyncio.run(_rounds(rt, 3))


async def _wait_times_out_on_one_rank(rt: Runtime, kind: str) -> None:
    async with AsyncClient(rt.address) as ac:
        seen = asyncio.Event()
        endless = asyncio.create_task(_collect(ac, _prompt(7, 9), ENDLESS, seen))
        await asyncio.wait_for(seen.wait(), WAIT_S)
        busy = [r.rank for r in (await ac.stats()).ranks if r.running]
        assert len(busy) == 1, busy
        start = time.monotonic()
        with pytest.raises(ControlError) as err:
            await asyncio.wait_for(ac.pause(mode="wait", timeout=1.0), WAIT_S)
        assert time.monotonic() - start < 60
        text = err.value.text
        # An expert-parallel group pauses together: neither rank had paused.
        late = "engine 0, engine 1" if kind == "ep2" else f"engine {busy[0]}"
        assert f"{late} did not answer pause within 1 s (pause mode wait" in text, text
        assert "state stays RUNNING" in text and "runs again" in text, text
        stats = await ac.stats()
        assert [str(r.state) for r in stats.ranks] == ["RUNNING", "RUNNING"], stats
        # Admission is back on both ranks.
        served = await asyncio.wait_for(
            asyncio.gather(*(ac.generate([_prompt(200 + i)], _sampling(1)) for i in range(2))),
            WAIT_S,
        )
        assert [str(c.finish_reason) for [c] in served] == ["length", "length"]
        assert not endless.done()
        assert str((await asyncio.wait_for(ac.pause(mode="abort"), WAIT_S)).state) == "PAUSED"
        tokens, reasons = await asyncio.wait_for(endless, WAIT_S)
        assert reasons == ["abort"] and len(tokens) < ENDLESS.max_tokens
        await asyncio.wait_for(ac.unpause(), WAIT_S)


def test_a_wait_one_rank_cannot_finish_in_time_is_undone_on_both(runtime):
    rt, _, kind = runtime
    asyncio.run(_wait_times_out_on_one_rank(rt, kind))


def test_replay_check_passes_over_both_ranks(runtime):
    rt, rec, _ = runtime
    rt.shutdown()
    out = replay_check(rec)
    for rank in (0, 1):
        assert f"engine-{rank}: ok" in out and f"allocator-{rank}: ok" in out


def test_a_rank_killed_during_a_wait_fails_the_pause_naming_it(tmp_path):
    path = make_random_llama(str(tmp_path / "tiny"), TINY_SHAPE)
    with Runtime(path, InferenceConfig(**CONFIG), data_parallel_size=2) as rt:

        async def scenario():
            async with AsyncClient(rt.address) as ac:
                seen = asyncio.Event()
                endless = asyncio.create_task(_collect(ac, _prompt(3, 9), ENDLESS, seen))
                await asyncio.wait_for(seen.wait(), WAIT_S)
                [busy] = [r.rank for r in (await ac.stats()).ranks if r.running]
                pause = asyncio.create_task(ac.pause(mode="wait"))
                await asyncio.sleep(0.5)  # the idle rank has paused, the busy one drains
                assert not pause.done()
                killed = time.monotonic()
                os.kill(rt.engine_pids[busy], signal.SIGKILL)
                with pytest.raises(ControlError) as err:
                    await asyncio.wait_for(pause, WAIT_S)
                assert time.monotonic() - killed < 15
                text = err.value.text
                assert f"engine {busy}: " in text and "runs again" in text, text
                tokens, reasons = await asyncio.wait_for(endless, WAIT_S)
                assert reasons == ["error"]
                stats = await ac.stats()
                live = [r for r in stats.ranks if r.alive]
                assert [(r.rank, str(r.state)) for r in live] == [(1 - busy, "RUNNING")]
                [c] = await asyncio.wait_for(ac.generate([_prompt(5)], _sampling(1)), WAIT_S)
                assert str(c.finish_reason) == "length"

        asyncio.run(scenario())
