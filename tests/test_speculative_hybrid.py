"""Speculative verify rows of hybrid models in the gpu worker (issue 29 item 1: the recurrent
state is rolled back to the last accepted position), the worker alone on CPU, fp32.

Two hybrids: a tiny random NemotronH (Mamba2 layers, tests/random_nemotron_h.py) and a tiny
random Qwen3-Next (Gated-DeltaNet layers, tests/random_qwen3_next.py). For each, a worker
without speculation decodes a prompt greedily one token at a time (the oracle: its tokens, and
its state after each token); a worker with k = 3 runs verify rows over the same sequence with
drafts accepted in full, in part and not at all: its new tokens are the oracle's, and after
each step its live slot holds the oracle's state after the last accepted token (close: a
verify row runs the chunked kernels, the oracle the one-token update), whatever was rejected.
A row beside it without drafts, and the slots nobody names, are untouched by the roll-back.
Sizing: each live slot brings k scratch slots (after the snapshots), which a
mamba_memory_ratio share pays for. Malformed verify rows are ValueErrors before the step runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from taipan.actors.gpu.sizing import GIB
from taipan.actors.gpu.worker import ModelWorker
from tests.random_nemotron_h import make_random_nemotron_h
from tests.random_qwen3_next import make_random_qwen3_next
from tests.test_gpu_worker_mamba import PROMPT, hybrid_plan, load_msg
from tests.test_ops_logprobs import Seq

pytest.importorskip("transformers")

K = 3
BLOCKS = [1, 2, 3, 4]  # PROMPT (30 tokens) and up to 34 more
P = len(PROMPT)


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "nemotron_h":
        return make_random_nemotron_h(path, "M-*-M-")
    return make_random_qwen3_next(path, "moe")


def _worker(path: str, k: int = 0, **extra) -> tuple[ModelWorker, object]:
    msg = dataclasses.replace(load_msg(path, **extra), speculative=k > 0, num_speculative_tokens=k)
    w = ModelWorker()
    return w, w.load(msg)


def _state(w: ModelWorker, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv, ssm = w.mamba_state
    return conv[:, slot].clone(), ssm[:, slot].clone()


def _close(a, b, what: str) -> None:
    for name, x, y in zip(("conv", "ssm"), a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=f"{what}: {name} state")


def _verify_plan(step: int, row: list[int], start: int, drafts: int, extra=()):
    """One verify row of `row` (its last known token, then `drafts` drafts) at `start`, in
    live slot 0; `extra`: more (Seq, slot) rows after it (no drafts)."""
    seqs = [Seq(row, start, BLOCKS)] + [s for s, _ in extra]
    slots = [0] + [slot for _, slot in extra]
    plan = hybrid_plan(step, seqs, init=slots, out=slots)
    nd = np.asarray([drafts] + [0] * len(extra), np.int32)
    return dataclasses.replace(plan, num_drafts=nd)


def _oracle(path: str, n: int):
    """Greedy decoding of PROMPT without speculation: (tokens t0..tn, the state after
    feeding each of t0..t(n-1))."""
    w, _ = _worker(path)
    r = w.step(hybrid_plan(1, [Seq(PROMPT, 0, BLOCKS)], init=[-1], out=[0]))
    tokens, states = [int(r.token_ids[0])], []
    for i in range(n):
        plan = hybrid_plan(2 + i, [Seq([tokens[-1]], P + i, BLOCKS)], init=[0], out=[0])
        r = w.step(plan)
        assert r.error is None
        tokens.append(int(r.token_ids[0]))
        states.append(_state(w, 0))
    return tokens, states


def test_verify_rows_roll_the_state_back_to_the_last_accepted_token(model_dir):
    want, states = _oracle(model_dir, 14)
    w, loaded = _worker(model_dir, K)
    r = w.step(hybrid_plan(1, [Seq(PROMPT, 0, BLOCKS)], init=[-1], out=[0]))
    assert int(r.token_ids[0]) == want[0]
    # A second request in live slot 1, decoding beside the verify rows without drafts.
    side = w.step(hybrid_plan(2, [Seq(PROMPT[:9], 0, [5])], init=[-1], out=[1]))
    side_token, side_len = int(side.token_ids[0]), 9
    untouched = [_state(w, s) for s in range(2, loaded.mamba_slots)]

    wrong = [(t + 1) % 200 for t in want]  # never the oracle's token
    at, step = 0, 3  # at: the oracle's tokens known so far - 1
    # (drafts as the oracle's next ones, then wrong ones from position `good`)
    for good in (2, 0, 3, 1):
        drafts = want[at + 1 : at + 1 + good] + wrong[at + 1 + good : at + 1 + K][: K - good]
        row = [want[at], *drafts]
        side_seq = Seq([side_token], side_len, [5])
        before_side = _state(w, 1)
        r = w.step(_verify_plan(step, row, P + at, K, extra=[(side_seq, 1)]))
        assert r.error is None, r.error
        new = r.spec_tokens[0][r.spec_tokens[0] >= 0].tolist()
        assert new == want[at + 1 : at + 2 + good], (good, new)
        at += good + 1
        _close(_state(w, 0), states[at - 1], f"after {good} accepted drafts")
        # the row without drafts advanced by its own token only
        assert (r.spec_tokens[1] < 0).all()
        assert not torch.equal(_state(w, 1)[1], before_side[1])
        side_token, side_len, step = int(r.token_ids[1]), side_len + 1, step + 1
    for s, before in zip(range(2, loaded.mamba_slots), untouched, strict=True):
        for x, y in zip(_state(w, s), before, strict=True):
            assert torch.equal(x, y), f"slot {s} changed"
    # The plain continuation from the rolled-back state is the oracle's.
    r = w.step(hybrid_plan(step, [Seq([want[at]], P + at, BLOCKS)], init=[0], out=[0]))
    assert int(r.token_ids[0]) == want[at + 1]


def test_the_step_buffers_carry_the_verify_snapshots_as_the_graphs_read_them(model_dir):
    """The verify rows' snapshot entries travel in the step buffers (snap_pos / snap_slots,
    K a row, padding (1, -1)), which a mixed CUDA graph passes to the kernels at every step.
    Run on the CPU the way a graph runs them (every forward given the buffers' entries, with
    or without verify rows): the same tokens and the same states in every slot as the
    forward given only the verify steps' entries."""
    ref, _ = _worker(model_dir, K)
    w, loaded = _worker(model_dir, K)
    fields = w.buffers.fields
    assert fields["snap_pos"].width == K and fields["snap_pos"].pad == 1
    assert fields["snap_slots"].pad == -1
    run = w._run_model
    w._run_model = lambda ids, inputs, attn, inner=None, static=False: run(
        ids, inputs, attn, inner, static_snaps=not inner
    )
    first = hybrid_plan(
        1, [Seq(PROMPT, 0, BLOCKS), Seq(PROMPT[:9], 0, [5])], init=[-1, -1], out=[0, 1]
    )
    a, b = ref.step(first), w.step(first)
    _same_steps(ref, w, a, b)
    tokens = [int(t) for t in a.token_ids]
    row = [tokens[0], 7, 11, 13]  # (drafts the model will mostly reject)
    second = _verify_plan(2, row, P, K, extra=[(Seq([tokens[1]], 9, [5]), 1)])
    a, b = ref.step(second), w.step(second)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.spec_tokens.tolist() == b.spec_tokens.tolist()
    _same_steps(ref, w, a, b)


def _same_steps(ref: ModelWorker, w: ModelWorker, a, b) -> None:
    """The two workers' step results and every state slot equal (bitwise: the CPU's kernels
    store snapshots besides, never instead)."""
    assert a.token_ids.tolist() == b.token_ids.tolist()
    for slot in range(w.mamba_state[0].shape[1]):
        for x, y in zip(_state(w, slot), _state(ref, slot), strict=True):
            assert torch.equal(x, y), f"slot {slot}"


def test_scratch_slots_are_sized_with_the_live_ones(model_dir):
    plain, loaded = _worker(model_dir)
    slot = loaded.mamba_slot_bytes
    w, spec = _worker(model_dir, K, mamba_snapshot_gb=2 * slot / GIB)
    assert spec.mamba_slots == loaded.mamba_slots and spec.mamba_snapshot_slots == 2
    assert w.mamba_state[0].shape[1] == spec.mamba_slots * (1 + K) + 2
    # A mamba_memory_ratio share pays for each live slot's scratch slots too: a share of
    # 2.5 requests' states (k + 1 slots each) holds 2 live slots.
    budget = 1 << 24
    ratio = 2.5 * slot * (1 + K) / budget
    _, shared = _worker(model_dir, K, budget_bytes=budget, mamba_memory_ratio=ratio)
    assert shared.mamba_slots == 2


def test_malformed_verify_rows_are_refused_before_the_step(model_dir):
    w, loaded = _worker(model_dir, 2, mamba_snapshot_gb=(1 << 20) / GIB)
    r = w.step(hybrid_plan(1, [Seq(PROMPT, 0, BLOCKS)], init=[-1], out=[0]))
    t = int(r.token_ids[0])
    before = _state(w, 0)
    cases = {
        "more than": _verify_plan(2, [t, 5, 6, 7], P, 3),
        "own live": dataclasses.replace(
            _verify_plan(2, [t, 5], P, 1), mamba_init=np.asarray([-1], np.int32)
        ),
        "prefix snapshots": dataclasses.replace(
            _verify_plan(2, [t, 5], P, 1),
            mamba_snap_row=np.asarray([0], np.int32),
            mamba_snap_pos=np.asarray([2], np.int32),
            mamba_snap_dst=np.asarray([loaded.mamba_slots], np.int32),
        ),
    }
    for what, plan in cases.items():
        with pytest.raises(ValueError, match=what):
            w.step(plan)
        for x, y in zip(_state(w, 0), before, strict=True):
            assert torch.equal(x, y)
    assert w.step(_verify_plan(3, [t, 5], P, 1)).error is None  # a valid one runs after
