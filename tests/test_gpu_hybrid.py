"""Hybrid (NemotronH) models through the whole runtime on the GPU (marker `gpu`): the Triton
Mamba and attention kernels, CUDA graphs and overlapping steps (the defaults on CUDA), Mamba
snapshots on and off. A tiny random hybrid in fp32 (head_dim 64: the attention kernels take 64
or 128); the prompts and waves of tests/test_e2e_hybrid_prefix.py hit every snapshot boundary.
Greedy tokens must equal Hugging Face's (its torch path on the CPU), with snapshots on and off,
and the exact counters must hold with snapshots on."""

from __future__ import annotations

import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h
from tests.test_e2e_hybrid import hf_generate
from tests.test_e2e_hybrid_prefix import BS, CACHED, GREEDY, PROMPTS, WAVES, slot_bytes

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_random_nemotron_h(
        str(tmp_path_factory.mktemp("nh")), pattern="M-*-M-", shape=TINY_HYBRID | {"head_dim": 64}
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = list(PROMPTS)
    want = dict(zip(names, hf_generate(hf, [PROMPTS[n] for n in names]), strict=True))
    return path, hf.config, want


@pytest.mark.parametrize("snapshots", [8, 0])
def test_gpu_hybrid_greedy_equals_hf_with_and_without_snapshots(hybrid, snapshots):
    path, c, want = hybrid
    config = InferenceConfig(
        block_size_tokens=BS,
        max_tokens=64,
        max_requests=4,
        buffer_size_gb=0.05,
        max_sequence_length=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=not snapshots,
        prefix_caching_mamba_gb=(snapshots + 0.5) * slot_bytes(c) / 1024**3 if snapshots else None,
    )
    got, cached = {}, {}
    with Runtime(path, config, device="cuda") as rt, Client(rt.address) as client:
        for wave in WAVES:
            done = client.generate([PROMPTS[n] for n in wave], GREEDY)
            for n, d in zip(wave, done, strict=True):
                got[n], cached[n] = d.token_ids, d.num_cached_tokens
        [stats] = client.stats().ranks
    assert got == want
    assert stats.steps_graphed > 0  # decode steps ran as CUDA graphs
    if snapshots:
        assert cached == CACHED
    else:
        assert set(cached.values()) == {0}
