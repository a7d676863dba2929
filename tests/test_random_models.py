"""`random:<shape>` models: named by runtime/models.py, built by ops/loader.py from a config with
seeded random weights (no disk), and the Hugging Face copy the bench times holds the same weights
(ops/hf_bench.py `hf_random_model`): equal logits, fp32, CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from taipan.models import RANDOM, ModelNotFoundError, resolve
from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import (
    RANDOM_SHAPES,
    load_model,
    random_config,
    random_state,
    random_tokenizer,
)
from taipan.ops.models.llama import LlamaForCausalLM, allocate_kv_cache
from taipan.ops.tokenizer import IncrementalDetokenizer, Tokenizer

BLOCK_SIZE = 16


def test_resolve_names_every_shape_the_loader_builds():
    assert set(RANDOM) == set(RANDOM_SHAPES)
    assert resolve("random:llama-8b") == ("llama-8b-shape", "random:llama-8b")
    with pytest.raises(ModelNotFoundError, match="random:llama-1b"):
        resolve("random:llama-70b")


@pytest.mark.parametrize(
    "spec, params, tied",
    # The published parameter counts of Llama-3.2-1B and Llama-3.1-8B.
    [("random:llama-1b", 1_235_814_400, True), ("random:llama-8b", 8_030_261_248, False)],
)
def test_shapes_are_the_real_models(spec, params, tied):
    config = random_config(spec)
    assert config.vocab_size == 128256 and config.tie_word_embeddings == tied
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == params


def test_weights_are_seeded_and_norms_are_one():
    config = random_config("random:tiny")
    a, b = random_state(config, torch.float32, "cpu"), random_state(config, torch.float32, "cpu")
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = random_state(config, torch.float32, "cpu", seed=1)
    assert not torch.equal(a["embed_tokens.weight"], other["embed_tokens.weight"])
    assert torch.equal(a["norm.weight"], torch.ones(config.hidden_size))
    assert abs(a["layers.0.mlp.gate_up_proj.weight"].std().item() - 0.02) < 0.002


def test_tokenizer_decodes_ids_beyond_its_vocabulary():
    """A random model samples any of its vocab_size ids; only 259 have tokens. Decoding skips
    the rest instead of failing, in full and incrementally, also after a round trip."""
    tok = Tokenizer.from_wire(random_tokenizer().to_wire())
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),) == (258,)
    assert tok.decode(tok.encode("hi <|im_end|>"), skip_special_tokens=False) == "hi <|im_end|>"
    assert tok.decode([104, 100_000, 105, 511]) == "hi"
    detok = IncrementalDetokenizer(tok, [104])
    text = "".join(detok.feed([i]) for i in (100_000, 105, 128_255)) + detok.flush()
    assert text == "i"


def _our_logits(model, config, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One prefill step over every prompt through the paged path, logits of every position."""
    blocks = [(len(p) + BLOCK_SIZE - 1) // BLOCK_SIZE for p in prompts]
    tables = [list(range(sum(blocks[:i]), sum(blocks[: i + 1]))) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    meta, positions = build_attention_metadata(lens, lens, tables, BLOCK_SIZE)
    cache = allocate_kv_cache(config, sum(blocks), BLOCK_SIZE, torch.float32, "cpu")
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, meta, cache)).split(lens)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_copy_has_our_weights(monkeypatch, tied):
    """Llama-3.2-1B ties the LM head to the embeddings, Llama-3.1-8B does not: both layouts."""
    pytest.importorskip("transformers")
    from taipan.ops.hf_bench import load_hf

    shape = dict(RANDOM_SHAPES["tiny"], tie_word_embeddings=tied)
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-test", shape)
    model, config, _ = load_model("random:tiny-test")
    assert (model.lm_head is None) == tied
    hf = load_hf("random:tiny-test", torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (37, 5)]
    for prompt, ours in zip(prompts, _our_logits(model, config, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_decode_floor_reads_the_lm_head_not_an_untied_embedding():
    """A decode step reads every weight once, but of an untied input embedding only its batch's
    rows (none of it is counted); a tied one is the LM head and counts once."""
    from taipan.ops.hardware import model_bytes

    untied = model_bytes("random:llama-8b", torch.bfloat16)
    assert untied["weight_bytes"] == 2 * (8_030_261_248 - 128256 * 4096)
    assert untied["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    tied = model_bytes("random:llama-1b", torch.bfloat16)
    assert tied["weight_bytes"] == 2 * 1_235_814_400 == 2 * tied["read_params"]


def test_decode_floor_of_a_mixture_reads_the_chosen_experts():
    """A mixture of experts' step reads each chosen expert once: at least top_k of num_experts
    per layer (floor_min_ms: the H100's 80B-A3B-like row at batch 1, 1.76 ms, was refused
    against every expert's 9.2 ms), about 1 - (1 - k/E)^b of them under uniform routing."""
    from taipan.bench.decode import _decode_row, decode_invalid, step_weight_bytes
    from taipan.ops.hardware import model_bytes

    hw = model_bytes("random:qwen3-next-80b-a3b-8l", torch.bfloat16)
    assert hw["experts"] == (512, 10)
    assert hw["expert_bytes"] == 2 * hw["expert_params"] == 2 * 8 * 512 * 3 * 512 * 2048
    dense = hw["weight_bytes"] - hw["expert_bytes"]
    expected, least = step_weight_bytes(hw, 1)
    assert expected == pytest.approx(least) == pytest.approx(dense + hw["expert_bytes"] * 10 / 512)
    expected, least = step_weight_bytes(hw, 64)
    assert expected == pytest.approx(dense + hw["expert_bytes"] * (1 - (502 / 512) ** 64))
    assert least < expected < hw["weight_bytes"]
    dense_hw = model_bytes("random:llama-1b", torch.bfloat16)
    assert step_weight_bytes(dense_hw, 64) == (dense_hw["weight_bytes"],) * 2
    args = argparse.Namespace(prompt_len=8, output_len=16, copy_gib=1.0, device="cuda")
    hw.update(copy_gb_s=1000.0, matmul_tflop_s=500.0)
    figures = dict(step_ms=50.0, diff_ms=50.0, t1_s=0.1, tn_s=0.2, gpu_idle_share=0.0)
    ours = {"graphs": {64: dict(figures, steps_graphed_share=1.0)}}
    row = _decode_row(args, {"workload": "decode", "batch": 64}, 64, ours, {}, hw)
    assert row["floor_min_ms"] < row["floor_ms"] and row["experts"].startswith("10 of 512")
    assert decode_invalid(row) is None
    ours["graphs"][64]["step_ms"] = row["floor_min_ms"] * 0.9
    row = _decode_row(args, {"workload": "decode", "batch": 64}, 64, ours, {}, hw)
    assert "below floor_min_ms" in decode_invalid(row)
