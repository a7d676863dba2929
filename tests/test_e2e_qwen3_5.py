"""Qwen3.5 text models served end to end (as tests/test_e2e_qwen3_next.py): real coordinator
and engine processes, a tiny random Qwen3_5ForCausalLM (split GDN projections, text "mrope",
an MTP tensor the loader skips), greedy tokens against Hugging Face's incremental decoding on
the same weights, with recurrent snapshots on (each request skips exactly its deepest
snapshot's tokens) and off (nothing skipped). The MoE variant and T = 2 are slow. With a
random MTP head added, its drafts served (speculative_method "mtp").
"""

from __future__ import annotations

import pytest
import torch

from tests.random_qwen3_5 import make_random_qwen3_5
from tests.random_qwen3_next import add_mtp_head
from tests.test_e2e_hybrid import hf_generate
from tests.test_e2e_hybrid_prefix import CACHED, PROMPTS
from tests.test_e2e_qwen3_next import config, run

transformers = pytest.importorskip("transformers")


def _model(tmp_path_factory, kind: str, mtp_head: bool = False):
    path = make_random_qwen3_5(str(tmp_path_factory.mktemp("q35")), kind)
    if mtp_head:  # (a random MTP head in Qwen3.5's `mtp.*` names)
        add_mtp_head(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = list(PROMPTS)
    want = dict(zip(names, hf_generate(hf, [PROMPTS[n] for n in names]), strict=True))
    return path, hf.config, want


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _model(tmp_path_factory, "dense")


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_snapshots_on_equal_off_and_hf(dense):
    path, c, want = dense
    got, cached, stats = run(path, config(c, snapshots=8))
    assert got == want
    assert cached == CACHED and stats.mamba_restored == 4
    got, cached, stats = run(path, config(c, snapshots=0))
    assert got == want
    assert set(cached.values()) == {0} and stats.prefix_cached_tokens == 0


@pytest.mark.slow
def test_moe_with_snapshots_equals_hf(tmp_path_factory):
    path, c, want = _model(tmp_path_factory, "moe")
    got, cached, _ = run(path, config(c, snapshots=8))
    assert got == want and cached == CACHED


@pytest.mark.slow
def test_tp2_with_snapshots_equals_hf(dense):
    from tests.test_e2e_tp_hybrid import per_peer

    path, c, want = dense
    got, cached, _ = run(path, per_peer(config(c, snapshots=8), 2), tensor_parallel_size=2)
    assert got == want and cached == CACHED


def test_dense_with_its_mtp_head_drafting_equals_hf(tmp_path_factory):
    """speculative_method "mtp" on a Qwen3.5 checkpoint with a (random) head: the head loads
    from Qwen3.5's `mtp.*`, drafts are verified every step, the tokens are Hugging Face's."""
    path, c, want = _model(tmp_path_factory, "dense", mtp_head=True)
    cfg = config(c, snapshots=8, num_speculative_tokens=3, speculative_method="mtp")
    got, cached, stats = run(path, cfg)
    assert got == want and cached == CACHED
    assert stats.spec_verify_rows > 0
