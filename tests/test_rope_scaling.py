"""RoPE scaling (ops/rope_scaling.py) against transformers' (fp32, CPU): the "linear", "llama3"
and "yarn" inverse frequencies and yarn's attention factor equal `ROPE_INIT_FUNCTIONS`' for
config.json in both forms (transformers >= 5's `rope_parameters`, the older `rope_scaling` with a
top-level `rope_theta`); each family's table (the one its model's forward reads) equals its
Hugging Face rotary embedding, Qwen3-Next's partial one included; a tiny random Llama with
llama3 scaling and a tiny random Qwen2 with yarn, both with original_max_position_embeddings 32,
give transformers' logits and greedy tokens on prompts longer than that; what we do not
implement is refused naming its type; the scaling is part of the architecture a weight update
checks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from taipan.kernels.rope import rope_cos_sin_cache
from taipan.ops.checkpoint import _MODELS, ModelLoadError
from taipan.ops.hf_configs import hf_config
from taipan.ops.loader import load_model
from taipan.ops.rope_scaling import RopeScaling, inverse_frequencies, rope_table
from taipan.ops.weight_updates import WeightUpdateError, check_same_architecture
from tests.random_dense import make_random_qwen2
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_ops_llama import PagedRunner, _greedy_generate

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

TOKENIZER = SimpleNamespace(bos_token_id=None, eos_token_ids=())  # what hf_config reads
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8)

# The RoPE part of config.json as checkpoints write it: (max_position_embeddings, fields).
LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
PARAMETER_SETS = {
    # Llama 3.1 / 3.3 as their config.json has it (the older form), and 3.2's factor 32.
    "llama3-legacy": (
        131072,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", original_max_position_embeddings=8192, **LLAMA31),
        ),
    ),
    "llama3-32": (
        131072,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            )
        ),
    ),
    "llama3-small-original": (
        4096,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=2.0,
                high_freq_factor=8.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    # Qwen2.5's README form ("type", no rope_theta inside), and Qwen3's.
    "yarn-legacy": (
        32768,
        dict(
            rope_theta=1e6,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
        ),
    ),
    "yarn-betas-untruncated": (
        40960,
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e6,
                factor=4.0,
                original_max_position_embeddings=1024,
                beta_fast=16,
                beta_slow=2,
                truncate=False,
            )
        ),
    ),
    "yarn-mscale": (
        163840,
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=40.0,
                original_max_position_embeddings=4096,
                mscale=1.0,
                mscale_all_dim=0.707,
            )
        ),
    ),
    "yarn-attention-factor-null-factor": (
        4096,
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=None,
                original_max_position_embeddings=1024,
                attention_factor=0.8,
            )
        ),
    ),
    # A top-level original_max_position_embeddings wins over the dict's default (Phi-3's form).
    "yarn-top-level-original": (
        4096,
        dict(
            original_max_position_embeddings=512,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0),
        ),
    ),
    "linear-legacy": (4096, dict(rope_theta=10000.0, rope_scaling=dict(type="linear", factor=2.0))),
    "linear": (
        4096,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=5e5, factor=4.0)),
    ),
}


def _config_json(family: str, name: str, **extra) -> dict:
    """config.json of a `family` (our name is transformers' model_type) with RoPE `name`."""
    max_positions, rope = PARAMETER_SETS[name]
    rope = json.loads(json.dumps(rope))  # (a fresh copy: transformers edits it in place)
    hf = dict(SHAPE, vocab_size=300, model_type=family, max_position_embeddings=max_positions)
    return hf | extra | rope


def _ours(family: str, hf: dict):
    return hf_config(Path("cfg"), hf, family, TOKENIZER)


@pytest.mark.parametrize("name", list(PARAMETER_SETS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_inverse_frequencies_and_attention_factor_equal_transformers(family, name):
    hf = _config_json(family, name)
    reference = transformers.AutoConfig.for_model(**hf)
    want, want_factor = ROPE_INIT_FUNCTIONS[reference.rope_parameters["rope_type"]](reference)
    config = _ours(family, hf)
    got = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(got, want)
    assert config.rope_scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)


def _hf_cos_sin(reference, positions: torch.Tensor) -> torch.Tensor:
    """transformers' cos | sin rows (each half once) for `positions`, from the model's own
    rotary embedding."""
    model = transformers.AutoModelForCausalLM.from_config(reference).eval()
    x = torch.zeros(1, len(positions), reference.hidden_size)
    cos, sin = model.model.rotary_emb(x, positions[None])
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


# family -> config.json fields beyond the shape (Qwen3-Next: partial RoPE, GDN shapes).
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "mistral": {},
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=1
    ),
    "qwen3_next": dict(
        head_dim=32,
        partial_rotary_factor=0.5,
        layer_types=["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=0,
    ),
}


@pytest.mark.parametrize(
    "family, name",
    [(f, "yarn-betas-untruncated") for f in FAMILIES]
    + [("llama", "llama3-small-original"), ("qwen3_next", "llama3-small-original")]
    + [("mistral", "linear"), ("qwen3_moe", "yarn-legacy")],
)
def test_each_familys_table_equals_its_hf_rotary_embedding(family, name):
    """The table our model's forward reads (`rope_cache`) against the cos / sin transformers'
    model computes (attention factor included), at positions far past the original length."""
    hf = _config_json(family, name, **FAMILIES[family])
    reference = transformers.AutoConfig.for_model(**hf)
    config = _ours(family, hf)
    with torch.device("meta"):
        model = _MODELS[type(config)](config)
    table = model.rope_cache(torch.device("cpu"))
    positions = torch.tensor([0, 1, 31, 32, 33, 500, 1023, 4000, hf["max_position_embeddings"] - 1])
    assert config.rope_scaling is not None
    torch.testing.assert_close(table[positions], _hf_cos_sin(reference, positions))


def test_plain_rope_is_the_plain_table():
    config = _ours("llama", dict(SHAPE, vocab_size=300, rope_theta=50000.0))
    assert config.rope_scaling is None and config.rope_theta == 50000.0
    with torch.device("meta"):
        model = _MODELS[type(config)](config)
    plain = rope_cos_sin_cache(config.max_position_embeddings, 64, 50000.0)
    assert torch.equal(model.rope_cache(torch.device("cpu")), plain)
    assert torch.equal(rope_table(100, 64, 50000.0, None), rope_cos_sin_cache(100, 64, 50000.0))


@pytest.mark.parametrize(
    "rope, match",
    [
        (dict(rope_type="dynamic", factor=2.0), "RoPE type 'dynamic' is not supported"),
        (dict(type="dynamic", factor=2.0), "RoPE type 'dynamic' is not supported"),
        (dict(rope_type="longrope", short_factor=[1.0], long_factor=[2.0]), "'longrope'"),
        (dict(rope_type="mrope", factor=2.0), "RoPE type 'mrope' is not supported"),
        (dict(rope_type="llama3", factor=8.0), "bad or missing RoPE field .'low_freq_factor'"),
    ],
)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_what_we_do_not_implement_is_refused_naming_it(family, rope, match):
    for key in ("rope_parameters", "rope_scaling"):
        with pytest.raises(ModelLoadError, match=match):
            _ours(family, dict(SHAPE, vocab_size=300, **{key: rope}))


def test_both_forms_read_alike_and_a_weight_update_checks_the_scaling():
    legacy = _config_json("llama", "llama3-legacy")
    modern = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = legacy["rope_scaling"] | {"rope_theta": legacy["rope_theta"]}
    a, b = _ours("llama", legacy), _ours("llama", modern)
    assert a == b and hash(a) == hash(b) and a.rope_theta == 500000.0
    want = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192)
    assert a.rope_scaling == dataclasses.replace(want, low_freq_factor=1.0, high_freq_factor=4.0)
    check_same_architecture(a, b, "same")
    other = dataclasses.replace(b, rope_scaling=dataclasses.replace(b.rope_scaling, factor=32.0))
    with pytest.raises(WeightUpdateError, match="rope_scaling RopeScaling.*factor=32.0"):
        check_same_architecture(a, other, "other")
    with pytest.raises(WeightUpdateError, match="rope_scaling None"):
        check_same_architecture(a, dataclasses.replace(b, rope_scaling=None), "plain")


ORIGINAL = 32  # original_max_position_embeddings of the end-to-end models: prompts go past it


@pytest.fixture(scope="module")
def scaled_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("scaled")
    llama3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0)
    llama3 |= dict(high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL)
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0)
    yarn |= dict(original_max_position_embeddings=ORIGINAL)
    return {
        "llama-llama3": make_random_llama(
            str(root / "llama"), TINY_SHAPE | dict(rope_parameters=llama3)
        ),
        "qwen2-yarn": make_random_qwen2(
            str(root / "qwen2"), rope_parameters=yarn, max_position_embeddings=4 * ORIGINAL
        ),
    }


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", ["llama-llama3", "qwen2-yarn"])
def test_scaled_models_give_transformers_logits_and_greedy_tokens(scaled_dirs, case):
    model, config, _ = load_model(scaled_dirs[case])
    assert config.rope_scaling.rope_type == case.split("-")[1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(scaled_dirs[case], dtype=torch.float32)
    hf = hf.eval()
    # Two chunks, the second ending past the original length, then greedy decode rows.
    prompt = _prompt(2 * ORIGINAL + 6, seed=1)
    runner = PagedRunner(model, config)
    runner.add(0, len(prompt))
    got = torch.cat([runner.step({0: prompt[:20]})[0], runner.step({0: prompt[20:]})[0]])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    ours = _greedy_generate(model, config, [prompt], 8)[0]
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=8,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    assert ours[: len(ids)] == ids
    # The scaling matters at these positions: plain RoPE would give other logits.
    plain = rope_cos_sin_cache(config.max_position_embeddings, config.head_dim, config.rope_theta)
    assert not torch.allclose(model.rope_cache(torch.device("cpu"))[ORIGINAL:], plain[ORIGINAL:])
