"""kernels.causal_conv1d (issue 10: the Mamba2 mixer's depthwise causal conv1d): the varlen and
decode-update Triton kernels against their `_ref`s (CPU interpreter, fp32, tiny shapes): query
lengths 1, 2, K - 1 and longer, zero-length sequences (padding, and a state that only moves to
another slot), initial states from slots or zeros, init == out slot, untouched slots, x as a
strided view, several channel blocks and sequence splits, state continuity over chunks and decode
steps; the launchers' refusals; and a GPU test (bf16 and fp32 at NemotronH-8B's conv_dim, and
both launchers captured in a CUDA graph and replayed on new inputs)."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels import causal_conv1d as cc
from taipan.kernels.causal_conv1d import (
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float().cpu() - expected.float().cpu()).norm()
    return (diff / expected.float().cpu().norm().clamp_min(1e-30)).item()


def _qsl(lens, dtype=torch.int32, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device=device)


def _slots(values, dtype=torch.int32, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _params(dim, width, gen, *, bias=True, dtype=torch.float32, device="cpu"):
    weight = (torch.randn(dim, width, generator=gen) * 0.5).to(device=device, dtype=dtype)
    b = (torch.randn(dim, generator=gen) * 0.5).to(device=device, dtype=dtype) if bias else None
    return weight, b


def _strided(rows, dim, gen, *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[rows, dim], a column slice of a wider buffer (as conv input is of the in_proj output)."""
    big = torch.randn(rows, dim + 11, generator=gen).to(device=device, dtype=dtype)
    return big[:, 3 : 3 + dim]


def _check_varlen(x, weight, bias, qsl, states, init, dest, **kwargs) -> torch.Tensor:
    """Runs kernel and ref on copies of the states; asserts outputs close, states equal, x
    unchanged. Returns the kernel's output."""
    x_before, want_states = x.clone(), states.clone()
    got = causal_conv1d_varlen(x, weight, bias, qsl, states, init, dest, **kwargs)
    want = causal_conv1d_varlen_ref(x, weight, bias, qsl, want_states, init, dest)
    end = int(qsl[-1])
    assert _rel_err(got[:end], want[:end]) < 1e-5
    assert torch.equal(states, want_states)  # states are copies of inputs: exact
    assert torch.equal(x, x_before)
    return got


# ----------------------------------------------------------------------------------- varlen


@pytest.mark.parametrize(
    "width, with_bias, index_dtype",
    [(4, True, torch.int32), (2, False, torch.int64), (8, True, torch.int64)],
)
def test_varlen_matches_ref(width, with_bias, index_dtype):
    gen = torch.Generator().manual_seed(width)
    dim, num_slots = 24, 10
    # 1 and 2 tokens (fewer than K - 1 for K = 4 and 8), K - 1, longer; a padding sequence
    # (length 0, slots -1); a length-0 sequence whose state moves from slot 4 to slot 7.
    lens = [1, 2, width - 1, 13, 0, 0, 17]
    init = _slots([-1, 1, 2, 3, -1, 4, 5], index_dtype)
    dest = _slots([0, 1, 6, 3, -1, 7, -1], index_dtype)  # slots 1 and 3: read, then rewritten
    x = _strided(sum(lens), dim, gen)
    weight, bias = _params(dim, width, gen, bias=with_bias)
    states = torch.randn(num_slots, width - 1, dim, generator=gen)
    before = states.clone()
    _check_varlen(x, weight, bias, _qsl(lens, index_dtype), states, init, dest)
    for slot in (2, 4, 5, 8, 9):  # read or never named: unchanged
        assert torch.equal(states[slot], before[slot])
    assert torch.equal(states[7], before[4])  # the length-0 sequence carried its state over
    # 2 tokens, init == out: the state's tail, then the tokens (for K = 4 and 8: a mix)
    assert torch.equal(states[1], torch.cat([before[1], x[1:3]])[-(width - 1) :])


@pytest.mark.parametrize(
    "max_block_d, target_programs, max_query_len",
    # (channel blocks, splits, tokens per tile): (3, 1, 16), (3, 3, 16), (1, 1, 8), (1, 3, 16)
    [(16, 1, None), (16, 10**6, None), (128, 10**6, 3), (128, 10**6, 40)],
)
def test_varlen_channel_blocks_splits_and_hints(
    monkeypatch, max_block_d, target_programs, max_query_len
):
    """Several channel blocks (the last partial), one program or many per sequence (splits),
    and max_query_len hints that are absent, too small or too large: the same results."""
    monkeypatch.setattr(cc, "_MAX_BLOCK_D", max_block_d)
    monkeypatch.setattr(cc, "_TARGET_PROGRAMS", target_programs)
    gen = torch.Generator().manual_seed(7)
    dim, width = 40, 4
    lens = [19, 3, 9]
    x = _strided(sum(lens) + 2, dim, gen)  # 2 rows past the last sequence: left untouched
    weight, bias = _params(dim, width, gen)
    states = torch.randn(5, width - 1, dim, generator=gen)
    out_buf = torch.full((sum(lens) + 2, dim + 4), 7.0)
    out = out_buf[:, 2 : 2 + dim]  # a strided out
    got = _check_varlen(
        x,
        weight,
        bias,
        _qsl(lens),
        states,
        _slots([0, -1, 2]),
        _slots([0, 1, 3]),
        out=out,
        max_query_len=max_query_len,
    )
    assert got is out
    assert torch.equal(out_buf[-2:], torch.full((2, dim + 4), 7.0))
    assert torch.equal(out_buf[:, :2], torch.full((sum(lens) + 2, 2), 7.0))


def test_chunks_and_decode_steps_continue_one_sequence():
    """One sequence fed as chunks of 1, 2 and 5 tokens (varlen, init == out slot) and then 3
    decode steps (update, init == out slot) equals the ref over the whole sequence at once."""
    gen = torch.Generator().manual_seed(11)
    dim, width, slot = 16, 4, 2
    total = 1 + 2 + 5 + 3
    x = torch.randn(total, dim, generator=gen)
    weight, bias = _params(dim, width, gen)
    states = torch.randn(4, width - 1, dim, generator=gen)  # slot 2 garbage: init -1 first
    want_states = states.clone()
    want = causal_conv1d_varlen_ref(
        x, weight, bias, _qsl([total]), want_states, _slots([-1]), _slots([slot])
    )
    pieces, pos = [], 0
    for i, n in enumerate([1, 2, 5]):
        init = _slots([-1 if i == 0 else slot])
        chunk = x[pos : pos + n]
        pieces.append(
            causal_conv1d_varlen(chunk, weight, bias, _qsl([n]), states, init, _slots([slot]))
        )
        pos += n
    for _ in range(3):
        row = x[pos : pos + 1]
        pieces.append(
            causal_conv1d_update(row, weight, bias, states, _slots([slot]), _slots([slot]))
        )
        pos += 1
    assert _rel_err(torch.cat(pieces), want) < 1e-5
    assert torch.equal(states[slot], want_states[slot])
    assert torch.equal(states[slot], x[-(width - 1) :])


@pytest.mark.parametrize("width", [2, 4])
def test_varlen_snapshots_match_prefix_states(width):
    """Snapshot entries (after 1 token: partly the initial state; after K - 1 and more; at the
    end, besides the final state; a sequence from zeros; one continuing in its own slot whose
    snapshot reads the initial state the final store overwrites) equal the final state of a
    call over just that many tokens, in kernel and ref; the final states are unchanged."""
    gen = torch.Generator().manual_seed(width)
    dim, num_slots = 24, 12
    lens = [20, 2, 0, 9]
    init, dest = _slots([0, -1, -1, 1]), _slots([2, 3, -1, 1])
    pos = _slots([[1, width - 1, 13, 20], [1, 2, 1, 1], [1, 1, 1, 1], [1, 5, 9, 1]])
    snap = _slots([[4, 5, 6, 7], [8, 9, -1, -1], [-1, -1, -1, -1], [10, 11, -1, -1]])
    x = _strided(sum(lens), dim, gen)
    weight, bias = _params(dim, width, gen)
    states = torch.randn(num_slots, width - 1, dim, generator=gen)
    before = states.clone()
    plain, want = states.clone(), states.clone()
    qsl = _qsl(lens)
    y_plain = causal_conv1d_varlen_ref(x, weight, bias, qsl, plain, init, dest)
    y_want = causal_conv1d_varlen_ref(
        x, weight, bias, qsl, want, init, dest, snap_pos=pos, snap_slots=snap
    )
    got = causal_conv1d_varlen(
        x, weight, bias, qsl, states, init, dest, snap_pos=pos, snap_slots=snap
    )
    assert torch.equal(y_want, y_plain)
    assert _rel_err(got, y_want) < 1e-5
    assert torch.equal(states, want)  # copies of inputs: exact
    assert torch.equal(want[:4], plain[:4])
    starts = qsl.tolist()
    for b in range(len(lens)):
        for p, slot in zip(pos[b].tolist(), snap[b].tolist(), strict=True):
            if slot < 0:
                continue
            prefix = before.clone()
            lo = starts[b]
            causal_conv1d_varlen_ref(
                x[lo : lo + p], weight, bias, _qsl([p]), prefix, init[b : b + 1], _slots([0])
            )
            assert torch.equal(want[slot], prefix[0]), (b, p)


def test_empty_calls():
    gen = torch.Generator().manual_seed(5)
    weight, bias = _params(8, 4, gen)
    states = torch.randn(2, 3, 8, generator=gen)
    before = states.clone()
    none = _slots([])
    x = torch.zeros(0, 8)
    assert causal_conv1d_varlen(x, weight, bias, _qsl([]), states, none, none).shape == (0, 8)
    assert causal_conv1d_update(x, weight, bias, states, none, none).shape == (0, 8)
    # T = 0 with sequences: a padding one, and one whose state moves from slot 0 to slot 1
    causal_conv1d_varlen(x, weight, bias, _qsl([0, 0]), states, _slots([-1, 0]), _slots([-1, 1]))
    assert torch.equal(states[0], before[0]) and torch.equal(states[1], before[0])


# ----------------------------------------------------------------------------------- update


@pytest.mark.parametrize(
    "width, with_bias, index_dtype",
    [(4, True, torch.int32), (2, True, torch.int64), (8, False, torch.int32)],
)
def test_update_matches_ref(width, with_bias, index_dtype):
    gen = torch.Generator().manual_seed(100 + width)
    dim, num_slots = 40, 9
    # continuing (init == out), restored (3 -> 6), fresh (-1 -> 1), padding (-1, -1),
    # read but not stored (5 -> -1)
    init = _slots([0, 3, -1, -1, 5, 2], index_dtype)
    dest = _slots([0, 6, 1, -1, -1, 2], index_dtype)
    x = _strided(6, dim, gen)
    weight, bias = _params(dim, width, gen, bias=with_bias)
    states = torch.randn(num_slots, width - 1, dim, generator=gen)
    before, want_states, x_before = states.clone(), states.clone(), x.clone()
    got = causal_conv1d_update(x, weight, bias, states, init, dest)
    want = causal_conv1d_update_ref(x, weight, bias, want_states, init, dest)
    assert _rel_err(got, want) < 1e-5  # the padding row too: computed from a zero state
    assert torch.equal(states, want_states)
    assert torch.equal(x, x_before)
    for slot in (3, 4, 5, 7, 8):
        assert torch.equal(states[slot], before[slot])
    assert torch.equal(states[0], torch.cat([before[0][1:], x[0:1]]))


# ------------------------------------------------------------------------------- refusals


def _good_args():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    weight, bias = _params(16, 4, gen)
    states = torch.randn(4, 3, 16, generator=gen)
    return x, weight, bias, _qsl([1, 2, 3]), states, _slots([-1, 0, 1]), _slots([0, 1, 2])


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"x": a["x"][0]}, r"x must be \[tokens, conv_dim\]"),
        (lambda a: {"x": a["x"].double()}, "x must be fp16, bf16 or fp32"),
        (lambda a: {"x": a["x"].t().contiguous().t()}, "x must have unit stride"),
        (lambda a: {"weight": a["weight"][:8]}, r"weight must be \[16, K\]"),
        (lambda a: {"weight": torch.randn(16, 1)}, "kernel width K must be in 2..8"),
        (lambda a: {"weight": torch.randn(16, 9)}, "kernel width K must be in 2..8"),
        (lambda a: {"weight": torch.randn(4, 16).t()}, "weight must be contiguous"),
        (lambda a: {"weight": a["weight"].int()}, "weight must be fp16, bf16 or fp32"),
        (lambda a: {"weight": _meta(a["weight"])}, "weight is on meta"),
        (lambda a: {"bias": a["bias"][:8]}, r"bias must be \[16\]"),
        (lambda a: {"bias": _meta(a["bias"])}, "bias is on meta"),
        (lambda a: {"states": a["states"][:, :2]}, r"conv_states must be \[num_slots, 3, 16\]"),
        (lambda a: {"states": a["states"].half()}, "conv_states must have x's dtype"),
        (lambda a: {"states": a["states"][::2]}, "conv_states must be contiguous"),
        (lambda a: {"states": _meta(a["states"])}, "conv_states is on meta"),
        (lambda a: {"init": a["init"].float()}, "init_slots must be int32 or int64"),
        (lambda a: {"init": a["init"][None]}, "init_slots must be 1-D"),
        (lambda a: {"dest": a["dest"][:2]}, r"out_slots must be \[3\]"),
        (lambda a: {"dest": _meta(a["dest"])}, "out_slots is on meta"),
        (lambda a: {"dest": torch.zeros(6, dtype=torch.int32)[::2]}, "out_slots must be contig"),
        (lambda a: {"qsl": a["qsl"][:3]}, r"query_start_loc must be \[4\]"),
        (lambda a: {"qsl": a["qsl"].float()}, "query_start_loc must be int32 or int64"),
        (lambda a: {"out": torch.empty(6, 8)}, "out must match x"),
        (lambda a: {"out": torch.empty(6, 16, dtype=torch.float16)}, "out must match x"),
        (lambda a: {"out": torch.empty(16, 6).t()}, "out must have unit stride"),
        (lambda a: {"out": a["x"]}, "out must not overlap x"),
        (lambda a: {"out": _meta(a["x"])}, "out is on meta"),
        (lambda a: {"max_query_len": -1}, "max_query_len must be"),
    ],
)
def test_varlen_refuses_bad_arguments(change, match):
    x, weight, bias, qsl, states, init, dest = _good_args()
    a = dict(x=x, weight=weight, bias=bias, qsl=qsl, states=states, init=init, dest=dest)
    a["out"], a["max_query_len"] = None, None
    a.update(change(a))
    with pytest.raises(ValueError, match=match):
        causal_conv1d_varlen(
            a["x"],
            a["weight"],
            a["bias"],
            a["qsl"],
            a["states"],
            a["init"],
            a["dest"],
            out=a["out"],
            max_query_len=a["max_query_len"],
        )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"x": a["x"][:2]}, "one row per sequence"),
        (lambda a: {"x": a["x"].t().contiguous().t()}, "x must have unit stride"),
        (lambda a: {"weight": torch.randn(16, 1)}, "kernel width K must be in 2..8"),
        (lambda a: {"states": a["states"].transpose(1, 2)}, "conv_states must be"),
        (lambda a: {"init": a["init"].to(torch.int16)}, "init_slots must be int32 or int64"),
        (lambda a: {"dest": a["dest"][:1]}, r"out_slots must be \[3\]"),
        (lambda a: {"out": a["x"][:, :8]}, "out must match x"),
    ],
)
def test_update_refuses_bad_arguments(change, match):
    x, weight, bias, _, states, init, dest = _good_args()
    a = dict(x=x[:3], weight=weight, bias=bias, states=states, init=init, dest=dest, out=None)
    a.update(change(a))
    with pytest.raises(ValueError, match=match):
        causal_conv1d_update(
            a["x"], a["weight"], a["bias"], a["states"], a["init"], a["dest"], out=a["out"]
        )


# ------------------------------------------------------------------------------------- GPU


def _check_against_fp32_ref(device, dtype, dim, width, lens, num_decodes, tol, seed=0):
    """A decode call then a varlen call on one states tensor (the mixer's order), in `dtype`,
    against the refs on fp32 copies of the same inputs: outputs within `tol` (norm-wise), states
    equal (they are copies of the inputs)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(lens)
    num_slots = num_seqs + num_decodes + 3
    snap = num_slots - 1  # a prefix snapshot: read, never written
    # varlen sequence b: live slot b; it starts fresh, continues, or restores the snapshot
    init = [[-1, b, snap][b % 3] for b in range(num_seqs)]
    dest = list(range(num_seqs))
    for b, n in enumerate(lens):
        if n == 0:
            init[b] = dest[b] = -1  # padding
    # decode row r: live slot num_seqs + r; continuing, restored, fresh, padding
    rows = [num_seqs + r for r in range(num_decodes)]
    init_d = [[s, snap, -1, -1][r % 4] for r, s in enumerate(rows)]
    dest_d = [[s, s, s, -1][r % 4] for r, s in enumerate(rows)]

    x = _strided(sum(lens), dim, gen, dtype=dtype, device=device)
    xd = _strided(num_decodes, dim, gen, dtype=dtype, device=device)
    weight, bias = _params(dim, width, gen, dtype=dtype, device=device)
    states = torch.randn(num_slots, width - 1, dim, generator=gen).to(device=device, dtype=dtype)
    want_states = states.float().cpu().clone()  # a copy also on CPU
    f32 = [t.float().cpu() for t in (x, xd, weight, bias)]

    got_d = causal_conv1d_update(
        xd, weight, bias, states, _slots(init_d, device=device), _slots(dest_d, device=device)
    )
    got = causal_conv1d_varlen(
        x,
        weight,
        bias,
        _qsl(lens, device=device),
        states,
        _slots(init, device=device),
        _slots(dest, device=device),
        max_query_len=max(lens),
    )
    want_d = causal_conv1d_update_ref(
        f32[1], f32[2], f32[3], want_states, _slots(init_d), _slots(dest_d)
    )
    want = causal_conv1d_varlen_ref(
        f32[0], f32[2], f32[3], _qsl(lens), want_states, _slots(init), _slots(dest)
    )
    assert got.dtype == dtype and got_d.dtype == dtype and states.dtype == dtype
    assert _rel_err(got_d, want_d) < tol, (dtype, "update")
    assert _rel_err(got, want) < tol, (dtype, "varlen")
    assert torch.equal(states.float().cpu(), want_states), dtype


def test_fp32_ref_comparison_helper_on_the_interpreter():
    """The GPU test's comparison at tiny shapes, so that its logic runs in CI too."""
    _check_against_fp32_ref("cpu", torch.float32, 24, 4, [5, 1, 0, 2, 9], 5, 1e-5)


def _check_cuda_graph(dim, width, dtype=torch.float32):
    """Both launchers captured in one CUDA graph on static buffers, then replayed after the
    inputs (values, lengths, slots) changed in place: each replay equals the refs."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(1)
    max_tokens, num_seqs, num_rows, num_slots = 300, 4, 8, 20
    x = torch.zeros(max_tokens, dim + 64, device=dev, dtype=dtype)[:, 16 : 16 + dim]
    xd = torch.zeros(num_rows, dim, device=dev, dtype=dtype)
    weight, bias = _params(dim, width, gen, dtype=dtype, device=dev)
    states = torch.zeros(num_slots, width - 1, dim, device=dev, dtype=dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32, device=dev)
    init, dest = (torch.full((num_seqs,), -1, dtype=torch.int32, device=dev) for _ in "ab")
    init_d, dest_d = (torch.full((num_rows,), -1, dtype=torch.int32, device=dev) for _ in "ab")
    out = torch.zeros(max_tokens, dim, device=dev, dtype=dtype)
    out_d = torch.zeros(num_rows, dim, device=dev, dtype=dtype)

    def run():
        causal_conv1d_update(xd, weight, bias, states, init_d, dest_d, out=out_d)
        causal_conv1d_varlen(
            x, weight, bias, qsl, states, init, dest, out=out, max_query_len=max_tokens
        )

    def load(lens, slots_in, slots_out, rows_in, rows_out):
        x.copy_(torch.randn(max_tokens, dim, generator=gen))
        xd.copy_(torch.randn(num_rows, dim, generator=gen))
        states.copy_(torch.randn(num_slots, width - 1, dim, generator=gen))
        qsl.copy_(_qsl(lens))
        init.copy_(_slots(slots_in))
        dest.copy_(_slots(slots_out))
        init_d.copy_(_slots(rows_in))
        dest_d.copy_(_slots(rows_out))

    load([3, 5, 0, 0], [-1, 1, -1, -1], [0, 1, -1, -1], [-1] * 8, [-1] * 8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    configs = [
        (
            [1, 2, 297, 0],
            [-1, 1, 19, -1],
            [0, 1, 2, -1],
            [4, 5, -1, -1, 19, 8, 9, -1],
            [4, 5, 6, -1, 7, 8, 9, -1],
        ),
        ([0, 150, 0, 3], [-1, 3, -1, 2], [-1, 3, -1, 2], [-1] * 6 + [10, 11], [-1] * 6 + [10, 12]),
    ]
    for lens, slots_in, slots_out, rows_in, rows_out in configs:
        load(lens, slots_in, slots_out, rows_in, rows_out)
        want_states = states.float().cpu().clone()  # a copy also on CPU
        graph.replay()
        torch.cuda.synchronize()
        f32 = [t.float().cpu() for t in (x, xd, weight, bias)]
        want_d = causal_conv1d_update_ref(
            f32[1], f32[2], f32[3], want_states, _slots(rows_in), _slots(rows_out)
        )
        want = causal_conv1d_varlen_ref(
            f32[0], f32[2], f32[3], _qsl(lens), want_states, _slots(slots_in), _slots(slots_out)
        )
        total = sum(lens)
        assert _rel_err(out_d, want_d) < 1e-5, lens
        assert _rel_err(out[:total], want[:total]) < 1e-5, lens
        assert torch.equal(states.float().cpu(), want_states), lens


@pytest.mark.gpu
def test_gpu_causal_conv1d_nemotron_h_shapes_and_cuda_graphs():
    """NemotronH-8B's conv (conv_dim 10240, K = 4) on CUDA: bf16 storage within 1e-2 of the
    fp32 ref on the same values, fp32 within 1e-5; then a CUDA graph capture and replays."""
    dim, width = 10240, 4
    lens = [600, 1, 2, 3, 0, 257, 64, 511, 17]
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        _check_against_fp32_ref("cuda", dtype, dim, width, lens, 37, tol)
        _check_against_fp32_ref("cuda", dtype, dim, width, [4096], 1, tol, seed=1)  # one long
    _check_cuda_graph(dim, width)


@pytest.mark.gpu
def test_gpu_causal_conv1d_snapshots_nemotron_h_shape():
    """Snapshot entries at NemotronH-8B's conv_dim on CUDA (bf16): exact copies of the ref's
    (the state is stored inputs), several per sequence, beside a continuing slot."""
    gen = torch.Generator().manual_seed(3)
    dim, width = 8192 + 2 * 8 * 128, 4
    lens = [300, 2, 700]
    x = _strided(sum(lens), dim, gen, dtype=torch.bfloat16, device="cuda")
    weight, bias = _params(dim, width, gen, dtype=torch.bfloat16, device="cuda")
    init = _slots([0, -1, 1], device="cuda")
    dest = _slots([2, 3, 1], device="cuda")
    pos = _slots([[1, 16, 300], [1, 2, 1], [2, 512, 700]], device="cuda")
    snap = _slots([[4, 5, 6], [7, 8, -1], [9, 10, 11]], device="cuda")
    states = torch.randn(12, width - 1, dim, generator=gen).to("cuda", torch.bfloat16)
    want = states.clone()
    qsl = _qsl(lens, device="cuda")
    got = causal_conv1d_varlen(
        x, weight, bias, qsl, states, init, dest, snap_pos=pos, snap_slots=snap
    )
    ref = causal_conv1d_varlen_ref(
        x, weight, bias, qsl, want, init, dest, snap_pos=pos, snap_slots=snap
    )
    assert _rel_err(got, ref) < 1e-2
    assert torch.equal(states, want)
