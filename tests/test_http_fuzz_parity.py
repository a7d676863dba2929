"""Fuzzing the OpenAI server's newer surfaces (issue 28): seeded random mutations of valid
tool-calling chat, /v1/responses, /tokenize and log-prob bodies (fields nulled, retyped, set
out of range, OpenAI's and vLLM's optional fields added) go to the real app over the session's
runtime, in process. Every answer is a 200 or a 4xx in OpenAI's error shape, never a 5xx
(tests/test_http_fuzz.py does the same for the plain completion and chat bodies)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random

import httpx
import pytest

from taipan.client import AsyncClient
from taipan.server import build_app

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MSGS = [{"role": "user", "content": "Hi"}]
TEMPLATES = [
    ("/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "stream": True,
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
    ("/v1/responses", {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 1,
                       "stream": True}),
    ("/tokenize", {"messages": MSGS, "tools": TOOLS, "return_token_strs": True}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "echo": True, "logprobs": 2,
                         "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": "日本", "max_tokens": 1, "echo": True, "logprobs": 0,
                         "stream": True}),
]  # fmt: skip
FIELDS = [
    "tools", "tool_choice", "parallel_tool_calls", "input", "instructions", "max_output_tokens",
    "prompt_logprobs", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "seed",
    "messages", "model", "store", "metadata", "response_format", "continue_final_message",
    "add_generation_prompt", "chat_template_kwargs", "text", "reasoning", "previous_response_id",
    "stop_token_ids", "include_stop_str_in_output", "logit_bias", "n", "prompt",
]  # fmt: skip
VALUES = [
    None, True, False, -1, 0, 1, 3, 2**63, -(2**63), 2**70, "", "x", "auto", "none", "required",
    [], {}, [1], ["a"], {"type": "text"}, {"type": "json_object"}, {"include_usage": True},
    {"continuous_usage_stats": True}, {"a": 1}, TOOLS, [{"type": "web_search"}],
    [{"type": "function"}], {"type": "function", "function": {"name": "f"}},
    [{"role": "user", "content": "q"}], [{"role": "assistant", "content": "x"}],
    [{"role": "tool", "content": None}], [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"type": "function_call_output", "output": "x"}], [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
]  # fmt: skip


def mutate(rng: random.Random) -> tuple[str, bytes]:
    path, body = copy.deepcopy(rng.choice(TEMPLATES))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.15 and body:
            body.pop(rng.choice(list(body)))
        else:
            body[rng.choice(FIELDS)] = copy.deepcopy(rng.choice(VALUES))
    if not isinstance(body, dict):
        return path, json.dumps(body).encode()
    if path != "/tokenize":  # keep valid bodies cheap
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 1
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    return path, json.dumps(body).encode()


async def fuzz(address: str, count: int, seed: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    rng = random.Random(seed)
    async with AsyncClient(address) as client:
        transport = httpx.ASGITransport(app=build_app(client, served_model_name="M"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for i in range(count):
                path, raw = mutate(rng)
                r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (i, path, raw[:400], r.text[:500])
                if r.status_code == 200 and r.headers["content-type"].startswith("text/event"):
                    assert 'data: {"error"' not in r.text, (path, raw[:400], r.text[-400:])
                elif r.status_code != 200:
                    err = r.json()["error"]
                    assert err["message"] and err["type"], r.text[:300]
    return statuses


@pytest.mark.slow
def test_fuzzed_parity_bodies_get_only_4xx_or_200(runtime):
    count = int(os.environ.get("HTTP_FUZZ_BODIES", 600))
    statuses = asyncio.run(fuzz(runtime.address, count, seed=3))
    assert statuses.get(200, 0) > count // 20 and set(statuses) <= {200, 400, 404}, statuses
