"""Chunked prefill through the real runtime: a small per-step token budget splits long prompts
across steps while other requests decode, and greedy outputs do not change."""

from __future__ import annotations

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

PROMPTS = [
    "Summarise: " + "The quick brown fox jumps over the lazy dog. " * 12,  # ~130 tokens
    "Hi",
    "List the planets of the solar system in order from the sun: " * 3,
    "def add(a, b):\n    return a + b\n\n# a test for add\n",
]


def small_budget(**extra) -> InferenceConfig:
    """40 tokens per step: the first prompt (~130 tokens) cannot prefill in one step."""
    return InferenceConfig(
        block_size_tokens=16,
        max_tokens=40,
        max_requests=8,
        buffer_size_gb=1,
        max_sequence_length=512,
        **extra,
    )


def test_chunked_prefill_keeps_greedy_outputs(client, model_path):
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    expected = client.generate(PROMPTS, sampling)  # shared runtime: whole prompts in one step
    with (
        Runtime(model_path, small_budget(enable_chunked_prefill=True)) as rt,
        Client(rt.address) as c,
    ):
        chunked = c.generate(PROMPTS, sampling)
        assert max(len(x.prompt_token_ids) for x in chunked) > 40  # really chunked
    assert [x.token_ids for x in chunked] == [x.token_ids for x in expected]


def test_prompt_over_budget_without_chunking_is_refused(model_path):
    with Runtime(model_path, small_budget()) as rt, Client(rt.address) as c:
        [bad, ok] = c.generate(
            [PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=4), raise_on_error=False
        )
    assert bad.finish_reason == "error" and "enable_chunked_prefill" in bad.error
    assert ok.finish_reason in ("stop", "length")
