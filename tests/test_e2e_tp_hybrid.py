"""Tensor-parallel serving of a NemotronH hybrid through real processes: CPU, gloo, fp32.

The tiny random hybrid of tests/test_e2e_hybrid_prefix.py ("M-*-M-": 8 Mamba heads in 2
groups, 4 attention heads over 2 kv heads, all split over 2 peers) served with
`tensor_parallel_size=2` (the engine process's gpu actor leads, one tp-follower child), prefix
caching with Mamba snapshots on: the prompts and waves of that module hit every snapshot
boundary, so each peer snapshots and restores its own shard of the state. Greedy tokens equal
T = 1's and Hugging Face's, and both sizes skip exactly the same prompt tokens (the counters of
the mamba_cache actor, which sized its slots from the leader's ModelLoaded, agree). A second
case adds a KV pool so small that requests pause and are evicted. A gpu-marked test runs
T = 2 over NCCL with CUDA graphs against T = 1 on 2 GPUs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from taipan.client import Client
from taipan.launcher import Runtime
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h
from tests.test_e2e_hybrid import hf_generate
from tests.test_e2e_hybrid_prefix import CACHED, GREEDY, PROMPTS, WAVES, config

transformers = pytest.importorskip("transformers")


def hybrid_and_want(root, shape: dict) -> tuple[str, object, dict]:
    path = make_random_nemotron_h(str(root / "nh"), pattern="M-*-M-", shape=shape)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = list(PROMPTS)
    want = dict(zip(names, hf_generate(hf, [PROMPTS[n] for n in names]), strict=True))
    return path, hf.config, want


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hybrid_and_want(tmp_path_factory.mktemp("tp-hybrid-e2e"), TINY_HYBRID)


def per_peer(cfg, size: int):
    """`cfg` with its memory budgets (per process) cut by `size`: a peer's KV block and Mamba
    slot take 1/size of T = 1's bytes, so each peer then holds T = 1's block and slot counts."""
    budgets = ("buffer_size_gb", "paused_buffer_size_gb", "prefix_caching_mamba_gb")
    cut = {f: getattr(cfg, f) / size for f in budgets if getattr(cfg, f) is not None}
    return dataclasses.replace(cfg, **cut)


def serve_waves(path: str, cfg, size: int, **runtime) -> tuple[dict, object]:
    """{prompt name: (tokens, cached prompt tokens)} over the staggered waves, and the rank's
    stats, served at tensor-parallel size `size` (with T = 1's block and slot counts)."""
    got = {}
    cfg = per_peer(cfg, size)
    with Runtime(path, cfg, tensor_parallel_size=size, **runtime) as rt, Client(rt.address) as c:
        for wave in WAVES:
            done = c.generate([PROMPTS[n] for n in wave], GREEDY)
            got |= {n: (d.token_ids, d.num_cached_tokens) for n, d in zip(wave, done, strict=True)}
        [stats] = c.stats().ranks
    return got, stats


def check_sizes(path, cfg, want, exact: bool = True, **runtime) -> dict:
    """T = 2 against T = 1 (and Hugging Face): the same tokens, and (`exact`) the same skipped
    prompt tokens and Mamba cache counters. Both sizes' stats. Under KV pressure which request
    pauses or is evicted depends on when each arrives (a step may start between two of one
    wave), so there only the tokens must agree."""
    (one, one_stats), (two, two_stats) = (
        serve_waves(path, cfg, size, **runtime) for size in (1, 2)
    )
    assert {n: t for n, (t, _) in two.items()} == {n: t for n, (t, _) in one.items()} == want
    if not exact:
        return one_stats, two_stats
    assert {n: c for n, (_, c) in two.items()} == {n: c for n, (_, c) in one.items()}
    counters = ("prefix_cached_tokens", "mamba_restored", "mamba_snapshots_taken", "paused_total")
    assert {f: getattr(two_stats, f) for f in counters} == {
        f: getattr(one_stats, f) for f in counters
    }
    return two, two_stats


def test_tp2_hybrid_with_mamba_snapshots_equals_tp1(model):
    path, c, want = model
    got, stats = check_sizes(path, config(c, snapshots=8, max_tokens=24, pressure=False), want)
    assert {n: cached for n, (_, cached) in got.items()} == CACHED
    assert stats.mamba_restored == 4 and stats.mamba_snapshots_taken == 6


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_tp2_hybrid_under_kv_pressure_equals_tp1(model):
    """Chunk budget 64, a pool of 8 blocks: requests pause and are evicted, and evicted KV
    blocks invalidate their snapshots, on both sizes; the tokens stay T = 1's."""
    path, c, want = model
    cfg = config(c, snapshots=8, max_tokens=64, pressure=True)
    for stats in check_sizes(path, cfg, want, exact=False):
        assert stats.paused_total > 0


@pytest.mark.gpu
def test_gpu_nccl_tp2_hybrid_with_cuda_graphs_equals_tp1(tmp_path):
    """Two GPUs over NCCL, fp32: the Triton Mamba kernels on each peer's shard, CUDA graphs
    that captured the Mamba out_proj's all-reduce; tokens and counters equal T = 1's on one
    GPU (and Hugging Face's), decode steps graphed."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    path, c, want = hybrid_and_want(tmp_path, TINY_HYBRID | {"head_dim": 64})  # kernels: 64/128
    got, stats = check_sizes(
        path, config(c, snapshots=8, max_tokens=64, pressure=False), want, device="cuda"
    )
    assert {n: cached for n, (_, cached) in got.items()} == CACHED
    assert stats.steps_graphed > 0
