"""The text model of a multimodal checkpoint (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration, Gemma3ForConditionalGeneration): config.json's `text_config`
is the model's config, `model.language_model.*` its weights (Gemma 3's older
`language_model.model.*`, which transformers still saves, too), and the vision tower and
projector are never loaded. Tiny random checkpoints saved by transformers (a text model's
weights put into the multimodal model, beside a tiny random vision tower) give transformers'
greedy tokens and log-probs on text-only prompts (fp32, CPU), and a weight update in the
multimodal model's names (vision tensors included, skipped) restores every parameter.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from taipan.models import has_mamba_layers
from taipan.ops.loader import load_model
from taipan.ops.weight_updates import hf_name_to_ours, state_updates
from tests.random_dense import make_random_gemma3
from tests.random_qwen3_5 import make_random_qwen3_5
from tests.test_ops_llama import PagedRunner
from tests.test_ops_nemotron_h import HybridRunner
from tests.test_ops_qwen3_next import _prompt, hf_greedy

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
QWEN_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    temporal_patch_size=1,
    num_position_embeddings=16,
)
SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)


def make_multimodal(path: str, kind: str) -> str:
    """A multimodal checkpoint directory whose text model is a tiny random one of
    tests/random_qwen3_5.py ("dense", "moe") or tests/random_dense.py ("gemma3")."""
    text_dir = os.path.join(path, "text")
    if kind == "gemma3":
        make_random_gemma3(text_dir)
    else:
        make_random_qwen3_5(text_dir, kind)
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tied = bool(text.config.tie_word_embeddings)
    config_cls, model_cls, vision = {
        "dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN_VISION),
        "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", QWEN_VISION),
        "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", SIGLIP),
    }[kind]
    extra = dict(mm_tokens_per_image=4) if kind == "gemma3" else {}
    config = getattr(transformers, config_cls)(
        text_config=text.config.to_dict(),
        vision_config=vision,
        tie_word_embeddings=tied,
        **extra,
    )
    config.architectures = [model_cls]
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    if not tied:
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    mm_dir = os.path.join(path, "mm")
    model.save_pretrained(mm_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(text_dir, name), mm_dir)
    return mm_dir


@pytest.fixture(scope="module", params=["dense", "moe", "gemma3"])
def pair(request, tmp_path_factory):
    path = make_multimodal(str(tmp_path_factory.mktemp("mm")), request.param)
    hf = getattr(transformers, _architecture(path)).from_pretrained(path, dtype=torch.float32)
    return load_model(path), hf.eval(), path


def _architecture(path: str) -> str:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)["architectures"][0]


def _runner(model, config):
    if hasattr(config, "mamba_state_for"):
        runner = HybridRunner(model, config)
        return runner, lambda n: runner.add(0, n, slot=0)
    runner = PagedRunner(model, config)
    return runner, lambda n: runner.add(0, n)


def test_config_is_the_text_models_and_no_vision_weight_is_kept(pair, caplog):
    (model, config, _), hf, path = pair
    with caplog.at_level(logging.INFO, logger="taipan.ops.hf_dir"):
        load_model(path)
    assert "serving its text model only" in caplog.text
    text = hf.config.get_text_config()
    assert config.num_layers == text.num_hidden_layers and config.vocab_size == text.vocab_size
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert not any("vis" in n or "projector" in n for n in model.state_dict())
    assert has_mamba_layers(path) == ("qwen3_5" in hf.config.model_type)


def test_greedy_tokens_and_logprobs_equal_hf(pair):
    """A text-only prompt: our greedy tokens and their log-probs equal those of transformers'
    multimodal model given input_ids only."""
    (model, config, _), hf, _ = pair
    prompt, new = _prompt(37, 5), 6
    runner, add = _runner(model, config)
    add(len(prompt) + new)
    tokens, logprobs = [], []
    logits = runner.step({0: prompt})[0]
    for _ in range(new):
        lp = torch.log_softmax(logits[-1], -1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]])
        logits = runner.step({0: [tokens[-1]]})[0]
    want_tokens, want = hf_greedy(hf, prompt, new)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.stack(logprobs), want, atol=ATOL, rtol=0)


def test_weight_update_in_multimodal_names_restores_every_parameter(pair):
    """The multimodal model's whole state dict (`model.language_model.*`, `lm_head`, the vision
    tower's and projector's, skipped) lands on every parameter of ours."""
    (model, _, _), hf, _ = pair
    state = {name: t.detach() for name, t in hf.state_dict().items()}
    assert any(".visual." in n or "vision_tower" in n for n in state)
    params = {name: torch.zeros_like(t) for name, t in model.state_dict().items()}
    touched = set()
    for name, index, array in state_updates(state, model, params):
        params[name][index] = torch.as_tensor(array)
        touched.add(name)
    assert touched == set(params)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(params[name], t, atol=0, rtol=0, msg=name)
    assert hf_name_to_ours("model.language_model.norm.weight", model.config)[0] == "norm.weight"


def test_gemma3_both_layouts_load_the_same_model(tmp_path, pair):
    """transformers saves Gemma 3 in its first releases' layout (`language_model.model.*`, the
    vision parts without `model.`); its modules' names (`model.language_model.*`,
    `model.vision_tower.*`) load the same model."""
    (model, _, _), _, path = pair
    if _architecture(path) != "Gemma3ForConditionalGeneration":
        pytest.skip("Gemma 3's two layouts only")
    from safetensors.torch import load_file, save_file

    new = shutil.copytree(path, tmp_path / "new")
    tensors = load_file(str(new / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in tensors)
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model."):
            name = name.removeprefix("language_model.")  # (an untied lm_head)
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        renamed[name] = t
    assert any(n.startswith("model.vision_tower.") for n in renamed)
    save_file(renamed, str(new / "model.safetensors"), metadata={"format": "pt"})
    again, _, _ = load_model(new)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], t, atol=0, rtol=0, msg=name)


def test_a_multimodal_config_without_text_config_is_refused():
    from pathlib import Path

    from taipan.ops.checkpoint import ModelLoadError
    from taipan.ops.hf_configs import hf_family, text_model_config

    for arch, family in (
        ("Qwen3_5MoeForConditionalGeneration", "qwen3_5"),
        ("Gemma3ForConditionalGeneration", "gemma3"),
    ):
        assert hf_family(Path("m"), {"architectures": [arch]}) == family
        with pytest.raises(ModelLoadError, match=f"{arch} without a text_config"):
            text_model_config(Path("m"), {"architectures": [arch]})
    assert hf_family(Path("m"), {"model_type": "gemma3"}) == "gemma3"
