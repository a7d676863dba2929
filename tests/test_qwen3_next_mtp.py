"""The multi-token-prediction head of Qwen3-Next-style checkpoints (issue 29 item 2, its model
side): `load_model(mtp=True)` reads `mtp.*`, and `Qwen3NextForCausalLM.mtp_forward` equals a
reference built from Hugging Face's own modules (fp32, CPU).

Hugging Face's model ignores `mtp.*`, so the reference is assembled here as vLLM's
Qwen3-Next MTP computes it: the next token's embedding and the model's output hidden state
(after its final norm), each through a zero-centred RMSNorm, concatenated [embedding |
hidden], `fc` back to the hidden size, one full-attention decoder layer (Hugging Face's
Qwen3NextDecoderLayer, causal over the head's own positions), the head's norm, the LM head.
The random head (tests/random_qwen3_next.add_mtp_head) takes its layer from a full-attention
layer of the model scaled by MTP_SCALE, in the checkpoint's own tensor layout, so Hugging
Face's layer module of that index, scaled alike, is the reference layer.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.mamba import MambaMetadata
from taipan.ops.moe import moe_blocks
from taipan.ops.weight_updates import state_updates
from tests.random_qwen3_next import (
    CONFIGS,
    MTP_SCALE,
    add_mtp_head,
    make_random_qwen3_next,
    mtp_source_layer,
)
from tests.test_ops_nemotron_h import BLOCK_SIZE, HybridRunner

transformers = pytest.importorskip("transformers")
ATOL = 2e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def with_head(request, tmp_path_factory):
    path = make_random_qwen3_next(str(tmp_path_factory.mktemp("q3n_mtp")), request.param)
    own = add_mtp_head(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, own, hf, load_model(path, mtp=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


@torch.no_grad()
def reference_logits(hf, own: dict, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row p scores the token at p + 2 from ids[p + 1] and the model's
    hidden state at p."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    c = hf.config
    tokens = torch.tensor([ids])
    hidden = hf.model(tokens).last_hidden_state[0]  # [T, H] after the final norm
    layer = copy.deepcopy(hf.model.layers[mtp_source_layer(c)])
    for p in layer.parameters():
        p.mul_(MTP_SCALE)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        norms[name].weight.copy_(own[f"mtp.{name}.weight"].float())
    embedded = norms["pre_fc_norm_embedding"](hf.model.embed_tokens(tokens[0, 1:]))
    x = torch.cat([embedded, norms["pre_fc_norm_hidden"](hidden[:-1])], -1)
    x = (x @ own["mtp.fc.weight"].float().T)[None]  # [1, T - 1, H]
    positions = torch.arange(len(ids) - 1)[None]
    cos_sin = hf.model.rotary_emb(x, positions)
    out = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    return hf.lm_head(norms["norm"](out))[0].float()


@torch.no_grad()
def model_step(runner: HybridRunner, seq: int, ids: list[int]) -> torch.Tensor:
    """The model's hidden states [len(ids), H] for the next tokens of `seq` (one sequence)."""
    done = runner.computed[seq]
    attn, positions = build_attention_metadata(
        [len(ids)], [done + len(ids)], [runner.tables[seq]], BLOCK_SIZE
    )
    slot = runner.slot[seq]
    mamba = MambaMetadata(
        runner.conv,
        runner.ssm,
        torch.tensor([slot if done else -1], dtype=torch.int32),
        torch.tensor([slot], dtype=torch.int32),
        attn.query_start_loc,
        attn.num_decodes,
    )
    hidden = runner.model(torch.tensor(ids), positions, attn, runner.cache, mamba)
    runner.computed[seq] += len(ids)
    return hidden


@torch.no_grad()
def mtp_step(runner: HybridRunner, seq: int, start: int, next_ids, hidden) -> torch.Tensor:
    """The head's logits at positions start .. start + len(next_ids) - 1 of `seq`."""
    n = len(next_ids)
    attn, positions = build_attention_metadata([n], [start + n], [runner.tables[seq]], BLOCK_SIZE)
    out = runner.model.mtp_forward(torch.tensor(next_ids), positions, hidden, attn, runner.cache)
    return runner.model.compute_logits(out)


def test_the_head_loads_as_a_layer_after_the_models(with_head):
    path, own, hf, (model, config, _) = with_head
    c = hf.config
    assert config.num_mtp_layers == 1 and config.num_layers == c.num_hidden_layers
    assert config.num_kv_layers == c.layer_types.count("full_attention") + 1
    assert len(model.layers) == config.num_layers + 1
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        got = getattr(model.mtp, name).weight
        assert torch.equal(got, own[f"mtp.{name}.weight"].float()), name
    # Every tensor of the head's layer, fused and stacked as the model's own: the source
    # layer's, scaled (the loader placed it as it places any layer).
    src, head = model.layers[mtp_source_layer(c)], model.layers[config.num_layers]
    theirs = dict(head.named_parameters())
    for name, p in src.named_parameters():
        assert torch.allclose(theirs[name], p * MTP_SCALE, atol=1e-6), name
    # Its MoE block is not one of the model's: a model step records no routing for it.
    assert len(moe_blocks(model)) == sum(config.is_moe_layer(i) for i in range(config.num_layers))


def test_without_mtp_the_checkpoint_loads_as_before(with_head):
    path, _, _, _ = with_head
    model, config, _ = load_model(path)
    assert config.num_mtp_layers == 0 and model.mtp is None
    assert len(model.layers) == config.num_layers
    with pytest.raises(ValueError, match="without its MTP head"):
        model.mtp_forward(torch.tensor([1]), torch.tensor([0]), None, None, None)


def test_refusals(tmp_path, with_head):
    path, _, _, (model, _, _) = with_head
    plain = make_random_qwen3_next(str(tmp_path / "plain"), "dense")
    with pytest.raises(ModelLoadError, match="no multi-token-prediction head"):
        load_model(plain, mtp=True)
    with pytest.raises(ModelLoadError, match="Hugging Face directory only"):
        load_model("random:llama-tiny", mtp=True)
    with pytest.raises(ValueError, match="depth 1: the model has 1 MTP layers"):
        model.mtp_forward(torch.tensor([1]), torch.tensor([0]), None, None, None, depth=1)


def test_a_llama_checkpoint_has_no_mtp_here(tmp_path):
    from tests.random_llama import TINY_SHAPE, make_random_llama

    path = make_random_llama(str(tmp_path / "llama"), TINY_SHAPE)
    with pytest.raises(ModelLoadError, match="Qwen3-Next-style checkpoints only"):
        load_model(path, mtp=True)


@pytest.mark.parametrize("cut", [None, 17], ids=["one-pass", "two-chunks"])
def test_mtp_logits_equal_the_reference_and_leave_the_models_kv(with_head, cut):
    """The head over a 40-token prompt (several KV blocks) in one pass or two (the second
    reads the KV the first wrote), equal to the reference; then the model's next step, which
    reads the attention layers' KV beside the head's, still equals Hugging Face's."""
    _, own, hf, (model, config, _) = with_head
    ids = _prompt(40, seed=3)
    want = reference_logits(hf, own, ids)
    runner = HybridRunner(model, config, num_blocks=16, num_slots=2, seed=5)
    runner.add(0, 48, slot=0)
    hidden = model_step(runner, 0, ids)
    cuts = [0, len(ids) - 1] if cut is None else [0, cut, len(ids) - 1]
    got = torch.cat(
        [
            mtp_step(runner, 0, a, ids[a + 1 : b + 1], hidden[a:b])
            for a, b in itertools.pairwise(cuts)
        ]
    )
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The model's KV beside the head's: its next token's logits are still Hugging Face's.
    nxt = int(want[-1].argmax())
    step = model.compute_logits(model_step(runner, 0, [nxt]))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids + [nxt]])).logits[0, -1].float()
    assert torch.allclose(step, ref, atol=ATOL), (step - ref).abs().max()


def test_weight_updates_in_hugging_faces_names_reach_the_head(with_head):
    """A trainer's state dict holds `mtp.*` as the checkpoint does: a model loaded with its
    head takes them (the layer as layer num_layers, fused as any layer's), one loaded without
    skips them, as its loader did."""
    from safetensors.torch import load_file

    path, own, _, (model, config, _) = with_head
    head = {n: t * 0.5 for n, t in load_file(f"{path}/model.safetensors").items() if "mtp." in n}
    fresh, _, _ = load_model(path, mtp=True)
    params = fresh.state_dict()
    updates = state_updates(head, fresh, params)
    with torch.no_grad():
        for name, rows, values in updates:
            params[name][rows].copy_(torch.as_tensor(values))
    assert torch.equal(fresh.mtp.fc.weight, own["mtp.fc.weight"].float() * 0.5)
    src, layer = model.layers[config.num_layers], fresh.layers[config.num_layers]
    theirs = dict(layer.named_parameters())
    for name, p in src.named_parameters():
        assert torch.allclose(theirs[name], p * 0.5, atol=1e-6), name
    plain, _, _ = load_model(path)
    assert state_updates(head, plain) == []
