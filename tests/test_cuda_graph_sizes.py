"""CUDA graph sizing (actors/config.cuda_graph_sizes) and bucket choice (actors/gpu/graphs.py):
pure functions, checked on CPU. Capture and replay run on the device: tests/test_gpu.py."""

from __future__ import annotations

import pytest

from taipan.actors.config import ConfigError, InferenceConfig, cuda_graph_sizes
from taipan.actors.gpu.graphs import Bucket, StepGraphs


def sizes(device="cuda", **fields):
    return cuda_graph_sizes(InferenceConfig(**fields), device)


def test_default_is_exponential_up_to_max_requests_then_max_tokens():
    decode, mixed = sizes(max_requests=128, max_tokens=512)
    assert decode == (1, 2, 4, 8, 16, 32, 64, 128)
    assert mixed == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # prompt chunks too, by default


def test_exponential_halves_rounding_up_and_keeps_the_bound():
    decode, _ = sizes(max_requests=100)
    assert decode == (1, 2, 4, 7, 13, 25, 50, 100)


def test_linear_spacing_as_the_seed_describes():
    decode, mixed = sizes(
        max_requests=64, max_tokens=600, cuda_graph_sizing_distribution="linear",
        cuda_graph_all_prefills=True, cuda_graph_mixed_prefill_count=None,
    )  # fmt: skip
    assert decode == (1, 2, 4, *range(8, 65, 8))
    assert mixed == (1, 2, 4, *range(8, 256, 8), *range(256, 600, 16), 600)


def test_all_prefills_extends_mixed_graphs_to_max_tokens():
    _, mixed = sizes(max_requests=8, max_tokens=64, cuda_graph_all_prefills=True)
    assert mixed == (1, 2, 4, 8, 16, 32, 64)
    _, mixed = sizes(max_requests=8, max_tokens=64, cuda_graph_all_prefills=False)
    assert mixed == (1, 2, 4, 8)  # the seed's default: mixed graphs as decode ones


def test_counts_cap_each_kind_keeping_the_largest():
    decode, mixed = sizes(max_requests=128, num_cuda_graphs=3, cuda_graph_mixed_prefill_count=2)
    assert decode == (1, 16, 128) and mixed == (1, 16384)  # (max_tokens: all prefills)
    decode, mixed = sizes(max_requests=128, num_cuda_graphs=1, cuda_graph_mixed_prefill_count=0)
    assert decode == (128,) and mixed == ()


def test_zero_graphs_or_no_non_decode_graphs():
    assert sizes(num_cuda_graphs=0) == ((), ())
    decode, mixed = sizes(max_requests=4, use_cuda_graphs_for_non_decode_steps=False)
    assert decode == (1, 2, 4) and mixed == ()


def test_cpu_has_no_graphs_and_refuses_graph_fields_by_name():
    assert sizes("cpu") == ((), ())
    assert sizes("cpu", num_cuda_graphs=0) == ((), ())  # the explicit off is fine anywhere
    for field, value in [
        ("num_cuda_graphs", 4),
        ("cuda_graph_mixed_prefill_count", 2),
        ("cuda_graph_sizing_distribution", "linear"),
        ("use_cuda_graphs_for_non_decode_steps", False),
        ("cuda_graph_all_prefills", False),
    ]:
        with pytest.raises(ConfigError, match=f"{field}.*CUDA graphs need a CUDA device"):
            sizes("cpu", **{field: value})


def test_launcher_refuses_graph_fields_on_cpu_before_starting_anything():
    from taipan.launcher import Runtime

    with pytest.raises(ConfigError, match="num_cuda_graphs"):
        Runtime("smollm2", InferenceConfig(num_cuda_graphs=4), device="cpu")


@pytest.mark.parametrize("field", ["num_cuda_graphs", "cuda_graph_mixed_prefill_count"])
def test_negative_counts_are_refused(field):
    with pytest.raises(ConfigError, match=f"{field} must be >= 0"):
        InferenceConfig(**{field: -1})


def test_static_kv_pointers_need_persist_mode():
    InferenceConfig(static_kv_memory_pointers=True)
    InferenceConfig(static_kv_memory_pointers=True, kv_cache_management_mode="persist")
    for mode in ("offload", "recompute"):
        with pytest.raises(ConfigError, match="static_kv_memory_pointers.*persist"):
            InferenceConfig(static_kv_memory_pointers=True, kv_cache_management_mode=mode)


def test_pick_takes_the_smallest_bucket_that_holds_the_step():
    graphs = StepGraphs((1, 2, 4, 8), (4, 16, 64), max_requests=8)
    assert graphs.pick(3, 3, all_decode=True) == Bucket(4, 4, True)
    assert graphs.pick(8, 8, all_decode=True) == Bucket(8, 8, True)
    # More decode rows than the largest decode graph holds: a mixed one takes them.
    capped = StepGraphs((1, 2), (4, 16), max_requests=8)
    assert capped.pick(3, 3, all_decode=True) == Bucket(4, 4, False)
    # Mixed steps: tokens and sequences both fit (mixed graphs hold min(max_requests, n) rows).
    assert graphs.pick(5, 2, all_decode=False) == Bucket(16, 8, False)
    assert graphs.pick(4, 4, all_decode=False) == Bucket(4, 4, False)
    assert graphs.pick(64, 8, all_decode=False) == Bucket(64, 8, False)
    assert graphs.pick(65, 3, all_decode=False) is None  # eager above the largest
    assert StepGraphs((), (), max_requests=8).pick(1, 1, all_decode=True) is None
