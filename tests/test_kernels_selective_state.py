"""kernels.selective_state (issue 10: the Mamba2 mixer's one-token decode update): the Triton
kernel against `selective_state_update_ref` (CPU interpreter, fp32, tiny shapes): initial states
from slots or zeros, init == out slots, padding rows that write nothing, slots nobody names left
untouched (and never read: they hold NaN), strided-view inputs, grouped B/C, masked P and N tiles,
dt clamping; the launcher's refusals; and a GPU test (bf16 and fp32 at NemotronH-8B's shape,
CUDA-graph replay). The ref itself is checked against Hugging Face in tests/test_mamba_refs.py."""

from __future__ import annotations

import math

import pytest
import torch

from taipan.kernels.selective_state import selective_state_update, selective_state_update_ref

NAN = float("nan")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


def _inputs(rows, H, P, G, N, *, gen, dtype=torch.float32, device="cpu", param_dtype=None):
    """x, dt, B, C as column views of one projection output (rows wider than their fields), as
    the mixer's in_proj + conv produce them; A < 0; D and dt_bias in `param_dtype`."""
    width = H * P + 2 * G * N + H + 3  # 3 unused columns: each row's stride is not a field's
    proj = torch.randn(rows, width, generator=gen, device=device).to(dtype)
    x = proj[:, : H * P].view(rows, H, P)
    B = proj[:, H * P : H * P + G * N].view(rows, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].view(rows, G, N)
    dt = proj[:, H * P + 2 * G * N : H * P + 2 * G * N + H]
    A = -torch.exp(torch.randn(H, generator=gen, device=device) * 0.5)
    D = torch.randn(H, generator=gen, device=device).to(param_dtype or dtype)
    dt_bias = (torch.randn(H, generator=gen, device=device) * 0.5).to(param_dtype or dtype)
    return x, dt, A, B, C, D, dt_bias


# Row 0 continues in its own slot (init == out), 1 starts from zeros into slot 0, 2 reads slot 4
# into slot 2, 3 is padding (both -1), 4 reads slot 3 and stores nothing. Slots 0, 2 and 5 are
# never read: they hold NaN.
INIT = [1, -1, 4, -1, 3]
DEST = [1, 0, 2, -1, -1]
REAL_ROWS = [0, 1, 2, 4]


@pytest.mark.parametrize(
    "G, P, N, dt_min, dt_max, index_dtype, param_dtype",
    [
        (2, 16, 16, 0.0, math.inf, torch.int32, torch.float32),
        (1, 24, 128, 0.0, math.inf, torch.int64, torch.float64),  # two masked P blocks
        (4, 16, 12, 0.3, math.inf, torch.int32, torch.float32),  # masked N; dt clamped below
        (2, 8, 16, 0.05, 0.7, torch.int64, torch.float32),  # dt clamped both ways
    ],
)
def test_selective_state_update_matches_ref(G, P, N, dt_min, dt_max, index_dtype, param_dtype):
    H = 4
    gen = torch.Generator().manual_seed(G * 100 + P + N)
    x, dt, A, B, C, D, dt_bias = _inputs(5, H, P, G, N, gen=gen, param_dtype=param_dtype)
    states = torch.full((6, H, P, N), NAN)
    for slot in (1, 3, 4):
        states[slot] = torch.randn(H, P, N, generator=gen)
    init, dest = torch.tensor(INIT, dtype=index_dtype), torch.tensor(DEST, dtype=index_dtype)
    start, want_states = states.clone(), states.clone()
    x_before = x.clone()
    kwargs = dict(dt_min=dt_min, dt_max=dt_max)
    got = selective_state_update(x, dt, A, B, C, D, dt_bias, states, init, dest, **kwargs)
    want = selective_state_update_ref(x, dt, A, B, C, D, dt_bias, want_states, init, dest, **kwargs)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(x, x_before)
    assert _rel_err(got[REAL_ROWS], want[REAL_ROWS]) < 1e-5
    torch.testing.assert_close(got[REAL_ROWS], want[REAL_ROWS], rtol=1e-4, atol=1e-4)
    for slot in (0, 1, 2):
        assert _rel_err(states[slot], want_states[slot]) < 1e-5, slot
    torch.testing.assert_close(states[3:], start[3:], rtol=0, atol=0, equal_nan=True)
    if dt_min > 0 or dt_max < math.inf:  # the clamp matters here
        unclamped = selective_state_update_ref(x, dt, A, B, C, D, dt_bias, start, init, dest)
        assert _rel_err(got[REAL_ROWS], unclamped[REAL_ROWS]) > 1e-2


def test_selective_state_update_out_buffer_in_place_and_empty():
    gen = torch.Generator().manual_seed(4)
    H, P, G, N = 2, 16, 1, 16
    x, dt, A, B, C, D, dt_bias = _inputs(3, H, P, G, N, gen=gen)
    start = torch.randn(4, H, P, N, generator=gen)
    init, dest = torch.tensor([0, -1, 2]), torch.tensor([0, 1, 3])
    args = (dt, A, B, C, D, dt_bias)
    want_states = start.clone()
    want = selective_state_update_ref(x, *args, want_states, init, dest)
    # out: a strided view (a column slice of a wider buffer)
    out = torch.full((3, H * P + 5), NAN)[:, 5:].view(3, H, P)
    states = start.clone()
    got = selective_state_update(x, *args, states, init, dest, out=out)
    assert got is out and _rel_err(out, want) < 1e-5
    assert _rel_err(states, want_states) < 1e-5
    # out = x: each program reads its x before it writes y
    x_copy, states = x.clone(), start.clone()
    got = selective_state_update(x_copy, *args, states, init, dest, out=x_copy)
    assert got is x_copy and _rel_err(x_copy, want) < 1e-5
    # no rows
    none = torch.zeros(0, dtype=torch.int32)
    states = start.clone()
    y = selective_state_update(x[:0], dt[:0], A, B[:0], C[:0], D, dt_bias, states, none, none)
    assert y.shape == (0, H, P) and torch.equal(states, start)


def _good_args(R=3, H=4, P=16, G=2, N=16, slots=3):
    gen = torch.Generator().manual_seed(0)
    x, dt, A, B, C, D, dt_bias = _inputs(R, H, P, G, N, gen=gen)
    return dict(
        x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
        ssm_states=torch.zeros(slots, H, P, N),
        init_slots=torch.tensor([0, -1, 2], dtype=torch.int32)[:R],
        out_slots=torch.tensor([0, 1, -1], dtype=torch.int32)[:R],
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
        (_replace(x=lambda a: a["x"].to(torch.int32)), {}, "x must be"),
        (_replace(x=lambda a: a["x"].transpose(1, 2).contiguous().transpose(1, 2)), {}, "unit"),
        (_replace(dt=lambda a: a["dt"][:2]), {}, "dt must have shape"),
        (_replace(B=lambda a: a["B"][:, :1].expand(3, 3, 16)), {}, "must divide the heads"),
        (_replace(C=lambda a: a["C"][:2]), {}, "C must have shape"),
        (_replace(B=lambda a: a["B"].transpose(1, 2).contiguous().transpose(1, 2)), {}, "unit"),
        (_replace(B=torch.zeros(3, 2, 512), C=torch.zeros(3, 2, 512)), {}, "state size N"),
        (_replace(A=lambda a: a["A"].double()), {}, "A must be a contiguous"),
        (_replace(D=lambda a: a["D"][:2]), {}, "D must be a contiguous"),
        (_replace(dt_bias=lambda a: torch.zeros(8)[::2]), {}, "dt_bias must be a contiguous"),
        (_replace(ssm_states=lambda a: a["ssm_states"].half()), {}, "ssm_states must be"),
        (_replace(ssm_states=torch.zeros(3, 4, 16, 8)), {}, "ssm_states must be"),
        (_replace(init_slots=lambda a: a["init_slots"].float()), {}, "init_slots must be"),
        (_replace(out_slots=torch.zeros(2, dtype=torch.int32)), {}, r"out_slots must be .*\[3\]"),
        (
            _replace(init_slots=torch.zeros(2, dtype=torch.int32)),
            {},
            "out_slots must be",  # init_slots sets the row count, out_slots disagrees
        ),
        (
            _replace(init_slots=torch.zeros(2, dtype=torch.int32), out_slots=torch.zeros(2)),
            {},
            "out_slots must be",
        ),
        (
            _replace(
                init_slots=torch.zeros(2, dtype=torch.int32),
                out_slots=torch.zeros(2, dtype=torch.int32),
            ),
            {},
            "one entry per row of x",
        ),
        (_replace(ssm_states=torch.zeros(3, 4, 16, 16, device=META)), {}, "ssm_states is on"),
        (_replace(out_slots=torch.zeros(3, dtype=torch.int64, device=META)), {}, "is on meta"),
        (_replace(dt=torch.zeros(3, 4, device=META)), {}, "dt is on meta"),
        (_replace(), dict(out=torch.zeros(3, 4, 16, dtype=torch.bfloat16)), "out must be"),
        (_replace(), dict(out=torch.zeros(3, 4, 8)), "out must have shape"),
    ],
)
def test_selective_state_update_refuses_bad_arguments(make, kwargs, match):
    args = make(_good_args())
    with pytest.raises(ValueError, match=match):
        selective_state_update(**args, **kwargs)


@pytest.mark.gpu
def test_gpu_selective_state_update_nemotron_shape():
    """NemotronH-8B's mixer (H=128, P=64, G=8, N=128) on CUDA, 64 decode rows: bf16 and fp32
    storage against the ref on fp32 copies; then the launcher captured in a CUDA graph, its
    inputs changed in place (other slots, more padding rows), replayed."""
    H, P, G, N, rows = 128, 64, 8, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.arange(rows)
    # Row b reads slot b (every 4th row: zeros) and writes it back (even rows) or slot rows + b
    # (odd rows); every 7th row stores nothing; row 5 is padding. No row writes a slot that
    # another row reads.
    init = torch.where(b % 4 == 3, -1, b)
    dest = torch.where(b % 2 == 0, b, rows + b)
    dest = torch.where(b % 7 == 3, -1, dest)
    init[5] = dest[5] = -1
    init, dest = init.to(torch.int32).cuda(), dest.to(torch.int32).cuda()
    real = (init >= 0) | (dest >= 0)
    written = dest[dest >= 0].long()
    kept = torch.ones(2 * rows, dtype=torch.bool, device="cuda")
    kept[written] = False
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-4)):
        x, dt, A, B, C, D, dt_bias = _inputs(rows, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
        states = torch.randn(2 * rows, H, P, N, generator=gen, device="cuda")
        want_states = states.clone()
        got = selective_state_update(x, dt, A, B, C, D, dt_bias, states, init, dest)
        want = selective_state_update_ref(
            x.float(), dt.float(), A, B.float(), C.float(), D.float(), dt_bias.float(),
            want_states, init, dest,
        )  # fmt: skip
        assert _rel_err(got[real], want[real]) < tol, dtype
        assert _rel_err(states[written], want_states[written]) < tol, dtype
        assert torch.equal(states[kept], want_states[kept])

    # CUDA graph: compile outside the capture, capture, then change every input in place.
    dtype = torch.bfloat16
    x, dt, A, B, C, D, dt_bias = _inputs(rows, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
    states = torch.randn(2 * rows, H, P, N, generator=gen, device="cuda")
    out = torch.empty(rows, H, P, dtype=dtype, device="cuda")
    args = (x, dt, A, B, C, D, dt_bias, states, init, dest)
    selective_state_update(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_state_update(*args, out=out)
    new = _inputs(rows, H, P, G, N, gen=gen, dtype=dtype, device="cuda")
    for static, fresh in zip((x, dt, A, B, C, D, dt_bias), new, strict=True):
        static.copy_(fresh)
    # now: row b reads slot rows + b (odd rows: zeros) and writes slot b; rows >= 48 are padding
    b = b.cuda()
    init.copy_(torch.where(b % 2 == 1, -1, rows + b))
    dest.copy_(b)
    init[48:] = dest[48:] = -1
    states.copy_(torch.randn(2 * rows, H, P, N, generator=gen, device="cuda"))
    want_states = states.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = selective_state_update_ref(
        x.float(), dt.float(), A, B.float(), C.float(), D.float(), dt_bias.float(),
        want_states, init, dest,
    )  # fmt: skip
    assert _rel_err(out[:48], want[:48]) < 1e-2
    assert _rel_err(states[:48], want_states[:48]) < 1e-2
    assert torch.equal(states[48:], want_states[48:])
