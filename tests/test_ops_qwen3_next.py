"""ops.models.qwen3_next + ops.gated_delta + the Qwen3-Next loader against Hugging Face
transformers' Qwen3NextForCausalLM on the same weights (fp32, CPU; issue 27 item 4).

Two tiny random hybrids saved with `save_pretrained` (tests/random_qwen3_next.py: "moe" with a
shared expert and one dense layer, "dense" with tied embeddings; both Hv = 2 Hk, Dk != Dv,
partial RoPE) are loaded by both sides. Our side runs the production path the gpu worker drives
(tests/test_ops_nemotron_h.py's HybridRunner): paged KV for the attention layers (shuffled block
tables), the GDN state in the Mamba state slots, decode rows through the one-token update and
the rest through the varlen references. Plain prefill + decode, chunked prefill mixed with
decode rows, batches of different lengths, a prefill restored from a snapshot slot and from
snapshots stored inside a chunk must all give Hugging Face's logits, greedy tokens and
log-probs. Tensor parallel T = 2 (gloo) equals T = 1; a weight update in Hugging Face's names
restores every parameter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from taipan.actors.gpu.mamba_config import has_recurrent_layers
from taipan.models import has_mamba_layers
from taipan.ops.loader import ModelLoadError, load_model, random_config
from taipan.ops.mamba import allocate_mamba_state
from taipan.ops.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.weight_updates import state_updates
from tests.random_qwen3_next import CONFIGS, TINY, make_random_qwen3_next
from tests.test_ops_nemotron_h import HybridRunner

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
LENGTHS = (5, 70)  # within a KV block; several blocks, past HF's 64-token GDN chunk


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = make_random_qwen3_next(str(tmp_path_factory.mktemp("q3n")), request.param)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, path


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Hugging Face's greedy tokens through its own cache (prompt in one forward, then one
    token at a time) and the log-probs of the picks [new]."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    while True:
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]])
        if len(tokens) == new:
            return tokens, torch.stack(logprobs)
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)


def test_config_layers_and_state_shapes(pair):
    (model, config, _), hf, path = pair
    c = hf.config
    assert isinstance(config, Qwen3NextConfig) and isinstance(model, Qwen3NextForCausalLM)
    assert list(config.layer_types) == c.layer_types
    assert config.num_kv_layers == c.layer_types.count("full_attention")
    assert config.rotary_dim == int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    assert [config.is_moe_layer(i) for i in range(config.num_layers)] == [
        type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" for layer in hf.model.layers
    ]
    assert has_recurrent_layers(config) and has_mamba_layers(path)
    shape = config.mamba_state
    key_dim, value_dim = 2 * 16, 4 * 8  # Hk * Dk, Hv * Dv
    assert shape.num_layers == c.layer_types.count("linear_attention")
    assert (shape.conv_dim, shape.num_heads, shape.head_dim, shape.state_size) == (
        2 * key_dim + value_dim, 4, 16, 8,
    )  # fmt: skip
    conv, ssm = allocate_mamba_state(shape, 3, torch.bfloat16, torch.float32, "cpu")
    assert ssm.shape == (shape.num_layers, 3, 4, 16, 8)
    assert shape.bytes_per_slot(torch.bfloat16, torch.float32) * 3 == conv.nbytes + ssm.nbytes


@pytest.mark.parametrize("length", LENGTHS)
def test_prompt_logits_match_hf(pair, length):
    (model, config, _), hf, _ = pair
    ids = _prompt(length, length)
    runner = HybridRunner(model, config)
    runner.add(0, length, slot=0)
    torch.testing.assert_close(runner.step({0: ids})[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_batch_of_different_lengths_then_greedy_equals_hf(pair):
    """Three prompts in one prefill step, then greedy decode steps of all three together:
    Hugging Face's greedy tokens and their log-probs (its own cache, one prompt at a time)."""
    (model, config, _), hf, _ = pair
    prompts = [_prompt(n, 10 + n) for n in (23, 3, 40)]
    new = 6
    runner = HybridRunner(model, config, seed=5)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + new, slot=seq)
    outs = {s: [] for s in range(len(prompts))}
    logprobs = {s: [] for s in outs}
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


def test_chunked_mixed_and_restored_match_hf(pair):
    """Four sequences: one prefilled in chunks (cut mid-block and at a block edge) while others
    decode; one restored from a snapshot of another's state at a block boundary (init slot is
    the snapshot, out slot its own); then all four decode together."""
    (model, config, _), hf, _ = pair
    base = _prompt(40, 1)
    prompts = [base, _prompt(23, 2), base[:32] + _prompt(9, 3), _prompt(3, 4)]
    cont = 4
    expected = [hf_logits(hf, p + [7] * cont) for p in prompts]
    runner = HybridRunner(model, config, seed=3)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + cont, slot=seq)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in range(4)}

    def run(chunks, restore=None):
        for s, logits in runner.step(chunks, restore).items():
            got[s].append(logits)

    run({0: base[:11], 3: prompts[3]})
    run({0: base[11:32], 3: [7], 1: prompts[1][:16]})
    runner.snapshot(0, slot=8)  # seq 0's state after 32 tokens
    run({0: base[32:], 1: prompts[1][16:], 3: [7]})
    runner.share(2, source=0, tokens=32)
    run({2: prompts[2][32:], 0: [7], 1: [7], 3: [7]}, restore={2: 8})
    for _ in range(cont - 1):
        run({s: [7] for s in range(4) if runner.computed[s] < len(prompts[s]) + cont})
    for seq in range(len(prompts)):
        logits = torch.cat(got[seq])
        skipped = 32 if seq == 2 else 0
        want = expected[seq][skipped : skipped + len(logits)]
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0, msg=f"sequence {seq}")


def test_snapshots_inside_chunks_restore_to_hf(pair):
    """States the conv and delta-rule kernels store inside a 40-token chunk (after 16 and 32
    tokens), beside a decode row, restored by two sequences sharing those prefixes."""
    (model, config, _), hf, _ = pair
    base = _prompt(40, 21)
    prompts = [base, _prompt(3, 23), base[:32] + _prompt(5, 24), base[:16] + _prompt(4, 25)]
    runner = HybridRunner(model, config, seed=7)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + 1, slot=seq)
    runner.step({1: prompts[1]})
    got = runner.step({0: base, 1: [7]}, snaps={0: [(16, 8), (32, 9)]})
    torch.testing.assert_close(got[0], hf_logits(hf, base), atol=ATOL, rtol=0)
    restore, skipped = {2: 9, 3: 8}, {2: 32, 3: 16}
    for seq in restore:
        runner.share(seq, source=0, tokens=skipped[seq])
    got = runner.step({s: prompts[s][skipped[s] :] for s in restore}, restore=restore)
    for seq, n in skipped.items():
        want = hf_logits(hf, prompts[seq])[n:]
        torch.testing.assert_close(got[seq], want, atol=ATOL, rtol=0, msg=f"sequence {seq}")


def test_weight_update_in_hf_names_restores_every_parameter(pair):
    """Hugging Face's state dict (its interleaved in_proj_qkvz / in_proj_ba, q_proj with the
    gate, per-expert and shared-expert matrices) maps onto every one of our parameters."""
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


def test_gpu_worker_sizes_state_slots_and_checks_the_state_config(pair):
    """The gpu worker treats the model as a hybrid: recurrent-state slots of the GDN layers'
    bytes, and mamba_inference_state_config checked against their shapes."""
    from taipan.actors.config import ConfigError
    from tests.test_gpu_worker_mamba import load

    (_, config, _), _, path = pair
    shape = config.mamba_state
    good = {
        "layer_type_list": list(config.pattern),
        "conv_states_shape": [shape.conv_kernel - 1, shape.conv_dim],
        "ssm_states_shape": [shape.num_heads, shape.head_dim, shape.state_size],
        "mamba_chunk_size": 64,
    }
    w, loaded = load(path, mamba_state_config=json.dumps(good))
    assert loaded.mamba_slots > 0 and w.kv_cache.shape[0] == config.num_kv_layers
    assert loaded.mamba_slot_bytes == shape.bytes_per_slot(torch.float32, torch.float32)
    with pytest.raises(ConfigError, match="mamba_inference_state_config.ssm_states_shape"):
        load(path, mamba_state_config=json.dumps({"ssm_states_shape": [4, 8, 16]}))


def _edit_config(path, **changes):
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)


def test_full_attention_interval_configs_load(tmp_path):
    """Older configs name no layer_types: every full_attention_interval-th layer attends."""
    path = make_random_qwen3_next(str(tmp_path / "m"), "moe")
    _edit_config(path, layer_types=None, full_attention_interval=4)
    _, config, _ = load_model(path)
    assert config.layer_types[-1] == "full_attention" and config.num_kv_layers == 1


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"num_experts": 0}, "unexpected"),  # expert tensors the config does not make
    ],
)
def test_loader_refuses_what_it_cannot_serve(tmp_path, changes, match):
    path = make_random_qwen3_next(str(tmp_path / "m"), "moe")
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(path)


def test_random_shape_is_the_80b_layer_pattern():
    """`random:qwen3-next-80b-a3b-8l`: Qwen3-Next-80B-A3B's layers (3 GDN, 1 attention) twice."""
    config = random_config("random:qwen3-next-80b-a3b-8l")
    assert config.pattern == "GGG*GGG*" and config.rotary_dim == 64
    assert has_mamba_layers("random:qwen3-next-80b-a3b-8l")
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    # 8 of the 48 layers: the embeddings, LM head and 8 layers of about 1.6 B parameters each.
    params = sum(p.numel() for p in model.parameters())
    assert 13.0e9 < params < 14.0e9, params


def test_tiny_random_copy_equals_the_bench_hf_copy(monkeypatch):
    """A tiny copy of the random shape (two of its 3 + 1 layer groups, its 8-expert MoE) runs,
    and the bench's Hugging Face copy holding our random weights (ops/hf_bench.py) agrees."""
    from taipan.ops.hf_bench import load_hf
    from taipan.ops.moe import MoEConfig
    from taipan.ops.random_model import RANDOM_SHAPES

    tiny = dict(RANDOM_SHAPES["qwen3-next-80b-a3b-8l"], vocab_size=512, hidden_size=64)
    tiny |= dict(intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16)
    tiny |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16)
    tiny |= dict(linear_value_head_dim=8, max_position_embeddings=256)
    tiny |= dict(moe=MoEConfig(8, 2, 32, "swiglu", "softmax", True))
    tiny |= dict(shared_expert_intermediate_size=32)
    monkeypatch.setitem(RANDOM_SHAPES, "qwen3-next-tiny", tiny)
    model, config, _ = load_model("random:qwen3-next-tiny")
    hf = load_hf("random:qwen3-next-tiny", torch.float32, "cpu")
    ids = _prompt(20, 3)
    runner = HybridRunner(model, config)
    runner.add(0, 20, slot=0)
    torch.testing.assert_close(runner.step({0: ids})[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


# ---- tensor parallel (T = 2, gloo) -------------------------------------------------------------


@torch.no_grad()
def _tp_script(tp: TPGroup, path: str) -> dict:
    model, config, _ = load_model(path, tp=tp)
    runner = HybridRunner(model, config, seed=3, tp=tp)
    base = _prompt(40, 1)
    prompts = {0: base, 1: _prompt(9, 2), 2: base[:16] + _prompt(5, 3)}
    for seq, p in prompts.items():
        runner.add(seq, len(p) + 4, slot=seq)
    steps, picks = [], {}

    def run(chunks, **kwargs):
        logits = runner.step(chunks, **kwargs)
        steps.append({s: x.numpy() for s, x in logits.items()})
        picks.update({s: int(x[-1].argmax()) for s, x in logits.items()})

    run({0: base[:24], 1: prompts[1]}, snaps={0: [(16, 8)]})
    runner.share(2, source=0, tokens=16)
    run({0: base[24:], 1: [picks[1]], 2: prompts[2][16:]}, restore={2: 8})
    for _ in range(3):
        run({s: [picks[s]] for s in prompts})
    return {"steps": steps, "ssm": runner.ssm.numpy()}


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    """Both ranks (GDN split by key heads, attention by heads, MLP / experts / shared expert by
    intermediate size, vocabulary) give T = 1's logits; each rank's recurrent state holds its
    own value heads of T = 1's."""
    from tests.test_tp import run_ranks

    path = make_random_qwen3_next(str(tmp_path / "m"), "moe")
    want = _tp_script(SINGLE, path)
    ranks = run_ranks(_tp_script, path)
    for rank, got in enumerate(ranks):
        for a, b in zip(got["steps"], want["steps"], strict=True):
            for seq in b:
                np.testing.assert_allclose(a[seq], b[seq], atol=1e-5, rtol=0)
        heads = TINY["linear_num_value_heads"] // 2
        own = want["ssm"][:, :, rank * heads : (rank + 1) * heads]
        np.testing.assert_allclose(got["ssm"], own, atol=1e-5, rtol=0)
