"""The `random:` shapes of other families than Llama (ops/random_model.py): `gemma3-1b`, `-4b`
and `-12b` (head_dim 256, local and global layers), `mistral-7b-window` (a window on every
layer) and `qwen2.5-7b` (qkv biases). Their configs are the real models' (parameter counts, the
window the engine is told), and a tiny-scaled copy of each (but Gemma's larger sizes) builds,
runs and gives transformers' logits when the bench's Hugging Face copy of it (ops/hf_bench.py
`hf_random_model`) holds our weights: fp32, CPU, windows shorter than the prompts."""

from __future__ import annotations

import pytest
import torch

from taipan.actors.gpu.window import kv_window
from taipan.models import resolve
from taipan.ops.loader import RANDOM_SHAPES, load_model, random_config, random_state
from taipan.ops.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from taipan.ops.models.mistral import MistralConfig, MistralForCausalLM
from taipan.ops.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tests.test_ops_dense import ours_and_hf_logits

SHAPES = {
    # shape: (config class, model class, published parameter count, kv_window)
    "gemma3-1b": (Gemma3Config, Gemma3ForCausalLM, 999_885_952, 0),
    # (4B and 12B: 3,209M and 10,759M without the embedding, as the Gemma 3 report's table 1)
    "gemma3-4b": (Gemma3Config, Gemma3ForCausalLM, 3_880_263_168, 0),
    "gemma3-12b": (Gemma3Config, Gemma3ForCausalLM, 11_766_034_176, 0),
    "mistral-7b-window": (MistralConfig, MistralForCausalLM, 7_241_732_096, 4096),
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, 7_615_616_512, 0),
}
# Tiny copies: 3 layers, windows of 8 keys (the test prompts run to 45 tokens).
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    sliding_window=8,
    max_position_embeddings=256,
)
TINY_LAYERS = {
    "gemma3-1b": dict(sliding_layers=(0, 1)),
    "mistral-7b-window": {},
    "qwen2.5-7b": dict(sliding_window=None),  # (as the real one: no window)
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_are_the_real_models(shape):
    config_cls, model_cls, params, window = SHAPES[shape]
    config = random_config(f"random:{shape}")
    assert type(config) is config_cls
    assert resolve(f"random:{shape}") == (f"{shape}-shape", f"random:{shape}")
    assert kv_window(config) == window
    with torch.device("meta"):
        model = model_cls(config)
    assert sum(p.numel() for p in model.parameters()) == params


def test_gemma3_1b_layers():
    """head_dim 256 with 4 heads (1024, not hidden 1152); layers 5, 11, 17, 23 global."""
    config = random_config("random:gemma3-1b")
    assert (config.head_dim, config.num_heads, config.num_kv_heads) == (256, 4, 1)
    assert [i for i in range(26) if not config.is_local(i)] == [5, 11, 17, 23]
    assert {config.layer_window(i) for i in range(26)} == {512, None}
    assert (config.rope_local_theta, config.rope_theta) == (10000.0, 1_000_000.0)


def test_gemma3_norms_are_the_identity():
    """Gemma's norms scale by (1 + w): its random weights are 0 where Llama's are 1."""
    state = random_state(_tiny_config("gemma3-1b"), torch.float32, "cpu")
    assert torch.equal(state["layers.0.pre_feedforward_layernorm.weight"], torch.zeros(64))


def _tiny_config(shape: str):
    fields = {**RANDOM_SHAPES[shape], **TINY, **TINY_LAYERS[shape]}
    fields.pop("family")
    return SHAPES[shape][0](**fields, bos_token_id=None, eos_token_ids=(258,))


@pytest.mark.parametrize("shape", list(TINY_LAYERS))  # (Gemma 3's other sizes: the same code)
def test_tiny_copy_runs_and_equals_hf(monkeypatch, shape):
    pytest.importorskip("transformers")
    from taipan.ops.hf_bench import load_hf

    tiny = {**RANDOM_SHAPES[shape], **TINY, **TINY_LAYERS[shape]}
    monkeypatch.setitem(RANDOM_SHAPES, f"{shape}-tiny", tiny)
    model, config, _ = load_model(f"random:{shape}-tiny")
    assert type(model) is SHAPES[shape][1]
    hf = load_hf(f"random:{shape}-tiny", torch.float32, "cpu")
    assert type(hf).__name__ == SHAPES[shape][1].__name__
    for got, want in ours_and_hf_logits(model, config, hf):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_decode_floor_reads_only_each_windowed_layers_window():
    from taipan.bench.decode import _kv_read_share

    assert _kv_read_share(None, 8192) == 1.0 and _kv_read_share([None, None], 100) == 1.0
    assert _kv_read_share([4096] * 32, 8192) == 0.5  # Mistral past its window: half the keys
    # Gemma 3's five local layers of 512 and one global at 2048 tokens: (5 * 512 + 2048) / 6.
    assert _kv_read_share([512] * 5 + [None], 2048) == (5 * 512 + 2048) / (6 * 2048)
    assert _kv_read_share([512] * 6, 256) == 1.0  # a window not reached reads everything
