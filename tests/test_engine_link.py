"""EngineLinks (actors/engine_link.py), the coordinator's side of the engine protocol that the
coordinator actor and the direct client share: which engine is which rank, silence, the
ModelInfo of a ModelLoaded, readiness and a failed start; and its two waits (silence, a process
exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from taipan.actors.engine_link import (
    EngineLinks,
    ServedModel,
    model_info,
    watch_process,
    watch_silence,
)
from taipan.messages.gpu import ModelLoaded
from taipan.messages.requests import ModelInfo

SERVED = ServedModel("m", 512, 2, prefix_caching=True)


def loaded(block_size: int = 16, num_blocks: int = 10) -> ModelLoaded:
    return ModelLoaded("m", num_blocks, block_size, 100, 512, "{}", (2,), 64)


def test_model_info_joins_what_is_served_with_what_the_rank_reports():
    info = model_info(loaded(), SERVED, weight_version=3)
    assert info == ModelInfo("m", "{}", 512, 2, 160, 640, 16, True, 3)


def test_ranks_are_known_by_identity_until_they_are_gone():
    links = EngineLinks(SERVED, timeout=5.0)
    links.join(1, b"e1", now=100.0)
    assert (links.rank_of(b"e1"), links.name(b"e1"), links.is_live(b"e1")) == (1, "engine 1", True)
    assert links.rank_of(b"other") is None and links.name(b"other") == "engine b'other'"
    links.heard(b"other", 101.0)  # no live engine: nothing to note
    assert links.heard_at == {b"e1": 100.0}
    assert links.gone(b"e1") == 1 and links.gone(b"e1") is None
    assert links.engines == {} and not links.is_live(b"e1")


def test_silence_counts_from_the_last_message():
    links = EngineLinks(SERVED, timeout=5.0)
    links.join(0, b"e0", now=100.0)
    links.join(1, b"e1", now=101.0)
    assert links.silent(104.9) == [] and links.next_check(104.0) == pytest.approx(1.0)
    links.heard(b"e0", 103.0)
    assert links.silent(106.0) == [(b"e1", 5.0)]
    assert links.next_check(106.0) == 0.0  # e1 is due now
    links.gone(b"e1")
    assert links.next_check(106.0) == pytest.approx(2.0)
    links.gone(b"e0")
    assert links.next_check(106.0) == 5.0  # nobody to watch: a full timeout


def test_the_first_model_report_makes_the_info_and_every_rank_must_match_it():
    links = EngineLinks(SERVED)
    assert links.block_size == 0 and links.info is None and not links.ready
    assert links.loaded_model(0, loaded(), weight_version=0) is None
    assert links.block_size == 16 and links.info.kv_cache_tokens == 160
    assert not links.ready  # one of two ranks
    why = links.loaded_model(1, loaded(block_size=32), weight_version=0)
    assert why == (
        "its block size 32 differs from the runtime's 16 (every rank must run the same config)"
    )
    assert not links.ready and links.loaded == {0}
    assert links.loaded_model(1, loaded(num_blocks=99), weight_version=0) is None
    assert links.ready and links.info.kv_cache_tokens == 160  # the first report's
    links.set_weight_version(4)
    assert links.info.weight_version == 4


def test_a_start_fails_on_a_load_error_or_a_death_before_every_rank_is_up():
    links = EngineLinks(SERVED)
    links.loaded_model(0, loaded(), 0)
    failure = links.start_failure(1, "its connection closed")
    assert failure == "engine rank 1 died before the runtime was ready (its connection closed)"
    assert links.load_error == failure and links.start_failure(0, "x") is None  # told once
    links.loaded_model(1, loaded(), 0)
    assert not links.ready
    up = EngineLinks(ServedModel("m", 512, 1))
    up.loaded_model(0, loaded(), 0)
    assert up.ready and up.start_failure(0, "later") is None and up.ready
    failed = EngineLinks(ServedModel("m", 512, 1))
    failed.load_failed("no such checkpoint")
    failed.loaded_model(0, loaded(), 0)
    assert not failed.ready and failed.load_error == "no such checkpoint"


@pytest.mark.asyncio
async def test_watch_silence_wakes_when_an_engine_falls_silent_and_not_before():
    links = EngineLinks(SERVED, timeout=0.3)
    seen: list[tuple[bytes, float]] = []  # (identity, seconds silent when called)
    called: list[float] = []  # seconds after the start

    async def on_silent(identity: bytes, silent: float) -> None:
        seen.append((identity, silent))
        called.append(time.time() - start)
        links.gone(identity)

    start = time.time()
    links.join(0, b"e0", start)
    links.join(1, b"e1", start)
    watch = asyncio.ensure_future(watch_silence(links, on_silent))
    try:
        for _ in range(4):  # e0 keeps talking
            await asyncio.sleep(0.1)
            links.heard(b"e0", time.time())
        assert [i for i, _ in seen] == [b"e1"] and seen[0][1] >= 0.3
        assert called[0] < 0.3 + 0.2  # at its deadline (the loop sleeps until then)
        await asyncio.sleep(0.5)
        assert [i for i, _ in seen] == [b"e1", b"e0"]
    finally:
        watch.cancel()


@pytest.mark.asyncio
async def test_watch_process_returns_when_the_process_exits():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    try:
        why = await asyncio.wait_for(watch_process(proc.pid), 10.0)
        assert why == f"its process {proc.pid} exited (see its log above)"
    finally:
        proc.wait()
    gone = await asyncio.wait_for(watch_process(proc.pid), 1.0)  # reaped: no such process
    assert gone.startswith(f"its process {proc.pid} is not running (")
