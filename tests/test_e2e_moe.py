"""Mixture-of-experts models served end to end (issue 12): real coordinator and engine processes,
real sockets, tiny random Qwen3-MoE and NemotronH-with-`E` directories saved with
`save_pretrained`, greedy tokens against Hugging Face's on the same weights.

Each runtime prefills in chunks (max_tokens 48 < the longer prompts) and gets more prompts than
`max_requests` (KV blocks, and a hybrid's Mamba slots, are handed back and reused). One test
drives `taipan generate --model DIR` as a user would (for the Qwen3-MoE: slow, ~15 s).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.random_moe import make_random_nemotron_h_moe, make_random_qwen3_moe, router_margin
from tests.test_ops_moe import hf_greedy

transformers = pytest.importorskip("transformers")
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
LENGTHS = (5, 16, 55, 100, 7, 33)
MODELS = {
    "qwen3_moe": lambda path: make_random_qwen3_moe(path),
    "nemotron_h_moe": lambda path: make_random_nemotron_h_moe(path, "M-*E-ME"),
}


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    return MODELS[request.param](str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Model directories by name, made once (for tests that pick their models)."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = MODELS[name](str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def test_greedy_tokens_equal_hf(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(3)
    config = InferenceConfig(
        block_size_tokens=16,
        max_tokens=48,
        max_requests=4,
        buffer_size_gb=0.05,
        max_sequence_length=256,
        enable_chunked_prefill=True,
    )
    with Runtime(model_dir, config) as rt, Client(rt.address) as c:
        got = [d.token_ids for d in c.generate(prompts, GREEDY)]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    for p, tokens in zip(prompts, want, strict=True):
        assert router_margin(hf, p + tokens) > 1e-5, "test data near a routing tie"
    assert got == want


@pytest.mark.parametrize(
    "name", ["nemotron_h_moe", pytest.param("qwen3_moe", marks=pytest.mark.slow)]
)
def test_cli_generate(made, name):
    """`taipan generate --model DIR`: starts the runtime, prints one JSON row per prompt with
    Hugging Face's greedy tokens."""
    from taipan.ops.tokenizer import Tokenizer

    model_dir = made(name)
    cmd = [sys.executable, "-m", "taipan.cli", "generate", "--model", model_dir, "--json"]
    cmd += ["--prompt", "Hello", "--prompt", "mixture of experts", "--temperature", "0"]
    cmd += ["--max-tokens", "6", "--ignore-eos"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "mixture of experts"]
    assert all(r["finish_reason"] == "length" for r in rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    for r in rows:
        assert r["token_ids"] == hf_greedy(hf, tokenizer.encode(r["prompt"]), 6), r["prompt"]
