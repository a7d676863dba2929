"""GPU runs of the whole runtime (marker `gpu`): skipped without CUDA, run on the lent device.

The model is a random-weight Llama with SmolLM2-135M's shape (the GGUF cannot travel to the
device); correctness is checked against Hugging Face transformers on the same GPU.
"""

from __future__ import annotations

import pytest

from messages.requests import SamplingParams
from runtime.client import Client
from runtime.config import InferenceConfig
from runtime.launcher import Runtime

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
CONFIG = dict(
    block_size_tokens=16,
    max_tokens=512,
    max_requests=32,
    buffer_size_gb=2,
    max_sequence_length=1024,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.random_llama import make_random_llama

    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")))


def _hf_greedy(model_dir, dtype, prompt_ids, n):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids], device="cuda")
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def _ours(model_dir, dtype, n):
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with Runtime(model_dir, InferenceConfig(**CONFIG), device="cuda", dtype=dtype) as rt:
        with Client(rt.address) as c:
            done = c.generate(PROMPTS, sampling)
    return [d.prompt_token_ids for d in done], [d.token_ids for d in done]


def test_gpu_fp32_greedy_matches_hf(model_dir):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    prompt_ids, ours = _ours(model_dir, "float32", 24)
    assert ours == _hf_greedy(model_dir, torch.float32, prompt_ids, 24)


def test_gpu_bf16_first_tokens_agree_with_hf(model_dir):
    import torch

    prompt_ids, ours = _ours(model_dir, "bfloat16", 8)
    hf = _hf_greedy(model_dir, torch.bfloat16, prompt_ids, 8)
    first = sum(a[0] == b[0] for a, b in zip(ours, hf, strict=True))
    assert first >= len(PROMPTS) - 1, (ours, hf)  # bf16 rounding may flip a near-tie
