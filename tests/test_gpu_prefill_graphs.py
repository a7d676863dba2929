"""Prompt chunks in CUDA graphs (`cuda_graph_all_prefills`: mixed graphs up to max_tokens, so
every step of these runs fits one) for the recurrent hybrids, whose chunks start from a slot or
a snapshot and whose last chunk stores the state the next step reads: NemotronH (Mamba2) and
Qwen3-Next (Gated-DeltaNet, MoE layers). Greedy tokens equal Hugging Face's and the cached
prompt tokens are exact; without snapshots no step runs eagerly (with them, a step whose kernels
store a snapshot inside a chunk still does: forward.py `_bucket`). The dense Llama path's prompt
chunks in graphs are tests/test_gpu.py's `test_gpu_graph_steps_equal_eager_steps`.

Why: a step no graph holds pays its launches from Python (~26 ms on a 1B shape), and the
offline bench ran 1.5-1.8x faster with the option on (tests/perf/NOTES.md, twentieth session);
it is off by default until these paths have run with it on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from taipan.actors.config import cuda_graph_sizes
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h
from tests.random_qwen3_next import make_random_qwen3_next
from tests.test_e2e_hybrid import hf_generate
from tests.test_e2e_hybrid_prefix import CACHED, PROMPTS
from tests.test_e2e_hybrid_prefix import slot_bytes as mamba_slot_bytes
from tests.test_e2e_qwen3_next import GPU_SHAPE, run
from tests.test_e2e_qwen3_next import config as qwen3_next_config
from tests.test_e2e_qwen3_next import slot_bytes as gdn_slot_bytes

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _want(path: str) -> tuple[object, dict]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = list(PROMPTS)
    return hf.config, dict(zip(names, hf_generate(hf, [PROMPTS[n] for n in names]), strict=True))


def _all_prefills(cfg):
    cfg = dataclasses.replace(cfg, cuda_graph_all_prefills=True)
    _, mixed = cuda_graph_sizes(cfg, "cuda")
    assert max(mixed) == cfg.max_tokens  # (every step fits a graph)
    return cfg


@pytest.mark.parametrize("snapshots", [8, 0])
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_gpu_hybrid_prompt_chunks_in_graphs_equal_hf(tmp_path, family, snapshots):
    """Snapshots on (8 slots) and off; a tiny random model of each family in fp32."""
    if family == "nemotron_h":
        shape = TINY_HYBRID | {"head_dim": 64}
        path = make_random_nemotron_h(str(tmp_path), pattern="M-*-M-", shape=shape)
        c, want = _want(path)
        slot = mamba_slot_bytes(c)
    else:
        path = make_random_qwen3_next(str(tmp_path), "moe", shape=GPU_SHAPE)
        c, want = _want(path)
        slot = gdn_slot_bytes(c)
    cfg = qwen3_next_config(c, 0, max_tokens=64)  # (its snapshot budget is set below)
    if snapshots:
        budget = (snapshots + 0.5) * slot / 1024**3
        cfg = dataclasses.replace(cfg, prefix_caching_mamba_gb=budget)
    got, cached, stats = run(path, _all_prefills(cfg), device="cuda")
    assert got == want
    assert cached == (CACHED if snapshots else dict.fromkeys(CACHED, 0))
    if snapshots:
        assert stats.steps_graphed > 0 and stats.mamba_restored > 0, stats
    else:
        assert stats.steps_graphed == stats.steps_total > 0, stats
