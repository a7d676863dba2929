"""Prefix caching on the GPU hot path (marker `gpu`): the random SmolLM2-shaped Llama of
tests/test_gpu.py in fp32, CUDA graphs and overlapping steps on (the defaults), greedy outputs
with prefix caching equal Hugging Face's for prompts that share block-aligned and unaligned
prefixes, exact duplicates and prefixes diverging inside a block; under KV pressure (every
pause evicts) and across suspend modes, including "recompute", which drops the cache."""

from __future__ import annotations

import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.test_gpu import CONFIG, _blocks_gb, _hf_greedy, model_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu
BS = CONFIG["block_size_tokens"]
SAMPLING = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    system = [(37 * i + 11) % 200 + 20 for i in range(4 * BS)]  # 4 complete blocks
    tails = [[(13 * i + 7 * k) % 200 + 20 for i in range(5 + 3 * k)] for k in range(3)]
    return [
        system + tails[0],
        system + tails[1],
        system,  # block-aligned: a full match once cached
        system,
        system + tails[0],
        system[: 3 * BS + 5] + tails[2],  # diverges inside block 4
        system[:40] + tails[1],  # diverges inside block 3
        tails[2],
    ]


@pytest.mark.parametrize(
    "extra",
    [
        dict(prefix_caching_eviction_policy="lru"),
        dict(prefix_caching_eviction_policy="ref_zero", overlap_steps=False),
        dict(
            enable_chunked_prefill=True,
            max_tokens=64,
            buffer_size_gb=_blocks_gb(9, 4),
            paused_buffer_size_gb=0.0,
        ),
    ],
    ids=["lru", "ref_zero-serial", "pressure-chunked"],
)
def test_gpu_prefix_caching_keeps_greedy_outputs(model_dir, extra):  # noqa: F811
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = prompts()
    want = _hf_greedy(model_dir, torch.float32, ps, SAMPLING.max_tokens)
    config = InferenceConfig(**dict(CONFIG, **extra), enable_prefix_caching=True)
    with Runtime(model_dir, config, device="cuda") as rt, Client(rt.address) as c:
        first = c.generate(ps[:1], SAMPLING) + c.generate(ps[1:], SAMPLING)  # staggered
        again = c.generate(ps, SAMPLING)  # all at once, warm cache
        [stats] = c.stats().ranks
    assert [d.token_ids for d in first] == want
    assert [d.token_ids for d in again] == want
    assert stats.prefix_cached_tokens > 0 and stats.steps_graphed > 0
    if "buffer_size_gb" in extra:
        assert stats.evicted_total > 0, stats
    else:  # (ref_zero: the first request's blocks went when it finished; the second
        # request caches them again and the next two share them)
        lru = extra["prefix_caching_eviction_policy"] == "lru"
        assert [d.num_cached_tokens for d in first][1:4] == [64 if lru else 0, 63, 63]


@pytest.fixture(scope="module")
def prefix_runtime(model_dir):  # noqa: F811
    """Started outside the test's event loop (Runtime is synchronous)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    config = InferenceConfig(**CONFIG, enable_prefix_caching=True)
    with Runtime(model_dir, config, device="cuda") as rt:
        yield rt


@pytest.mark.asyncio
async def test_gpu_prefix_caching_across_suspend_modes(model_dir, prefix_runtime):  # noqa: F811
    import torch

    from tests.test_e2e_lifecycle import suspended_in_each_mode

    ps = prompts()
    want = _hf_greedy(model_dir, torch.float32, ps, SAMPLING.max_tokens)
    outs = await suspended_in_each_mode(prefix_runtime.address, SAMPLING, ps)
    async with AsyncClient(prefix_runtime.address) as c:
        [stats] = (await c.stats()).ranks
    assert outs == {"persist": want, "offload": want, "recompute": want}
    assert stats.prefix_cached_tokens > 0
