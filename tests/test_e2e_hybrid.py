"""Hybrid (NemotronH) models served end to end (issue 10, step 2): real coordinator and engine
processes, real sockets, a tiny random NemotronH saved with `save_pretrained`, greedy tokens
against Hugging Face's incremental decoding on the same weights (see `hf_generate`).

Every layer pattern of the issue runs with chunked prefill and more prompts than request slots
(so Mamba state slots are handed back and reused); one runtime adds a tiny KV pool (requests
pause and are evicted, then recompute from position 0 with fresh Mamba state), KV prefix
caching (hybrids share KV blocks but skip nothing without Mamba snapshots), suspend / resume in
every mode mid-generation, and `taipan replay --check` over the recorded session.
"""

from __future__ import annotations

import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.random_nemotron_h import PATTERNS, make_random_nemotron_h
from tests.replay_check import replay_check
from tests.test_e2e_lifecycle import suspended_in_each_mode

transformers = pytest.importorskip("transformers")
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
LENGTHS = (5, 16, 55, 100, 7, 33)  # shorter than, equal to, several times mamba_chunk_size


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


def hf_generate(hf, prompts: list[list[int]]) -> list[list[int]]:
    """Hugging Face greedy decoding through its own cache: the prompt in one forward, then one
    token at a time (its forward agrees with its full-sequence forward to ~1e-6). Not
    `generate()`: on transformers 5.23 its logits for a NemotronH differ from the model's own
    forward (by ~0.04 for a 33-token prompt of these models), which flips close greedy picks."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = hf(torch.tensor([p]), use_cache=True)
            cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
            while len(tokens) < NEW:
                out = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs


def _model(tmp_path_factory, pattern: str):
    path = make_random_nemotron_h(str(tmp_path_factory.mktemp("nh")), pattern=pattern)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _config(**extra) -> InferenceConfig:
    base = dict(
        block_size_tokens=16,
        max_tokens=48,
        max_requests=4,
        buffer_size_gb=0.05,
        max_sequence_length=256,
        enable_chunked_prefill=True,
    )
    return InferenceConfig(**(base | extra))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_tokens_equal_hf_generate(tmp_path_factory, pattern):
    path, hf = _model(tmp_path_factory, pattern)
    prompts = _prompts(len(pattern))
    with Runtime(path, _config()) as rt, Client(rt.address) as c:
        got = [d.token_ids for d in c.generate(prompts, GREEDY)]
    assert got == hf_generate(hf, prompts)


@pytest.fixture(scope="module")
def pressured(tmp_path_factory):
    """A recorded hybrid runtime with a KV pool of 8 blocks of 16 tokens, prefix caching on."""
    path, hf = _model(tmp_path_factory, "M-M-*-M-M-*-")
    rec = tmp_path_factory.mktemp("hybrid-rec")
    c = hf.config  # one KV block: K and V of each attention layer, fp32
    block_bytes = c.hybrid_override_pattern.count("*") * 2 * 16 * c.num_key_value_heads * 16 * 4
    config = _config(
        buffer_size_gb=8.5 * block_bytes / 1024**3,
        max_tokens=24,
        max_requests=6,
        paused_buffer_size_gb=1.5 * block_bytes / 1024**3,  # paused hold 1 block: evictions
        enable_prefix_caching=True,
        logging_step_interval=5,
    )
    rt = Runtime(path, config, record_dir=str(rec))
    with rt, Client(rt.address) as client:
        yield rt, client, hf, rec


def test_kv_pressure_and_prefix_sharing_equal_hf(pressured):
    """Six requests in 8 blocks: they pause and are evicted (recomputed from position 0, with
    fresh Mamba state). Half share a 32-token prefix: they share its KV blocks but, without
    Mamba snapshots, compute every token (nothing counts as cached)."""
    rt, c, hf, _ = pressured
    shared = _prompts(1, (32,))[0]
    prompts = _prompts(2, (20, 40, 9))
    prompts += [shared + t for t in _prompts(3, (5, 17, 1))]
    done = c.generate(prompts, GREEDY)
    assert [d.token_ids for d in done] == hf_generate(hf, prompts)
    assert all(d.num_cached_tokens == 0 for d in done)
    [stats] = c.stats().ranks
    assert stats.paused_total > 0 and stats.evicted_total > 0, stats
    assert stats.prefix_cached_tokens == 0


@pytest.mark.asyncio
async def test_suspend_in_each_mode_keeps_or_recomputes_mamba_state(pressured):
    rt, _, hf, _ = pressured
    prompts = _prompts(4, (30, 12))
    want = hf_generate(hf, prompts)
    sampling = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = await suspended_in_each_mode(rt.address, sampling, prompts)
    for mode, got in outs.items():
        assert got == want, mode


def test_replay_check_covers_the_hybrid_session(pressured):
    rt, c, _, rec = pressured
    c.generate(_prompts(5, (21, 44)), GREEDY)
    rt.shutdown()
    out = replay_check(rec)
    assert "engine-0: ok" in out and "allocator-0: ok" in out
