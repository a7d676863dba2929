"""kernels.ssd_scan (issue 10: the Mamba2 mixer's chunked SSD scan over a varlen prefill batch):
the Triton kernel against `ssd_scan_varlen_ref` (CPU interpreter, fp32, tiny shapes): sequences
shorter than, equal to and several times the chunk, chunks longer than the kernel's step, initial
states from slots or zeros, init == out slots, slots nobody names left untouched (and never
read: they hold NaN), zero-length sequences, strided-view inputs, grouped B/C, dt clamping; the
launcher's refusals; and a GPU test (bf16 and fp32 at NemotronH-8B's shape, CUDA-graph replay).
The ref itself is checked against Hugging Face in tests/test_mamba_refs.py."""

from __future__ import annotations

import math

import pytest
import torch

from taipan.kernels.ssd_scan import ssd_scan_varlen, ssd_scan_varlen_ref

NAN = float("nan")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


def _qsl(lens, dtype=torch.int32, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device=device)


def _inputs(total, H, P, G, N, *, gen, dtype=torch.float32, device="cpu", param_dtype=None):
    """x, dt, B, C as column views of one projection output (rows wider than their fields), as
    the mixer's in_proj + conv produce them; A < 0; D and dt_bias in `param_dtype`."""
    width = H * P + 2 * G * N + H + 3  # 3 unused columns: each row's stride is not a field's
    proj = torch.randn(total, width, generator=gen, device=device).to(dtype)
    x = proj[:, : H * P].view(total, H, P)
    B = proj[:, H * P : H * P + G * N].view(total, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].view(total, G, N)
    dt = proj[:, H * P + 2 * G * N : H * P + 2 * G * N + H]
    A = -torch.exp(torch.randn(H, generator=gen, device=device) * 0.5)
    D = torch.randn(H, generator=gen, device=device).to(param_dtype or dtype)
    dt_bias = (torch.randn(H, generator=gen, device=device) * 0.5).to(param_dtype or dtype)
    return x, dt, A, B, C, D, dt_bias


def _assert_slots(got, want, slots):
    """The named slots match (NaN where the ref has NaN: untouched slots hold NaN)."""
    torch.testing.assert_close(got[slots], want[slots], rtol=0, atol=0, equal_nan=True)


# Sequence 0 starts from zeros, 1 continues in its own slot (init == out), 2 is padding (empty,
# no slots), 3 reads slot 3 into slot 4 (it is longer than every chunk, and than the kernel's
# step of ssd_scan.MAX_STEP = 32 tokens), 4 reads slot 5 and stores nothing. Slots 0, 1, 2, 4
# and 6 are never read: they hold NaN.
LENS = [1, 8, 0, 35, 3]
INIT = [-1, 2, -1, 3, 5]
DEST = [0, 2, -1, 4, -1]
NUM_SLOTS = 7


@pytest.mark.parametrize(
    "chunk, G, P, N, dt_min, dt_max, index_dtype, param_dtype",
    [
        (4, 2, 16, 16, 0.0, math.inf, torch.int32, torch.float32),
        (8, 1, 24, 12, 0.0, math.inf, torch.int64, torch.float64),  # masked P and N tiles
        (16, 4, 16, 16, 0.3, math.inf, torch.int32, torch.float32),  # dt clamped from below
        (48, 2, 16, 32, 0.05, 0.7, torch.int32, torch.float32),  # chunk > step; dt_max
    ],
)
def test_ssd_scan_matches_ref(chunk, G, P, N, dt_min, dt_max, index_dtype, param_dtype):
    H = 4
    gen = torch.Generator().manual_seed(chunk * 10 + G)
    total = sum(LENS)
    x, dt, A, B, C, D, dt_bias = _inputs(total, H, P, G, N, gen=gen, param_dtype=param_dtype)
    states = torch.full((NUM_SLOTS, H, P, N), NAN)
    for slot in (2, 3, 5):
        states[slot] = torch.randn(H, P, N, generator=gen)
    qsl = _qsl(LENS, index_dtype)
    init, dest = torch.tensor(INIT, dtype=index_dtype), torch.tensor(DEST, dtype=index_dtype)
    start, want_states = states.clone(), states.clone()
    x_before = x.clone()
    kwargs = dict(chunk_size=chunk, dt_min=dt_min, dt_max=dt_max)
    got = ssd_scan_varlen(x, dt, A, B, C, D, dt_bias, qsl, states, init, dest, **kwargs)
    want = ssd_scan_varlen_ref(x, dt, A, B, C, D, dt_bias, qsl, want_states, init, dest, **kwargs)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(x, x_before)
    assert _rel_err(got, want) < 2e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for slot in (0, 2, 4):
        assert _rel_err(states[slot], want_states[slot]) < 2e-5, slot
    _assert_slots(states, want_states, [1, 3, 5, 6])
    if dt_min > 0 or dt_max < math.inf:  # the clamp matters here
        unclamped = ssd_scan_varlen_ref(
            x, dt, A, B, C, D, dt_bias, qsl, start, init, dest, chunk_size=chunk
        )
        assert _rel_err(got, unclamped) > 1e-2


# Snapshot entries: sequence 0 (40 tokens, from slot 0) snapshots after 1 token, after 16 and 20
# (two in one kernel step), after 32 (a step's last token) and 40 (its last token, besides its
# final state); sequence 1 (5 tokens, from zeros) after 3; sequence 2 (padding) has an entry
# with slot -1; sequence 3 (33 tokens) after 33 (the first token of a step, and its end).
SNAP_LENS = [40, 5, 0, 33]
SNAP_INIT = [0, -1, -1, 1]
SNAP_DEST = [2, 3, -1, 1]
SNAP_POS = [[1, 16, 20, 32, 40], [3, 1, 1, 1, 1], [1, 1, 1, 1, 1], [33, 1, 1, 1, 1]]
SNAP_SLOTS = [[4, 5, 6, 7, 8], [9, -1, -1, -1, -1], [-1] * 5, [10, -1, -1, -1, -1]]


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_ssd_scan_snapshots_match_prefix_states(chunk):
    """Each snapshot equals the ref's final state over just that many tokens (an independent
    oracle: no snapshot code), and the kernel's snapshots and outputs equal the ref's; the
    final states are what they are without snapshots; slots nobody names stay NaN."""
    H, P, G, N = 2, 16, 1, 16
    gen = torch.Generator().manual_seed(chunk)
    x, dt, A, B, C, D, dt_bias = _inputs(sum(SNAP_LENS), H, P, G, N, gen=gen)
    states = torch.full((12, H, P, N), NAN)
    states[0], states[1] = torch.randn(2, H, P, N, generator=gen)
    qsl = _qsl(SNAP_LENS)
    init, dest = torch.tensor(SNAP_INIT), torch.tensor(SNAP_DEST)
    pos, slots = torch.tensor(SNAP_POS), torch.tensor(SNAP_SLOTS)
    args = (x, dt, A, B, C, D, dt_bias, qsl)
    plain, want, got = states.clone(), states.clone(), states.clone()
    y_plain = ssd_scan_varlen_ref(*args, plain, init, dest, chunk_size=chunk)
    y_want = ssd_scan_varlen_ref(
        *args, want, init, dest, chunk_size=chunk, snap_pos=pos, snap_slots=slots
    )
    y_got = ssd_scan_varlen(
        *args, got, init, dest, chunk_size=chunk, snap_pos=pos, snap_slots=slots
    )
    assert torch.equal(y_want, y_plain)
    assert _rel_err(y_got, y_want) < 2e-5
    for slot in range(12):
        if slot in (0, 11):  # read only / never named
            _assert_slots(got, want, [slot])
        else:
            assert _rel_err(got[slot], want[slot]) < 2e-5, slot
    torch.testing.assert_close(want[:4], plain[:4], rtol=0, atol=0, equal_nan=True)
    starts = qsl.tolist()
    for b, (row_pos, row_slots) in enumerate(zip(SNAP_POS, SNAP_SLOTS, strict=True)):
        for p, slot in zip(row_pos, row_slots, strict=True):
            if slot < 0:
                continue
            lo = starts[b]
            prefix = states.clone()
            ssd_scan_varlen_ref(
                x[lo : lo + p], dt[lo : lo + p], A, B[lo : lo + p], C[lo : lo + p], D, dt_bias,
                _qsl([p]), prefix, init[b : b + 1], torch.tensor([11]), chunk_size=chunk,
            )  # fmt: skip
            assert _rel_err(want[slot], prefix[11]) < 2e-5, (b, p)


def test_ssd_scan_refuses_bad_snapshot_arguments():
    H, P, G, N = 2, 16, 1, 16
    gen = torch.Generator().manual_seed(0)
    x, dt, A, B, C, D, dt_bias = _inputs(4, H, P, G, N, gen=gen)
    states = torch.zeros(3, H, P, N)
    args = (x, dt, A, B, C, D, dt_bias, _qsl([4]), states, torch.tensor([-1]), torch.tensor([0]))
    pos = torch.tensor([[2]])
    for kw, match in (
        ({"snap_pos": pos}, "both or neither"),
        ({"snap_pos": pos, "snap_slots": torch.tensor([1])}, "snap_slots must be"),
        ({"snap_pos": pos.float(), "snap_slots": pos}, "snap_pos must be"),
        ({"snap_pos": torch.ones(1, 9, dtype=torch.int64), "snap_slots": pos}, "K <= 8"),
        ({"snap_pos": pos, "snap_slots": torch.tensor([[1, 2]])}, "differ"),
    ):
        with pytest.raises(ValueError, match=match):
            ssd_scan_varlen(*args, chunk_size=4, **kw)


def test_ssd_scan_result_does_not_depend_on_chunk_size():
    gen = torch.Generator().manual_seed(5)
    H, P, G, N = 2, 16, 1, 16
    lens = [13, 22]
    x, dt, A, B, C, D, dt_bias = _inputs(sum(lens), H, P, G, N, gen=gen)
    init, dest = torch.tensor([0, -1]), torch.tensor([1, 2])
    start = torch.randn(3, H, P, N, generator=gen)
    results = []
    for chunk in (1, 5, 16, 256):
        states = start.clone()
        y = ssd_scan_varlen(
            x, dt, A, B, C, D, dt_bias, _qsl(lens), states, init, dest, chunk_size=chunk
        )
        results.append((y, states))
    for y, states in results[1:]:
        assert _rel_err(y, results[0][0]) < 2e-5
        assert _rel_err(states, results[0][1]) < 2e-5


def test_ssd_scan_empty_sequences_copy_their_state():
    """A sequence with no tokens stores its initial state (zeros for slot -1) into its out slot,
    as the ref does; with no tokens at all the kernel still runs; with no sequences it does
    nothing."""
    gen = torch.Generator().manual_seed(11)
    H, P, G, N = 2, 16, 2, 16
    for lens in ([0, 4, 0], [0, 0, 0]):
        total = sum(lens)
        x, dt, A, B, C, D, dt_bias = _inputs(total, H, P, G, N, gen=gen)
        states = torch.randn(6, H, P, N, generator=gen)
        init, dest = torch.tensor([1, -1, -1]), torch.tensor([3, 4, 5])
        want_states = states.clone()
        args = (x, dt, A, B, C, D, dt_bias, _qsl(lens), states, init, dest)
        got = ssd_scan_varlen(*args, chunk_size=8)
        want = ssd_scan_varlen_ref(*args[:8], want_states, init, dest, chunk_size=8)
        assert got.shape == (total, H, P)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
        assert torch.equal(states[3], want_states[1]) and not states[5].any()
    none = torch.zeros(0, dtype=torch.int32)
    x, dt, A, B, C, D, dt_bias = _inputs(3, H, P, G, N, gen=gen)
    states = torch.randn(2, H, P, N, generator=gen)
    before = states.clone()
    y = ssd_scan_varlen(
        x, dt, A, B, C, D, dt_bias, torch.zeros(1, dtype=torch.int32), states, none, none,
        chunk_size=4,
    )  # fmt: skip
    assert y.shape == x.shape and torch.equal(states, before)


def test_ssd_scan_out_buffer_and_in_place():
    gen = torch.Generator().manual_seed(2)
    H, P, G, N = 2, 16, 1, 16
    lens = [6, 9]
    x, dt, A, B, C, D, dt_bias = _inputs(sum(lens), H, P, G, N, gen=gen)
    init, dest = torch.tensor([-1, 0]), torch.tensor([1, 0])
    start = torch.randn(2, H, P, N, generator=gen)
    args = (dt, A, B, C, D, dt_bias, _qsl(lens))
    want = ssd_scan_varlen_ref(x, *args, start.clone(), init, dest, chunk_size=4)
    # out: a strided view (a column slice of a wider buffer)
    buffer = torch.full((sum(lens), H * P + 5), NAN)
    out = buffer[:, 5:].view(sum(lens), H, P)
    got = ssd_scan_varlen(x, *args, start.clone(), init, dest, chunk_size=4, out=out)
    assert got is out and _rel_err(out, want) < 2e-5
    # out = x: each program reads a step's x before it writes that step's y
    x_copy = x.clone()
    got = ssd_scan_varlen(x_copy, *args, start.clone(), init, dest, chunk_size=4, out=x_copy)
    assert got is x_copy and _rel_err(x_copy, want) < 2e-5


def _good_args(T=5, H=4, P=16, G=2, N=16, S=2, slots=3):
    gen = torch.Generator().manual_seed(0)
    x, dt, A, B, C, D, dt_bias = _inputs(T, H, P, G, N, gen=gen)
    return dict(
        x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
        query_start_loc=torch.tensor([0, 2, T], dtype=torch.int32)[: S + 1],
        ssm_states=torch.zeros(slots, H, P, N),
        init_slots=torch.tensor([0, -1], dtype=torch.int32)[:S],
        out_slots=torch.tensor([1, 2], dtype=torch.int32)[:S],
    )  # fmt: skip


def _replace(**changes):
    def make(args):
        for key, value in changes.items():
            args[key] = value(args) if callable(value) else value
        return args

    return make


META = torch.device("meta")


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (_replace(x=lambda a: a["x"][:, 0]), {}, r"x must be \[tokens, heads, head_dim\]"),
        (_replace(x=lambda a: a["x"].double()), {}, "x must be"),
        (_replace(x=lambda a: a["x"].transpose(1, 2).contiguous().transpose(1, 2)), {}, "unit"),
        (_replace(dt=lambda a: a["dt"][:, :3]), {}, "dt must have shape"),
        (_replace(dt=lambda a: a["dt"].to(torch.int32)), {}, "dt must be"),
        (_replace(B=lambda a: a["B"][:, :1].expand(5, 3, 16)), {}, "must divide the heads"),
        (_replace(C=lambda a: a["C"][:, :, :8]), {}, "C must have shape"),
        (_replace(C=lambda a: a["C"].transpose(1, 2).contiguous().transpose(1, 2)), {}, "unit"),
        (_replace(B=torch.zeros(5, 2, 272), C=torch.zeros(5, 2, 272)), {}, "state size N"),
        (_replace(A=lambda a: a["A"].half()), {}, "A must be a contiguous"),
        (_replace(D=lambda a: a["D"][:3]), {}, "D must be a contiguous"),
        (_replace(dt_bias=lambda a: a["dt_bias"].long()), {}, "dt_bias must be"),
        (_replace(ssm_states=lambda a: a["ssm_states"].bfloat16()), {}, "ssm_states must be"),
        (_replace(ssm_states=torch.zeros(3, 4, 8, 16)), {}, "ssm_states must be"),
        (_replace(ssm_states=torch.zeros(3, 4, 16, 16).transpose(2, 3)), {}, "ssm_states must"),
        (_replace(init_slots=lambda a: a["init_slots"].float()), {}, "init_slots must be"),
        (_replace(init_slots=torch.zeros(2, 1, dtype=torch.int32)), {}, "init_slots must be"),
        (_replace(out_slots=torch.zeros(3, dtype=torch.int32)), {}, r"out_slots must be .*\[2\]"),
        (_replace(query_start_loc=torch.tensor([0, 5])), {}, r"query_start_loc must be .*\[3\]"),
        (_replace(query_start_loc=lambda a: a["query_start_loc"].short()), {}, "query_start"),
        (_replace(), dict(chunk_size=0), "chunk_size"),
        (_replace(), dict(chunk_size=4.0), "chunk_size"),
        (_replace(ssm_states=torch.zeros(3, 4, 16, 16, device=META)), {}, "ssm_states is on"),
        (_replace(init_slots=torch.zeros(2, dtype=torch.int32, device=META)), {}, "is on meta"),
        (_replace(B=torch.zeros(5, 2, 16, device=META)), {}, "B is on meta"),
        (_replace(), dict(out=torch.zeros(5, 4, 16, dtype=torch.float16)), "out must be"),
        (_replace(), dict(out=torch.zeros(5, 16, 4).transpose(1, 2)), "out must have unit"),
    ],
)
def test_ssd_scan_refuses_bad_arguments(make, kwargs, match):
    args = make(_good_args())
    kwargs = {"chunk_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        ssd_scan_varlen(**args, **kwargs)


@pytest.mark.gpu
def test_gpu_ssd_scan_nemotron_shape():
    """NemotronH-8B's mixer (H=128, P=64, G=8, N=128, chunk 128) on CUDA: bf16 and fp32 storage
    against the ref on fp32 copies; then the launcher captured in a CUDA graph, its inputs
    changed in place (other lengths, a padding sequence, other slots), replayed."""
    H, P, G, N, chunk = 128, 64, 8, 128, 128
    lens = [1, 100, 128, 300, 700]
    total = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = torch.tensor([-1, 2, -1, 5, 6], dtype=torch.int32, device="cuda")
    dest = torch.tensor([0, 2, 3, 5, 7], dtype=torch.int32, device="cuda")
    qsl = _qsl(lens, device="cuda")
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-4)):
        x, dt, A, B, C, D, dt_bias = _inputs(total, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
        states = torch.randn(9, H, P, N, generator=gen, device="cuda")
        want_states = states.clone()
        got = ssd_scan_varlen(x, dt, A, B, C, D, dt_bias, qsl, states, init, dest, chunk_size=chunk)
        want = ssd_scan_varlen_ref(
            x.float(), dt.float(), A, B.float(), C.float(), D.float(), dt_bias.float(),
            qsl, want_states, init, dest, chunk_size=chunk,
        )  # fmt: skip
        assert _rel_err(got, want) < tol, dtype
        for slot in (0, 2, 3, 5, 7):
            assert _rel_err(states[slot], want_states[slot]) < tol, (dtype, slot)
        assert torch.equal(states[[1, 4, 6, 8]], want_states[[1, 4, 6, 8]])

    # CUDA graph: compile outside the capture, capture, then change every input in place.
    dtype = torch.bfloat16
    x, dt, A, B, C, D, dt_bias = _inputs(total, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
    states = torch.randn(9, H, P, N, generator=gen, device="cuda")
    out = torch.empty(total, H, P, dtype=dtype, device="cuda")
    args = (x, dt, A, B, C, D, dt_bias, qsl, states, init, dest)
    ssd_scan_varlen(*args, chunk_size=chunk, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ssd_scan_varlen(*args, chunk_size=chunk, out=out)
    new = _inputs(total, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
    for static, fresh in zip((x, dt, A, B, C, D, dt_bias), new, strict=True):
        static.copy_(fresh)
    qsl.copy_(_qsl([600, 0, 29, 200, 400], device="cuda"))  # sequence 1 is now padding
    init.copy_(torch.tensor([4, -1, 1, -1, 7], dtype=torch.int32))
    dest.copy_(torch.tensor([4, -1, 8, 0, 6], dtype=torch.int32))
    states.copy_(torch.randn(9, H, P, N, generator=gen, device="cuda"))
    want_states = states.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = ssd_scan_varlen_ref(
        x.float(), dt.float(), A, B.float(), C.float(), D.float(), dt_bias.float(),
        qsl, want_states, init, dest, chunk_size=chunk,
    )  # fmt: skip
    assert _rel_err(out, want) < 1e-2
    for slot in (4, 8, 0, 6):
        assert _rel_err(states[slot], want_states[slot]) < 1e-2, slot
    assert torch.equal(states[[1, 2, 3, 5, 7]], want_states[[1, 2, 3, 5, 7]])


@pytest.mark.gpu
def test_gpu_ssd_scan_snapshots_nemotron_shape():
    """Snapshot entries at NemotronH-8B's shape on CUDA (bf16 storage): inside a 32-token step,
    on step edges, at a sequence's end, several per sequence, against the ref on fp32 copies."""
    H, P, G, N, chunk = 128, 64, 8, 128, 128
    lens = [300, 64, 700]
    gen = torch.Generator(device="cuda").manual_seed(1)
    x, dt, A, B, C, D, dt_bias = _inputs(
        sum(lens), H, P, G, N, gen=gen, dtype=torch.bfloat16, device="cuda"
    )
    init = torch.tensor([0, -1, 1], dtype=torch.int32, device="cuda")
    dest = torch.tensor([2, 3, 1], dtype=torch.int32, device="cuda")
    pos = torch.tensor([[16, 32, 33, 300], [64, 1, 1, 1], [256, 512, 700, 1]], device="cuda")
    slots = torch.tensor([[4, 5, 6, 7], [8, -1, -1, -1], [9, 10, 11, -1]], device="cuda")
    states = torch.randn(12, H, P, N, generator=gen, device="cuda")
    want_states = states.clone()
    qsl = _qsl(lens, device="cuda")
    snaps = {"snap_pos": pos, "snap_slots": slots}
    got = ssd_scan_varlen(
        x, dt, A, B, C, D, dt_bias, qsl, states, init, dest, chunk_size=chunk, **snaps
    )
    want = ssd_scan_varlen_ref(
        x.float(), dt.float(), A, B.float(), C.float(), D.float(), dt_bias.float(),
        qsl, want_states, init, dest, chunk_size=chunk, **snaps,
    )  # fmt: skip
    assert _rel_err(got, want) < 1e-2
    for slot in range(2, 12):
        assert _rel_err(states[slot], want_states[slot]) < 1e-2, slot
    assert torch.equal(states[0], want_states[0])
