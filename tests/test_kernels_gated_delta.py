"""kernels.gated_delta (Gated-DeltaNet, Qwen3-Next's linear attention): the refs against Hugging
Face's torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (initial states, more
value heads than key heads, with and without the q/k l2norm); the varlen ref's own contract
(sequences alone, a sequence split anywhere and continued from its slot, snapshots, padding);
the chunked varlen and decode Triton kernels against the refs (CPU interpreter, fp32, tiny
shapes: chunk 16, Dk = Dv = 16); the launchers' refusals; and GPU tests (bf16 at Qwen3-Next's
shape, mixed lengths past 1000 tokens, snapshots, CUDA-graph replay)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from taipan.kernels.gated_delta import (
    gated_delta_update,
    gated_delta_update_ref,
    gated_delta_varlen,
    gated_delta_varlen_ref,
)

NAN = float("nan")
# The torch bodies, past the decorator that would swap in FLA's kernels where installed.
HF_CHUNK = hf.torch_chunk_gated_delta_rule.__wrapped__
HF_RECURRENT = hf.torch_recurrent_gated_delta_rule.__wrapped__


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float().cpu() - expected.float().cpu()).norm()
    return (diff / expected.float().cpu().norm().clamp_min(1e-30)).item()


def _qsl(lens, dtype=torch.int32, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device=device)


def _ints(values, dtype=torch.int32, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _inputs(T, Hk, Hv, Dk, Dv, *, gen, dtype=torch.float32, device="cpu"):
    """q, k, v as column views of one conv output row (as the mixer splits it), g < 0 as the
    model computes it, beta in (0, 1)."""
    width = 2 * Hk * Dk + Hv * Dv + 5  # 5 unused columns: no field's stride is its row's
    conv = torch.randn(T, width, generator=gen).to(device=device, dtype=dtype)
    q = conv[:, : Hk * Dk].view(T, Hk, Dk)
    k = conv[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
    v = conv[:, 2 * Hk * Dk : 2 * Hk * Dk + Hv * Dv].view(T, Hv, Dv)
    A_log = torch.randn(Hv, generator=gen) * 0.5
    a, b = torch.randn(2, T, Hv, generator=gen)
    g = -A_log.exp() * torch.nn.functional.softplus(a)
    return q, k, v, g.to(device), b.sigmoid().to(device=device, dtype=dtype)


# ---- the refs against Hugging Face -------------------------------------------------------------


@pytest.mark.parametrize("Hk, Hv, l2norm", [(2, 2, True), (2, 4, True), (1, 3, False)])
def test_refs_match_transformers(Hk, Hv, l2norm):
    """Batched HF (two sequences of one length, own initial states) against our varlen ref over
    the same sequences as a flat batch, both HF forms; and one decode step against HF's
    recurrent rule over one token."""
    T, Dk, Dv = 37, 16, 8
    gen = torch.Generator().manual_seed(Hv)
    q, k, v, g, beta = _inputs(2 * T, Hk, Hv, Dk, Dv, gen=gen)
    init = torch.randn(2, Hv, Dk, Dv, generator=gen)
    if not l2norm:  # keep the recurrence bounded without the norm
        q, k = q / Dk**0.5, k / Dk**0.5
    batch = [x.reshape(2, T, *x.shape[1:]) for x in (q, k, v, g, beta)]
    states = torch.full((5, Hv, Dk, Dv), NAN)
    states[0:2] = init
    got = gated_delta_varlen_ref(
        q, k, v, g, beta, _qsl([T, T]), states, _ints([0, 1]), _ints([2, 3]),
        use_qk_l2norm=l2norm,
    )  # fmt: skip
    for rule, kwargs in ((HF_CHUNK, {"chunk_size": 16}), (HF_RECURRENT, {})):
        want, final = rule(
            *batch, initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(got.view(2, T, Hv, Dv), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[2:4], final, rtol=1e-4, atol=1e-5)
    assert states[4].isnan().all()

    one = [x[:2].unsqueeze(1) for x in (q, k, v, g, beta)]  # [2 rows, 1 token, ...]
    want, final = HF_RECURRENT(
        *one, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    got = gated_delta_update_ref(
        q[:2], k[:2], v[:2], g[:2], beta[:2], states, _ints([0, 1]), _ints([1, 4]),
        use_qk_l2norm=l2norm,
    )  # fmt: skip
    torch.testing.assert_close(got, want[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[[1, 4]], final, rtol=1e-4, atol=1e-5)


def test_ref_scale_multiplies_the_output():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(9, 1, 2, 16, 16, gen=gen)
    states = torch.zeros(1, 2, 16, 16)
    args = (q, k, v, g, beta, _qsl([9]), states, _ints([-1]), _ints([-1]))
    default = gated_delta_varlen_ref(*args)  # scale = 16 ** -0.5 = 0.25
    torch.testing.assert_close(gated_delta_varlen_ref(*args, scale=1.0), default * 4.0)
    torch.testing.assert_close(gated_delta_varlen_ref(*args, scale=0.5), default * 2.0)


# ---- the varlen ref's contract -----------------------------------------------------------------


def _alone(q, k, v, g, beta, states, qsl, b, init, dest):
    """Sequence b of a flat batch run alone (on a copy of the states): (o, the state it stores)."""
    lo, hi = int(qsl[b]), int(qsl[b + 1])
    mine = states.clone()
    o = gated_delta_varlen_ref(
        q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], _qsl([hi - lo]), mine,
        _ints([init]), _ints([dest]),
    )  # fmt: skip
    return o, mine[dest]


def test_varlen_ref_equals_each_sequence_alone_and_leaves_padding_alone():
    lens, init, dest = [6, 0, 11, 0, 3], [1, -1, -1, 2, 2], [1, -1, 0, 4, -1]
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(sum(lens) + 2, 1, 2, 16, 8, gen=gen)  # 2 rows past the batch
    states = torch.full((6, 2, 16, 8), NAN)
    states[1], states[2] = torch.randn(2, 2, 16, 8, generator=gen)
    start = states.clone()
    out = torch.full(v.shape, NAN)
    qsl = _qsl(lens)
    o = gated_delta_varlen_ref(q, k, v, g, beta, qsl, states, _ints(init), _ints(dest), out=out)
    assert o is out and not o[:-2].isnan().any() and o[-2:].isnan().all()
    for b in (0, 2, 4):
        want_o, want_state = _alone(q, k, v, g, beta, start, qsl, b, init[b], 5)
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        torch.testing.assert_close(o[lo:hi], want_o, rtol=0, atol=0)
        if dest[b] >= 0:
            torch.testing.assert_close(states[dest[b]], want_state, rtol=0, atol=0)
    assert torch.equal(states[4], start[2])  # empty sequence 3 moved slot 2 into slot 4
    torch.testing.assert_close(states[[2, 3, 5]], start[[2, 3, 5]], equal_nan=True)


@pytest.mark.parametrize("cut", [0, 1, 7, 16, 19, 20])
def test_varlen_ref_split_anywhere_continues_from_the_slot(cut):
    """A 20-token sequence in one pass == its first `cut` tokens stored into a slot and the rest
    continued from it (an empty first part moves the initial state)."""
    T = 20
    gen = torch.Generator().manual_seed(cut)
    q, k, v, g, beta = _inputs(T, 2, 4, 16, 16, gen=gen)
    states = torch.randn(3, 4, 16, 16, generator=gen)
    whole = states.clone()
    want = gated_delta_varlen_ref(q, k, v, g, beta, _qsl([T]), whole, _ints([0]), _ints([1]))
    parts = states.clone()
    first = gated_delta_varlen_ref(
        q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], _qsl([cut]), parts, _ints([0]), _ints([2])
    )
    rest = gated_delta_varlen_ref(
        q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], _qsl([T - cut]), parts, _ints([2]),
        _ints([1]),
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([first, rest]), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts[1], whole[1], rtol=1e-5, atol=1e-6)


# Sequence 0 (40 tokens, from slot 0) snapshots after 1, 16, 20 (two in one 16-token chunk), 32
# (a chunk's last token) and 40 (its last token, besides its final state); sequence 1 (5 tokens,
# from zeros) after 3; sequence 2 (padding) has an entry with slot -1; sequence 3 (33 tokens,
# continuing in slot 1) after 17 (a chunk's first token) and 33. Slot 11 is never named.
SNAP_LENS = [40, 5, 0, 33]
SNAP_INIT = [0, -1, -1, 1]
SNAP_DEST = [2, 3, -1, 1]
SNAP_POS = [[1, 16, 20, 32, 40], [3, 1, 1, 1, 1], [1, 1, 1, 1, 1], [17, 33, 1, 1, 1]]
SNAP_SLOTS = [[4, 5, 6, 7, 8], [9, -1, -1, -1, -1], [-1] * 5, [10, 12, -1, -1, -1]]


def _snapshot_case(gen, Hk=1, Hv=2, D=16):
    q, k, v, g, beta = _inputs(sum(SNAP_LENS), Hk, Hv, D, D, gen=gen)
    states = torch.full((13, Hv, D, D), NAN)
    states[0], states[1] = torch.randn(2, Hv, D, D, generator=gen)
    snaps = {"snap_pos": _ints(SNAP_POS), "snap_slots": _ints(SNAP_SLOTS)}
    return (q, k, v, g, beta, _qsl(SNAP_LENS)), states, snaps


def test_varlen_ref_snapshots_equal_prefix_states():
    """Each snapshot equals the final state of a run over just that many tokens (no snapshot
    code involved); outputs and final states are what they are without snapshots."""
    gen = torch.Generator().manual_seed(2)
    args, states, snaps = _snapshot_case(gen)
    init, dest = _ints(SNAP_INIT), _ints(SNAP_DEST)
    plain, with_snaps = states.clone(), states.clone()
    o_plain = gated_delta_varlen_ref(*args, plain, init, dest)
    o_snaps = gated_delta_varlen_ref(*args, with_snaps, init, dest, **snaps)
    assert torch.equal(o_plain, o_snaps)
    torch.testing.assert_close(with_snaps[:4], plain[:4], rtol=0, atol=0, equal_nan=True)
    assert with_snaps[11].isnan().all()
    q, k, v, g, beta, qsl = args
    for b, (row_pos, row_slots) in enumerate(zip(SNAP_POS, SNAP_SLOTS, strict=True)):
        for pos, slot in zip(row_pos, row_slots, strict=True):
            if slot < 0:
                continue
            lo = int(qsl[b])
            prefix = states.clone()
            sl = slice(lo, lo + pos)
            gated_delta_varlen_ref(
                q[sl], k[sl], v[sl], g[sl], beta[sl], _qsl([pos]), prefix,
                _ints([SNAP_INIT[b]]), _ints([11]),
            )  # fmt: skip
            torch.testing.assert_close(with_snaps[slot], prefix[11], rtol=1e-6, atol=1e-6)


# ---- the Triton kernels against the refs (CPU interpreter) -------------------------------------

# Sequence 0 starts from zeros; 1 continues in its own slot (init == out); 2 is padding; 3 reads
# slot 3 into slot 4 (three 16-token chunks, the last partial); 4 reads slot 5 and stores
# nothing. Slots 0, 1, 4 and 6 are never read: they hold NaN.
LENS = [1, 16, 0, 35, 3]
INIT = [-1, 2, -1, 3, 5]
DEST = [0, 2, -1, 4, -1]


@pytest.mark.parametrize(
    "Hk, Hv, Dk, Dv, l2norm, index_dtype",
    [
        (1, 2, 16, 16, True, torch.int32),
        (2, 2, 12, 20, False, torch.int64),  # masked Dk and Dv tiles, two Dv blocks
    ],
)
def test_varlen_kernel_matches_ref(Hk, Hv, Dk, Dv, l2norm, index_dtype):
    gen = torch.Generator().manual_seed(Dk)
    q, k, v, g, beta = _inputs(sum(LENS), Hk, Hv, Dk, Dv, gen=gen)
    states = torch.full((7, Hv, Dk, Dv), NAN)
    for slot in (2, 3, 5):
        states[slot] = torch.randn(Hv, Dk, Dv, generator=gen)
    want_states = states.clone()
    args = (q, k, v, g, beta, _qsl(LENS, index_dtype))
    slots = (_ints(INIT, index_dtype), _ints(DEST, index_dtype))
    before = [t.clone() for t in args]
    got = gated_delta_varlen(*args, states, *slots, use_qk_l2norm=l2norm, chunk_size=16)
    want = gated_delta_varlen_ref(*args, want_states, *slots, use_qk_l2norm=l2norm)
    assert got.shape == v.shape and got.dtype == v.dtype
    assert all(torch.equal(a, b) for a, b in zip(args, before, strict=True))
    assert _rel_err(got, want) < 2e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for slot in (0, 2, 4):
        assert _rel_err(states[slot], want_states[slot]) < 2e-5, slot
    torch.testing.assert_close(states[[1, 3, 5, 6]], want_states[[1, 3, 5, 6]], equal_nan=True)


def test_varlen_kernel_snapshots_match_ref():
    gen = torch.Generator().manual_seed(4)
    args, states, snaps = _snapshot_case(gen)
    init, dest = _ints(SNAP_INIT), _ints(SNAP_DEST)
    got, want = states.clone(), states.clone()
    o_got = gated_delta_varlen(*args, got, init, dest, chunk_size=16, **snaps)
    o_want = gated_delta_varlen_ref(*args, want, init, dest, **snaps)
    assert _rel_err(o_got, o_want) < 2e-5
    for slot in range(13):
        if slot in (0, 11):  # read only / never named
            torch.testing.assert_close(got[slot], want[slot], rtol=0, atol=0, equal_nan=True)
        else:
            assert _rel_err(got[slot], want[slot]) < 2e-5, slot


def test_varlen_kernel_does_not_depend_on_chunk_size_and_writes_into_out():
    gen = torch.Generator().manual_seed(6)
    lens = [13, 40]
    q, k, v, g, beta = _inputs(sum(lens), 2, 4, 16, 16, gen=gen)
    start = torch.randn(3, 4, 16, 16, generator=gen)
    init, dest = _ints([0, -1]), _ints([1, 2])
    results = []
    for chunk in (16, 32, 64):
        states = start.clone()
        buffer = torch.full((sum(lens), 4 * 16 + 3), NAN)
        out = buffer[:, 3:].view(sum(lens), 4, 16)  # a strided view
        o = gated_delta_varlen(
            q, k, v, g, beta, _qsl(lens), states, init, dest, chunk_size=chunk, out=out
        )
        assert o is out
        results.append((o, states))
    for o, states in results[1:]:
        assert _rel_err(o, results[0][0]) < 2e-5
        assert _rel_err(states, results[0][1]) < 2e-5


def test_varlen_kernel_empty_sequences_and_calls():
    """A sequence with no tokens stores its initial state (zeros for -1) into its out slot;
    with no tokens at all the kernel still runs; with no sequences it does nothing."""
    gen = torch.Generator().manual_seed(7)
    for lens in ([0, 4, 0], [0, 0, 0]):
        q, k, v, g, beta = _inputs(sum(lens), 1, 2, 16, 16, gen=gen)
        states = torch.randn(6, 2, 16, 16, generator=gen)
        want_states = states.clone()
        init, dest = _ints([1, -1, -1]), _ints([3, 4, 5])
        args = (q, k, v, g, beta, _qsl(lens))
        got = gated_delta_varlen(*args, states, init, dest, chunk_size=16)
        want = gated_delta_varlen_ref(*args, want_states, init, dest)
        assert got.shape == v.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-6)
        assert torch.equal(states[3], want_states[1]) and not states[5].any()
    none = torch.zeros(0, dtype=torch.int32)
    q, k, v, g, beta = _inputs(3, 1, 2, 16, 16, gen=gen)
    states = torch.randn(2, 2, 16, 16, generator=gen)
    before = states.clone()
    o = gated_delta_varlen(q, k, v, g, beta, _ints([0]), states, none, none)
    assert o.shape == v.shape and torch.equal(states, before)


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, l2norm", [(1, 2, 16, 16, True), (2, 4, 12, 40, False)])
def test_update_kernel_matches_ref(Hk, Hv, Dk, Dv, l2norm):
    """Rows: from zeros into a slot, a live slot continuing (init == out), a snapshot restored
    into another slot, padding (no slots: o from a zero state, nothing stored)."""
    gen = torch.Generator().manual_seed(Dv)
    q, k, v, g, beta = _inputs(4, Hk, Hv, Dk, Dv, gen=gen)
    states = torch.full((6, Hv, Dk, Dv), NAN)
    states[1], states[2] = torch.randn(2, Hv, Dk, Dv, generator=gen)
    want_states = states.clone()
    init, dest = _ints([-1, 1, 2, -1]), _ints([0, 1, 3, -1])
    got = gated_delta_update(q, k, v, g, beta, states, init, dest, use_qk_l2norm=l2norm)
    want = gated_delta_update_ref(q, k, v, g, beta, want_states, init, dest, use_qk_l2norm=l2norm)
    assert _rel_err(got, want) < 2e-5
    for slot in (0, 1, 3):
        assert _rel_err(states[slot], want_states[slot]) < 2e-5, slot
    torch.testing.assert_close(states[[2, 4, 5]], want_states[[2, 4, 5]], equal_nan=True)


def test_chunks_then_decode_steps_continue_one_sequence():
    """Prefill in two varlen calls then three decode steps, all through one live slot ==
    the ref over the whole sequence in one pass."""
    gen = torch.Generator().manual_seed(8)
    T = 27
    q, k, v, g, beta = _inputs(T, 1, 2, 16, 16, gen=gen)
    whole = torch.zeros(1, 2, 16, 16)
    want = gated_delta_varlen_ref(q, k, v, g, beta, _qsl([T]), whole, _ints([-1]), _ints([0]))
    states = torch.full((1, 2, 16, 16), NAN)
    outs = []
    for lo, hi, init in ((0, 10, -1), (10, 24, 0)):
        sl = slice(lo, hi)
        outs.append(
            gated_delta_varlen(
                q[sl],
                k[sl],
                v[sl],
                g[sl],
                beta[sl],
                _qsl([hi - lo]),
                states,
                _ints([init]),
                _ints([0]),
                chunk_size=16,
            )  # fmt: skip
        )
    for t in range(24, T):
        sl = slice(t, t + 1)
        outs.append(
            gated_delta_update(q[sl], k[sl], v[sl], g[sl], beta[sl], states, _ints([0]), _ints([0]))
        )
    assert _rel_err(torch.cat(outs), want) < 2e-5
    assert _rel_err(states, whole) < 2e-5


# ---- refusals ----------------------------------------------------------------------------------


def _good_args(T=5, Hk=1, Hv=2, Dk=16, Dv=16):
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _inputs(T, Hk, Hv, Dk, Dv, gen=gen)
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, query_start_loc=_ints([0, 2, T]),
        states=torch.zeros(3, Hv, Dk, Dv), init_slots=_ints([0, -1]), out_slots=_ints([1, 2]),
    )  # fmt: skip


META = torch.device("meta")
BAD = [
    ({"v": lambda a: a["v"][:, 0]}, r"v must be \[tokens"),
    ({"q": lambda a: a["q"].double()}, "q must be"),
    ({"k": lambda a: a["k"][:, :, :8]}, "k must have shape"),
    ({"v": lambda a: a["v"].transpose(1, 2).contiguous().transpose(1, 2)}, "unit stride"),
    (
        {
            "q": lambda a: torch.zeros(len(a["g"]), 2, 16),
            "k": lambda a: a["q"].clone(),
            "v": lambda a: torch.zeros(len(a["g"]), 3, 16),
        },
        "must divide the value heads",
    ),  # fmt: skip
    (
        {"q": lambda a: torch.zeros(len(a["g"]), 1, 272), "k": lambda a: a["q"].clone()},
        "head_k_dim",
    ),
    ({"g": lambda a: a["g"][:, :1]}, "g must have shape"),
    ({"beta": lambda a: a["beta"].to(torch.int32)}, "beta must be"),
    ({"states": torch.zeros(3, 2, 16, 16, dtype=torch.bfloat16)}, "states must be an fp32"),
    ({"states": torch.zeros(3, 2, 16, 8)}, "states must be"),
    ({"states": torch.zeros(3, 2, 16, 16).transpose(2, 3)}, "unit stride in its last"),
    ({"states": torch.zeros(3, 2, 16, 16, device=META)}, "states is on meta"),
    ({"init_slots": _ints([0, -1]).float()}, "init_slots must be"),
    ({"out_slots": _ints([1, 2, 3])}, r"out_slots must be a \[2\]"),
    ({"init_slots": torch.zeros(2, dtype=torch.int32, device=META)}, "is on meta"),
]


def _apply(args, changes):
    for key, value in changes.items():
        args[key] = value(args) if callable(value) else value
    return args


@pytest.mark.parametrize(
    "changes, kwargs, match",
    [(c, {}, m) for c, m in BAD]
    + [
        ({"query_start_loc": _ints([0, 5])}, {}, r"query_start_loc must be a \[3\]"),
        ({}, {"chunk_size": 8}, "chunk_size must be an int >= 16"),
        ({}, {"chunk_size": 48}, "power of two"),
        ({}, {"snap_pos": _ints([[1], [1]])}, "both or neither"),
        ({}, {"out": torch.zeros(5, 2, 16, dtype=torch.float16)}, "out must have v's dtype"),
        ({}, {"out": lambda a: a["v"]}, "must not overlap"),
    ],
)
def test_varlen_refuses_bad_arguments(changes, kwargs, match):
    args = _apply(_good_args(), changes)
    kwargs = {key: value(args) if callable(value) else value for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        gated_delta_varlen(**args, **kwargs)


@pytest.mark.parametrize("changes, match", BAD)
def test_update_refuses_bad_arguments(changes, match):
    args = _apply(_good_args(T=2), changes)
    args.pop("query_start_loc")
    with pytest.raises(ValueError, match=match):
        gated_delta_update(**args)


def test_update_refuses_rows_unlike_slots():
    args = _good_args(T=3)
    args.pop("query_start_loc")
    with pytest.raises(ValueError, match="one row per sequence"):
        gated_delta_update(**args)


# ---- GPU ---------------------------------------------------------------------------------------

# Qwen3-Next-80B-A3B's linear attention: 16 key heads, 32 value heads, head dims 128.
QWEN3_NEXT = dict(Hk=16, Hv=32, Dk=128, Dv=128)


@pytest.mark.gpu
def test_gpu_gated_delta_varlen_qwen3_next_shape():
    """bf16 and fp32 storage against the ref on fp32 copies: mixed lengths (1 to 1500 tokens,
    chunk 64 and not a multiple of it), initial states, init == out, snapshots anywhere; then
    the launcher captured in a CUDA graph and replayed with other lengths and slots."""
    lens = [1, 100, 64, 1500, 333]
    total = sum(lens)
    init = _ints([-1, 2, -1, 5, 6], device="cuda")
    dest = _ints([0, 2, 3, 5, 7], device="cuda")
    pos = _ints([[1, 1], [50, 100], [64, 1], [700, 1024], [1, 333]], device="cuda")
    slots = _ints([[-1, -1], [8, 9], [10, -1], [11, 12], [13, 14]], device="cuda")
    snaps = {"snap_pos": pos, "snap_slots": slots}
    qsl = _qsl(lens, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        q, k, v, g, beta = _inputs(total, **QWEN3_NEXT, gen=gen, dtype=dtype, device="cuda")
        states = torch.randn(15, 32, 128, 128, generator=gen).cuda()
        want_states = states.clone()
        got = gated_delta_varlen(q, k, v, g, beta, qsl, states, init, dest, **snaps)
        want = gated_delta_varlen_ref(
            q.float(), k.float(), v.float(), g, beta.float(), qsl, want_states, init, dest,
            **snaps,
        )  # fmt: skip
        assert got.dtype == dtype and _rel_err(got, want) < tol, dtype
        for slot in (0, 2, 3, 5, 7, *range(8, 15)):
            assert _rel_err(states[slot], want_states[slot]) < tol, (dtype, slot)
        assert torch.equal(states[[1, 4, 6]], want_states[[1, 4, 6]])

    # CUDA graph: compile outside the capture, capture, then change every input in place.
    q, k, v, g, beta = _inputs(total, **QWEN3_NEXT, gen=gen, dtype=torch.bfloat16, device="cuda")
    states = torch.randn(15, 32, 128, 128, generator=gen).cuda()
    out = torch.empty_like(v)
    args = (q, k, v, g, beta, qsl, states, init, dest)
    gated_delta_varlen(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_delta_varlen(*args, out=out)
    fresh = _inputs(total, **QWEN3_NEXT, gen=gen, dtype=torch.bfloat16, device="cuda")
    for static, new in zip((q, k, v, g, beta), fresh, strict=True):
        static.copy_(new)
    qsl.copy_(_qsl([1200, 0, 29, 500, 269]))  # sequence 1 is now padding
    init.copy_(_ints([4, -1, 1, -1, 7]))
    dest.copy_(_ints([4, -1, 8, 0, 6]))
    states.copy_(torch.randn(15, 32, 128, 128, generator=gen))
    want_states = states.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = gated_delta_varlen_ref(
        q.float(), k.float(), v.float(), g, beta.float(), qsl, want_states, init, dest
    )
    assert _rel_err(out, want) < 2e-2
    for slot in (4, 8, 0, 6):
        assert _rel_err(states[slot], want_states[slot]) < 2e-2, slot
    assert torch.equal(states[[1, 2, 3, 5, 7]], want_states[[1, 2, 3, 5, 7]])


@pytest.mark.gpu
def test_gpu_gated_delta_update_qwen3_next_shape():
    """bf16 and fp32 decode rows (256 rows, a padding row, init == out and restored slots)
    against the ref, then captured in a CUDA graph and replayed."""
    rows = 256
    gen = torch.Generator().manual_seed(1)
    init = torch.arange(rows, dtype=torch.int32)
    dest = init.clone()
    init[3], dest[3] = -1, -1  # padding
    init[5], dest[5] = rows, 5  # a snapshot slot restored into a live slot
    init, dest = init.cuda(), dest.cuda()
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        q, k, v, g, beta = _inputs(rows, **QWEN3_NEXT, gen=gen, dtype=dtype, device="cuda")
        states = torch.randn(rows + 1, 32, 128, 128, generator=gen).cuda()
        want_states = states.clone()
        got = gated_delta_update(q, k, v, g, beta, states, init, dest)
        want = gated_delta_update_ref(
            q.float(), k.float(), v.float(), g, beta.float(), want_states, init, dest
        )
        assert got.dtype == dtype and _rel_err(got, want) < tol, dtype
        assert _rel_err(states, want_states) < 1e-5
    out = torch.empty_like(v)
    args = (q, k, v, g, beta, states, init, dest)
    gated_delta_update(*args, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_delta_update(*args, out=out)
    fresh = _inputs(rows, **QWEN3_NEXT, gen=gen, dtype=torch.float32, device="cuda")
    for static, new in zip((q, k, v, g, beta), fresh, strict=True):
        static.copy_(new)
    want_states = states.clone()
    graph.replay()
    want = gated_delta_update_ref(q, k, v, g, beta, want_states, init, dest)
    assert _rel_err(out, want) < 1e-5 and _rel_err(states, want_states) < 1e-5
