"""InferenceConfig: the seed's fields and defaults, refusal of unbuilt options, parsing, limits."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing

import pytest

from taipan.actors.config import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TOKENS,
    NOT_IMPLEMENTED,
    ConfigError,
    CudaGraphSizingDistribution,
    InferenceConfig,
    KVCacheManagementMode,
    PrefixCachingEvictionPolicy,
    _coerce,
    plan_limits,
)

# Megatron's core.inference.config.InferenceConfig defaults (shared/seeds/000_*.txt).
SEED_DEFAULTS = {
    "block_size_tokens": 256,
    "buffer_size_gb": 20,
    "paused_buffer_size_gb": None,
    "mamba_inference_state_config": None,
    "mamba_memory_ratio": None,
    "max_requests": None,
    "max_tokens": None,
    "unified_memory_level": 0,
    "kv_cache_management_mode": None,
    "num_cuda_graphs": None,
    "cuda_graph_mixed_prefill_count": 16,
    "cuda_graph_sizing_distribution": None,
    "use_cuda_graphs_for_non_decode_steps": True,
    "cuda_graph_all_prefills": False,
    "static_kv_memory_pointers": False,
    "max_sequence_length": 2560,
    "pg_collection": None,
    "use_flashinfer_fused_rope": False,
    "materialize_only_last_token_logits": True,
    "enable_chunked_prefill": False,
    "num_speculative_tokens": 0,
    "enable_prefix_caching": False,
    "prefix_caching_eviction_policy": None,
    "prefix_caching_coordinator_policy": None,
    "prefix_caching_routing_alpha": 0.5,
    "prefix_caching_mamba_gb": None,
    "track_paused_request_events": False,
    "track_generated_token_events": False,
    "metrics_writer": None,
    "logging_step_interval": 0,
    "sampling_backend": "torch",
    "request_metadata_types": None,
    "use_synchronous_zmq_collectives": False,
    "disable_ep_consensus": False,
    "ep_consensus_interval": 20,
}
# Where taipan's default differs from the seed's, and why. buffer_size_gb None means "the seed's
# 20 GB on CUDA; on CPU a bounded share of the available memory" (DESIGN.md §12: the KV cache is
# host memory there, and 20 GB of it would not leave a 24 GiB machine usable).
# cuda_graph_all_prefills True: a step no graph holds launches its kernels from Python (~26 ms
# a step on a 1B shape), and under continuous admission most steps carry a prompt chunk larger
# than the seed's bound of max_requests tokens (README, CUDA graphs).
DIFFERS_FROM_SEED = {"buffer_size_gb": None, "cuda_graph_all_prefills": True}
# taipan's own fields, not in the seed (README: configuration).
TAIPAN_FIELDS = {
    "overlap_steps": None,
    "custom_all_reduce": None,
    "speculative_method": "ngram",
    "ngram_prompt_lookup_min": 1,
    "ngram_prompt_lookup_max": 4,
    "speculative_chain_steps": 1,
    "speculative_chain_max_rows": 4,
    "speculative_disable_by_batch_size": None,
    "speculative_model": None,
    "draft_weight_policy": "keep",
    "disable_hybrid_kv_cache_manager": False,
}
HINTS = typing.get_type_hints(InferenceConfig)
FIELDS = {f.name: f for f in dataclasses.fields(InferenceConfig)}


def test_defaults_equal_the_seed():
    config = InferenceConfig()
    assert set(FIELDS) == set(SEED_DEFAULTS) | set(TAIPAN_FIELDS)
    for name, value in {**SEED_DEFAULTS, **DIFFERS_FROM_SEED, **TAIPAN_FIELDS}.items():
        got = getattr(config, name)
        assert got == value and type(got) is type(value), name


def test_verbose_is_an_init_only_flag():
    assert InferenceConfig(verbose=True) == InferenceConfig()
    assert "verbose" not in InferenceConfig().to_dict()


def test_frozen():
    config = InferenceConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_tokens = 5  # type: ignore[misc]


# --- options that are not built yet ----------------------------------------------------------


def _base_type(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def plausible_other_value(name: str):
    """A value of the field's type that differs from its default and passes range checks."""
    default = FIELDS[name].default
    tp = _base_type(HINTS[name])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(m for m in tp if m != default)
    if tp is bool:
        return not default
    if tp is int:
        return 4 if default is None else default + 1
    if tp is float:
        return 0.25 if default is None else default / 2
    if tp is str:
        return "flashinfer" if default is not None else "wandb"
    if tp is dict:
        return {"key": 1}
    if tp is list:
        return [["priority", "int32"]]
    raise AssertionError(f"no plausible value for {name}: {tp!r}")


def test_not_implemented_names_real_fields():
    assert set(NOT_IMPLEMENTED) <= set(FIELDS)
    assert all(isinstance(why, str) and why for why in NOT_IMPLEMENTED.values())


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_unbuilt_option_set_to_non_default_is_refused_by_name(name):
    value = plausible_other_value(name)
    with pytest.raises(ConfigError, match=name) as info:
        InferenceConfig(**{name: value})
    assert "not implemented" in str(info.value) and NOT_IMPLEMENTED[name] in str(info.value)
    # The same through the JSON / --set path.
    with pytest.raises(ConfigError, match=name):
        InferenceConfig.from_dict({name: value.value if isinstance(value, enum.Enum) else value})


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_unbuilt_option_at_its_default_is_fine(name):
    default = FIELDS[name].default
    assert getattr(InferenceConfig(**{name: default}), name) == default
    # What a user would type: `none`, `true`, `16`, `0.5`, `torch` (no enum field has a default).
    raw = (
        default if isinstance(default, str) else "none" if default is None else json.dumps(default)
    )
    assert getattr(InferenceConfig.from_cli(None, [f"{name}={raw}"]), name) == default


def test_implemented_options_are_accepted():
    config = InferenceConfig(
        block_size_tokens=16,
        buffer_size_gb=1.5,
        max_requests=8,
        max_tokens=64,
        max_sequence_length=128,
        enable_chunked_prefill=True,
        logging_step_interval=10,
    )
    assert config.block_size_tokens == 16 and config.enable_chunked_prefill


# --- --set and JSON parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, name, value",
    [
        ("enable_chunked_prefill=true", "enable_chunked_prefill", True),
        ("enable_chunked_prefill=false", "enable_chunked_prefill", False),
        ("block_size_tokens=16", "block_size_tokens", 16),
        (" max_tokens = 512 ", "max_tokens", 512),
        ("max_tokens=none", "max_tokens", None),
        ("max_requests=null", "max_requests", None),
        ("max_requests=None", "max_requests", None),
        ("buffer_size_gb=2", "buffer_size_gb", 2.0),
        ("buffer_size_gb=0.5", "buffer_size_gb", 0.5),
        ("logging_step_interval=0", "logging_step_interval", 0),
        ("sampling_backend=torch", "sampling_backend", "torch"),
    ],
)
def test_set_parses_by_field_type(item, name, value):
    got = getattr(InferenceConfig.from_cli(None, [item]), name)
    assert got == value and type(got) is type(value)


def test_later_set_wins_over_earlier_and_over_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size_tokens": 32, "max_tokens": 128}))
    config = InferenceConfig.from_cli(str(path), ["block_size_tokens=64", "block_size_tokens=16"])
    assert config.block_size_tokens == 16 and config.max_tokens == 128


@pytest.mark.parametrize(
    "tp, raw, expected",
    [
        (KVCacheManagementMode | None, "persist", KVCacheManagementMode.PERSIST),
        (KVCacheManagementMode | None, "none", None),
        (PrefixCachingEvictionPolicy | None, "lru", PrefixCachingEvictionPolicy.LRU),
        (CudaGraphSizingDistribution | None, "linear", CudaGraphSizingDistribution.LINEAR),
        (bool | None, "true", True),
        (float | None, "3", 3.0),
        (dict | None, '{"a": 1}', {"a": 1}),
        (list | None, "[1, 2]", [1, 2]),
        (str | None, "null", None),
    ],
)
def test_coerce_by_type(tp, raw, expected):
    got = _coerce("field", tp, raw)
    assert got == expected and type(got) is type(expected)


def test_enum_value_not_in_choices_lists_them():
    with pytest.raises(ConfigError, match="persist, offload, recompute"):
        InferenceConfig.from_cli(None, ["kv_cache_management_mode=bogus"])


def test_prefix_caching_options_need_prefix_caching_on():
    with pytest.raises(ConfigError, match="prefix_caching_eviction_policy needs enable_prefix"):
        InferenceConfig.from_cli(None, ["prefix_caching_eviction_policy=lru"])
    with pytest.raises(ConfigError, match="longest_prefix needs enable_prefix_caching"):
        InferenceConfig.from_cli(None, ["prefix_caching_coordinator_policy=longest_prefix"])
    on = ["enable_prefix_caching=true", "prefix_caching_eviction_policy=ref_zero"]
    config = InferenceConfig.from_cli(None, on)
    assert config.prefix_caching_eviction_policy == "ref_zero"
    config = InferenceConfig.from_cli(None, ["prefix_caching_coordinator_policy=load_balanced"])
    assert config.prefix_caching_coordinator_policy == "load_balanced"


def test_enum_option_parses_to_its_member():
    config = InferenceConfig.from_cli(None, ["kv_cache_management_mode=offload"])
    assert config.kv_cache_management_mode == "offload"


@pytest.mark.parametrize("value", [-0.5, 30.0])
def test_paused_buffer_must_fit_in_the_buffer(value):
    with pytest.raises(ConfigError, match="paused_buffer_size_gb"):
        InferenceConfig(buffer_size_gb=20, paused_buffer_size_gb=value)


@pytest.mark.parametrize(
    "item, words",
    [
        ("block_size_tokens=abc", ["block_size_tokens", "cannot parse"]),
        ("block_size_tokens=1.5", ["block_size_tokens", "expected int"]),
        ("block_size_tokens=true", ["block_size_tokens", "expected int"]),
        ("block_size_tokens=[16]", ["block_size_tokens", "expected int"]),
        ("enable_chunked_prefill=1", ["enable_chunked_prefill", "expected bool"]),
        ("enable_chunked_prefill=yes", ["enable_chunked_prefill", "cannot parse"]),
        ("buffer_size_gb=big", ["buffer_size_gb", "cannot parse"]),
        ("buffer_size_gb=false", ["buffer_size_gb", "expected float"]),
        ("max_tokens=", ["max_tokens", "cannot parse"]),
        ("block_size_tokens", ["FIELD=VALUE", "block_size_tokens"]),
    ],
)
def test_bad_set_values_say_which_field(item, words):
    with pytest.raises(ConfigError) as info:
        InferenceConfig.from_cli(None, [item])
    for word in words:
        assert word in str(info.value)


def test_unknown_fields_are_listed():
    with pytest.raises(ConfigError, match="unknown InferenceConfig field.*blok_size, zzz"):
        InferenceConfig.from_cli(None, ["zzz=1", "blok_size=16", "max_tokens=64"])
    with pytest.raises(ConfigError, match="mamba_chunk_size"):
        InferenceConfig.from_dict({"mamba_chunk_size": 128})


def test_verbose_logs_the_config_once():
    import structlog

    with structlog.testing.capture_logs() as logs:
        InferenceConfig.from_cli(None, ["verbose=true", "block_size_tokens=32"])
        InferenceConfig.from_dict({"verbose": False, "block_size_tokens": 64})
        InferenceConfig(block_size_tokens=128)
    [entry] = logs
    assert entry["event"] == "inference config" and entry["block_size_tokens"] == 32
    assert entry["max_sequence_length"] == 2560 and "verbose" not in entry


def test_bad_verbose_value_is_a_config_error():
    with pytest.raises(ConfigError, match="verbose"):
        InferenceConfig.from_cli(None, ["verbose=maybe"])


def test_from_cli_reads_a_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"block_size_tokens": 16, "max_tokens": 256, "enable_chunked_prefill": True})
    )
    config = InferenceConfig.from_cli(str(path), [])
    assert (config.block_size_tokens, config.max_tokens) == (16, 256)
    assert config.enable_chunked_prefill is True


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", ["cannot read config file"]),
        ("[1, 2]", ["must hold a JSON object"]),
        ('"text"', ["must hold a JSON object"]),
        ('{"block_size_tokens": "sixteen"}', ["block_size_tokens"]),
        ('{"bogus": 1}', ["bogus"]),
        ('{"block_size_tokens": 0}', ["block_size_tokens must be >= 1"]),
    ],
)
def test_from_cli_bad_file_contents(tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        InferenceConfig.from_cli(str(path), [])
    for word in words:
        assert word in str(info.value)


def test_from_cli_missing_file_or_directory(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        InferenceConfig.from_cli(str(tmp_path / "absent.json"), [])
    with pytest.raises(ConfigError, match="cannot read config file"):
        InferenceConfig.from_cli(str(tmp_path), [])


def test_from_cli_binary_file_is_a_config_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read config file"):
        InferenceConfig.from_cli(str(path), [])


def test_to_dict_roundtrips_through_json():
    config = InferenceConfig(block_size_tokens=32, max_tokens=512, max_requests=16)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["block_size_tokens"] == 32 and set(data) == set(FIELDS)
    assert InferenceConfig.from_dict(data) == config
    assert InferenceConfig.from_dict(InferenceConfig().to_dict()) == InferenceConfig()


# --- ranges ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"block_size_tokens": 0}, ["block_size_tokens must be >= 1, got 0"]),
        ({"max_sequence_length": -1}, ["max_sequence_length must be >= 1"]),
        ({"max_tokens": 0}, ["max_tokens must be >= 1"]),
        ({"max_requests": 0}, ["max_requests must be >= 1"]),
        ({"buffer_size_gb": 0}, ["buffer_size_gb must be > 0"]),
        ({"buffer_size_gb": float("nan")}, ["buffer_size_gb must be > 0"]),
        ({"logging_step_interval": -1}, ["logging_step_interval must be >= 0"]),
        (
            {"max_tokens": 64, "max_requests": 128},
            ["max_tokens (64) must be >= max_requests (128)"],
        ),
    ],
)
def test_range_errors_are_actionable(kwargs, words):
    with pytest.raises(ConfigError) as info:
        InferenceConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_max_tokens_equal_to_max_requests_is_fine():
    assert InferenceConfig(max_tokens=8, max_requests=8).max_tokens == 8


def test_plan_limits_fill_in_the_defaults():
    assert plan_limits(InferenceConfig()) == (DEFAULT_MAX_REQUESTS, DEFAULT_MAX_TOKENS)
    assert plan_limits(InferenceConfig(max_tokens=64)) == (64, 64)
    assert plan_limits(InferenceConfig(max_tokens=4096)) == (DEFAULT_MAX_REQUESTS, 4096)
    assert plan_limits(InferenceConfig(max_requests=4)) == (4, DEFAULT_MAX_TOKENS)
    assert plan_limits(InferenceConfig(max_requests=4, max_tokens=16)) == (4, 16)


def test_max_requests_above_default_max_tokens_is_refused():
    with pytest.raises(ConfigError, match="max_requests"):
        InferenceConfig(max_requests=DEFAULT_MAX_TOKENS + 1)


def test_mamba_inference_state_config_keys_and_values_are_checked():
    ok = {"ssm_states_dtype": "bfloat16", "conv_states_shape": [3, 128], "mamba_chunk_size": 16}
    assert InferenceConfig(mamba_inference_state_config=ok).mamba_inference_state_config == ok
    for bad, words in [
        ({"ssm_state_dtype": "float32"}, "unknown key"),
        ({"ssm_states_dtype": "int8"}, "is not one of"),
        ({"ssm_states_shape": [8, -1, 16]}, "positive ints"),
    ]:
        with pytest.raises(ConfigError, match=words):
            InferenceConfig(mamba_inference_state_config=bad)


def test_speculative_fields():
    config = InferenceConfig(num_speculative_tokens=4, ngram_prompt_lookup_max=3)
    assert config.num_speculative_tokens == 4
    for method in ("eagle", "medusa"):
        with pytest.raises(ConfigError, match=f"speculative_method='{method}' is not built"):
            InferenceConfig(num_speculative_tokens=2, speculative_method=method)
    assert (
        InferenceConfig(num_speculative_tokens=2, speculative_method="mtp").num_speculative_tokens
        == 2
    )
    with pytest.raises(ConfigError, match="must be one of ngram, draft_model, mtp"):
        InferenceConfig(speculative_method="magic")
    drafted = InferenceConfig(
        num_speculative_tokens=3, speculative_method="draft_model", speculative_model="/d"
    )
    assert drafted.speculative_model == "/d"
    for bad in ({"speculative_method": "draft_model"}, {"speculative_model": "/d"}):
        with pytest.raises(ConfigError, match="needs speculative_model"):
            InferenceConfig(num_speculative_tokens=2, **bad)
    for policy in ("keep", "disable", "refuse"):
        assert dataclasses.replace(drafted, draft_weight_policy=policy).draft_weight_policy
    with pytest.raises(ConfigError, match="draft_weight_policy must be one of"):
        dataclasses.replace(drafted, draft_weight_policy="retrain")
    for model in (None, "self:2"):  # (no draft of its own: the policy would do nothing)
        method = "draft_model" if model else "ngram"
        with pytest.raises(ConfigError, match="applies to a draft model with weights"):
            InferenceConfig(
                num_speculative_tokens=2,
                speculative_method=method,
                speculative_model=model,
                draft_weight_policy="disable",
            )
    with pytest.raises(ConfigError, match="num_speculative_tokens must be in"):
        InferenceConfig(num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="1 <= min <= max"):
        InferenceConfig(ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2)
