"""The dense families beside Llama (issue 27 items 1-2): Qwen2 (q/k/v biases, tied or untied
embeddings), Qwen3 (per-head q/k norms, head_dim twice hidden / heads), Mistral (with a sliding
window, long or shorter than the prompts) and Gemma 3 (Gemma's norms, a local and a global
layer with their RoPEs, linear RoPE scaling), loaded from tiny random Hugging Face directories
(tests/random_dense.py) and checked against transformers on the same weights (fp32, CPU) through
the production paged forward: chunked prefill, a decode row next to a prefill chunk, and a
prefix reused from the cache.

Also: the config fields and which layers a window applies to, where the new tensors go under
tensor parallelism (biases column-parallel like their weights, q/k norms replicated), weight
updates by Hugging Face name of a bias, a q/k norm and Gemma's norms equal to transformers with
the same change, the same forward and updates at T = 2 (gloo) equal to T = 1, and a sharded
checkpoint read through its index (not the consolidated.safetensors Mistral's repositories carry
beside).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.parallel import SINGLE
from taipan.ops.sharding import checkpoint_names, placement
from taipan.ops.weight_updates import WeightUpdateError, check_same_architecture, state_updates
from tests.random_dense import make_random_dense, make_random_mistral, make_random_qwen2
from tests.test_ops_llama import PagedRunner
from tests.test_tp import assert_ranks_match, run_batch, run_ranks
from tests.test_tp_moe import fake_tp

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
# name -> (family, builder arguments); every case loads, and matches transformers.
CASES = {
    "qwen2-untied": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie=True)),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "mistral-window": ("mistral", dict(sliding_window=512)),  # >= every sequence here
    "mistral-window-8": ("mistral", dict(sliding_window=8)),  # shorter than the prompts
    # Qwen2 windows the layers from max_window_layers on: layer 1 only.
    "qwen2-window-8": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "gemma3": ("gemma3", {}),
    "gemma3-window-8": ("gemma3", dict(sliding_window=8)),
    "gemma3-linear-rope": ("gemma3", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
}
# Per family, Hugging Face tensors a weight update changes: a bias, a q/k norm, and a split one.
UPDATES = {
    "qwen2-untied": [
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.v_proj.bias",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ],
    "qwen2-tied": ["model.layers.1.self_attn.k_proj.bias", "model.embed_tokens.weight"],
    "qwen3": [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ],
    "mistral": ["model.layers.1.self_attn.v_proj.weight", "model.norm.weight"],
    # Gemma's (1 + w) norms take Hugging Face's w as it is: four per layer, q/k, final.
    "gemma3": [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.pre_feedforward_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.norm.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.embed_tokens.weight",
    ],
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dense")
    return {
        name: make_random_dense(fam, str(root / name), **kw) for name, (fam, kw) in CASES.items()
    }


def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def ours_and_hf_logits(model, config, hf) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Our logits, step by step, next to transformers' for the same positions: sequence 0
    prefilled in two chunks (the second beside sequence 1's prompt), then a decode row of each;
    sequence 2 shares sequence 0's first 32 tokens, which it reads from sequence 0's blocks."""
    a, b = _ids(45, 1), _ids(20, 2)
    runner = PagedRunner(model, config)
    runner.add(0, 64)
    runner.add(1, 32)
    steps = [runner.step({0: a[:21]}), runner.step({0: a[21:], 1: b})]
    nxt = {s: int(steps[-1][s][-1].argmax()) for s in (0, 1)}
    steps.append(runner.step({0: [nxt[0]], 1: [nxt[1]]}))
    full = {0: a + [nxt[0]], 1: b + [nxt[1]]}
    # Sequence 2: the first two blocks (32 tokens) are sequence 0's, its own tail after them.
    tail = _ids(9, 3)
    runner.tables[2] = runner.tables[0][:2] + [runner.free.pop()]
    runner.computed[2] = 32
    steps.append(runner.step({2: tail}))
    full[2] = a[:32] + tail
    want = {s: hf(torch.tensor([ids])).logits[0] for s, ids in full.items()}
    starts = {0: 0, 1: 0, 2: 32}
    out = []
    for step in steps:
        for s, got in step.items():
            n = got.shape[0]
            out.append((got, want[s][starts[s] : starts[s] + n]))
            starts[s] += n
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(dirs, case):
    model, config, _ = load_model(dirs[case])
    family = CASES[case][0]
    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma3": "Gemma3"}
    assert type(model).__name__ == names[family] + "ForCausalLM"
    for got, want in ours_and_hf_logits(model, config, hf_model(dirs[case])):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_config_fields(dirs):
    _, qwen2, _ = load_model(dirs["qwen2-tied"])
    assert qwen2.tie_word_embeddings and qwen2.head_dim == 16 and qwen2.sliding_window is None
    model, qwen3, _ = load_model(dirs["qwen3"])
    assert (qwen3.hidden_size, qwen3.num_heads, qwen3.head_dim) == (64, 4, 32)
    assert model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert model.layers[0].self_attn.qkv_proj.bias is None
    _, mistral, _ = load_model(dirs["mistral-window"])
    assert mistral.sliding_window == 512 and mistral.sliding_layers is None
    model, gemma, _ = load_model(dirs["gemma3-linear-rope"])
    assert (gemma.head_dim, gemma.query_pre_attn_scalar, gemma.sliding_layers) == (32, 24.0, (0,))
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.rope_scaling_factor) == (5e4, 1e4, 4)
    assert gemma.tie_word_embeddings and model.lm_head is None
    assert [layer.self_attn.sliding_window for layer in model.layers] == [512, None]
    with pytest.raises(WeightUpdateError, match="Qwen2 model, the loaded one is Qwen3"):
        check_same_architecture(qwen3, qwen2, "other")
    with pytest.raises(WeightUpdateError, match="rope_scaling_factor 1.0 .loaded: 4.0"):
        check_same_architecture(gemma, load_model(dirs["gemma3"])[1], "other")


def _rewrite_config(path: str, **fields) -> None:
    file = os.path.join(path, "config.json")
    hf = json.load(open(file)) | fields
    with open(file, "w") as f:
        json.dump(hf, f)


def _windows(path: str) -> list[int | None]:
    """Each layer's attention window as loaded."""
    return [layer.self_attn.sliding_window for layer in load_model(path)[0].layers]


def test_which_layers_a_window_applies_to(tmp_path):
    """As transformers reads the configs: Mistral's window is every layer's (and binds at any
    max_sequence_length); Qwen2's counts only with use_sliding_window on, for the layers from
    max_window_layers on or those layer_types marks."""
    path = make_random_mistral(str(tmp_path / "m"), sliding_window=256)
    assert _windows(path) == [256, 256]
    assert load_model(path)[1].sliding_window == 256
    qwen = make_random_qwen2(str(tmp_path / "q"))
    _rewrite_config(qwen, sliding_window=64, use_sliding_window=False, layer_types=None)
    assert _windows(qwen) == [None, None]
    _rewrite_config(qwen, use_sliding_window=True, max_window_layers=1)
    assert _windows(qwen) == [None, 64]
    _rewrite_config(qwen, layer_types=["sliding_attention", "full_attention"])
    assert _windows(qwen) == [64, None]
    _rewrite_config(qwen, layer_types=["full_attention"] * 2)
    assert _windows(qwen) == [None, None]
    assert load_model(qwen)[1].sliding_window is None


def test_sharded_checkpoint_beside_a_consolidated_file(dirs, tmp_path):
    """Shards named by model.safetensors.index.json are read, and a consolidated.safetensors
    beside them (Mistral's repositories: Mistral's own tensor names) is not."""
    import shutil

    from safetensors.numpy import save_file

    src, dst = dirs["mistral"], tmp_path / "sharded"
    hf = hf_model(src)
    hf.save_pretrained(dst, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), dst / name)
    save_file(
        {"layers.0.attention.wq.weight": np.zeros((2, 2), np.float32)},
        dst / "consolidated.safetensors",
    )
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    model, config, _ = load_model(dst)
    for got, want in ours_and_hf_logits(model, config, hf):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_unsupported_settings_are_refused(tmp_path):
    path = make_random_dense("qwen3", str(tmp_path / "q3"))
    _rewrite_config(path, attention_bias=True)
    with pytest.raises(ModelLoadError, match="attention_bias=true is not supported"):
        load_model(path)
    _rewrite_config(
        path, attention_bias=False, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"
    )
    with pytest.raises(ModelLoadError, match="Qwen2MoeForCausalLM.*supported: .*Qwen3ForCausal"):
        load_model(path)


def test_placement_of_biases_and_qk_norms():
    """q/k/v biases are column-parallel like their weights (rank 1 of 2 reads its heads' rows of
    each, into the same rows of the fused bias); q/k norm weights are replicated."""
    from taipan.ops.models.qwen2 import Qwen2Config

    config = Qwen2Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_ids=(258,),
    )
    tp = fake_tp(1)
    for kind in ("weight", "bias"):
        q = placement(f"layers.0.self_attn.q_proj.{kind}", config, tp)
        k = placement(f"layers.0.self_attn.k_proj.{kind}", config, tp)
        v = placement(f"layers.0.self_attn.v_proj.{kind}", config, tp)
        assert {q.param, k.param, v.param} == {f"layers.0.self_attn.qkv_proj.{kind}"}
        assert (q.rows, q.dim, q.start, q.length, q.full) == (slice(0, 32), 0, 32, 32, 64)
        assert (k.rows, k.start, k.length, k.full) == (slice(32, 48), 16, 16, 32)
        assert (v.rows, v.start, v.length, v.full) == (slice(48, 64), 16, 16, 32)
    assert checkpoint_names("layers.0.self_attn.qkv_proj.bias") == tuple(
        f"layers.0.self_attn.{x}_proj.bias" for x in "qkv"
    )
    norm = placement("layers.1.self_attn.k_norm.weight", config, tp)
    assert (norm.param, norm.rows, norm.dim) == (
        "layers.1.self_attn.k_norm.weight",
        slice(None),
        None,
    )
    assert norm.take(torch.arange(16.0)).tolist() == list(range(16))


def update_state(path: str, case: str) -> dict[str, np.ndarray]:
    """New values, in Hugging Face names, for UPDATES[case]."""
    from safetensors.numpy import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    gen = np.random.default_rng(11)
    return {
        n: saved[n] + gen.normal(0, 0.3, saved[n].shape).astype(np.float32) for n in UPDATES[case]
    }


def apply_updates(model, state: dict) -> None:
    params = model.state_dict()
    with torch.no_grad():
        for ours, index, values in state_updates(state, model, params):
            params[ours][index].copy_(torch.as_tensor(np.ascontiguousarray(values)))


@pytest.mark.parametrize("case", list(UPDATES))
def test_weight_updates_by_hf_name_match_hf(dirs, case):
    """A state dict changing a bias / a q/k norm (and a split matrix) gives transformers'
    logits with the same change; the update is seen (the logits move)."""
    model, config, _ = load_model(dirs[case])
    hf = hf_model(dirs[case])
    state = update_state(dirs[case], case)
    before = ours_and_hf_logits(model, config, hf)[0][0]
    apply_updates(model, state)
    hf.load_state_dict({n: torch.from_numpy(v) for n, v in state.items()}, strict=False)
    pairs = ours_and_hf_logits(model, config, hf)
    assert (pairs[0][0] - before).abs().max() > 1e-2
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def tp_job(tp, paths: dict[str, str]) -> dict[str, list[dict]]:
    """Per checkpoint: the T-rank forward, then again after a weight update."""
    out = {}
    for case, path in paths.items():
        model, config, _ = load_model(path, tp=tp)
        first = run_batch(model, config, tp)
        apply_updates(model, update_state(path, case))
        out[case] = [first, run_batch(model, config, tp)]
    return out


def test_tp2_forward_and_updates_equal_tp1(dirs):
    """Two gloo ranks hold half the heads (with their rows of the q/k/v biases) and whole q/k
    norms; their logits equal T = 1's, before and after updates of biases and norms."""
    paths = {case: dirs[case] for case in UPDATES}
    ranks = run_ranks(tp_job, paths)
    single = tp_job(SINGLE, paths)
    for case in paths:
        for phase in (0, 1):
            assert_ranks_match([r[case][phase] for r in ranks], single[case][phase], 259)
        logits = [single[case][phase]["logits"][0] for phase in (0, 1)]
        assert not np.allclose(*logits), case
