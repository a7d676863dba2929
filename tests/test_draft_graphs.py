"""A draft model's forwards through its static graph buffers (actors/gpu/draft_graphs.py) against
the eager ones (actors/gpu/draft.py), on the CPU: the bodies the CUDA graphs record, run as they
are over padded buckets. A tiny random Llama drafts for itself; two DraftModels with KV caches
of their own, one eager and one through the buffers, take the same plans (a prefill, then
verify rows beside a plain decode row that reads the previous step's sampled token, then a
step of plain decode rows): the same drafts, the same KV caches. The CUDA capture and replay:
tests/test_e2e_speculative_draft.py's GPU test."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from taipan.actors.gpu.draft import DraftModel
from taipan.actors.gpu.draft_graphs import DraftGraphs, draft_graph_sizes
from taipan.ops.loader import load_model
from taipan.ops.models.llama import allocate_kv_cache
from taipan.ops.parallel import SINGLE
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_ops_logprobs import Seq, make_plan

BLOCK = 16
NUM_BLOCKS = 12


def test_bucket_sizes_hold_verify_rows_as_two():
    assert draft_graph_sizes((1, 2, 4, 8), max_requests=8) == (1, 2, 4, 8, 16)
    assert draft_graph_sizes((1, 8), max_requests=4) == (1, 2, 8)
    assert draft_graph_sizes((), max_requests=4) == ()
    assert draft_graph_sizes((1, 64, 128, 256), max_requests=256) == (1, 2, 64, 128)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_llama(str(tmp_path_factory.mktemp("draft-graphs") / "m"), TINY_SHAPE)
    model, config, _ = load_model(path, dtype=torch.float32, device="cpu")
    return model, config


def _draft(model, config, graphs: bool, device="cpu") -> DraftModel:
    device = torch.device(device)
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK, torch.float32, device, SINGLE)
    kv.zero_()
    draft = DraftModel(model, kv, BLOCK, device)
    if graphs:
        draft.graphs = DraftGraphs(model, kv, BLOCK, (1, 2, 4, 8), 4, device)
    return draft


def _verify(plan, prev: list[int], drafts: list[int]):
    return dataclasses.replace(
        plan,
        draft_prev=np.asarray(prev, np.int32),
        num_drafts=np.asarray(drafts, np.int32),
    )


def test_buffered_forwards_draft_and_write_as_the_eager_ones(model):
    model, config = model
    eager, buffered = _draft(model, config, False), _draft(model, config, True)
    sampled = torch.tensor([7, 11, 0, 0], dtype=torch.int64)
    buffered.graphs.use_eagerly(sampled)
    _same_steps(eager, buffered, sampled)


def _same_steps(eager: DraftModel, buffered: DraftModel, sampled: torch.Tensor) -> None:
    gen = np.random.default_rng(0)
    a, b, c = (gen.integers(0, 256, n).tolist() for n in (21, 9, 14))
    blocks = [[3, 5], [1, 8], [2, 9]]
    prefill = make_plan(0, [Seq(a, 0, blocks[0]), Seq(b, 0, blocks[1]), Seq(c, 0, blocks[2])])
    # Step 1: a verifies 3 drafts after its sampled token 40 (its last prompt token before it);
    # b is a plain decode row whose token is the previous step's sampled[1]; c verifies 2.
    step = make_plan(
        1,
        [Seq([40, 0, 0, 0], 21, blocks[0]), Seq([0], 9, blocks[1]), Seq([41, 0, 0], 14, blocks[2])],
    )
    step = dataclasses.replace(
        step, prev_rows=np.asarray([-1, -1, -1, -1, 1, -1, -1, -1], np.int32)
    )
    step = _verify(step, [a[-1], -1, c[-1]], [3, 0, 2])
    # Step 2: every row one plain token (a's after accepting every draft: draft_prev -1).
    plain = make_plan(
        2, [Seq([42], 25, blocks[0]), Seq([43], 10, blocks[1]), Seq([44], 17, blocks[2])]
    )
    for plan in (prefill, step, plain):
        want, got = eager.fill(plan, sampled), buffered.fill(plan, sampled)
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        torch.testing.assert_close(buffered.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_captured_forwards_draft_and_write_as_the_eager_ones(tmp_path):
    """The same steps on CUDA (fp32) with every bucket captured: the decode-only forwards
    (verify rows as two rows, each greedy step, the plain step) replay graphs."""
    from tests.random_llama import GPU_TINY_SHAPE

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = make_random_llama(str(tmp_path / "m"), GPU_TINY_SHAPE)
    model, config, _ = load_model(path, dtype=torch.float32, device="cuda")
    eager, buffered = _draft(model, config, False, "cuda"), _draft(model, config, True, "cuda")
    sampled = torch.tensor([7, 11, 0, 0], dtype=torch.int64, device="cuda")
    buffered.graphs.capture(sampled)
    _same_steps(eager, buffered, sampled)
    assert buffered.graphs.replays == 1 + 2 + 1  # step 1's first forward, 2 greedy, step 2
