"""The Llama-family decoder layer's fused few-row path (kernels/gemv.py through
`DecoderLayer._fused_forward`) against its unfused path on the same weights and cache: on the CPU
the Triton kernels run in the interpreter (fp32, tiny shapes, the path forced on); on a GPU the
path the shape picks, fp32 and bf16, eager and under a CUDA graph. Llama, Qwen2 (qkv bias),
Qwen3 (q/k norms), a model whose MoE layers stay unfused between fused dense ones, and Gemma 3
(its (1 + w) norm and GELU-tanh gate inside the products, its post-norms outside)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from taipan.ops.attention import build_attention_metadata
from taipan.ops.layers import Attention
from taipan.ops.models import gemma3, llama
from taipan.ops.models.gemma3 import Gemma3Config, Gemma3DecoderLayer, Gemma3ForCausalLM
from taipan.ops.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from taipan.ops.moe import MoE, MoEConfig
from taipan.ops.random_model import RANDOM_SHAPES
from tests.perf.cuda_graphs import graph_of

BLOCK_SIZE = 16
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 90, 7, 28, 55, 4, 19, 66, 23]  # 19 tokens
# The tiny random shape (ops/random_model.py), a third layer (the MoE variant's sparse one sits
# between two dense ones), untied (the Gemma variant ties nothing either) and a short table.
CONFIG = {
    k: v for k, v in RANDOM_SHAPES["tiny"].items() if k not in ("vocab_size", "num_layers")
} | dict(
    vocab_size=128,
    num_layers=3,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_ids=(1,),
)


def _model(variant: str, head_dim: int, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**(CONFIG | {"head_dim": head_dim}))
    if variant == "gemma3":  # one local layer (a window of 8 keys), two global ones
        fields = CONFIG | {"head_dim": head_dim, "sliding_window": 8, "sliding_layers": (1,)}
        config = Gemma3Config(**fields, query_pre_attn_scalar=float(head_dim))
        torch.manual_seed(0)
        return _randomized(Gemma3ForCausalLM(config), device, dtype)

    def make_layer(index: int) -> DecoderLayer:
        if variant == "qwen2":
            return DecoderLayer(config, qkv_bias=True)
        if variant == "qwen3":
            return DecoderLayer(config, qk_norm=True)
        if variant == "moe" and index == 1:  # a sparse layer between two dense ones
            moe = MoEConfig(4, 2, 32, activation="swiglu", scoring="softmax", renormalize=True)
            return DecoderLayer(config, mlp=MoE(64, moe))
        return DecoderLayer(config)

    torch.manual_seed(0)
    return _randomized(LlamaForCausalLM(config, make_layer), device, dtype)


def _randomized(model, device: str, dtype: torch.dtype):
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 1.0 / p.shape[-1] ** 0.5
            p.copy_(
                1.0 + scale * torch.randn(p.shape)
                if "norm" in name
                else scale * torch.randn(p.shape)
            )
    return model.to(device=device, dtype=dtype).eval()


def _inputs(cache, rows: int, device: str) -> tuple:
    """One step of `rows` decode rows after the prompt (row r: the prompt's first block, then a
    copy of its second in block 2 + r, so each row appends its token in a block of its own),
    over a copy of `cache`: the model's arguments."""
    cache = cache.clone()
    cache[:, :, 2 : 2 + rows] = cache[:, :, 1:2]
    seq_lens = [len(PROMPT) + 1] * rows
    tables = [[0, 2 + r] for r in range(rows)]
    meta, positions = build_attention_metadata([1] * rows, seq_lens, tables, BLOCK_SIZE, device)
    ids = torch.tensor([40 + r for r in range(rows)], device=device)
    return ids, positions, meta, cache


def _decode(model, cache, rows: int, device: str) -> torch.Tensor:
    """The final hidden states of that step."""
    with torch.no_grad():
        return model(*_inputs(cache, rows, device))


def _prefill(model, device: str, dtype: torch.dtype) -> torch.Tensor:
    cache = llama.allocate_kv_cache(model.config, 8, BLOCK_SIZE, dtype, device)
    meta, positions = build_attention_metadata(
        [len(PROMPT)], [len(PROMPT)], [[0, 1]], BLOCK_SIZE, device
    )
    with torch.no_grad():
        model(torch.tensor(PROMPT, device=device), positions, meta, cache)
    return cache


VARIANTS = ["llama", "qwen2", "qwen3", "moe", "gemma3"]


def _fused_rows(monkeypatch, rows: int) -> None:
    """The rows up to which both layer kinds take the fused path (each module holds its own
    copy of ops/layers.FUSED_DECODE_ROWS)."""
    monkeypatch.setattr(llama, "FUSED_DECODE_ROWS", rows)
    monkeypatch.setattr(gemma3, "FUSED_DECODE_ROWS", rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_path_equals_the_unfused_one_on_cpu(variant, rows, monkeypatch):
    model = _model(variant, 16, "cpu", torch.float32)
    cache = _prefill(model, "cpu", torch.float32)
    unfused = _decode(model, cache, rows, "cpu")
    # Force the path on the CPU (the shape check asks for CUDA): the interpreter runs gemv.
    taken = []

    def fused(self, x):
        taken.append(
            type(self).__name__ == "Gemma3DecoderLayer" or type(self.mlp) is llama.SwiGLUMLP
        )
        return taken[-1]

    monkeypatch.setattr(DecoderLayer, "_fused", fused)
    monkeypatch.setattr(Gemma3DecoderLayer, "_fused", fused)
    got = _decode(model, cache, rows, "cpu")
    assert taken == ([True, False, True] if variant == "moe" else [True] * 3)
    torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
@pytest.mark.parametrize("rows", [1, 3])
def test_q_k_norms_inside_rope_equal_the_norm_modules_on_cpu(variant, rows, monkeypatch):
    """The CUDA path's q/k norms inside the RoPE kernel (`Attention._norms_in_rope`), forced
    on the CPU (the interpreter runs kernels/rope.py), against the norm modules then the RoPE
    reference: prefill and decode rows, Qwen3's RMSNorm and Gemma 3's (1 + w)."""
    model = _model(variant, 16, "cpu", torch.float32)
    cache = _prefill(model, "cpu", torch.float32)
    want = _decode(model, cache, rows, "cpu")
    monkeypatch.setattr(Attention, "_norms_in_rope", lambda self, qkv: self.q_norm is not None)
    got_cache = _prefill(model, "cpu", torch.float32)
    for written in (lambda c: c[:, :, 0], lambda c: c[:, :, 1, :3]):  # the prompt's 19 slots
        torch.testing.assert_close(written(got_cache), written(cache), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_decode(model, got_cache, rows, "cpu"), want, rtol=1e-5, atol=1e-5)


def test_the_shape_picks_the_path(monkeypatch):
    """One token row on CUDA, no TP, the dense SwiGLU MLP: fused; anything else not (the CPU
    runs the references). `_fused` reads only the tensor's device and row count."""
    assert llama.FUSED_DECODE_ROWS == gemma3.FUSED_DECODE_ROWS == 1  # (TAIPAN_FUSED_GEMV unset)
    dense = _model("llama", 16, "cpu", torch.float32).layers[0]
    sparse = _model("moe", 16, "cpu", torch.float32).layers[1]
    gemma = _model("gemma3", 16, "cpu", torch.float32).layers[0]

    def rows(n, cuda=True):
        return types.SimpleNamespace(is_cuda=cuda, shape=(n, 64))

    for layer in (dense, gemma):
        assert layer._fused(rows(1))
        assert not layer._fused(rows(2)) and not layer._fused(rows(1, cuda=False))
    assert not sparse._fused(rows(1))
    with monkeypatch.context() as m:
        m.setattr(llama, "FUSED_DECODE_ROWS", 0)  # (TAIPAN_FUSED_GEMV=0)
        assert not dense._fused(rows(1))
    monkeypatch.setattr(dense, "tp", types.SimpleNamespace(size=2))  # a TP rank: fused too
    assert dense._fused(rows(1)) and not dense._fused(rows(2))


def _tp_job(tp, paths: list[str]) -> list[dict]:
    """On each rank of a gloo group: one decode row after the prompt, unfused, then with the
    fused path forced (the interpreter runs gemv), as logits over the whole vocabulary."""
    from taipan.ops.loader import load_model

    outs = []
    for path in paths:
        DecoderLayer._fused = _unfused
        model, config, _ = load_model(path, tp=tp)
        cache = llama.allocate_kv_cache(config, 8, BLOCK_SIZE, torch.float32, "cpu", tp)
        meta, positions = build_attention_metadata(
            [len(PROMPT)], [len(PROMPT)], [[0, 1]], BLOCK_SIZE, "cpu"
        )
        with torch.no_grad():
            model(torch.tensor(PROMPT), positions, meta, cache)
        unfused = model.compute_logits(_decode(model, cache, 1, "cpu"))
        DecoderLayer._fused = _forced
        taken, rank_path = [], DecoderLayer._fused_tp_forward

        def counted(self, *args, taken=taken, rank_path=rank_path):
            taken.append(type(self).__name__)
            return rank_path(self, *args)

        DecoderLayer._fused_tp_forward = counted
        fused = model.compute_logits(_decode(model, cache, 1, "cpu"))
        DecoderLayer._fused_tp_forward = rank_path
        # The products with their sums (FastAllReduce.fits_gemv): the layers' wiring of
        # NORMALIZED outputs and the next layers' norms, the sums over gloo.
        sums = _GlooGemvSum(tp)
        model = load_model(path, tp=dataclasses.replace(tp, fast=sums))[0]
        with torch.no_grad():
            DecoderLayer._fused = _unfused
            model(torch.tensor(PROMPT), positions, meta, cache)
            DecoderLayer._fused = _forced
            summed = model.compute_logits(_decode(model, cache, 1, "cpu"))
        outs.append({"unfused": unfused.numpy(), "fused": fused.numpy(), "taken": taken,
                     "summed": summed.numpy(), "sum_calls": sums.calls})  # fmt: skip
    return outs


class _GlooGemvSum:
    """FastAllReduce's row-parallel product with its sum (kernels/gemv_all_reduce.py's
    contract: the rounded partial product, summed, added, normalized) over gloo, for the
    layers' wiring on the CPU; takes nothing else (`fits`, `fits_rows`: False)."""

    def __init__(self, tp) -> None:
        self.tp, self.calls = tp, 0

    def fits(self, x) -> bool:
        return False

    def fits_rows(self, x) -> bool:
        return False

    def fits_gemv(self, x, w) -> bool:
        return x.shape[0] <= 4

    def gemv_all_reduce_rms_norm_(self, x, w, residual, weight, eps):
        import torch.distributed as dist

        from taipan.kernels.rmsnorm import rms_norm_ref

        self.calls += 1
        part = torch.nn.functional.linear(x, w)
        dist.all_reduce(part, group=self.tp.group)
        return rms_norm_ref(part, weight, eps, residual=residual)


def _unfused(self, x) -> bool:
    return False


def _forced(self, x) -> bool:
    return type(self.mlp) is llama.SwiGLUMLP


def test_fused_path_at_tp2_equals_the_unfused_one_on_cpu(tmp_path):
    """Two ranks over gloo, each its shard of the heads and of the MLP: the fused rank path
    (`DecoderLayer._fused_tp_forward`: RoPE inside the qkv product, SiLU inside gate_up, the
    sums left to the norms) gives the unfused path's logits on every rank. Qwen2 (qkv biases,
    RoPE in the product) and Qwen3 (q/k norms: the product, then the unfused RoPE)."""
    from tests.random_dense import make_random_qwen2, make_random_qwen3
    from tests.test_tp import run_ranks

    paths = [
        make_random_qwen2(str(tmp_path / "qwen2")),
        make_random_qwen3(str(tmp_path / "qwen3")),
    ]
    ranks = run_ranks(_tp_job, paths)
    for rank, outs in enumerate(ranks):
        for path, out in zip(paths, outs, strict=True):
            np.testing.assert_allclose(
                out["fused"], out["unfused"], rtol=1e-5, atol=1e-5, err_msg=f"{path} {rank}"
            )
            np.testing.assert_array_equal(out["fused"], ranks[0][paths.index(path)]["fused"])
            assert out["taken"] == ["DecoderLayer"] * 2  # (both layers took the rank path)
            np.testing.assert_allclose(out["summed"], out["unfused"], rtol=1e-5, atol=1e-5)
            assert out["sum_calls"] == 4  # o_proj and down_proj of both layers


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_fused_path_equals_the_unfused_one(variant, monkeypatch):
    """One row takes the fused path on CUDA (FUSED_DECODE_ROWS); four rows are made to (the
    kernel takes up to gemv.MAX_ROWS); eager and graphed alike. fp32: equal to the unfused
    path within its sums' order. bf16: as close to fp32 as the unfused bf16 path is (the
    fused one sums in another order and does not round the normalized rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert llama.FUSED_DECODE_ROWS == gemma3.FUSED_DECODE_ROWS == 1
    _fused_rows(monkeypatch, 4)
    model = _model(variant, 64, "cuda", torch.float32)
    half = _model(variant, 64, "cuda", torch.bfloat16)
    cache, half_cache = (
        _prefill(model, "cuda", torch.float32),
        _prefill(half, "cuda", torch.bfloat16),
    )
    for rows in (1, 4):
        fused = _decode(model, cache, rows, "cuda")
        inputs, captured = _inputs(cache, rows, "cuda"), {}

        def step(inputs=inputs, captured=captured):
            captured["out"] = model(*inputs)

        with torch.no_grad():
            graph = graph_of(step)
        graph.replay()
        half_fused = _decode(half, half_cache, rows, "cuda")
        with monkeypatch.context() as m:
            _fused_rows(m, 0)
            unfused = _decode(model, cache, rows, "cuda")
            half_unfused = _decode(half, half_cache, rows, "cuda")
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(captured["out"], fused, rtol=0, atol=0)

        fused_error, unfused_error = (_distance(t, unfused) for t in (half_fused, half_unfused))
        assert fused_error < 1.5 * unfused_error + 1e-3, (rows, fused_error, unfused_error)


def _distance(t: torch.Tensor, reference: torch.Tensor) -> float:
    return ((t.float() - reference).norm() / reference.norm()).item()
