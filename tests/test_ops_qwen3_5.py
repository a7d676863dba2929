"""ops.models.qwen3_5 (Qwen3-Next's hybrid with Qwen3.5's split GDN projections) and its loader
against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM on the same weights (fp32,
CPU). Tiny random models (tests/random_qwen3_5.py: "dense" with tied embeddings and the text
"mrope", "moe" with every layer sparse) run through the production path
(tests/test_ops_nemotron_h.py's HybridRunner): a plain prompt, a batch then greedy decode
(tokens and log-probs), a chunked prefill beside decode rows and a prefill restored from a
snapshot slot must give Hugging Face's numbers; the MTP tensor is skipped; weight updates in
Hugging Face's names restore every parameter; T = 2 equals T = 1. The MoE model's tests and
T = 2 are marked slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taipan.models import has_mamba_layers
from taipan.ops.loader import load_model
from taipan.ops.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from taipan.ops.parallel import SINGLE
from taipan.ops.weight_updates import state_updates
from tests.random_qwen3_5 import CONFIGS, make_random_qwen3_5
from tests.random_qwen3_next import TINY
from tests.test_ops_nemotron_h import HybridRunner
from tests.test_ops_qwen3_next import _prompt, _tp_script, hf_greedy, hf_logits

transformers = pytest.importorskip("transformers")
ATOL = 1e-4


# (the MoE model's Hugging Face side is slow on a CPU: its tests run with the slow ones)
@pytest.fixture(scope="module", params=["dense", pytest.param("moe", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    path = make_random_qwen3_5(str(tmp_path_factory.mktemp("q35")), request.param)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, path


def test_config_split_projections_and_no_mtp(pair):
    (model, config, _), hf, path = pair
    assert isinstance(config, Qwen3_5Config) and type(model) is Qwen3_5ForCausalLM
    assert type(hf).__name__ == hf.config.architectures[0] and has_mamba_layers(path)
    names = set(model.state_dict())
    assert "layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not any("in_proj_qkvz" in n or n.startswith("mtp.") for n in names)
    moe = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [config.is_moe_layer(i) for i in range(config.num_layers)] == moe


def test_text_mrope_is_plain_partial_rope(pair):
    """transformers' Qwen3.5 rotary embedding (three mrope sections, each its own position id)
    at text positions (all sections the same id) equals our partial RoPE table."""
    (model, config, _), hf, _ = pair
    positions = torch.arange(300)
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, sin = hf.model.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
    half = config.rotary_dim // 2
    assert cos.shape[-1] == config.rotary_dim
    table = model.rope_cache(torch.device("cpu"))[positions]  # [T, rotary_dim]: cos | sin
    torch.testing.assert_close(cos[0, :, :half], table[:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0, :, :half], table[:, half:], atol=1e-6, rtol=0)


def test_prompt_logits_match_hf(pair):
    (model, config, _), hf, _ = pair
    ids = _prompt(70, 70)  # past Hugging Face's 64-token GDN chunk
    runner = HybridRunner(model, config)
    runner.add(0, 70, slot=0)
    torch.testing.assert_close(runner.step({0: ids})[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_batch_then_greedy_equals_hf(pair):
    """Two prompts prefilled together, then greedy decode of both: Hugging Face's tokens and
    log-probs (its own cache, one prompt at a time)."""
    (model, config, _), hf, _ = pair
    prompts, new = [_prompt(23, 33), _prompt(3, 13)], 5
    runner = HybridRunner(model, config, seed=5)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + new, slot=seq)
    outs, logprobs = {0: [], 1: []}, {0: [], 1: []}
    logits = runner.step(dict(enumerate(prompts)))
    for _ in range(new):
        for s, lg in logits.items():
            lp = torch.log_softmax(lg[-1], -1)
            outs[s].append(int(lp.argmax()))
            logprobs[s].append(lp[outs[s][-1]])
        logits = runner.step({s: [outs[s][-1]] for s in outs})
    for seq, p in enumerate(prompts):
        tokens, want = hf_greedy(hf, p, new)
        assert outs[seq] == tokens, f"prompt {seq}"
        torch.testing.assert_close(torch.stack(logprobs[seq]), want, atol=ATOL, rtol=0)


def test_chunked_prefill_and_restore_match_hf(pair):
    """One prompt prefilled in three chunks beside a decoding sequence, its state snapshotted
    after 32 tokens; a third sequence sharing those 32 tokens restores from the snapshot."""
    (model, config, _), hf, _ = pair
    base = _prompt(40, 1)
    prompts = [base, _prompt(3, 4), base[:32] + _prompt(9, 3)]
    runner = HybridRunner(model, config, seed=3)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + 2, slot=seq)
    got = {s: [] for s in range(3)}

    def run(chunks, restore=None):
        for s, logits in runner.step(chunks, restore).items():
            got[s].append(logits)

    run({0: base[:11], 1: prompts[1]})
    run({0: base[11:32], 1: [7]})
    runner.snapshot(0, slot=8)
    run({0: base[32:], 1: [7]})
    runner.share(2, source=0, tokens=32)
    run({2: prompts[2][32:], 0: [7]}, restore={2: 8})
    torch.testing.assert_close(torch.cat(got[0]), hf_logits(hf, base + [7]), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got[1]), hf_logits(hf, prompts[1] + [7, 7]),
                               atol=ATOL, rtol=0)  # fmt: skip
    want = hf_logits(hf, prompts[2])[32:]
    torch.testing.assert_close(torch.cat(got[2]), want, atol=ATOL, rtol=0)


def test_weight_update_in_hf_names_restores_every_parameter(pair):
    (model, _, _), hf, _ = pair
    params = {name: torch.zeros_like(t) for name, t in model.state_dict().items()}
    state = {name: t.detach() for name, t in hf.state_dict().items()}
    touched = set()
    for name, index, array in state_updates(state, model, params):
        params[name][index] = torch.as_tensor(array)
        touched.add(name)
    assert touched == set(params)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(params[name], t, atol=0, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tp2_equals_tp1(tmp_path, kind):
    """T = 2 (gloo): in_proj_qkv split by q / k / v segment, in_proj_z / _b / _a by value heads;
    both ranks give T = 1's logits, each rank's state its own value heads of T = 1's."""
    from tests.test_tp import run_ranks

    path = make_random_qwen3_5(str(tmp_path / "m"), kind)
    want = _tp_script(SINGLE, path)
    for rank, got in enumerate(run_ranks(_tp_script, path)):
        for a, b in zip(got["steps"], want["steps"], strict=True):
            for seq in b:
                np.testing.assert_allclose(a[seq], b[seq], atol=1e-5, rtol=0)
        heads = TINY["linear_num_value_heads"] // 2
        own = want["ssm"][:, :, rank * heads : (rank + 1) * heads]
        np.testing.assert_allclose(got["ssm"], own, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
)
def test_multimodal_checkpoints_are_the_qwen3_5_family(arch):
    """Their text model is served (tests/test_multimodal_text.py loads them)."""
    from pathlib import Path

    from taipan.ops.hf_configs import hf_family

    assert hf_family(Path("m"), {"architectures": [arch]}) == "qwen3_5"
    assert hf_family(Path("m"), {"model_type": "qwen3_5_moe_text"}) == "qwen3_5"
