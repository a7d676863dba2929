"""ops.models.nemotron_h + ops.mamba + the NemotronH loader against Hugging Face transformers'
NemotronHForCausalLM on the same weights (fp32, CPU; issue 10).

Tiny random hybrids saved with `save_pretrained` (three layer patterns, mamba_chunk_size 16) are
loaded by both sides. Our side runs the production path the gpu worker drives: paged KV for the
attention layers (shuffled block tables), Mamba state in slots, decode rows through the one-token
update and the rest through the varlen prefill references. Prompts are shorter than, equal to and
several times the chunk; chunked prefill, mixed prefill + decode steps, and a prefill restored
from a snapshot slot (read in place: init slot != out slot) must all give Hugging Face's logits.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.mamba import MambaMetadata, allocate_mamba_state
from taipan.ops.models.llama import allocate_kv_cache
from taipan.ops.parallel import SINGLE
from tests.random_nemotron_h import PATTERNS, TINY_HYBRID, make_random_nemotron_h

transformers = pytest.importorskip("transformers")
BLOCK_SIZE = 16
ATOL = 1e-4
LENGTHS = (5, 16, 16 * 3 + 7)  # shorter than, equal to, several times mamba_chunk_size


@pytest.fixture(scope="module", params=PATTERNS)
def pair(request, tmp_path_factory):
    path = make_random_nemotron_h(str(tmp_path_factory.mktemp("nh")), pattern=request.param)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


class HybridRunner:
    """A minimal gpu-worker stand-in: shuffled KV blocks and one live Mamba slot per sequence,
    plus spare slots for snapshots. A step's decode rows (one token, continuing) come first.
    `tp`: the model's tensor-parallel group (the caches hold the rank's share)."""

    def __init__(self, model, config, num_blocks=64, num_slots=12, seed=0, device="cpu", tp=SINGLE):
        self.model, self.config, self.device = model, config, device
        dtype = next(model.parameters()).dtype
        self.cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, dtype, device, tp)
        self.conv, self.ssm = allocate_mamba_state(
            config.mamba_state_for(tp), num_slots, dtype, torch.float32, device
        )
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.slot: dict[int, int] = {}

    def add(self, seq: int, max_len: int, slot: int) -> None:
        self.tables[seq] = [self.free.pop() for _ in range(math.ceil(max_len / BLOCK_SIZE))]
        self.computed[seq], self.slot[seq] = 0, slot

    def snapshot(self, seq: int, slot: int) -> None:
        """Copy a sequence's live state into another slot (what a snapshot is)."""
        self.conv[:, slot] = self.conv[:, self.slot[seq]]
        self.ssm[:, slot] = self.ssm[:, self.slot[seq]]

    def share(self, seq: int, source: int, tokens: int) -> None:
        """Let `seq` start after `tokens` tokens of `source`'s KV (block-aligned)."""
        assert tokens % BLOCK_SIZE == 0
        self.tables[seq][: tokens // BLOCK_SIZE] = self.tables[source][: tokens // BLOCK_SIZE]
        self.computed[seq] = tokens

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]], restore: dict[int, int] | None = None, snaps=None):
        """One forward over every sequence's chunk (decode rows first, as the engine orders
        them); `restore`: seq -> the slot its initial state is read from; `snaps`: seq ->
        [(tokens into its chunk, snapshot slot)], states the kernels store inside the chunk.
        Logits per seq."""
        restore, snaps = restore or {}, snaps or {}
        seqs = sorted(chunks, key=lambda s: len(chunks[s]) != 1 or self.computed[s] == 0)
        query_lens = [len(chunks[s]) for s in seqs]
        seq_lens = [self.computed[s] + len(chunks[s]) for s in seqs]
        attn, positions = build_attention_metadata(
            query_lens, seq_lens, [self.tables[s] for s in seqs], BLOCK_SIZE, self.device
        )
        init = [restore.get(s, self.slot[s] if self.computed[s] else -1) for s in seqs]
        mamba = MambaMetadata(
            self.conv,
            self.ssm,
            torch.tensor(init, dtype=torch.int32, device=self.device),
            torch.tensor([self.slot[s] for s in seqs], dtype=torch.int32, device=self.device),
            attn.query_start_loc,
            attn.num_decodes,
        )
        if snaps:
            rows = seqs[attn.num_decodes :]
            width = max(len(v) for v in snaps.values())
            pad = [(1, -1)] * width
            table = [(snaps.get(s, []) + pad)[:width] for s in rows]
            mamba.snap_pos = torch.tensor([[p for p, _ in r] for r in table], device=self.device)
            mamba.snap_slots = torch.tensor([[t for _, t in r] for r in table], device=self.device)
        ids = torch.tensor([t for s in seqs for t in chunks[s]], device=self.device)
        hidden = self.model(ids, positions, attn, self.cache, mamba)
        logits = self.model.compute_logits(hidden).cpu()
        for s, n in zip(seqs, query_lens, strict=True):
            self.computed[s] += n
        return dict(zip(seqs, logits.split(query_lens), strict=True))


def test_config_and_state_shapes(pair):
    (model, config, tok), hf = pair
    assert config.pattern == hf.config.hybrid_override_pattern
    assert config.num_kv_layers == config.pattern.count("*")
    shape = config.mamba_state
    assert shape.num_layers == config.pattern.count("M")
    assert shape.conv_dim == 8 * 8 + 2 * 2 * 16
    conv, ssm = allocate_mamba_state(shape, 3, torch.bfloat16, torch.float32, "cpu")
    assert conv.shape == (shape.num_layers, 3, 3, shape.conv_dim)
    assert ssm.shape == (shape.num_layers, 3, 8, 8, 16) and ssm.dtype == torch.float32
    assert shape.bytes_per_slot(torch.bfloat16, torch.float32) * 3 == conv.nbytes + ssm.nbytes


@pytest.mark.parametrize("length", LENGTHS)
def test_prompt_logits_match_hf(pair, length):
    (model, config, _), hf = pair
    ids = _prompt(length, length)
    runner = HybridRunner(model, config)
    runner.add(0, length, slot=0)
    torch.testing.assert_close(runner.step({0: ids})[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_mixed_and_restored_match_hf(pair):
    """Four sequences: one prefilled in chunks (cut mid-block and at a block edge) while others
    decode; one restored from a snapshot of another's state at a block boundary (init slot is
    the snapshot, out slot its own); then all four decode together."""
    (model, config, _), hf = pair
    base = _prompt(40, 1)
    prompts = [base, _prompt(23, 2), base[:32] + _prompt(9, 3), _prompt(3, 4)]
    cont = 5
    expected = [hf_logits(hf, p + [7] * cont) for p in prompts]
    runner = HybridRunner(model, config, seed=3)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + cont, slot=seq)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in range(4)}

    def run(chunks, restore=None):
        for s, logits in runner.step(chunks, restore).items():
            got[s].append(logits)

    run({0: base[:11], 3: prompts[3]})  # seq 0 chunk 1 (mid-block), seq 3 whole
    run({0: base[11:32], 3: [7], 1: prompts[1][:16]})  # seq 0 up to the 2-block edge
    runner.snapshot(0, slot=8)  # seq 0's state after 32 tokens
    run({0: base[32:], 1: prompts[1][16:], 3: [7]})
    runner.share(2, source=0, tokens=32)
    run({2: prompts[2][32:], 0: [7], 1: [7], 3: [7]}, restore={2: 8})
    for _ in range(cont - 1):
        chunks = {s: [7] for s in range(4) if runner.computed[s] < len(prompts[s]) + cont}
        run(chunks)
    for seq in range(len(prompts)):
        logits = torch.cat(got[seq])
        skipped = 32 if seq == 2 else 0
        want = expected[seq][skipped : skipped + len(logits)]
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0, msg=f"sequence {seq}")


def test_snapshots_inside_chunks_restore_to_hf(pair):
    """Snapshots the kernels take inside prefill chunks (seq 0: one 40-token chunk, states
    after 16 and 32 tokens; seq 1: after 16 of its 23, in a step with a decode row), restored
    by three sequences sharing those prefixes in one step: Hugging Face's logits."""
    (model, config, _), hf = pair
    base, other = _prompt(40, 21), _prompt(23, 22)
    prompts = [base, other, _prompt(3, 23), base[:32] + _prompt(5, 24)]
    prompts += [base[:16] + _prompt(4, 25), other[:16] + _prompt(17, 26)]
    runner = HybridRunner(model, config, seed=7)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + 1, slot=seq)
    got = runner.step({2: prompts[2]})
    torch.testing.assert_close(got[2], hf_logits(hf, prompts[2]), atol=ATOL, rtol=0)
    got = runner.step({0: base, 1: other, 2: [7]}, snaps={0: [(16, 8), (32, 9)], 1: [(16, 10)]})
    for seq in (0, 1):
        torch.testing.assert_close(got[seq], hf_logits(hf, prompts[seq]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2][-1], hf_logits(hf, prompts[2] + [7])[-1], atol=ATOL, rtol=0)
    restore, skipped = {3: 9, 4: 8, 5: 10}, {3: 32, 4: 16, 5: 16}
    for seq, source in ((3, 0), (4, 0), (5, 1)):
        runner.share(seq, source=source, tokens=skipped[seq])
    got = runner.step({s: prompts[s][skipped[s] :] for s in restore}, restore=restore)
    for seq, n in skipped.items():
        want = hf_logits(hf, prompts[seq])[n:]
        torch.testing.assert_close(got[seq], want, atol=ATOL, rtol=0, msg=f"sequence {seq}")


def test_greedy_generation_matches_hf_generate(pair):
    (model, config, _), hf = pair
    prompts = [_prompt(n, 10 + n) for n in LENGTHS]
    new = 12
    runner = HybridRunner(model, config, seed=5)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + new, slot=seq)
    outs = {s: [] for s in range(len(prompts))}
    logits = runner.step(dict(enumerate(prompts)))
    for _ in range(new):
        for s, lg in logits.items():
            outs[s].append(int(lg[-1].argmax()))
        logits = runner.step({s: [outs[s][-1]] for s in outs})
    for seq, p in enumerate(prompts):
        with torch.no_grad():
            hf_out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert outs[seq] == hf_out[0, len(p) :].tolist(), f"prompt {seq}"


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


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"layers_block_type": ["linear_attention", "moe", "full_attention"]}, "no expert tensors"),
        ({"layers_block_type": ["linear_attention", "conv"]}, "unknown layer types"),
        ({"layers_block_type": ["linear_attention", "mlp"]}, "no attention layer"),
        ({"residual_in_fp32": True}, "residual_in_fp32"),
        ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
        ({"mamba_num_heads": None}, "mamba_num_heads"),
    ],
)
def test_loader_refuses_what_it_cannot_serve(tmp_path, changes, match):
    path = make_random_nemotron_h(str(tmp_path / "m"), pattern="M-*-")
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(path)


def test_pattern_string_configs_load(tmp_path):
    """Real checkpoints carry `hybrid_override_pattern` (and inf as JSON Infinity)."""
    path = make_random_nemotron_h(str(tmp_path / "m"), pattern="M-*-")
    _edit_config(
        path,
        layers_block_type=None,
        hybrid_override_pattern="M-*-",
        time_step_limit=[0.0, float("inf")],
    )
    _, config, _ = load_model(path)
    assert config.pattern == "M-*-" and config.dt_limit == (0.0, math.inf)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 0.1)])
def test_gpu_kernels_path_matches_cpu_reference(tmp_path, dtype, tol):
    """The Triton path (CUDA) of a mixed step — chunked prefill, decode rows, a prefill
    restored from a snapshot slot — against the torch references on the CPU, then 8 greedy
    tokens. fp32 tolerance covers TF32 dots inside the scan; bf16 is compared loosely."""
    shape = TINY_HYBRID | {"head_dim": 64}  # the attention kernels take head_dim 64 or 128
    path = make_random_nemotron_h(str(tmp_path / "m"), pattern="M-M-*-M-M-*-", shape=shape)
    runs = {}
    for device, dt in (("cpu", torch.float32), ("cuda", dtype)):
        model, config, _ = load_model(path, dtype=dt, device=device)
        runner = HybridRunner(model, config, seed=2, device=device)
        base = _prompt(70, 9)
        for seq, n in enumerate((70, 40, 9)):
            runner.add(seq, n + 40, slot=seq)
        out = [runner.step({0: base[:32], 1: _prompt(40, 8)})]
        runner.snapshot(0, slot=7)
        out.append(runner.step({0: base[32:], 1: [5]}))
        runner.share(2, source=0, tokens=32)
        out.append(runner.step({1: [6], 2: base[32:41]}, restore={2: 7}))
        tokens = []
        for _ in range(8):
            step = runner.step({s: [int(out[-1][s][-1].argmax())] for s in out[-1]})
            out.append(step)
            tokens.append([int(step[s][-1].argmax()) for s in sorted(step)])
        runs[device] = (out, tokens)
    for step_cpu, step_gpu in zip(runs["cpu"][0], runs["cuda"][0], strict=True):
        for s in step_cpu:
            err = (step_gpu[s] - step_cpu[s]).abs().max().item()
            assert err < tol * step_cpu[s].abs().max().item(), (s, err)
    if dtype == torch.float32:
        assert runs["cpu"][1] == runs["cuda"][1]
