"""ops.moe, ops.models.qwen3_moe, NemotronH `E` layers and their loading, against Hugging Face
transformers 5.23 on the same weights (fp32, CPU; issue 12).

Tiny random models saved with `save_pretrained` (tests/random_moe.py: one tensor per expert):
two Qwen3-MoE variants (mlp_only_layers; decoder_sparse_step 2 with tied embeddings and
unnormalized top-k) and two NemotronH hybrids with `E` layers (grouped sigmoid routing with a
correction bias, a shared expert, one with latent projections). Checks: both routers and both MoE
blocks equal Hugging Face's modules; experts split into 2 and 4 ranges give partial outputs whose
sum (shared experts once) is the whole, at the block and, through threads standing in for the
expert-parallel ranks, at the model; logits of varlen prefill, chunked prefill and decode rows
equal Hugging Face's forward; greedy tokens equal Hugging Face's decoding; `expert_range` reads
only its experts; stacked (3D) checkpoints load alike; what we cannot serve is refused; weight
updates land in the right experts of each rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import numpy as np
import pytest
import torch

from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import (
    ModelLoadError,
    load_model,
)
from taipan.ops.mamba import MambaMetadata, allocate_mamba_state
from taipan.ops.models.llama import allocate_kv_cache
from taipan.ops.moe import ExpertGate, MoE, MoEConfig, set_expert_combine
from taipan.ops.weight_updates import (
    WeightUpdateError,
    check_same_architecture,
    state_updates,
)
from tests.random_moe import (
    NEMOTRON_MOE_PATTERNS,
    QWEN3_MOE_VARIANTS,
    make_random_nemotron_h_moe,
    make_random_qwen3_moe,
    router_margin,
)

transformers = pytest.importorskip("transformers")
BLOCK_SIZE = 16
ATOL = 1e-4
MIN_MARGIN = 1e-5  # router_margin of the test data: far from a flipped expert choice
MODELS = [f"qwen3:{v}" for v in QWEN3_MOE_VARIANTS] + [f"nh:{p}" for p in NEMOTRON_MOE_PATTERNS]


def make_model(path: str, name: str, seed: int = 0, **overrides) -> str:
    family, variant = name.split(":")
    if family == "qwen3":
        return make_random_qwen3_moe(path, seed=seed, **QWEN3_MOE_VARIANTS[variant] | overrides)
    latent = NEMOTRON_MOE_PATTERNS[variant]
    return make_random_nemotron_h_moe(path, variant, latent, seed=seed, **overrides)


@pytest.fixture(scope="module", params=MODELS)
def pair(request, tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("moe")), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, load_model(path), hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    assert router_margin(hf, ids) > MIN_MARGIN, "test data near a routing tie: change a seed"
    return hf(torch.tensor([ids])).logits[0].float()


def assert_same_weights(a, b) -> None:
    a, b = a.state_dict(), b.state_dict()
    assert list(a) == list(b)
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def moe_blocks(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def hf_moe_blocks(hf) -> list[torch.nn.Module]:
    kinds = ("Qwen3MoeSparseMoeBlock", "NemotronHMoE")
    return [m for m in hf.modules() if type(m).__name__ in kinds]


class Runner:
    """A minimal gpu-worker stand-in: shuffled KV blocks, one Mamba slot per sequence (hybrids
    only); each step puts its decode rows (one token, continuing) first, as the engine does."""

    def __init__(self, model, config, num_blocks=64, seed=0, device="cpu"):
        self.model, self.config, self.device = model, config, device
        self.cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, torch.float32, device)
        self.mamba = None
        if hasattr(config, "mamba_state"):
            self.mamba = allocate_mamba_state(
                config.mamba_state, 8, torch.float32, torch.float32, device
            )
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def add(self, seq: int, max_len: int) -> None:
        self.tables[seq] = [self.free.pop() for _ in range(math.ceil(max_len / BLOCK_SIZE))]
        self.computed[seq] = 0

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """One forward over every sequence's chunk; logits [len(chunk), vocab] per seq."""
        seqs = sorted(chunks, key=lambda s: len(chunks[s]) != 1 or self.computed[s] == 0)
        query_lens = [len(chunks[s]) for s in seqs]
        seq_lens = [self.computed[s] + n for s, n in zip(seqs, query_lens, strict=True)]
        attn, positions = build_attention_metadata(
            query_lens, seq_lens, [self.tables[s] for s in seqs], BLOCK_SIZE, self.device
        )
        ids = torch.tensor([t for s in seqs for t in chunks[s]], device=self.device)
        args = (ids, positions, attn, self.cache)
        if self.mamba is not None:  # slot = sequence id; a new sequence starts from zeros
            init = [s if self.computed[s] else -1 for s in seqs]
            init = torch.tensor(init, dtype=torch.int32, device=self.device)
            out = torch.tensor(seqs, dtype=torch.int32, device=self.device)
            args += (MambaMetadata(*self.mamba, init, out, attn.query_start_loc, attn.num_decodes),)
        logits = self.model.compute_logits(self.model(*args)).cpu()
        for s, n in zip(seqs, query_lens, strict=True):
            self.computed[s] += n
        return dict(zip(seqs, logits.split(query_lens), strict=True))


# ---- routers and blocks ----------------------------------------------------------------------


def test_softmax_router_equals_hf():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for renormalize in (True, False):
        hf_config = transformers.Qwen3MoeConfig(
            hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize
        )
        hf = Qwen3MoeTopKRouter(hf_config)
        config = MoEConfig(16, 4, 8, "swiglu", "softmax", renormalize)
        ours = ExpertGate(32, config)
        torch.nn.init.normal_(hf.weight)
        ours.load_state_dict(hf.state_dict())
        x = torch.randn(50, 32)
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, atol=1e-7, rtol=0)
        if renormalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(50))


@pytest.mark.parametrize("groups, chosen, renormalize", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_sigmoid_grouped_router_equals_hf(groups, chosen, renormalize):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    hf_config = transformers.NemotronHConfig(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=groups,
        topk_group=chosen,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    hf = NemotronHTopkRouter(hf_config)
    torch.nn.init.normal_(hf.weight)
    hf.e_score_correction_bias.uniform_(-0.5, 0.5)
    config = MoEConfig(16, 4, 8, "relu2", "sigmoid", renormalize, groups, chosen, 2.5)
    ours = ExpertGate(32, config)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(50, 32)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    # Hugging Face takes its top-k unsorted: compare each token's experts as a set.
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(
        weights.gather(1, mine), hf_weights.gather(1, order), atol=1e-6, rtol=0
    )
    if groups > chosen:  # the bias steered some choices away from the top sigmoid scores
        unbiased = torch.sigmoid(x @ hf.weight.t()).topk(4, dim=-1).indices.sort(-1).values
        assert not torch.equal(unbiased, ids)


def test_moe_blocks_equal_hf(pair):
    _, (model, config, _), hf = pair
    ours, theirs = moe_blocks(model), hf_moe_blocks(hf)
    assert len(ours) == len(theirs) > 0
    x = torch.randn(40, config.hidden_size)
    with torch.no_grad():
        for block, hf_block in zip(ours, theirs, strict=True):
            torch.testing.assert_close(block(x), hf_block(x[None])[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_expert_ranges_sum_to_the_whole(pair, num_ranks):
    """Each rank (loaded with its expert_range) computes a partial routed output; with a combine
    that sums the partials (an all-reduce), every rank's block output is the whole block's,
    shared experts included once."""
    path, (model, config, _), _ = pair
    per_rank = config.moe.num_experts // num_ranks
    ranks = [load_model(path, expert_range=(r * per_rank, per_rank))[0] for r in range(num_ranks)]
    x = torch.randn(40, config.hidden_size)
    with torch.no_grad():
        for layer, whole in enumerate(moe_blocks(model)):
            blocks = [moe_blocks(rank)[layer] for rank in ranks]
            assert all(b.w1.shape[0] == per_rank for b in blocks)
            partials = []
            for block in blocks:  # pass 1: each rank's partial (combine: identity)
                block.combine = lambda p, out=partials: out.append(p) or p
                block(x)
            total = torch.stack(partials).sum(0)
            for block in blocks:  # pass 2: the all-reduced sum
                block.combine = lambda p, total=total: total
                torch.testing.assert_close(block(x), whole(x), atol=1e-6, rtol=0)


class ThreadAllReduce:
    """An all-reduce (sum) among threads, each standing in for an expert-parallel rank."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * num_ranks

    def for_rank(self, rank: int):
        def combine(partial: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = partial
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)  # same order on every rank
            self.barrier.wait()  # all have read before a later layer writes its slot
            return total

        return combine


def test_expert_parallel_ranks_give_the_whole_models_logits(pair):
    """Two ranks, each holding half the experts of every MoE layer (`expert_range`) and an
    all-reduce installed with `set_expert_combine`, run one step concurrently: each gives the
    whole model's logits."""
    path, (model, config, _), _ = pair
    half = config.moe.num_experts // 2
    prompts = {0: _prompt(21, 1), 1: _prompt(9, 2)}
    whole = Runner(model, config)
    for s, p in prompts.items():
        whole.add(s, len(p))
    want = whole.step(prompts)
    reduce, results = ThreadAllReduce(2), {}
    runners = []
    for rank in range(2):
        rank_model, _, _ = load_model(path, expert_range=(rank * half, half))
        assert set_expert_combine(rank_model, reduce.for_rank(rank)) == len(moe_blocks(model))
        runners.append(Runner(rank_model, config))
        for s, p in prompts.items():
            runners[rank].add(s, len(p))

    def run(rank: int) -> None:
        results[rank] = runners[rank].step(prompts)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(2):
        for s in prompts:
            torch.testing.assert_close(results[rank][s], want[s], atol=1e-5, rtol=0)


# ---- models against Hugging Face -----------------------------------------------------------------


def test_config_and_layers(pair):
    _, (model, config, _), hf = pair
    c = hf.config
    if hasattr(config, "pattern"):
        assert config.pattern == c.hybrid_override_pattern
        assert config.moe.latent_size == c.moe_latent_size
        assert config.moe.shared_intermediate_size == c.moe_shared_expert_intermediate_size
    else:
        sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
        assert [config.is_moe_layer(i) for i in range(config.num_layers)] == sparse
        assert config.tie_word_embeddings == c.tie_word_embeddings
        assert config.moe.renormalize == c.norm_topk_prob
    assert config.moe.num_experts == 8 and config.moe.top_k == 2
    assert len(moe_blocks(model)) == len(hf_moe_blocks(hf))


def test_varlen_chunked_and_decode_logits_match_hf(pair):
    """Three prompts prefilled in one step (one of them in two chunks, cut mid-block), then
    steps mixing that chunk with decode rows, then decode rows only."""
    _, (model, config, _), hf = pair
    prompts = [_prompt(40, 11), _prompt(23, 12), _prompt(5, 13)]
    cont = 4
    expected = [hf_logits(hf, p + [7] * cont) for p in prompts]
    runner = Runner(model, config, seed=3)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + cont)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in range(3)}

    def run(chunks):
        for s, logits in runner.step(chunks).items():
            got[s].append(logits)

    run({0: prompts[0][:19], 1: prompts[1], 2: prompts[2]})
    run({0: prompts[0][19:], 1: [7], 2: [7]})
    for _ in range(cont):
        run({s: [7] for s in range(3) if runner.computed[s] < len(prompts[s]) + cont})
    for seq in range(3):
        logits = torch.cat(got[seq])
        want = expected[seq][: len(logits)]
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0, msg=f"sequence {seq}")


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """Hugging Face's greedy tokens: `generate()` for Qwen3-MoE; for a NemotronH its own
    incremental decoding (on transformers 5.23 `generate()` disagrees with the model's forward
    for NemotronH: tests/test_e2e_hybrid.py `hf_generate`)."""
    with torch.no_grad():
        if hf.config.model_type == "qwen3_moe":
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            return out[0, len(prompt) :].tolist()
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        while len(tokens) < new:
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


def test_greedy_tokens_match_hf(pair):
    _, (model, config, _), hf = pair
    prompts = [_prompt(n, 20 + n) for n in (5, 16, 37)]
    new = 10
    runner = Runner(model, config, seed=5)
    for seq, p in enumerate(prompts):
        runner.add(seq, len(p) + new)
    outs = {s: [] for s in range(len(prompts))}
    logits = runner.step(dict(enumerate(prompts)))
    for _ in range(new):
        for s, lg in logits.items():
            outs[s].append(int(lg[-1].argmax()))
        logits = runner.step({s: [outs[s][-1]] for s in outs})
    for seq, p in enumerate(prompts):
        assert router_margin(hf, p + outs[seq]) > MIN_MARGIN
        assert outs[seq] == hf_greedy(hf, p, new), f"prompt {seq}"


# ---- loading -------------------------------------------------------------------------------------


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


def _rewrite_weights(path, edit) -> None:
    """Replace model.safetensors by `edit(tensors)` (a dict of name -> tensor)."""
    from safetensors.torch import load_file, save_file

    file = f"{path}/model.safetensors"
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_random_qwen3_moe(str(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def nh_dir(tmp_path_factory):
    return make_random_nemotron_h_moe(str(tmp_path_factory.mktemp("nh")), "ME*EM", 32)


@pytest.mark.parametrize(
    "family, changes, match",
    [
        ("qwen", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen", {"attention_bias": True}, "attention_bias"),
        ("qwen", {"hidden_act": "gelu"}, "hidden_act"),
        (
            "qwen",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "RoPE type 'dynamic'",
        ),
        ("qwen", {"num_local_experts": 0}, "without experts"),
        ("qwen", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen", {"moe_intermediate_size": None}, "moe_intermediate_size"),
        ("qwen", {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "x"}, "Qwen2Moe"),
        ("qwen", {"mlp_only_layers": [0, 2]}, r"layers\.0\.mlp'\], which the config does not"),
        ("qwen", {"num_local_experts": 6}, "expert 6, but the config has 6"),
        ("nh", {"n_routed_experts": 4, "n_group": 2}, "expert 4, but the config has 4"),
        ("nh", {"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate"),
        ("nh", {"n_group": 3}, "n_group"),
        ("nh", {"mlp_bias": True}, "mlp_bias"),
        ("nh", {"moe_intermediate_size": 16}, "weights do not fit"),
    ],
)
def test_loader_refuses_what_it_cannot_serve(qwen_dir, nh_dir, tmp_path, family, changes, match):
    import shutil

    path = shutil.copytree(qwen_dir if family == "qwen" else nh_dir, tmp_path / "m")
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(path)


def test_expert_range_is_checked(qwen_dir, tmp_path):
    for bad in ((6, 3), (0, 0), (-1, 2), ("0", 2)):
        with pytest.raises(ModelLoadError, match="expert_range"):
            load_model(qwen_dir, expert_range=bad)
    from tests.random_nemotron_h import make_random_nemotron_h

    dense = make_random_nemotron_h(str(tmp_path / "dense"), pattern="M*-")
    with pytest.raises(ModelLoadError, match="has no experts"):
        load_model(dense, expert_range=(0, 1))


def test_expert_range_reads_only_its_experts(nh_dir, tmp_path):
    """A rank's model holds exactly its experts' slices of the whole model's; a checkpoint
    without the other experts' tensors still loads for that rank (they are never read),
    while a load of every expert names the first missing one."""
    import shutil

    whole, config, _ = load_model(nh_dir)
    rank, _, _ = load_model(nh_dir, expert_range=(2, 3))
    for ours, full in zip(moe_blocks(rank), moe_blocks(whole), strict=True):
        assert ours.expert_range.start == 2 and ours.w1.shape[0] == 3
        assert torch.equal(ours.w1, full.w1[2:5]) and torch.equal(ours.w2, full.w2[2:5])
        assert torch.equal(ours.gate.weight, full.gate.weight)  # the router: all experts
    path = shutil.copytree(nh_dir, tmp_path / "partial")
    keep = ("experts.2.", "experts.3.", "experts.4.")
    _rewrite_weights(
        path,
        lambda t: {n: v for n, v in t.items() if ".experts." not in n or any(k in n for k in keep)},
    )  # noqa: E501
    assert_same_weights(rank, load_model(path, expert_range=(2, 3))[0])
    with pytest.raises(
        ModelLoadError, match=r"no expert tensors for layers\.1\.mixer\.experts\.0\."
    ):
        load_model(path)


def test_stacked_expert_checkpoints_load_alike(qwen_dir, nh_dir, tmp_path):
    """Checkpoints with one [E, ...] tensor per matrix (the names of transformers' modules)
    give the same model, whole or one rank's slice."""
    import shutil

    for src, w1_name in ((qwen_dir, "gate_up"), (nh_dir, "up")):
        path = shutil.copytree(src, tmp_path / w1_name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        stacked = {n: t for n, t in hf.state_dict().items() if ".experts." in n}
        assert any(n.endswith(f"experts.{w1_name}_proj") for n in stacked)

        def edit(tensors, stacked=stacked):
            out = {n: v for n, v in tensors.items() if ".experts." not in n}
            return out | {n: t.contiguous() for n, t in stacked.items()}

        _rewrite_weights(path, edit)
        for experts in (None, (4, 4)):
            a, _, _ = load_model(src, expert_range=experts)
            b, _, _ = load_model(path, expert_range=experts)
            assert_same_weights(a, b)
    _rewrite_weights(path, lambda t: {n: v for n, v in t.items() if "experts.down" not in n})
    with pytest.raises(ModelLoadError, match="expected stacked"):
        load_model(path)
    _edit_config(path, n_routed_experts=4, n_group=2)
    with pytest.raises(ModelLoadError, match="stacks 8 experts, the config has 4"):
        load_model(path)


def test_correction_bias_stays_fp32(nh_dir):
    model, _, _ = load_model(nh_dir, dtype=torch.bfloat16)
    block = moe_blocks(model)[0]
    assert block.w1.dtype == torch.bfloat16
    assert block.gate.e_score_correction_bias.dtype == torch.float32


# ---- weight updates ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen", "nh"])
def test_weight_updates_land_in_each_ranks_experts(qwen_dir, nh_dir, tmp_path, family):
    """A whole Hugging Face state dict of another checkpoint, in the names of its files (one
    tensor per expert) or of its modules (stacked), updates a rank's model to exactly what a
    load of that checkpoint for the rank gives; a different MoE shape is refused naming it."""
    src = qwen_dir if family == "qwen" else nh_dir
    name = "qwen3:mlp-only-2" if family == "qwen" else "nh:ME*EM"
    other = make_model(str(tmp_path / "other"), name, seed=7)
    want, want_config, _ = load_model(other, expert_range=(4, 2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    from safetensors.torch import load_file

    as_saved = {n: t.numpy() for n, t in load_file(f"{other}/model.safetensors").items()}
    as_modules = {n: t.numpy() for n, t in hf.state_dict().items()}
    for state in (as_saved, as_modules):
        model, config, _ = load_model(src, expert_range=(4, 2))
        check_same_architecture(config, want_config, other)
        params = model.state_dict()
        with torch.no_grad():
            for ours, index, values in state_updates(state, model):
                params[ours][index].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        assert_same_weights(model, want)
    bigger = dataclasses.replace(config, moe=dataclasses.replace(config.moe, intermediate_size=64))
    with pytest.raises(WeightUpdateError, match="intermediate_size=64"):
        check_same_architecture(config, bigger, "new")
    bad = {n: v for n, v in as_saved.items() if ".experts.5." in n}
    bad = {n.replace(".experts.5.", ".experts.9."): v for n, v in bad.items()}
    with pytest.raises(WeightUpdateError, match="expert 9, the model has 8"):
        state_updates(bad, model)


def test_worker_update_weights_of_a_moe_model(nh_dir, tmp_path):
    """The gpu worker's update_weights on a NemotronH with `E` layers: from a checkpoint of
    another seed (per-expert names) and back from the first model's in-memory Hugging Face
    state dict (stacked expert names, the correction bias): each time exactly a fresh load."""
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import GpuControl, LoadModel

    other = make_model(str(tmp_path / "other"), "nh:ME*EM", seed=7)
    worker = ModelWorker()
    worker.load(LoadModel(nh_dir, "float32", "cpu", BLOCK_SIZE, 8, 1.0, 256, 4, 128))
    assert worker.control(GpuControl("suspend", "persist", None, None)).error is None
    reply = worker.control(GpuControl("update_weights", None, other, None))
    assert reply.error is None and reply.weight_version == 1
    assert_same_weights(worker.model, load_model(other)[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(nh_dir, dtype=torch.float32)
    state = {n: t.numpy() for n, t in hf.state_dict().items()}
    assert any(n.endswith("experts.up_proj") for n in state)
    assert worker.control(GpuControl("update_weights", None, None, state)).error is None
    assert_same_weights(worker.model, load_model(nh_dir)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_path_matches_cpu_reference(tmp_path, name):
    """The CUDA path (Triton attention, RoPE, RMSNorm, q/k norms, Mamba kernels, the fused MoE
    kernel) of chunked prefill, varlen prefill and decode rows against the CPU references in
    fp32 (a TF32 tolerance), then greedy tokens; then the whole runtime on the GPU with CUDA
    graphs (the default there, capturing the MoE kernel) gives the same greedy tokens."""
    from taipan.actors.config import InferenceConfig
    from taipan.client import Client
    from taipan.launcher import Runtime
    from taipan.messages.requests import SamplingParams

    path = make_model(str(tmp_path / "m"), name, head_dim=64)  # the attention kernels' size
    prompts = [_prompt(40, 31), _prompt(23, 32), _prompt(5, 33)]
    runs = {}
    for device in ("cpu", "cuda"):
        model, config, _ = load_model(path, device=device)
        runner = Runner(model, config, seed=4, device=device)
        for seq, p in enumerate(prompts):
            runner.add(seq, len(p) + 8)
        steps = [runner.step({0: prompts[0][:19], 1: prompts[1], 2: prompts[2]})]
        steps.append(runner.step({0: prompts[0][19:], 1: [7], 2: [7]}))
        tokens = []
        for _ in range(6):
            step = runner.step({s: [int(steps[-1][s][-1].argmax())] for s in range(3)})
            steps.append(step)
            tokens.append([int(step[s][-1].argmax()) for s in range(3)])
        runs[device] = steps, tokens
    for cpu, gpu in zip(runs["cpu"][0], runs["cuda"][0], strict=True):
        for s in cpu:
            err = (gpu[s] - cpu[s]).abs().max().item()
            assert err < 2e-3 * cpu[s].abs().max().item(), (s, err)
    assert runs["cpu"][1] == runs["cuda"][1]
    config = InferenceConfig(
        block_size_tokens=BLOCK_SIZE,
        max_tokens=64,
        max_requests=4,
        buffer_size_gb=0.05,
        max_sequence_length=256,
        enable_chunked_prefill=True,
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = {}
    for device in ("cpu", "cuda"):
        with Runtime(path, config, device=device) as rt, Client(rt.address) as client:
            got[device] = [d.token_ids for d in client.generate(prompts, greedy)]
            steps = client.stats().merged()
        if device == "cuda":
            assert steps.steps_graphed > 0  # decode steps ran as CUDA graphs
    assert got["cuda"] == got["cpu"]
