"""The gpu worker with a multi-token-prediction head (speculative_method "mtp", issue 29):
its StepResult.next_drafts against the reference of tests/test_qwen3_next_mtp.py (after prompt
chunks and a verify row, CPU), a graphed CUDA worker against an eager one (GPU), bad MTP plan
fields refused, and an expert-parallel group of two gloo ranks against a worker holding every
expert (the head's MoE layer in the exchange, its passes in step, dummy steps too)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from taipan.ops.moe import moe_blocks
from tests.random_qwen3_next import TINY, add_mtp_head, make_random_qwen3_next
from tests.test_ops_logprobs import Seq, make_plan
from tests.test_ops_nemotron_h import BLOCK_SIZE, HybridRunner
from tests.test_qwen3_next_mtp import (
    FAMILIES,
    K,
    _prompt,
    checkpoint_with_head,
    model_step,
    mtp_step,
    reference_drafts,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=FAMILIES, ids=["-".join(f) for f in FAMILIES])
def with_head(request, tmp_path_factory):
    return checkpoint_with_head(request.param, tmp_path_factory)


# ---- the gpu worker with the head (speculative_method "mtp") ---------------------------------


@pytest.fixture(scope="module")
def mtp_worker(with_head):
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import LoadModel

    w = ModelWorker()
    load = LoadModel(with_head[0], "float32", "cpu", BLOCK_SIZE, 32, 0.05, 256, 4, 256)
    w.load(dataclasses.replace(load, speculative=True, num_speculative_tokens=K, mtp=True))
    return w


def _mtp_plan(step: int, seqs: list[Seq], nxt: list[int], draft: list[int], drafts=None):
    """make_plan's StepPlan with each sequence's recurrent slot (its index; from zeros at
    position 0) and the head's fields; `drafts`: per sequence, how many of its last tokens
    are drafts."""
    plan = make_plan(step, seqs, BLOCK_SIZE)
    n = len(seqs)
    extra = {
        "mamba_init": np.asarray([i if s.start else -1 for i, s in enumerate(seqs)], np.int32),
        "mamba_out": np.arange(n, dtype=np.int32),
        "mtp_next": np.asarray(nxt, np.int32),
        "mtp_draft": np.asarray(draft, np.int8),
    }
    if drafts is not None:
        extra["num_drafts"] = np.asarray(drafts, np.int32)
    return dataclasses.replace(plan, **extra)


def test_the_worker_drafts_after_chunks_and_verify_rows(with_head, mtp_worker):
    """Through ModelWorker.step: a prompt in two chunks (the first hands the head the next
    prompt token: mtp_next) with a second sequence beside it asking no drafts, then a verify
    row of the drafts the first step returned: every StepResult.next_drafts row equals the
    reference's drafts over the true sequence."""
    check_worker_drafts(with_head, mtp_worker, atol=1e-5)


def _gpu_checkpoint(family_kind: tuple[str, str], tmp_path) -> str:
    """FAMILIES' checkpoint with a random head in head dims the CUDA kernels serve (attention
    64, the GDN layers' 32)."""
    family, kind = family_kind
    dims = {"head_dim": 64, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    if family == "qwen3_5":
        from tests.random_qwen3_5 import make_random_qwen3_5

        path = make_random_qwen3_5(str(tmp_path), kind, shape=TINY | dims)
    else:
        path = make_random_qwen3_next(str(tmp_path), kind, shape=TINY | dims)
    add_mtp_head(path)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("family_kind", FAMILIES, ids=["-".join(f) for f in FAMILIES])
def test_gpu_worker_drafts_from_the_heads_graphs(family_kind, tmp_path):
    """The same steps on CUDA (fp32), a worker with mixed CUDA graphs against one without:
    every step of the graphed one (two prompt steps, then the hybrid's verify step, its
    recurrent snapshots in the step buffers) replays its bucket's graph and then the head's
    graph of that bucket (actors/gpu/mtp.py: nothing waits on the host); the same tokens and
    drafts at every step, and the same keys and values in the head's cache layer. (Against
    the reference: the CPU test above; the GPU's fp32 GDN kernels differ from the CPU's by
    ~1e-4 relative.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import LoadModel

    path = _gpu_checkpoint(family_kind, tmp_path)
    load = LoadModel(path, "float32", "cuda", BLOCK_SIZE, 32, 0.05, 64, 4, 256)
    load = dataclasses.replace(load, speculative=True, num_speculative_tokens=K, mtp=True)
    runs = []
    for sizes in ((16, 32, 64), ()):
        w = ModelWorker()
        w.load(dataclasses.replace(load, cuda_graph_mixed_sizes=sizes))
        results = _worker_steps(w)
        runs.append((results, w.kv_cache[-1].cpu(), w.mtp.replays))
        del w
    (graphed, kv, replays), (eager, eager_kv, eager_replays) = runs
    assert (replays, eager_replays) == (3, 0)
    for a, b in zip(graphed, eager, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.next_drafts.tolist() == b.next_drafts.tolist()
        assert a.spec_tokens.tolist() == b.spec_tokens.tolist()
    assert graphed[1].next_drafts[0, 0] >= 0 and graphed[2].next_drafts[0, 0] >= 0
    blocks = [3, 9, 4]
    got, want = (_positions(c, blocks, 41) for c in (kv, eager_kv))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()  # (cuBLAS per shape)


def _worker_steps(w) -> list:
    """check_worker_drafts' three steps, the verify row made of the worker's own drafts: the
    StepResults."""
    ids, other = _prompt(37, seed=31), _prompt(12, seed=32)
    blocks, other_blocks = [3, 9, 4], [7]
    first = _mtp_plan(1, [Seq(ids[:20], 0, blocks, sample=False), Seq(other, 0, other_blocks)],
                      [ids[20], -1], [0, 0])  # fmt: skip
    second = _mtp_plan(2, [Seq(ids[20:], 20, blocks)], [-1], [1])
    results = [w.step(first), w.step(second)]
    drafts = [int(t) for t in results[1].next_drafts[0][:3]]
    row = [int(results[1].token_ids[0]), *drafts]
    results.append(w.step(_mtp_plan(3, [Seq(row, 37, blocks)], [-1], [1], drafts=[3])))
    assert all(r.error is None for r in results)
    return results


def check_worker_drafts(with_head, w, atol: float) -> None:
    """The three steps of the test above against the reference."""
    _, own, hf, _ = with_head
    ids, other = _prompt(37, seed=31), _prompt(12, seed=32)
    blocks, other_blocks = [3, 9, 4], [7]
    first = _mtp_plan(1, [Seq(ids[:20], 0, blocks, sample=False), Seq(other, 0, other_blocks)],
                      [ids[20], -1], [0, 0])  # fmt: skip
    result = w.step(first)
    assert result.error is None and not len(result.next_drafts)  # (none asked)
    second = _mtp_plan(2, [Seq(ids[20:], 20, blocks)], [-1], [1])
    result = w.step(second)
    sampled = int(result.token_ids[0])
    want = reference_drafts(hf, own, ids, sampled, K)[0]
    assert result.next_drafts[0].tolist() == want
    # The head's KV over the whole prompt (the chunk boundary's position read mtp_next) is
    # the one pass's of the ops test, block for block.
    model, config = with_head[3][:2]
    runner = HybridRunner(model, config, num_blocks=32, num_slots=2)
    runner.tables[0], runner.computed[0], runner.slot[0] = blocks, 0, 0
    hidden = model_step(runner, 0, ids)
    mtp_step(runner, 0, 0, ids[1:] + [sampled], hidden)
    layer = config.num_kv_layers - 1  # (the head's cache layer)
    got, ref = (_positions(c[layer].cpu(), blocks, len(ids)) for c in (w.kv_cache, runner.cache))
    assert torch.allclose(got, ref, atol=atol), (got - ref).abs().max()
    # A verify row of those drafts: its accepted ones and the token drawn, then new drafts.
    row = [sampled, *want[:3]]
    third = _mtp_plan(3, [Seq(row, 37, blocks)], [-1], [1], drafts=[3])
    result = w.step(third)
    new = [t for t in result.spec_tokens[0].tolist() if t >= 0]
    known = ids + [sampled] + new[:-1]
    want = reference_drafts(hf, own, known, new[-1], K)[0]
    # (the chain stays inside the row's last block: one draft, then one per position left)
    count = min(K, 1 + -(-(37 + 4) // BLOCK_SIZE) * BLOCK_SIZE - len(known))
    assert result.next_drafts[0].tolist() == want[:count] + [-1] * (K - count)


def _positions(layer_cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """Keys and values of positions 0..n-1 of a sequence on `blocks`: [2, n, KVH, D]."""
    return torch.cat([layer_cache[:, b] for b in blocks], dim=1)[:, :n]


def test_the_worker_refuses_bad_mtp_fields(mtp_worker):
    w = mtp_worker
    ids = _prompt(5, seed=33)
    with pytest.raises(ValueError, match="one entry per sequence"):
        w.step(_mtp_plan(1, [Seq(ids, 0, [1])], [], [1]))
    with pytest.raises(ValueError, match="must be -1 for a sequence that samples"):
        w.step(_mtp_plan(1, [Seq(ids, 0, [1])], [3], [1]))
    with pytest.raises(ValueError, match="must be a token id"):
        w.step(_mtp_plan(1, [Seq(ids, 0, [1], sample=False)], [-1], [0]))
    with pytest.raises(ValueError, match="1 only for a sequence that samples"):
        w.step(_mtp_plan(1, [Seq(ids, 0, [1], sample=False)], [4], [1]))


# ---- expert parallelism (2 ranks, gloo) --------------------------------------------------------


def _ep_rank(rank: int, path: str, init: str) -> None:
    """One process of an expert-parallel group of 2 (torch.multiprocessing.spawn): a worker
    holding half of every MoE layer's experts, the head's layer's too, against one holding
    them all. Rank 0 steps a prompt, then a decode row, while rank 1 runs dummy steps (which
    must meet the head's exchanges too); then both step prompts of their own: every step's
    tokens, drafts and head KV equal the whole worker's."""
    from taipan.actors.engine.wire import dummy_plan
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import LoadModel

    torch.set_num_threads(1)
    load = LoadModel(path, "float32", "cpu", BLOCK_SIZE, 32, 0.05, 256, 4, 256)
    load = dataclasses.replace(load, speculative=True, num_speculative_tokens=K, mtp=True)
    whole, ep = ModelWorker(), ModelWorker()
    whole.load(load)
    ep.load(dataclasses.replace(load, expert_parallel_rank=rank, expert_parallel_size=2,
                                expert_parallel_init=init))  # fmt: skip
    head = moe_blocks(ep.model)[0].w1.shape[0]  # (the model's experts on this rank)
    assert ep.model.layers[-1].mlp.w1.shape[0] == head  # (the head's: the same share)

    def same(plan, blocks: list[int], written: int):
        got, want = ep.step(plan), whole.step(plan)
        assert got.error is None, got.error
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.next_drafts.tolist() == want.next_drafts.tolist()
        # The head's KV at the positions written so far (the chain's passes after the first
        # read the head's MoE output; the rest of the cache is uninitialized memory).
        got_kv, want_kv = (_positions(w.kv_cache[-1], blocks, written) for w in (ep, whole))
        torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=0)
        return got

    blocks = [3, 9, 4]
    if rank == 0:  # (37 prompt tokens and the chain's K - 1 passes; then a decode row's)
        ids = _prompt(37, seed=41)
        first = same(_mtp_plan(1, [Seq(ids, 0, blocks)], [-1], [1]), blocks, 37 + K - 1)
        assert (first.next_drafts[0] >= 0).all()
        token = int(first.token_ids[0])
        same(_mtp_plan(2, [Seq([token], 37, blocks)], [-1], [1]), blocks, 38 + K - 1)
    else:
        for _ in range(2):
            assert ep.step(dummy_plan(0)).error is None
    mine = [_prompt(9, seed=42), _prompt(5, seed=43)][rank]
    same(_mtp_plan(3, [Seq(mine, 0, [7])], [-1], [1]), [7], len(mine) + K - 1)
    torch.distributed.destroy_process_group()


def test_expert_parallel_workers_draft_as_one_holding_every_expert(with_head, tmp_path):
    import torch.multiprocessing as mp

    path, _, _, (model, config, _) = with_head
    if getattr(config, "moe", None) is None:
        pytest.skip("a dense MLP: no experts to share")
    mp.spawn(_ep_rank, args=(path, f"file://{tmp_path}/init"), nprocs=2, join=True)
