"""Mamba-state prefix caching end to end (issue 10, DESIGN.md §6): real coordinator and engine
processes (engine, allocator, mamba_cache and gpu actors), a tiny random NemotronH, greedy
tokens against Hugging Face's incremental decoding on the same weights.

The prompts hit every snapshot boundary with block size 16: a block-aligned prompt (snapshots at
its last boundary before the end, 32, and at its end, 48), its extension (restores the final
state), a prompt sharing 2.5 blocks (restores 32), one sharing 1.25 blocks (no snapshot there:
its KV divergence point 16 is snapshotted) and one that then restores it, and an identical
prompt (restores 32, computes the last block). "Staggered" sends them in three waves, so that
the later waves restore (several prefills restoring state in one step); "simultaneous" sends
them at once. Every configuration must give the same tokens as HF: Mamba snapshots on and off,
chunk budgets of 24 and 64 tokens, and a KV pool so small that requests pause and are evicted
(and with them KV blocks whose eviction invalidates snapshots) next to a roomy one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.random_nemotron_h import make_random_nemotron_h
from tests.test_e2e_hybrid import hf_generate

transformers = pytest.importorskip("transformers")
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BS = 16


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


BASE = _tokens(1, 48)  # 3 blocks
PROMPTS = {
    "aligned": BASE,
    "extension": BASE + _tokens(2, 10),
    "shares_40": BASE[:40] + _tokens(3, 9),
    "shares_20": BASE[:20] + _tokens(4, 30),
    "identical": list(BASE),
    "after_divergence": BASE[:20] + _tokens(5, 25),
}
WAVES = (("aligned",), ("extension", "shares_40", "shares_20", "identical"), ("after_divergence",))
# Prompt tokens each skips in the staggered order with snapshots on (and a roomy pool):
# the final state of "aligned" at 48, its last boundary 32, the divergence point 16.
CACHED = {
    "aligned": 0,
    "extension": 48,
    "shares_40": 32,
    "shares_20": 0,
    "identical": 32,
    "after_divergence": 16,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_nemotron_h(str(tmp_path_factory.mktemp("nh")), pattern="M-*-M-")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = list(PROMPTS)
    want = dict(zip(names, hf_generate(hf, [PROMPTS[n] for n in names]), strict=True))
    return path, hf.config, want


def slot_bytes(c) -> int:
    """One Mamba slot (conv + SSM state of every Mamba layer, fp32), as the worker sizes it."""
    conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    conv = (c.conv_kernel - 1) * conv_dim * 4
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4
    return c.hybrid_override_pattern.count("M") * (conv + ssm)


def block_bytes(c) -> int:
    return c.hybrid_override_pattern.count("*") * 2 * BS * c.num_key_value_heads * c.head_dim * 4


def config(c, *, snapshots: int, max_tokens: int, pressure: bool) -> InferenceConfig:
    gib = 1024**3
    extra = {}
    if snapshots:
        extra["prefix_caching_mamba_gb"] = (snapshots + 0.5) * slot_bytes(c) / gib
    if pressure:  # 8 blocks; paused requests may hold one before the oldest is evicted
        extra["buffer_size_gb"] = 8.5 * block_bytes(c) / gib
        extra["paused_buffer_size_gb"] = 1.5 * block_bytes(c) / gib
    return InferenceConfig(
        **{
            "block_size_tokens": BS,
            "max_tokens": max_tokens,
            "max_requests": 4,
            "buffer_size_gb": 0.05,
            "max_sequence_length": 256,
            "enable_prefix_caching": True,
            # With snapshots chunked prefill comes on by itself (chunks end on boundaries).
            "enable_chunked_prefill": not snapshots,
            **extra,
        }
    )


def run(path, cfg: InferenceConfig, staggered: bool, record_dir=None):
    """{prompt name: (tokens, cached prompt tokens)} and the rank's stats."""
    out = {}
    with Runtime(path, cfg, record_dir=record_dir) as rt, Client(rt.address) as c:
        waves = WAVES if staggered else (tuple(n for w in WAVES for n in w),)
        for wave in waves:
            done = c.generate([PROMPTS[n] for n in wave], GREEDY)
            out |= {n: (d.token_ids, d.num_cached_tokens) for n, d in zip(wave, done, strict=True)}
        [stats] = c.stats().ranks
    return out, stats


def check(got, want) -> None:
    assert {n: t for n, (t, _) in got.items()} == want


def test_snapshots_restore_at_every_boundary_with_exact_counters(model):
    """Staggered, roomy pool, snapshots on: outputs equal HF and each request skips exactly
    k * 16 prompt tokens (its deepest snapshot), so it computes len - k * 16."""
    path, c, want = model
    got, stats = run(path, config(c, snapshots=8, max_tokens=24, pressure=False), True)
    check(got, want)
    assert {n: cached for n, (_, cached) in got.items()} == CACHED
    assert stats.prefix_cached_tokens == sum(CACHED.values())
    # Four prefills restored; snapshots: "aligned" at 32 and 48, "shares_40" at 48 (its own
    # third block), "shares_20" at 16 and 48, "after_divergence" at 32 (its own second block);
    # all still held (8 slots), and every live slot is free again.
    assert stats.mamba_restored == 4
    assert stats.mamba_snapshots_taken == stats.mamba_snapshots == 6
    assert stats.mamba_live_free == 4
    total = sum(len(p) for p in PROMPTS.values())
    assert stats.prefix_prompt_tokens == total


def test_without_snapshots_hybrids_share_kv_but_skip_nothing(model):
    path, c, want = model
    got, stats = run(path, config(c, snapshots=0, max_tokens=24, pressure=False), True)
    check(got, want)
    assert all(cached == 0 for _, cached in got.values()) and stats.prefix_cached_tokens == 0


@pytest.mark.parametrize(
    "snapshots,max_tokens,pressure,staggered",
    [
        (8, 64, True, True),
        (1, 24, False, True),  # one snapshot slot: LRU evictions between the waves
        (8, 24, True, False),
        pytest.param(0, 64, True, False, marks=pytest.mark.slow),
        pytest.param(8, 64, False, False, marks=pytest.mark.slow),
        pytest.param(2, 24, True, True, marks=pytest.mark.slow),
        pytest.param(0, 24, True, True, marks=pytest.mark.slow),
        pytest.param(8, 24, False, False, marks=pytest.mark.slow),
    ],
)
def test_every_configuration_gives_the_same_tokens(
    model, snapshots, max_tokens, pressure, staggered
):
    path, c, want = model
    cfg = config(c, snapshots=snapshots, max_tokens=max_tokens, pressure=pressure)
    got, stats = run(path, cfg, staggered)
    check(got, want)
    if pressure:
        assert stats.paused_total > 0, stats
    if not snapshots:
        assert stats.prefix_cached_tokens == 0


def test_snapshot_budget_too_small_for_one_slot_is_a_clear_error(model):
    path, c, _ = model
    cfg = config(c, snapshots=0, max_tokens=24, pressure=False)
    cfg = dataclasses.replace(cfg, prefix_caching_mamba_gb=0.5 * slot_bytes(c) / 1024**3)
    with pytest.raises(Exception, match="holds no Mamba snapshot slot"):
        with Runtime(path, cfg):
            pass


def test_a_state_config_that_is_not_the_models_fails_the_start(model):
    """mamba_inference_state_config reaches the gpu worker: a chunk size the model does not
    have stops the start, naming the key."""
    path, c, _ = model
    cfg = config(c, snapshots=0, max_tokens=24, pressure=False)
    cfg = dataclasses.replace(cfg, mamba_inference_state_config={"mamba_chunk_size": 128})
    with pytest.raises(Exception, match="mamba_inference_state_config.mamba_chunk_size"):
        with Runtime(path, cfg):
            pass


def test_replay_check_re_drives_the_mamba_cache_actor(model, tmp_path):
    path, c, _ = model
    cfg = config(c, snapshots=2, max_tokens=24, pressure=True)
    run(path, cfg, True, record_dir=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "taipan.cli",
            "replay",
            str(tmp_path),
            "--check",
            "--allow-unchecked",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for actor in ("engine-0", "allocator-0", "mamba_cache-0"):
        assert f"{actor}: ok" in done.stdout, done.stdout


def test_weight_update_between_rollouts_drops_the_snapshots(model, tmp_path):
    """An RL loop on a hybrid: pause, suspend, update_weights from another checkpoint of the
    same shape, resume, unpause. The repeated prompts then get the new model's tokens (HF on
    the new weights) and no cached prefix (the hash salt moved; the snapshots were dropped),
    and a later wave restores again, from snapshots taken under the new weights."""
    path, c, want = model
    other = make_random_nemotron_h(str(tmp_path / "other"), pattern="M-*-M-", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    names = ["aligned", "identical"]
    want_new = hf_generate(hf, [PROMPTS[n] for n in names])
    cfg = config(c, snapshots=4, max_tokens=64, pressure=False)
    with Runtime(path, cfg) as rt, Client(rt.address) as client:
        first = client.generate([PROMPTS["aligned"]], GREEDY)[0]
        assert first.token_ids == want["aligned"]
        client.pause()
        client.suspend("persist")
        assert client.update_weights(path=other).weight_version == 1
        client.resume()
        client.unpause()
        again = client.generate([PROMPTS["aligned"]], GREEDY)[0]
        assert again.token_ids == want_new[0] and again.num_cached_tokens == 0
        later = client.generate([PROMPTS["identical"]], GREEDY)[0]
        assert later.token_ids == want_new[1] and later.num_cached_tokens == 32
