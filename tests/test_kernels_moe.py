"""kernels.moe (issue 12: the fused MoE experts): `fused_moe` against `fused_moe_ref` (CPU
interpreter, fp32, tiny shapes): both activations, one to four local experts, expert ranges that
exclude some or all choices, strided inputs, masked K and N tails, the `out=` path; the
alignment step against `moe_align_ref`; no host sync in the launcher; every refusal; a tensor-
parallel rank's share of each expert's intermediate size (smaller I: the ranks' partial sums add
up to the whole). GPU tests (bf16 and fp32 at Qwen3-30B-A3B's and a NemotronH-style layer's
sizes, also split over 4 and 8 ranks; a CUDA graph replayed with new inputs) carry the `gpu`
marker."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.moe import fused_moe, fused_moe_ref
from taipan.kernels.moe_align import moe_align, moe_align_ref

NAN = float("nan")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


def _problem(T, H, inter, k, E_local, E_total, activation, *, seed, dtype=torch.float32,
             device="cpu"):  # fmt: skip
    """x, w1, w2 (scaled so that activations stay O(1)), and a top-k routing over E_total
    global experts: distinct ids per token, softmax weights renormalized over the k."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = 2 * inter if activation == "swiglu" else inter
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    w1 = (torch.randn(E_local, n, H, generator=g, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E_local, H, inter, generator=g, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(T, E_total, generator=g, device=device)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, w1, w2, ids, weights / weights.sum(-1, keepdim=True)


# T, H, I, k, E_local, E_total, expert_start. With the interpreter's 32-wide tiles, I = 48 wraps
# the last N tile onto real rows (stores masked); H = 40, I = 24 (not multiples of 16) take the
# masked K-tail loads.
CASES = [
    (1, 32, 16, 1, 1, 1, 0),  # one token, one expert
    (3, 48, 32, 2, 4, 4, 0),  # every choice local
    (17, 32, 48, 2, 4, 8, 2),  # experts 2..5 of 8: some choices elsewhere
    (17, 64, 32, 1, 1, 4, 3),  # the last expert of 4 only
    (3, 32, 32, 2, 4, 12, 8),  # a range some tokens miss entirely
    (5, 40, 24, 2, 3, 3, 0),  # K tails in both GEMMs
]


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-H{}-I{}-k{}-E{}of{}@{}".format(*c))
def test_fused_moe_matches_ref(activation, case):
    T, H, inter, k, E_local, E_total, start = case
    x, w1, w2, ids, weights = _problem(T, H, inter, k, E_local, E_total, activation, seed=sum(case))
    want = fused_moe_ref(x, w1, w2, ids, weights, activation=activation, expert_start=start)
    got = fused_moe(x, w1, w2, ids, weights, activation=activation, expert_start=start)
    assert got.shape == (T, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    local = (ids >= start) & (ids < start + E_local)
    assert torch.equal(got[~local.any(1)], torch.zeros_like(got[~local.any(1)]))


def _tp_shard(w1, w2, activation: str, rank: int, size: int):
    """A tensor-parallel rank's experts (ops/sharding.py's split): intermediate channels
    [rank * I / size, ...) of w1's gate and up rows and of w2's columns."""
    inter = w2.shape[2]
    count = inter // size
    own = torch.arange(rank * count, (rank + 1) * count, device=w1.device)
    rows = torch.cat([own, inter + own]) if activation == "swiglu" else own
    return w1[:, rows].contiguous(), w2[:, :, own].contiguous()


def _tp_sum(x, w1, w2, ids, weights, activation: str, size: int) -> torch.Tensor:
    """The fused kernel on each rank's share, summed (the all-reduce) in fp32."""
    parts = [
        fused_moe(x, *_tp_shard(w1, w2, activation, r, size), ids, weights, activation=activation)
        for r in range(size)
    ]
    return torch.stack(parts).float().sum(0)


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("size", [2, 3])
def test_fused_moe_tensor_parallel_shares_sum_to_the_whole(activation, size):
    """I = 48 over 2 ranks (24 each: masked K tails in the down GEMM) and 3 (16 each)."""
    x, w1, w2, ids, weights = _problem(9, 32, 48, 2, 4, 4, activation, seed=size)
    want = fused_moe_ref(x, w1, w2, ids, weights, activation=activation)
    got = _tp_sum(x, w1, w2, ids, weights, activation, size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_all_choices_elsewhere_give_zeros():
    x, w1, w2, ids, weights = _problem(5, 32, 16, 2, 2, 8, "relu2", seed=1)
    out = torch.full_like(x, NAN)
    got = fused_moe(x, w1, w2, ids % 4, weights, activation="relu2", expert_start=4, out=out)
    assert got is out and torch.equal(out, torch.zeros_like(x))


def test_fused_moe_out_buffer_and_strided_inputs():
    """out a column slice of a NaN-filled buffer (every row must be written); x a column slice;
    topk_ids / topk_weights transposed views, int32 ids, bf16 routing weights."""
    T, H, inter, k = 6, 32, 32, 2
    x, w1, w2, ids, weights = _problem(T, H, inter, k, 3, 5, "swiglu", seed=2)
    wide = torch.randn(T, H + 16)
    wide[:, 16:] = x
    ids_t = ids.to(torch.int32).t().contiguous().t()  # strides (1, T)
    weights_t = weights.bfloat16().t().contiguous().t()
    buffer = torch.full((T, H + 8), NAN)
    out = buffer[:, 8:]
    want = fused_moe_ref(x, w1, w2, ids_t, weights_t, expert_start=1)
    got = fused_moe(wide[:, 16:], w1, w2, ids_t, weights_t, expert_start=1, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(buffer[:, :8]).all()  # nothing outside out is written


@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_align_matches_ref(block_m):
    """Blocks per expert in order, pairs in order inside each, -1 padding and tail; the kernel's
    unused rows are garbage, so only used blocks' rows are compared."""
    g = torch.Generator().manual_seed(block_m)
    ids = torch.rand(40, 6, generator=g).topk(2, dim=-1).indices  # experts 0..5
    ids[3:9] = torch.tensor([4, 5])  # expert 4: more than a block of 16 on its own
    for num_experts, start in ((4, 1), (6, 0), (1, 5)):
        sorted_pairs, block_expert = moe_align(ids, num_experts, start, block_m)
        want_pairs, want_blocks = moe_align_ref(ids, num_experts, start, block_m)
        assert torch.equal(block_expert, want_blocks)
        used = (want_blocks >= 0).repeat_interleave(block_m)
        assert torch.equal(sorted_pairs[used], want_pairs[used])
        local = ((ids >= start) & (ids < start + num_experts)).sum().item()
        assert (want_pairs >= 0).sum() == local  # every local pair placed once


def test_decode_grid_is_bounded_by_the_pairs():
    """A decode step (T = 1, k = 8) over 128 local experts launches 8 row blocks, not 128+."""
    ids = torch.tensor([[3, 70, 9, 127, 0, 64, 65, 12]])
    _, block_expert = moe_align(ids, 128, 0, 16)
    assert block_expert.shape == (8,)
    assert torch.equal(block_expert, ids.sort().values.flatten().int())


def test_launcher_never_syncs_the_host(monkeypatch):
    x, w1, w2, ids, weights = _problem(4, 32, 16, 2, 2, 4, "swiglu", seed=3)
    want = fused_moe_ref(x, w1, w2, ids, weights, expert_start=1)

    def host_sync(*args, **kwargs):
        raise AssertionError("fused_moe read a device value on the host")

    for name in ("item", "tolist", "nonzero", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    for name in ("unique", "nonzero", "bincount"):
        monkeypatch.setattr(torch, name, host_sync)
    got = fused_moe(x, w1, w2, ids, weights, expert_start=1)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _good(**changes):
    x, w1, w2, ids, weights = _problem(3, 32, 16, 2, 2, 4, "swiglu", seed=4)
    args = dict(x=x, w1=w1, w2=w2, topk_ids=ids, topk_weights=weights)
    kwargs = {key: changes.pop(key) for key in list(changes) if key not in args}
    return {**args, **changes}, kwargs


META = torch.device("meta")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(activation="gelu"), "activation must be one of"),
        (dict(x=torch.randn(3, 32, 1)), r"x must be \[T, H\]"),
        (dict(w1=torch.randn(2, 16, 32)), r"w1 must be \[E, 32, 32\]"),  # relu2-sized for swiglu
        (dict(w2=torch.randn(3, 32, 16)), "swiglu experts"),  # E differs from w1's
        (dict(w1=torch.randn(2, 32, 32), activation="relu2"), r"w1 must be \[E, 16, 32\]"),
        (dict(topk_ids=torch.zeros(3, 3, dtype=torch.long)), "both be"),
        (dict(topk_ids=torch.zeros(2, 2, dtype=torch.long), topk_weights=torch.ones(2, 2)), "rows"),
        (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be int32 or int64"),
        (dict(x=torch.randn(3, 32, dtype=torch.float64)), "x must be fp16, bf16 or fp32"),
        (dict(w2=torch.randn(2, 32, 16).bfloat16()), "w1 and w2 must be"),
        (dict(topk_weights=torch.ones(3, 2, dtype=torch.int32)), "topk_weights must be a float"),
        (dict(x=torch.randn(32, 3).t()), "x must have unit stride"),
        (dict(w1=torch.randn(2, 32, 32).transpose(1, 2)), "w1 must have unit stride"),
        (dict(w2=torch.randn(2, 16, 32).transpose(1, 2)), "w2 must have unit stride"),
        (dict(expert_start=-1), "expert_start must be"),
        (dict(expert_start=1.0), "expert_start must be"),
        (dict(out=torch.empty(3, 16)), "out must be"),
        (dict(out=torch.empty(3, 32, dtype=torch.float16)), "out must be"),
        (dict(out=torch.empty(32, 3).t()), "out must be"),
        (dict(w2=torch.randn(2, 32, 16, device=META)), "w2 is on meta"),
        (dict(topk_weights=torch.ones(3, 2, device=META)), "topk_weights is on meta"),
        (dict(out=torch.empty(3, 32, device=META)), "out is on meta"),
    ],
    ids=lambda c: c if isinstance(c, str) else None,
)
def test_launcher_refuses(changes, match):
    args, kwargs = _good(**changes)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args, **kwargs)


# ------------------------------------------------------------------------------------------ GPU

QWEN3_MOE = (2048, 768, 128, 8, "swiglu")  # Qwen3-30B-A3B: H, I, E, k, activation
NEMOTRON_MOE = (2688, 1856, 128, 6, "relu2")  # NemotronH-style
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [QWEN3_MOE, NEMOTRON_MOE], ids=["qwen3-30b-a3b", "nemotron-h"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_fused_moe_realistic_sizes(layer, dtype):
    """All experts local at T = 1, 64, 512, 1024 (each tile regime), then half of them (an
    expert-parallel rank), into a NaN-filled out, against the ref on the same inputs (fp32
    inside)."""
    H, inter, E, k, activation = layer
    for seed, (T, E_local, start) in enumerate(
        [(1, E, 0), (64, E, 0), (512, E, 0), (1024, E, 0), (1024, E // 2, E // 4),
         (1, E // 2, E // 2)]
    ):  # fmt: skip
        x, w1, w2, ids, weights = _problem(
            T, H, inter, k, E_local, E, activation, seed=seed, dtype=dtype, device="cuda"
        )
        out = torch.full((T, H), NAN, dtype=dtype, device="cuda")
        fused_moe(x, w1, w2, ids, weights, activation=activation, expert_start=start, out=out)
        want = fused_moe_ref(x, w1, w2, ids, weights, activation=activation, expert_start=start)
        assert torch.isfinite(out).all(), (T, E_local, start)
        err = _rel_err(out, want)
        assert err < TOLERANCE[dtype], (T, E_local, start, err)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [QWEN3_MOE, NEMOTRON_MOE], ids=["qwen3-30b-a3b", "nemotron-h"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("size", [4, 8])
def test_gpu_fused_moe_tensor_parallel_shares(layer, dtype, size):
    """Each expert's intermediate size split over `size` ranks (Qwen3-30B-A3B: I = 192, 96;
    NemotronH-style: 464, 232): the ranks' outputs summed against the ref of the whole, at
    decode and prefill sizes."""
    H, inter, E, k, activation = layer
    for seed, T in enumerate((1, 64, 512)):
        x, w1, w2, ids, weights = _problem(
            T, H, inter, k, E, E, activation, seed=seed, dtype=dtype, device="cuda"
        )
        got = _tp_sum(x, w1, w2, ids, weights, activation, size)
        want = fused_moe_ref(x, w1, w2, ids, weights, activation=activation)
        assert torch.isfinite(got).all(), T
        err = _rel_err(got, want)
        assert err < TOLERANCE[dtype], (T, size, err)


@pytest.mark.gpu
def test_gpu_fused_moe_cuda_graph_replays_new_inputs():
    """Captured once at Qwen3-30B-A3B's size (bf16, T = 64), replayed after new activations and
    a new routing (some choices outside the local range) are copied into the same buffers."""
    T, H, inter, E, k = 64, 2048, 768, 128, 8
    x, w1, w2, ids, weights = _problem(
        T, H, inter, k, E, E, "swiglu", seed=7, dtype=torch.bfloat16, device="cuda"
    )
    out = torch.full((T, H), NAN, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fused_moe(x, w1, w2, ids, weights, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w1, w2, ids, weights, out=out)
    for seed in (8, 9):
        new_x, _, _, new_ids, new_weights = _problem(
            T, H, inter, k, E, E + 32, "swiglu", seed=seed, dtype=torch.bfloat16, device="cuda"
        )  # ids >= 128 are another rank's experts
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe_ref(x, w1, w2, ids, weights)
        assert torch.isfinite(out).all() and _rel_err(out, want) < 1e-2, seed
