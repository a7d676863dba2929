"""Fuzzing the OpenAI server (issue 11): seeded random mutations of valid completion and chat
bodies (fields deleted, retyped, set out of range, unknown fields added, the JSON text cut or
garbled) go to the real app over a real runtime (ASGI in-process: the HTTP parsing is
uvicorn's, tested in tests/test_e2e_http.py). Every answer is a 200 with choices or a 4xx in
OpenAI's error shape, never a 5xx; afterwards the server still serves and every KV block is
back. `HTTP_FUZZ_BODIES` sets the count (default 1,000; the slow test runs 10,000)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time

import httpx
import pytest

from taipan.client import AsyncClient
from taipan.server import build_app

TEMPLATES = [
    ("/v1/completions", {"model": "M", "prompt": "Hi there", "max_tokens": 1, "temperature": 0}),
    (
        "/v1/completions",
        {"model": "M", "prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 1, "echo": True},
    ),
    (
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ),
    (
        "/v1/chat/completions",
        {
            "model": "M",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "x"},
            ],
            "max_completion_tokens": 1,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
        },
    ),
]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "n", "logprobs", "top_logprobs", "echo",
    "stream", "stream_options", "presence_penalty", "best_of", "user", "ignore_eos", "bogus",
]  # fmt: skip
VALUES = [
    None, True, False, -1, 0, 1, 2, 3.5, -0.5, 2**40, 2**70, float("nan"), "", "x", "M",
    [], [1], [-5], [[1, 2], [3]], ["a", ""], {}, {"include_usage": True}, {"a": 1},
    [{"role": "user", "content": "q"}], [{"role": "robot"}], [{"content": 1}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
]  # fmt: skip


def mutate(rng: random.Random) -> tuple[str, bytes]:
    """One (path, raw body): a template with 1-3 mutations."""
    path, body = copy.deepcopy(rng.choice(TEMPLATES))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.15 and body:
            body.pop(rng.choice(list(body)))
        elif op < 0.85:
            body[rng.choice(FIELDS)] = copy.deepcopy(rng.choice(VALUES))
        elif op < 0.9:
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        else:
            body = rng.choice([[], "text", 3, None, [body]])
            break
    # Keep valid bodies cheap: never ask for many tokens (the defaults are up to the context).
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 1
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 2:
                body[key] = 2 if rng.random() < 0.5 else 10**9
    raw = json.dumps(body).encode()
    r = rng.random()
    if r < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # cut
    elif r < 0.08:
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))  # garbage
    return path, raw


async def fuzz(address: str, count: int, seed: int) -> dict[int, int]:
    client = AsyncClient(address)
    await client.connect()
    app = build_app(client, served_model_name="M")
    transport = httpx.ASGITransport(app=app)
    statuses: dict[int, int] = {}
    rng = random.Random(seed)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for i in range(count):
                path, raw = mutate(rng)
                r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (i, path, raw[:300], r.text[:500])
                if r.status_code == 200:
                    if r.headers["content-type"].startswith("text/event-stream"):
                        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
                        assert '"error"' not in r.text, r.text[-300:]
                    else:
                        assert r.json()["choices"], r.text[:300]
                else:
                    assert "error" in r.json(), (r.status_code, path, raw[:300], r.text[:300])
                    err = r.json()["error"]
                    assert err["message"] and err["type"], r.text[:300]
            ok = await http.post(
                "/v1/completions", json={"model": "M", "prompt": "Hi", "max_tokens": 2}
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        deadline = time.monotonic() + 10
        while True:
            rank = (await client.stats()).ranks[0]
            if not rank.running and rank.blocks_free + rank.blocks_evictable == rank.num_blocks:
                break
            assert time.monotonic() < deadline, rank
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    return statuses


def test_fuzzed_bodies_get_only_4xx_or_200(runtime):
    count = int(os.environ.get("HTTP_FUZZ_BODIES", 400))  # (10,000 in the slow run)
    statuses = asyncio.run(fuzz(runtime.address, count, seed=1))
    assert sum(statuses.values()) == count
    assert statuses.get(400, 0) > count // 2 and statuses.get(200, 0) > 0, statuses


@pytest.mark.slow
def test_ten_thousand_fuzzed_bodies(runtime):
    statuses = asyncio.run(fuzz(runtime.address, 10_000, seed=2))
    assert sum(statuses.values()) == 10_000 and set(statuses) <= {200, 400, 404}, statuses
