"""Persistent step inputs (actors/gpu/buffers.py): fixed addresses, one copy, neutral padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taipan.actors.gpu.buffers import ALIGN, StepBuffers


def plan_arrays(tokens: int, seqs: int, width: int, rng: np.random.Generator) -> dict:
    q = np.sort(rng.choice(np.arange(1, tokens), size=seqs - 1, replace=False)) if seqs > 1 else []
    return {
        "input_ids": rng.integers(0, 1000, tokens).astype(np.int32),
        "positions": rng.integers(0, 500, tokens).astype(np.int32),
        "slot_mapping": rng.integers(0, 4096, tokens).astype(np.int64),
        "prompt_targets": rng.integers(-1, 1000, tokens).astype(np.int32),
        "prev_rows": rng.integers(-1, seqs, tokens).astype(np.int32),
        "query_start_loc": np.array([0, *q, tokens], np.int32),
        "seq_lens": rng.integers(1, 500, seqs).astype(np.int32),
        "block_tables": rng.integers(1, 64, (seqs, width)).astype(np.int32),
        "sample": rng.integers(0, 2, seqs).astype(np.int8),
        "temperature": rng.random(seqs).astype(np.float32),
        "top_k": rng.integers(0, 50, seqs).astype(np.int32),
        "top_p": rng.random(seqs).astype(np.float32),
        "min_p": rng.random(seqs).astype(np.float32),
        "seeds": rng.integers(-1, 2**62, seqs).astype(np.int64),
        "gen_index": rng.integers(0, 100, seqs).astype(np.int32),
        "logprobs": rng.integers(0, 2, seqs).astype(np.int8),
        "top_n": rng.integers(0, 5, seqs).astype(np.int32),
        "mamba_init": rng.integers(-1, 8, seqs).astype(np.int32),
        "mamba_out": rng.integers(0, 8, seqs).astype(np.int32),
    }


def test_views_hold_the_step_and_keep_their_addresses():
    rng = np.random.default_rng(0)
    buf = StepBuffers("cpu", max_tokens=64, max_requests=8, max_blocks_per_seq=6)
    first = buf.load(plan_arrays(20, 3, 4, rng))
    addresses = {k: v.data_ptr() for k, v in first.items()}
    for step in range(4):  # both staging buffers, twice
        arrays = plan_arrays(30 + step, 5, 6, rng)
        views = buf.load(arrays)
        assert {k: v.data_ptr() for k, v in views.items()} == addresses
        for name, arr in arrays.items():
            assert np.array_equal(views[name].numpy(), arr), name
    assert all(offset % ALIGN == 0 for offset in buf.offsets.values())


def test_padded_rows_are_neutral_never_stale():
    rng = np.random.default_rng(1)
    buf = StepBuffers("cpu", max_tokens=64, max_requests=8, max_blocks_per_seq=6)
    buf.load(plan_arrays(40, 6, 6, rng))  # a big step leaves its values in the buffers ...
    buf.load(plan_arrays(40, 6, 6, rng))  # ... of both staging copies
    small = plan_arrays(10, 2, 3, rng)
    views = buf.load(small, num_tokens=16, num_seqs=4)  # ... then a small step, padded
    assert views["input_ids"].shape == (16,) and views["seq_lens"].shape == (4,)
    assert views["slot_mapping"][10:].eq(-1).all()  # padding tokens write no KV
    assert views["prompt_targets"][10:].eq(-1).all()
    assert views["prev_rows"][10:].eq(-1).all()
    assert views["seq_lens"][2:].eq(0).all()  # padding rows attend nothing
    assert views["query_start_loc"].tolist() == [*small["query_start_loc"].tolist(), 10, 10]
    assert views["block_tables"].shape == (4, 6)
    assert views["block_tables"][:2, :3].numpy().tolist() == small["block_tables"].tolist()
    assert views["block_tables"][:2, 3:].eq(0).all() and views["block_tables"][2:].eq(0).all()
    assert views["top_p"][2:].eq(1.0).all() and views["sample"][2:].eq(0).all()
    assert views["mamba_init"][2:].eq(-1).all() and views["mamba_out"][2:].eq(-1).all()


def test_a_step_larger_than_the_buffers_is_refused():
    rng = np.random.default_rng(2)
    buf = StepBuffers("cpu", max_tokens=16, max_requests=4, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.load(plan_arrays(17, 2, 2, rng))
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.load(plan_arrays(8, 2, 2, rng), num_seqs=5)
    with pytest.raises(ValueError, match="do not fit"):
        buf.load(plan_arrays(8, 2, 3, rng))


@pytest.mark.gpu
def test_gpu_buffers_copy_once_and_reuse_staging_safely():
    rng = np.random.default_rng(3)
    buf = StepBuffers("cuda", max_tokens=4096, max_requests=256, max_blocks_per_seq=64)
    assert all(s.is_pinned() for s in buf._staging)
    results = []
    for step in range(6):  # the host refills a staging buffer only after its copy finished
        arrays = plan_arrays(1000 + step, 100, 64, rng)
        views = buf.load(arrays)
        results.append((arrays, {k: v.clone() for k, v in views.items()}))
    torch.cuda.synchronize()
    for arrays, views in results:
        for name, arr in arrays.items():
            assert np.array_equal(views[name].cpu().numpy(), arr), name
