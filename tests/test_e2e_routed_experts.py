"""Routed experts end to end (issue 26 item 4): `SamplingParams(return_routed_experts=True)`
through real coordinator and engine processes, the tiny random Qwen3-MoE of
tests/random_moe.py in fp32 on the CPU, against the expert ids Hugging Face's routers choose
for the same tokens (a hook on each `.gate`).

Each completion carries [tokens - 1, MoE layers, top_k] ids (the last token is never run
through the model): equal to Hugging Face's for prompt and generated positions, with chunked
prefill, in a KV pool so small that requests are preempted and recomputed, on a prefix-cache
hit, and with expert parallelism over two ranks. A dense model refuses the option at
submission. The GPU test checks the CUDA graphs' in-place writes on a device.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client, RequestError
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

try:
    from taipan.server.app import build_app
except ImportError:  # (no fastapi, as on the GPU machines: the HTTP test skips)
    build_app = None
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.random_moe import (
    GPU_HEAD_DIM,
    make_random_nemotron_h_moe,
    make_random_qwen3_moe,
    router_margin,
)

transformers = pytest.importorskip("transformers")
NEW = 10
ROUTED = SamplingParams(
    max_tokens=NEW, temperature=0.0, ignore_eos=True, return_routed_experts=True
)
BLOCK = 16
CONFIG = dict(
    block_size_tokens=BLOCK,
    max_tokens=48,  # < the longer prompts: their prefill comes in chunks
    max_requests=4,
    buffer_size_gb=0.05,
    max_sequence_length=256,
    enable_chunked_prefill=True,
)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(directory, Hugging Face model) of the tiny Qwen3-MoE: 3 MoE layers of 8 experts, 2 a
    token."""
    path = make_random_qwen3_moe(str(tmp_path_factory.mktemp("qwen3-moe")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def served(model):
    """The runtime of CONFIG over the model, and a Client of it."""
    with Runtime(model[0], InferenceConfig(**CONFIG)) as rt, Client(rt.address) as c:
        yield rt, c


def hf_routing(hf, ids: list[int]) -> np.ndarray:
    """[len(ids), MoE layers, top_k]: the experts Hugging Face's routers choose for `ids`."""
    chosen = []
    gates = [m for n, m in hf.named_modules() if n.endswith(".gate") and hasattr(m, "top_k")]
    hooks = [g.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(chosen, dim=1).numpy()


def mixed(c: Client, prompts, routed: SamplingParams, plain: SamplingParams) -> list:
    """`prompts` with `routed`, then the first again with `plain`, submitted together (so
    steps hold rows that ask and rows that do not)."""

    async def both():
        return await asyncio.gather(
            c.aio.generate(prompts, routed), c.aio.generate(prompts[:1], plain)
        )

    asked, [not_asked] = c.run(both())
    return [*asked, not_asked]


def assert_equal_hf(hf, prompt: list[int], c) -> None:
    ids = prompt + c.token_ids
    assert router_margin(hf, ids) > 1e-5, "test data near a routing tie"
    got = c.routed_experts
    assert got.dtype == np.int16 and got.shape == (len(ids) - 1, 3, 2)
    assert np.array_equal(got, hf_routing(hf, ids)[: len(ids) - 1])


def test_routed_experts_equal_hf_for_prompt_and_generated_tokens(model, served):
    _, hf = model
    _, c = served
    prompts = _prompts(3, (5, 16, 55, 100))
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    done = mixed(c, prompts, ROUTED, plain)
    deltas = list(c.stream(prompts[2], ROUTED))
    for p, out in zip(prompts, done, strict=False):
        assert_equal_hf(hf, p, out)
    assert done[4].routed_experts is None  # not asked
    assert all(d.routed_experts is None for d in deltas[:-1]) and deltas[-1].finished
    assert np.array_equal(deltas[-1].routed_experts, done[2].routed_experts)


@pytest.mark.asyncio
async def test_generate_over_http_returns_them(model, served):
    """`POST /generate` (token ids in and out) carries them as nested lists, streamed or not."""
    if build_app is None:
        pytest.skip("the HTTP server needs fastapi")
    _, hf = model
    rt, _ = served
    prompt = _prompts(3, (16,))[0]
    ac = AsyncClient(rt.address)
    await ac.connect()
    app = build_app(ac, served_model_name="tiny", api_key="k")
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://t",
        headers={"authorization": "Bearer k"},
        timeout=60,
    )
    params = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    try:
        body = {"input_ids": prompt, "sampling_params": params | {"return_routed_experts": True}}
        one = (await http.post("/generate", json=body)).json()
        streamed = await http.post("/generate", json=body | {"stream": True})
        plain = (await http.post("/generate", json=body | {"sampling_params": params})).json()
    finally:
        await http.aclose()
        await ac.close()
    ids = prompt + one["output_ids"]
    assert one["routed_experts"] == hf_routing(hf, ids)[: len(ids) - 1].tolist()
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x[6:].startswith("{")]
    assert events[-1]["finished"] and events[-1]["routed_experts"] == one["routed_experts"]
    assert all("routed_experts" not in e for e in events[:-1]) and "routed_experts" not in plain


def test_routed_experts_survive_preemption_and_recompute(model):
    path, hf = model
    c = hf.config
    per_block = c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * c.head_dim * 4
    tiny = CONFIG | dict(
        buffer_size_gb=8.5 * per_block / 1024**3,  # 8 blocks for 6 requests of 2-3 blocks
        paused_buffer_size_gb=1.5 * per_block / 1024**3,
        max_tokens=24,
        max_requests=6,
    )
    prompts = _prompts(5, (20, 27, 18, 30, 22, 25))
    sampling = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, return_routed_experts=True
    )
    with Runtime(path, InferenceConfig(**tiny)) as rt, Client(rt.address) as client:
        done = client.generate(prompts, sampling)
        stats = client.stats().ranks[0]
    assert stats.paused_total > 0 and stats.evicted_total > 0, stats
    for p, out in zip(prompts, done, strict=True):
        assert_equal_hf(hf, p, out)


def test_a_prefix_cache_hit_keeps_the_routing_of_the_cached_blocks(model, tmp_path):
    """A request that asks shares cached blocks only with their routing: those a request that
    asked computed, not those cached by one that did not (it recomputes them). Recorded, and
    `taipan replay --check` re-plans the engine's steps from the log."""
    path, hf = model
    [shared, other, tail_a, tail_b] = _prompts(7, (40, 36, 9, 6))
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    config = InferenceConfig(**CONFIG, enable_prefix_caching=True)
    with Runtime(path, config, record_dir=str(tmp_path)) as rt, Client(rt.address) as c:
        [no_routing] = c.generate([other + tail_b], plain)  # caches 2 blocks, no routing
        [first] = c.generate([shared + tail_a], ROUTED)  # caches 3 blocks with it
        [second] = c.generate([shared + tail_b], ROUTED)  # shares 2 of them
        [third] = c.generate([other + tail_a], ROUTED)  # shares none
        [fourth] = c.generate([shared + tail_a], plain)  # (not asking: shares all 3)
    cached = [o.num_cached_tokens for o in (no_routing, first, second, third, fourth)]
    assert cached == [0, 0, 32, 0, 48]
    asked = [(shared + tail_a, first), (shared + tail_b, second), (other + tail_a, third)]
    for prompt, out in asked:
        assert_equal_hf(hf, prompt, out)
    done = subprocess.run(
        [sys.executable, "-m", "taipan.cli", "replay", str(tmp_path), "--check",
         "--actor", "engine-0", "--actor", "allocator-0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "engine-0: ok" in done.stdout, done.stdout + done.stderr


def test_expert_parallel_ranks_return_their_own_tokens_routing(model):
    """EP=2 (gloo): each rank's routers run on its own tokens before the exchange, so its
    requests get their global expert ids."""
    path, hf = model
    prompts = _prompts(3, (5, 55, 16, 100))
    with (
        Runtime(
            path, InferenceConfig(**CONFIG), data_parallel_size=2, expert_parallel_size=2
        ) as rt,
        Client(rt.address) as c,
    ):
        done = c.generate(prompts, ROUTED)
        ranks = c.stats().ranks
    assert all(r.steps_total > 0 for r in ranks)  # both ranks served requests
    for p, out in zip(prompts, done, strict=True):
        assert_equal_hf(hf, p, out)


def test_a_hybrid_with_moe_layers_returns_them(tmp_path):
    """NemotronH with `E` layers (sigmoid grouped routing; Mamba and attention around them):
    the ids of its MoE layers, as a set per token (Hugging Face's top-k is unsorted)."""
    path = make_random_nemotron_h_moe(str(tmp_path / "nh"), "M-*E-ME")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(3, (5, 55))
    with Runtime(path, InferenceConfig(**CONFIG)) as rt, Client(rt.address) as c:
        done = c.generate(prompts, ROUTED)
    for p, out in zip(prompts, done, strict=True):
        ids = p + out.token_ids
        assert router_margin(hf, ids) > 1e-5, "test data near a routing tie"
        want = np.sort(hf_routing(hf, ids)[: len(ids) - 1], axis=-1)
        assert out.routed_experts.shape == (len(ids) - 1, 2, 2)
        assert np.array_equal(np.sort(out.routed_experts, axis=-1), want)


def test_a_model_without_moe_layers_refuses_the_option(tmp_path):
    path = make_random_llama(str(tmp_path / "dense"), TINY_SHAPE)
    with Runtime(path, InferenceConfig(**CONFIG)) as rt, Client(rt.address) as c:
        with pytest.raises(RequestError, match="return_routed_experts needs a mixture-of-experts"):
            c.generate([[1, 2, 3]], ROUTED)
        # (ignore_eos: an unseeded sample may draw EOS first and end after one token)
        plain = SamplingParams(max_tokens=2, ignore_eos=True)
        assert len(c.generate([[1, 2, 3]], plain)[0].token_ids) == 2


@pytest.mark.gpu
def test_cuda_graphs_write_the_routed_experts_in_place(tmp_path):
    """On the GPU, decode steps replay CUDA graphs that wrote the routers' ids into the static
    buffer at capture: the ids must equal the CPU runtime's and Hugging Face's, eager prefill
    and graphed decode steps alike, with a request that does not ask in the same batches."""
    path = make_random_qwen3_moe(str(tmp_path / "m"), head_dim=GPU_HEAD_DIM)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(13, (5, 40, 100))
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = {}
    for device in ("cpu", "cuda"):
        with Runtime(path, InferenceConfig(**CONFIG), device=device) as rt:
            with Client(rt.address) as c:
                got[device] = mixed(c, prompts, ROUTED, plain)
                steps = c.stats().merged()
        if device == "cuda":
            assert steps.steps_graphed > 0  # decode steps ran as CUDA graphs
    for cpu, cuda in zip(got["cpu"][:3], got["cuda"][:3], strict=True):
        assert cuda.token_ids == cpu.token_ids
        assert np.array_equal(cuda.routed_experts, cpu.routed_experts)
    for p, out in zip(prompts, got["cuda"], strict=False):
        assert_equal_hf(hf, p, out)
    assert got["cuda"][3].routed_experts is None


@pytest.mark.parametrize("chain", [1, 4])
def test_speculating_requests_return_the_routing_of_their_accepted_tokens(model, chain):
    """With n-gram drafts (prompts that repeat themselves, so drafts are proposed and some are
    rejected), each position's routing is that of its real token, as Hugging Face's; with
    verify steps chained in the gpu actor (speculative_chain_steps 4) too."""
    path, hf = model
    base = _prompts(7, (9, 12))
    prompts = [p * 3 for p in base]  # (the drafter finds the repeats)
    cfg = InferenceConfig(**CONFIG, num_speculative_tokens=3, speculative_chain_steps=chain)
    with Runtime(path, cfg) as rt, Client(rt.address) as client:
        done = client.generate(prompts, ROUTED)
        stats = client.stats().merged()
    assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert (stats.spec_chains > 0) == (chain > 1), stats
    for p, out in zip(prompts, done, strict=True):
        assert_equal_hf(hf, p, out)
