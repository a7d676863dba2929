"""The OpenAI server's bounded queue (issue 11): at most `max_queued` choices in flight (n x
prompts each), a request that finds no room waits up to `queue_timeout` seconds and then gets a
503 in OpenAI's shape with Retry-After, one that can never fit a 400 at once; room comes back
when a request ends, however it ends (completed, failed, cancelled, its client gone). The
queue core (`Admission`) alone, then the real app over the session's runtime: in process through
ASGI, and through uvicorn on a socket for a client that hangs up mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import httpx
import pytest

from taipan.client import AsyncClient
from taipan.launcher import LaunchError, Runtime
from taipan.server import Admission, APIError, build_app, serve
from tests.ports import free_port

LONG = {"model": "M", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
SHORT = {"model": "M", "prompt": "Hi", "max_tokens": 2, "temperature": 0}


# --- the core ----------------------------------------------------------------------------------


def test_admission_waits_first_come_first_served_and_refuses_after_its_timeout():
    async def main():
        q = Admission(3, timeout=5.0)
        await q.acquire(2)
        big = asyncio.ensure_future(q.acquire(3))  # waits: 2 + 3 > 3
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(q.acquire(1))  # would fit, but must not overtake `big`
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and q.waiting == 4
        q.release(2)  # `big` takes all three; `small` still waits
        await asyncio.sleep(0.01)
        assert big.done() and not small.done() and q.in_flight == 3
        q.release(3)
        await small
        assert q.in_flight == 1 and q.waiting == 0

        # A waiter that is cancelled (its client went away) leaves the line; the next moves up.
        q2 = Admission(2, timeout=5.0)
        await q2.acquire(1)
        gone = asyncio.ensure_future(q2.acquire(2))
        await asyncio.sleep(0.01)
        after = asyncio.ensure_future(q2.acquire(1))
        await asyncio.sleep(0.01)
        gone.cancel()
        await after  # admitted as soon as the large waiter at the head left
        assert q2.in_flight == 2 and q2.waiting == 0

        # No room within the timeout: a 503 with Retry-After, nothing held; 0 refuses at once.
        for timeout in (0.1, 0.0):
            q3 = Admission(1, timeout=timeout)
            await q3.acquire(1)
            start = time.monotonic()
            with pytest.raises(APIError) as e:
                await q3.acquire(1)
            assert timeout <= time.monotonic() - start < timeout + 1
            assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
            assert q3.in_flight == 1 and q3.waiting == 0
        # More choices than the bound can ever hold: 400 at once.
        with pytest.raises(APIError) as e:
            await Admission(2, timeout=5.0).acquire(3)
        assert e.value.status == 400 and e.value.param == "n"

    asyncio.run(main())


@pytest.mark.parametrize("max_queued, timeout", [(0, 1.0), (1, -1.0), (1, float("nan"))])
def test_bad_queue_settings_are_refused(max_queued, timeout, model_path):
    with pytest.raises(ValueError, match="max_queued|queue_timeout"):
        Admission(max_queued, timeout)
    with pytest.raises(LaunchError, match="max_queued|queue_timeout"):  # before any process
        Runtime(model_path, http_port=8000, max_queued=max_queued, queue_timeout=timeout)


def test_serve_refuses_a_bad_max_queued(model_path):
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model_path]
    cmd += ["--http-port", "8000", "--max-queued", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "taipan: error: max_queued must be >= 1, got 0" in done.stderr


# --- the app over the real runtime ---------------------------------------------------------


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _engine_idle(client: AsyncClient) -> None:
    async def idle():
        rank = (await client.stats()).ranks[0]
        free = rank.blocks_free + rank.blocks_evictable
        return not rank.running and not rank.waiting and free == rank.num_blocks

    await _until(idle, "the engine did not become idle with every KV block back")


async def _in_flight(http, n: int, what: str = "in flight") -> None:
    async def check():
        return await _metric(http, "taipan_http_in_flight") == n

    await _until(check, f"taipan_http_in_flight never became {n} ({what})")


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_full_queue_refuses_then_serves_again(runtime):
    """max_queued 2: two long streams hold both slots, a third request gets a 503 after the
    0.2 s wait; cancelling a stream makes room; n above the bound is a 400; every choice's slot
    and KV blocks come back."""

    async def main():
        async with AsyncClient(runtime.address) as client:
            app = build_app(client, served_model_name="M", max_queued=2, queue_timeout=0.2)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                assert await _metric(http, "taipan_http_max_queued") == 2
                # ASGI in process buffers a streamed body: each long stream runs in a task
                # until it is cancelled (the stream cancelled mid-way).
                streams = [
                    asyncio.ensure_future(
                        http.post("/v1/completions", json={**LONG, "stream": True})
                    )
                    for _ in range(2)
                ]
                await _in_flight(http, 2, "two long streams")
                start = time.monotonic()
                r = await http.post("/v1/completions", json=SHORT)
                waited = time.monotonic() - start
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["type"] == "server_error" and err["code"] == "server_overloaded"
                assert "--max-queued" in err["message"]
                assert 0.2 <= waited < 5, waited
                assert await _metric(http, "taipan_http_refused_total") == 1
                assert not any(s.done() for s in streams)  # the refusal touched neither

                await _cancel(streams[0])
                await _in_flight(http, 1, "one stream cancelled")
                r = await http.post("/v1/chat/completions", json={
                    "model": "M", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2,
                })  # fmt: skip
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
                await _in_flight(http, 1, "a completed request gave its slot back")

                # 2 prompts x n=2 = 4 choices can never fit in 2: a 400 at once, not a wait.
                r = await http.post("/v1/completions", json={**SHORT, "prompt": ["a", "b"], "n": 2})
                assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
                assert "4 choices" in r.json()["error"]["message"]
                r = await http.post("/v1/chat/completions", json={
                    "model": "M", "messages": [{"role": "user", "content": "Hi"}], "n": 3,
                })  # fmt: skip
                assert r.status_code == 400 and "3 choices" in r.json()["error"]["message"]
                assert await _metric(http, "taipan_http_refused_total") == 1  # 503s only

                await _cancel(streams[1])
                await _in_flight(http, 0, "both streams cancelled")
            await _engine_idle(client)

    asyncio.run(main())


def test_a_waiting_request_is_served_when_room_comes(runtime):
    """queue_timeout 30 s: a request that finds the one slot taken waits (counted in
    taipan_http_waiting) and is served, first, once the long stream is cancelled."""

    async def main():
        async with AsyncClient(runtime.address) as client:
            app = build_app(client, served_model_name="M", max_queued=2, queue_timeout=30)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                long = asyncio.ensure_future(
                    http.post("/v1/completions", json={**LONG, "stream": True, "n": 2})
                )
                await _in_flight(http, 2, "one long stream of n=2")
                waiting = asyncio.ensure_future(
                    http.post("/v1/completions", json={**SHORT, "stream": True})
                )

                async def queued():
                    return await _metric(http, "taipan_http_waiting") == 1

                await _until(queued, "the short request never waited")
                assert not waiting.done()
                await _cancel(long)
                r = await asyncio.wait_for(waiting, 60)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason":"length"' in r.text
                await _in_flight(http, 0)
                assert await _metric(http, "taipan_http_refused_total") == 0
            await _engine_idle(client)

    asyncio.run(main())


def test_a_failed_request_gives_its_slot_back(runtime):
    """The runtime unreachable (the app's client closed): a stream ends with an error event
    and a plain request is a 500; both slots come back."""

    async def main():
        client = AsyncClient(runtime.address)
        await client.connect()
        app = build_app(client, served_model_name="M", max_queued=1, queue_timeout=0)
        await client.close()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post("/v1/completions", json={**SHORT, "stream": True})
            assert r.status_code == 200 and '"error"' in r.text, r.text
            assert r.text.rstrip().endswith("data: [DONE]")
            r = await http.post("/v1/completions", json=SHORT)
            assert r.status_code == 500
            # With one slot and no wait, a leaked slot would make this a 503.
            r = await http.post("/v1/completions", json={**SHORT, "stream": True})
            assert r.status_code == 200, r.text
            assert app.state.server.admission.in_flight == 0

    asyncio.run(main())


def test_a_client_that_hangs_up_gives_its_slot_back(runtime):
    """Through uvicorn on a socket, max_queued 1 and no wait: a client that closes its
    connection mid-stream, and one that gives up on a plain answer, each free the one slot
    (the next request is served, not refused) and their KV blocks."""

    async def main():
        async with AsyncClient(runtime.address) as client:
            port = free_port()
            started = asyncio.Event()
            server = asyncio.ensure_future(
                serve(client, port=port, served_model_name="M", max_queued=1, queue_timeout=0,
                      started=started)
            )  # fmt: skip
            try:
                await asyncio.wait_for(started.wait(), 30)
                base = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                    body = {**LONG, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        lines = r.aiter_lines()
                        assert (await anext(lines)).startswith("data: ")
                        assert await _metric(http, "taipan_http_in_flight") == 1
                        busy = await http.post("/v1/completions", json=SHORT)
                        assert busy.status_code == 503  # the slot is taken, and no wait
                    await _in_flight(http, 0, "the streaming client hung up")
                    await _engine_idle(client)

                    with pytest.raises(httpx.ReadTimeout):  # gives up after 1 s, hangs up
                        await http.post(
                            "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0)
                        )
                    await _in_flight(http, 0, "the plain client hung up")
                    r = await http.post("/v1/completions", json=SHORT)
                    assert r.status_code == 200 and r.json()["choices"][0]["text"]
                    assert await _metric(http, "taipan_http_refused_total") == 1
                await _engine_idle(client)
            finally:
                await _cancel(server)

    asyncio.run(main())
