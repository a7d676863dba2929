"""End to end through real processes and sockets: client -> coordinator -> engine -> gpu actor.

Greedy outputs are checked token for token against Hugging Face transformers on the same GGUF.
"""

from __future__ import annotations

import pytest
import torch

from taipan.client import AsyncClient, RequestError
from taipan.messages.requests import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who",
    "def quicksort(arr):",
    "The three primary colors are",
    "In 1969, the first humans",
    "Water boils at",
    "My favourite recipe for pancakes: first,",
    "¿Dónde está la biblioteca? Es una pregunta",
]
CHAT = [
    "What is 2+2?",
    "Name a fruit that is yellow.",
    "Write one sentence about the moon.",
    "Say hello in German.",
    "How many legs does a spider have?",
    "What colour is grass?",
    "Give me a synonym for happy.",
    "What is the opposite of cold?",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    model, tok = hf
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=tok.eos_token_id,
        )
    new = out[0, len(ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    for i, t in enumerate(new):  # HF pads after EOS; ours stops at it (EOS included)
        if t in eos:
            return new[: i + 1]
    return new


# (HF's generate is most of the time: the default run checks four prompts, ASCII, code and not)
@pytest.mark.parametrize(
    "prompts",
    [[PROMPTS[i] for i in (0, 1, 2, 7)], pytest.param(PROMPTS, marks=pytest.mark.slow)],
    ids=["four", "all"],
)
def test_raw_prompts_match_hf(client, hf, prompts):
    done = client.generate(prompts, GREEDY)
    for prompt, c in zip(prompts, done, strict=True):
        assert c.prompt_token_ids == hf[1](prompt).input_ids
        assert c.token_ids == hf_greedy(hf, c.prompt_token_ids, 32), prompt
        assert c.text == hf[1].decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_chat_prompts_match_hf(client, hf):
    done = client.generate(CHAT, GREEDY, chat=True)
    for prompt, c in zip(CHAT, done, strict=True):
        expected_ids = hf[1].apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(expected_ids, "input_ids") or isinstance(expected_ids, dict):
            expected_ids = expected_ids["input_ids"]
        assert c.prompt_token_ids == list(expected_ids)
        assert c.token_ids == hf_greedy(hf, c.prompt_token_ids, 32), prompt
        assert c.finish_reason in ("stop", "length")


@pytest.mark.asyncio
async def test_concurrent_equals_alone(runtime):
    prompts = [f"{PROMPTS[i]} {i}" for i in range(0, 8, 2)]  # (four: one batch, then alone)
    sampling = SamplingParams(max_tokens=12, temperature=0.0)

    async def main():
        async with AsyncClient(runtime.address) as c:
            together = await c.generate(prompts, sampling)
            alone = [(await c.generate([p], sampling))[0] for p in prompts]
        return together, alone

    together, alone = await main()
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


@pytest.mark.asyncio
async def test_stream_deltas_add_up(runtime):
    sampling = SamplingParams(max_tokens=20, temperature=0.0)

    async def main():
        async with AsyncClient(runtime.address) as c:
            deltas = [d async for d in c.stream(PROMPTS[1], sampling)]
            [full] = await c.generate([PROMPTS[1]], sampling)
        return deltas, full

    deltas, full = await main()
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert "".join(d.text for d in deltas) == full.text


def test_seeded_sampling_is_reproducible(client):
    s = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    a = client.generate(PROMPTS[:4], s)
    b = client.generate(PROMPTS[:4][::-1], s)[::-1]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.parametrize(
    "prompt, sampling, needle",
    [
        ("hello " * 600, SamplingParams(max_tokens=4), "exceeds max_sequence_length"),
        ("", SamplingParams(max_tokens=4), "prompt is empty"),
        ("hello", SamplingParams(max_tokens=-1), "max_tokens must be >= 1"),
        ("hello", SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_get_clear_errors(client, prompt, sampling, needle):
    with pytest.raises(RequestError, match=needle):
        client.generate([prompt], sampling)
    [ok] = client.generate(["Still serving?"], SamplingParams(max_tokens=3, temperature=0))
    assert ok.finish_reason in ("stop", "length") and ok.token_ids


def test_cli_generate_json_against_running_runtime(runtime, client):
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "taipan.cli",
        "generate",
        "--address",
        runtime.address,
        "--prompt",
        PROMPTS[0],
        "--prompt",
        CHAT[0],
        "--chat",
        "--json",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPTS[0], CHAT[0]]
    expected = client.generate(
        [PROMPTS[0], CHAT[0]], SamplingParams(max_tokens=8, temperature=0), chat=True
    )
    for row, c in zip(rows, expected, strict=True):
        assert row["token_ids"] == c.token_ids and row["text"] == c.text
        assert row["finish_reason"] in ("stop", "length")


def test_cli_generate_stops_at_a_stop_string(runtime, client):
    import json
    import subprocess
    import sys

    [full] = client.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0))
    stop = full.text[len(full.text) // 2 :][:3]
    cmd = [sys.executable, "-m", "taipan.cli", "generate", "--address", runtime.address]
    cmd += ["--prompt", PROMPTS[0], "--max-tokens", "24", "--temperature", "0", "--json"]
    done = subprocess.run([*cmd, "--stop", stop], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    assert row["text"] == full.text[: full.text.find(stop)]
    assert (row["finish_reason"], row["stop_reason"]) == ("stop", stop)
