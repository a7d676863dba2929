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

import numpy as np
import pytest
import torch

from taipan.ops.attention import AttentionMetadata, build_attention_metadata
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.mamba import MambaMetadata
from taipan.ops.moe import moe_blocks
from taipan.ops.mtp import mtp_drafts, mtp_drafts_static
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


FAMILIES = [("qwen3_next", kind) for kind in CONFIGS] + [("qwen3_5", "moe")]


@pytest.fixture(scope="module", params=FAMILIES, ids=["-".join(f) for f in FAMILIES])
def with_head(request, tmp_path_factory):
    return checkpoint_with_head(request.param, tmp_path_factory)


def checkpoint_with_head(family_kind: tuple[str, str], tmp_path_factory):
    """(path, the head's own tensors, Hugging Face's model, our load_model(mtp=True)) of a tiny
    random checkpoint of FAMILIES with a random head."""
    family, kind = family_kind
    root = str(tmp_path_factory.mktemp("mtp"))
    if family == "qwen3_5":
        from tests.random_qwen3_5 import make_random_qwen3_5

        path = make_random_qwen3_5(root, kind)
    else:
        path = make_random_qwen3_next(root, kind)
    own = add_mtp_head(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, own, hf, load_model(path, mtp=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


def _reference_parts(hf, own: dict):
    """The head's modules in Hugging Face's classes: (its decoder layer, its norms, fc)."""
    c = hf.config
    layer = copy.deepcopy(hf.model.layers[mtp_source_layer(c)])
    for p in layer.parameters():
        p.mul_(MTP_SCALE)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = type(hf.model.norm)(c.hidden_size, eps=c.rms_norm_eps)  # (the family's)
        norms[name].weight.copy_(own[f"mtp.{name}.weight"].float())
    fc = own["mtp.fc.weight"].float()

    def fuse(next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = norms["pre_fc_norm_embedding"](hf.model.embed_tokens(next_ids))
        return torch.cat([embedded, norms["pre_fc_norm_hidden"](hidden)], -1) @ fc.T

    def run(x: torch.Tensor) -> torch.Tensor:
        """The layer over inputs [n, H] at positions 0..n-1 (causal), then the head's norm."""
        positions = torch.arange(x.shape[0])[None]
        cos_sin = hf.model.rotary_emb(x[None], positions)
        out = layer(
            x[None], position_embeddings=cos_sin, attention_mask=None, position_ids=positions
        )
        return norms["norm"]((out[0] if isinstance(out, tuple) else out)[0])

    return fuse, run


@torch.no_grad()
def reference_logits(hf, own: dict, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row p scores the token at p + 2 from ids[p + 1] and the model's
    hidden state at p."""
    fuse, run = _reference_parts(hf, own)
    hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H] after the final norm
    return hf.lm_head(run(fuse(torch.tensor(ids[1:]), hidden[:-1]))).float()


@torch.no_grad()
def reference_drafts(hf, own: dict, known: list[int], after: int, k: int):
    """k greedy drafts of the head at the last position of `known` (the token after it:
    `after`), each later one fed the head's own output and its previous draft; and their
    logits [k, V]."""
    fuse, run = _reference_parts(hf, own)
    hidden = hf.model(torch.tensor([known])).last_hidden_state[0]
    x = fuse(torch.tensor(known[1:] + [after]), hidden)  # [n, H]: position p's input
    drafts, logits = [], []
    for _ in range(k):
        state = run(x)[-1]
        logits.append(hf.lm_head(state).float())
        drafts.append(int(logits[-1].argmax()))
        x = torch.cat([x, fuse(torch.tensor(drafts[-1:]), state[None])])
    return drafts, torch.stack(logits)


def assert_drafts(got, want) -> None:
    """(drafts, logits) of one row equal the reference's: drafts exactly, each draft's logits
    within ATOL (where the row has that draft)."""
    (drafts, logits), (want_drafts, want_logits) = got, want
    n = len(want_drafts)
    assert list(drafts[:n]) == want_drafts and all(d == -1 for d in drafts[n:])
    assert torch.allclose(logits[:n], want_logits, atol=ATOL), (
        (logits[:n] - want_logits).abs().max()
    )
    assert torch.isnan(logits[n:]).all()


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
    runner.last_step = (attn, positions)
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
    # A head of two layers (the first one's tensors again as mtp.layers.1): not served.
    from safetensors.torch import load_file, save_file

    two = make_random_qwen3_next(str(tmp_path / "two"), "dense")
    add_mtp_head(two)
    tensors = load_file(f"{two}/model.safetensors")
    layer0 = {n: t for n, t in tensors.items() if n.startswith("mtp.layers.0.")}
    tensors |= {n.replace("layers.0.", "layers.1.", 1): t.clone() for n, t in layer0.items()}
    save_file(tensors, f"{two}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="has 2 layers; heads of more than one"):
        load_model(two, mtp=True)


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


K = 4


def _drafts(runner, seq: int, ids: list[int], hidden, last: int, after: int):
    """mtp_drafts of the step `model_step` just ran for `seq` (one row): (drafts, logits)."""
    attn, positions = runner.last_step
    drafts, logits = mtp_drafts(
        runner.model,
        runner.cache,
        attn,
        [runner.tables[seq]],
        BLOCK_SIZE,
        torch.tensor(ids),
        positions,
        hidden,
        np.array([last]),
        np.array([after]),
        np.array([True]),
        K,
        with_logits=True,
    )
    return drafts[0].tolist(), logits[0]


def test_drafts_after_a_prompt_and_after_a_partly_accepted_verify_row(with_head):
    """A whole prompt (the sampled token after it), then a verify-shaped row of four tokens of
    which the first two are kept and a bonus token follows: both times the head's k drafts
    equal the reference's over the true sequence (the rejected positions' KV is rewritten by
    the chain before it is read)."""
    _, own, hf, (model, config, _) = with_head
    ids = _prompt(40, seed=11)
    runner = HybridRunner(model, config, num_blocks=16, num_slots=2, seed=7)
    runner.add(0, 64, slot=0)
    hidden = model_step(runner, 0, ids)
    sampled = int(model.compute_logits(hidden[-1:]).argmax())
    got = _drafts(runner, 0, ids, hidden, len(ids) - 1, sampled)
    assert_drafts(got, reference_drafts(hf, own, ids, sampled, K))
    row = [sampled, 5, 9, 13]  # the last known token, three "drafts"; two tokens kept
    hidden = model_step(runner, 0, row)
    bonus = 77
    got = _drafts(runner, 0, row, hidden, 1, bonus)
    assert_drafts(got, reference_drafts(hf, own, ids + row[:2], bonus, K))


def test_a_row_at_its_blocks_end_drafts_once(with_head):
    """seq_len 32 with blocks of 16: the chain would write the head's KV in a block the row
    does not own yet, so only the first draft comes."""
    _, own, hf, (model, config, _) = with_head
    ids = _prompt(32, seed=12)
    runner = HybridRunner(model, config, num_blocks=16, num_slots=2, seed=8)
    runner.add(0, 48, slot=0)
    hidden = model_step(runner, 0, ids)
    got = _drafts(runner, 0, ids, hidden, len(ids) - 1, 3)
    assert_drafts(got, reference_drafts(hf, own, ids, 3, 1))


def test_two_rows_in_one_step_draft_each_its_own(with_head):
    """Two prompts in one step (different lengths, shuffled blocks) and a row not drafting:
    each drafting row's drafts equal the reference's alone."""
    _, own, hf, (model, config, _) = with_head
    prompts = {0: _prompt(23, seed=21), 1: _prompt(37, seed=22), 2: _prompt(9, seed=23)}
    runner, attn, positions, flat, hidden = _three_prompts(model, config, prompts, seed=9)
    flat = flat.tolist()
    ends = np.cumsum([len(p) for p in prompts.values()]) - 1
    after = np.array([4, 8, 15])
    drafts, logits = mtp_drafts(
        model, runner.cache, attn, [runner.tables[s] for s in (0, 1, 2)], BLOCK_SIZE,
        torch.tensor(flat), positions, hidden, ends, after, np.array([True, True, False]), K,
        with_logits=True,
    )  # fmt: skip
    for seq in (0, 1):
        want = reference_drafts(hf, own, prompts[seq], int(after[seq]), K)
        assert_drafts((drafts[seq].tolist(), logits[seq]), want)
    assert drafts[2].tolist() == [-1] * K and torch.isnan(logits[2]).all()
    with pytest.raises(ValueError, match="must be one of its tokens"):
        mtp_drafts(
            model, runner.cache, attn, [runner.tables[s] for s in (0, 1, 2)], BLOCK_SIZE,
            torch.tensor(flat), positions, hidden, ends + 1, after, np.ones(3, bool), K,
        )  # fmt: skip
    with pytest.raises(ValueError, match="token after its last valid position"):
        mtp_drafts(
            model, runner.cache, attn, [runner.tables[s] for s in (0, 1, 2)], BLOCK_SIZE,
            torch.tensor(flat), positions, hidden, ends, after - 100, np.ones(3, bool), K,
        )  # fmt: skip


def test_the_static_drafts_equal_the_references(with_head):
    """`mtp_drafts_static` (what the worker runs and records in a CUDA graph: every row of the
    step, device tensors only) against `mtp_drafts` over one step of three prompts (one not
    drafting, one near its block's end): the same drafts, and the same keys and values in the
    head's cache layer (those the drafts wrote, and nothing else). Fails if a row that does
    not draft, or a pass past a row's room, wrote the head's KV."""
    _, _, _, (model, config, _) = with_head
    prompts = {0: _prompt(23, seed=31), 1: _prompt(30, seed=32), 2: _prompt(9, seed=33)}
    runner, attn, positions, flat, hidden = _three_prompts(model, config, prompts, seed=10)
    tables = [runner.tables[s] for s in (0, 1, 2)]
    ends = np.cumsum([len(p) for p in prompts.values()]) - 1
    after, drafting = np.array([4, 8, 15]), np.array([1, 1, 0], bool)
    before = runner.cache.clone()
    want = mtp_drafts(
        model, runner.cache, attn, tables, BLOCK_SIZE, flat, positions, hidden, ends, after,
        drafting, K,
    )  # fmt: skip
    want_cache = runner.cache.clone()
    runner.cache.copy_(before)
    got = mtp_drafts_static(
        model, runner.cache, attn, flat, positions, hidden, torch.as_tensor(ends),
        torch.as_tensor(after), torch.as_tensor(drafting), attn.seq_lens, attn.block_tables,
        BLOCK_SIZE, K,
    )  # fmt: skip
    assert got.tolist() == want.tolist()
    assert want[1, 2] >= 0 and want[1, 3] == -1  # (30 tokens in blocks of 16: 2 passes left)
    assert torch.allclose(runner.cache, want_cache, atol=1e-5, equal_nan=True)
    assert not torch.equal(runner.cache, before)
    # Padded as a graph's bucket pads it: 5 more tokens (slot -1, owned by no row) and a row of
    # no tokens (last -1, length 0, a table of zeros): the same drafts, -1 for the padding row,
    # and the same KV (padding writes nothing).
    runner.cache.copy_(before)
    pad, n = 5, len(flat)
    padded = AttentionMetadata(
        query_start_loc=torch.cat([attn.query_start_loc, attn.query_start_loc[-1:]]),
        seq_lens=torch.cat([attn.seq_lens, torch.zeros(1, dtype=torch.int32)]),
        block_tables=torch.cat([attn.block_tables, torch.zeros_like(attn.block_tables[:1])]),
        slot_mapping=torch.cat([attn.slot_mapping, torch.full((pad,), -1)]),
    ).with_layout([*attn.query_start_loc.tolist(), n], [*attn.seq_lens.tolist(), 0], BLOCK_SIZE)
    got = mtp_drafts_static(
        model, runner.cache, padded, torch.cat([flat, torch.zeros(pad, dtype=flat.dtype)]),
        torch.cat([positions, torch.zeros(pad, dtype=positions.dtype)]),
        torch.cat([hidden, torch.randn(pad, hidden.shape[1])]), torch.tensor([*ends, -1]),
        torch.tensor([*after, 0]), torch.tensor([*drafting, False]), padded.seq_lens,
        padded.block_tables, BLOCK_SIZE, K,
    )  # fmt: skip
    assert got.tolist() == [*want.tolist(), [-1] * K]
    assert torch.allclose(runner.cache, want_cache, atol=1e-5, equal_nan=True)


def _three_prompts(model, config, prompts: dict, seed: int):
    """The model's step over prompts 0, 1 and 2 from position 0, each in its own blocks and
    recurrent slot: (runner, attn, positions, the step's token ids, hidden states)."""
    runner = HybridRunner(model, config, num_blocks=24, num_slots=4, seed=seed)
    for seq in prompts:
        runner.add(seq, 48, slot=seq)
    lens = [len(prompts[s]) for s in (0, 1, 2)]
    tables = [runner.tables[s] for s in (0, 1, 2)]
    attn, positions = build_attention_metadata(lens, lens, tables, BLOCK_SIZE)
    mamba = MambaMetadata(
        runner.conv, runner.ssm, torch.tensor([-1, -1, -1], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32), attn.query_start_loc, attn.num_decodes,
    )  # fmt: skip
    flat = torch.tensor([t for s in (0, 1, 2) for t in prompts[s]])
    with torch.no_grad():
        hidden = model(flat, positions, attn, runner.cache, mamba)
    return runner, attn, positions, flat, hidden


# ---- tensor parallel (T = 2, gloo) -------------------------------------------------------------


def _tp_drafts(tp, path: str) -> dict:
    """A prompt's drafts and their logits at tensor-parallel group `tp` (the head's layer
    sharded as any layer, fc and its norms replicated, the LM head's vocabulary gathered)."""
    model, config, _ = load_model(path, tp=tp, mtp=True)
    runner = HybridRunner(model, config, num_blocks=16, num_slots=2, seed=4, tp=tp)
    runner.add(0, 48, slot=0)
    ids = _prompt(30, seed=41)
    hidden = model_step(runner, 0, ids)
    drafts, logits = _drafts(runner, 0, ids, hidden, len(ids) - 1, 9)
    return {"drafts": drafts, "logits": logits.numpy()}


def test_tp2_drafts_equal_tp1(with_head):
    from taipan.ops.parallel import SINGLE
    from tests.test_tp import run_ranks

    path = with_head[0]
    want = _tp_drafts(SINGLE, path)
    for got in run_ranks(_tp_drafts, path):
        assert got["drafts"] == want["drafts"]
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5, rtol=0)
