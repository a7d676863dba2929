"""InferenceConfig: the seed's fields and defaults, frozen and validated; RuntimePlan beside it.

Owns: user-facing configuration and its parsing from JSON / `--set FIELD=VALUE`. Values found at
run time (block count, eos ids, ...) live in `RuntimePlan`, never written back into the config.

Every seed field exists. A field whose feature is not built yet raises `ConfigError` naming it
when set to anything but its default (`NOT_IMPLEMENTED`); nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing

from taipan.messages.allocator import PrefixCachingEvictionPolicy
from taipan.messages.lifecycle import KVCacheManagementMode

__all__ = [
    "ConfigError",
    "InferenceConfig",
    "KVCacheManagementMode",
    "PrefixCachingCoordinatorPolicy",
    "PrefixCachingEvictionPolicy",
    "RuntimePlan",
    "cuda_graph_sizes",
    "plan_limits",
]


class ConfigError(ValueError):
    pass


class PrefixCachingCoordinatorPolicy(enum.StrEnum):
    """How the coordinator routes a new request to a rank (actors/coordinator/routing.py)."""

    LONGEST_PREFIX = "longest_prefix"
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    ROUND_ROBIN = "round_robin"
    LOAD_BALANCED = "load_balanced"  # taipan's: the rank with the most free capacity


# The routing policies that read block hashes: they need prefix caching on, and the
# coordinator hashes prompts for them.
HASHING_POLICIES = frozenset(
    {
        PrefixCachingCoordinatorPolicy.LONGEST_PREFIX,
        PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK,
    }
)


class CudaGraphSizingDistribution(enum.StrEnum):
    EXPONENTIAL = "exponential"
    LINEAR = "linear"


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    block_size_tokens: int = 256
    # None: the seed's 20 GB on CUDA; on CPU a fifth of the memory available at start-up (at most
    # 20 GB): the KV cache is host memory there, and most of it must stay free for everything else.
    buffer_size_gb: float | None = None
    paused_buffer_size_gb: float | None = None
    mamba_inference_state_config: dict | None = None
    mamba_memory_ratio: float | None = None
    max_requests: int | None = None
    max_tokens: int | None = None
    unified_memory_level: int = 0
    kv_cache_management_mode: KVCacheManagementMode | None = None
    num_cuda_graphs: int | None = None
    cuda_graph_mixed_prefill_count: int | None = 16
    cuda_graph_sizing_distribution: CudaGraphSizingDistribution | None = None
    use_cuda_graphs_for_non_decode_steps: bool = True
    # True here (Megatron-LM's default is False): without it every step with a prompt chunk
    # above max_requests tokens runs eagerly, its launches paid from Python (README, CUDA graphs).
    cuda_graph_all_prefills: bool = True
    static_kv_memory_pointers: bool = False
    max_sequence_length: int = 2560
    pg_collection: dict | None = None
    use_flashinfer_fused_rope: bool | None = False
    materialize_only_last_token_logits: bool = True
    enable_chunked_prefill: bool = False
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = False
    prefix_caching_eviction_policy: PrefixCachingEvictionPolicy | None = None
    prefix_caching_coordinator_policy: PrefixCachingCoordinatorPolicy | None = None
    prefix_caching_routing_alpha: float = 0.5
    prefix_caching_mamba_gb: float | None = None
    track_paused_request_events: bool = False
    track_generated_token_events: bool = False
    metrics_writer: str | None = None
    logging_step_interval: int = 0
    sampling_backend: str = "torch"
    request_metadata_types: list | None = None
    use_synchronous_zmq_collectives: bool = False
    disable_ep_consensus: bool = False
    ep_consensus_interval: int = 20
    # taipan's own (not in Megatron's InferenceConfig): plan step N+1 while step N runs, as
    # vLLM's async scheduling and SGLang's overlap scheduler; False: plan, run, apply, repeat.
    # None: on with a CUDA device, off elsewhere (on a CPU the forward needs the very cores the
    # planning would run on, and the two then contend for the GIL: the CPU bench lost 20 %).
    overlap_steps: bool | None = None
    # taipan's own: under tensor parallelism on CUDA, small all-reduces (a decode step's) run as
    # one Triton kernel that reads every peer's buffer over CUDA IPC (ops/custom_all_reduce.py),
    # larger ones through NCCL. None: on where every pair of GPUs has peer access; False: NCCL
    # only (vLLM's disable_custom_all_reduce); True: on, or a clear error where it cannot be.
    custom_all_reduce: bool | None = None
    # Speculative decoding (num_speculative_tokens k > 0, the seed's field): each decode step
    # of a request verifies up to k draft tokens and keeps the longest agreeing prefix plus one
    # token (greedy outputs equal those without it; sampled ones keep their law and seeds).
    # `speculative_method`: who drafts: "ngram" (prompt lookup: copy what followed the latest
    # earlier occurrence of the longest suffix n-gram of n in [ngram_prompt_lookup_min,
    # ngram_prompt_lookup_max], vLLM's names), "draft_model" (below) or "mtp" (the checkpoint's
    # own multi-token-prediction head, Qwen3-Next-style: ops/mtp.py; its passes recorded in
    # CUDA graphs, eager under expert parallelism). actors/engine/speculation.py says which
    # requests speculate and what is not built yet.
    speculative_method: str = "ngram"
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    # "ngram" only: up to this many verify steps run back to back in the gpu actor for one
    # plan, which drafts each next step itself by the same rule (actors/gpu/chain.py), so the
    # engine's turn and the hops between the actors are paid once per chain, not per verify
    # step. A step chains when all its rows are verify rows of requests without top-n or
    # processed log-probs, logit controls or grammars, nothing waits to be admitted, and it
    # has at most speculative_chain_max_rows rows (the gpu drafts them one by one); the
    # others run one verify step per plan. Tokens then stream a chain at a time. 1: off.
    # taipan's own (vLLM's old multi-step scheduling, num_scheduler_steps, for speculation).
    # Not under expert parallelism.
    speculative_chain_steps: int = 1
    speculative_chain_max_rows: int = 4
    # No request speculates in a step planned while more than this many requests run (vLLM's
    # speculative_config disable_by_batch_size): a large batch's step computes more than it
    # reads, so a verify row's extra positions cost what they save, and a speculating request
    # gives up the overlap of plain steps. Speculation comes back in the first step planned at
    # or under it (the long tail of an RL batch). None: at every batch size.
    speculative_disable_by_batch_size: int | None = None
    # speculative_method "draft_model" (vLLM's speculative_config model): a smaller model of
    # the same tokenizer (a path or a registry name, as the target's), run by the same gpu
    # actor with a KV cache of its own over the same block ids; it drafts greedily
    # (actors/gpu/draft.py). "self:N": the target's first N layers and its head (a
    # self-speculative draft that shares the target's weights, so it follows every weight
    # update). taipan's name; vLLM's old flag was --speculative-model.
    speculative_model: str | None = None
    # What a weight update does to a draft model of its own (not "self:N", which shares the
    # target's weights and follows every update): "keep" (it drafts with its old weights; the
    # outputs stay exact, acceptance falls: spec_accepted_per_position shows it), "disable"
    # (speculation stops on the rank after its first update, until the draft's own weights
    # are updated: update_weights(..., draft=True)), "refuse" (updates of the target's weights
    # are refused while the draft is loaded; the draft's own still land). taipan's own.
    draft_weight_policy: str = "keep"
    # Per-layer-group KV: a model whose windowed layers sit among global ones (Gemma 3's local
    # layers, Qwen's max_window_layers) keeps the windowed layers' keys in a pool of their own,
    # each request a ring of its last window (actors/engine/local_kv.py; with prefix caching
    # that pool also caches the windowed keys of cached prompt blocks). True: one pool for every
    # layer, as a model without such layers has (vLLM's --disable-hybrid-kv-cache-manager).
    disable_hybrid_kv_cache_manager: bool = False
    verbose: dataclasses.InitVar[bool] = False

    @property
    def draft_has_own_weights(self) -> bool:
        """Speculation by a draft model with weights of its own (speculative_model a path or
        name, not "self:N"): the draft draft_weight_policy governs and UpdateWeights.draft
        updates."""
        draft = self.speculative_model
        return (
            bool(self.num_speculative_tokens)
            and self.speculative_method == "draft_model"
            and draft is not None
            and not draft.startswith("self:")
        )

    def __post_init__(self, verbose: bool):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in NOT_IMPLEMENTED and value != f.default:
                raise ConfigError(
                    f"{f.name}={value!r} is not implemented yet ({NOT_IMPLEMENTED[f.name]}); "
                    f"leave it at its default {f.default!r}"
                )
        self._check_ranges()
        if verbose:
            from taipan.actors.log import get_logger

            get_logger(component="config").warning("inference config", **self.to_dict())

    def _check_ranges(self) -> None:
        positive = ("block_size_tokens", "max_sequence_length", "ep_consensus_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_requests", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 when set, got {value}")
        if self.buffer_size_gb is not None and not self.buffer_size_gb > 0:
            raise ConfigError(f"buffer_size_gb must be > 0, got {self.buffer_size_gb}")
        paused = self.paused_buffer_size_gb
        if paused is not None and not 0 <= paused <= (self.buffer_size_gb or float("inf")):
            raise ConfigError(
                f"paused_buffer_size_gb ({paused}) must be in [0, buffer_size_gb "
                f"({self.buffer_size_gb})]: paused requests hold blocks of the same pool"
            )
        for name in ("num_cuda_graphs", "cuda_graph_mixed_prefill_count"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0 when set (0 = none), got {value}")
        mode = self.kv_cache_management_mode
        if self.static_kv_memory_pointers and mode not in (None, KVCacheManagementMode.PERSIST):
            raise ConfigError(
                f"static_kv_memory_pointers=True needs kv_cache_management_mode persist, got "
                f"{mode}: keeping the KV address while its memory is released needs "
                "virtual-memory remapping (UVM or torch_memory_saver), which taipan does not have"
            )
        if self.use_synchronous_zmq_collectives and self.overlap_steps:
            raise ConfigError(
                "use_synchronous_zmq_collectives=true needs overlap_steps off: a consensus round "
                "that blocks the engine's event loop while a step is in flight could block the "
                "very gpu actor its peers wait for (leave overlap_steps unset or false)"
            )
        if self.logging_step_interval < 0:
            raise ConfigError("logging_step_interval must be >= 0 (0 = off)")
        _check_mamba_state_config(self.mamba_inference_state_config)
        ratio = self.mamba_memory_ratio
        if ratio is not None and not 0 < ratio < 1:
            raise ConfigError(
                f"mamba_memory_ratio must be in (0, 1) when set (the share of buffer_size_gb "
                f"for live Mamba states, the rest for KV blocks), got {ratio}"
            )
        mamba_gb = self.prefix_caching_mamba_gb
        if mamba_gb is not None and mamba_gb > 0 and not self.enable_prefix_caching:
            raise ConfigError(
                f"prefix_caching_mamba_gb={mamba_gb} needs enable_prefix_caching=true (Mamba "
                "snapshots extend cached KV prefixes)"
            )
        if not 0 <= self.prefix_caching_routing_alpha <= 1:
            raise ConfigError("prefix_caching_routing_alpha must be in [0, 1]")
        routing = self.prefix_caching_coordinator_policy
        needs_cache = routing in HASHING_POLICIES
        if not self.enable_prefix_caching and (self.prefix_caching_eviction_policy or needs_cache):
            which = "prefix_caching_eviction_policy"
            if needs_cache:
                which = f"prefix_caching_coordinator_policy={routing}"
            raise ConfigError(f"{which} needs enable_prefix_caching=true")
        self._check_speculative()
        max_tokens = self.max_tokens or DEFAULT_MAX_TOKENS
        if self.max_requests is not None and max_tokens < self.max_requests:
            raise ConfigError(
                f"max_tokens ({max_tokens}) must be >= max_requests "
                f"({self.max_requests}): every running request needs a token each step"
            )

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if k < 0 or k > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0 = off), "
                f"got {k}"
            )
        method = self.speculative_method
        if method in UNBUILT_SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method={method!r} is not built yet; only 'ngram' (prompt "
                "lookup), 'draft_model' and 'mtp' are"
            )
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {method!r}"
            )
        draft = self.speculative_model
        if (method == "draft_model") != bool(draft):
            raise ConfigError(
                "speculative_method='draft_model' needs speculative_model (the draft's path or "
                "name), and speculative_model needs speculative_method='draft_model'"
            )
        if draft and draft.startswith("self:"):
            n = draft.removeprefix("self:")
            if not n.isdigit() or int(n) < 1:
                raise ConfigError(
                    f"speculative_model={draft!r}: 'self:N' needs N >= 1 (the target's first "
                    "N layers)"
                )
        policy = self.draft_weight_policy
        if policy not in DRAFT_WEIGHT_POLICIES:
            raise ConfigError(
                f"draft_weight_policy must be one of {', '.join(DRAFT_WEIGHT_POLICIES)}, got "
                f"{policy!r}"
            )
        if policy != "keep" and (not draft or draft.startswith("self:")):
            raise ConfigError(
                f"draft_weight_policy={policy!r} applies to a draft model with weights of its "
                "own (speculative_model a path or name; a 'self:N' draft follows every update)"
            )
        chain, rows = self.speculative_chain_steps, self.speculative_chain_max_rows
        if not 1 <= chain <= MAX_CHAIN_STEPS or rows < 1:
            raise ConfigError(
                f"speculative_chain_steps must be in [1, {MAX_CHAIN_STEPS}] (1 = off) and "
                f"speculative_chain_max_rows >= 1, got {chain} and {rows}"
            )
        if chain > 1 and (not k or method != "ngram"):
            raise ConfigError(
                "speculative_chain_steps > 1 chains n-gram verify steps: it needs "
                "num_speculative_tokens > 0 and speculative_method='ngram'"
            )
        off_above = self.speculative_disable_by_batch_size
        if off_above is not None and (not k or off_above < 1):
            raise ConfigError(
                f"speculative_disable_by_batch_size={off_above!r}: give None (speculate at "
                "every batch size) or a number of running requests >= 1, with "
                "num_speculative_tokens > 0"
            )
        lo, hi = self.ngram_prompt_lookup_min, self.ngram_prompt_lookup_max
        if not 1 <= lo <= hi:
            raise ConfigError(
                f"ngram_prompt_lookup_min ({lo}) and ngram_prompt_lookup_max ({hi}) need "
                "1 <= min <= max"
            )

    # --- parsing ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict) -> InferenceConfig:
        names = {f.name for f in dataclasses.fields(cls)} | {"verbose"}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown InferenceConfig field(s): {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        hints = {k: getattr(t, "type", t) for k, t in hints.items()}  # unwrap InitVar[bool]
        return cls(**{k: _coerce(k, hints[k], v) for k, v in values.items()})

    @classmethod
    def from_cli(cls, config_file: str | None, sets: list[str]) -> InferenceConfig:
        values: dict = {}
        if config_file:
            try:
                with open(config_file) as f:
                    loaded = json.load(f)
            except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
                raise ConfigError(f"cannot read config file {config_file}: {e}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {config_file} must hold a JSON object")
            values.update(loaded)
        for item in sets:
            name, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}")
            values[name.strip()] = raw.strip()
        return cls.from_dict(values)

    def to_dict(self) -> dict:
        return {
            f.name: (v.value if isinstance(v := getattr(self, f.name), enum.Enum) else v)
            for f in dataclasses.fields(self)
        }


def _coerce(name: str, tp, value):
    """Turn a JSON value or a --set string into the field's type, or raise ConfigError."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in args if a is not type(None))
    if isinstance(value, str) and tp is not str and not isinstance(tp, type(enum.Enum)):
        if tp is bool and value.lower() in ("true", "false"):  # accept Python's True/False too
            value = value.lower()
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(
                f"{name}: cannot parse {value!r} as {getattr(tp, '__name__', tp)}"
            ) from None
    try:
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return tp(value)
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if tp in (str, dict, list) and isinstance(value, tp):
            return value
    except ValueError:
        choices = ", ".join(m.value for m in tp)
        raise ConfigError(f"{name}: {value!r} is not one of {choices}") from None
    raise ConfigError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


# mamba_inference_state_config (Megatron's MambaInferenceStateConfig as a dict): the state
# dtypes, and shapes that must agree with the model (taipan reads them from the model itself).
MAMBA_STATE_KEYS = (
    "layer_type_list",
    "conv_states_shape",
    "ssm_states_shape",
    "conv_states_dtype",
    "ssm_states_dtype",
    "mamba_chunk_size",
)
MAMBA_STATE_DTYPES = ("float32", "bfloat16", "float16")


def _check_mamba_state_config(state: dict | None) -> None:
    if state is None:
        return
    unknown = sorted(set(state) - set(MAMBA_STATE_KEYS))
    if unknown:
        raise ConfigError(
            f"mamba_inference_state_config: unknown key(s) {unknown} (known: "
            f"{', '.join(MAMBA_STATE_KEYS)})"
        )
    for key in ("conv_states_dtype", "ssm_states_dtype"):
        value = state.get(key)
        if value is not None and str(value).removeprefix("torch.") not in MAMBA_STATE_DTYPES:
            raise ConfigError(
                f"mamba_inference_state_config.{key}: {value!r} is not one of "
                f"{', '.join(MAMBA_STATE_DTYPES)}"
            )
    for key in ("conv_states_shape", "ssm_states_shape"):
        value = state.get(key)
        if value is not None and not (
            isinstance(value, list | tuple) and all(isinstance(d, int) and d > 0 for d in value)
        ):
            raise ConfigError(
                f"mamba_inference_state_config.{key}: {value!r} is not a list of positive ints"
            )


def routing_policy(config: InferenceConfig) -> PrefixCachingCoordinatorPolicy:
    """The coordinator's routing policy: the configured one, else "longest_prefix" with prefix
    caching on (Megatron's default) and "round_robin" with it off."""
    policy = config.prefix_caching_coordinator_policy
    if policy is None:
        return (
            PrefixCachingCoordinatorPolicy.LONGEST_PREFIX
            if config.enable_prefix_caching
            else PrefixCachingCoordinatorPolicy.ROUND_ROBIN
        )
    return PrefixCachingCoordinatorPolicy(policy)  # a config built in code may hold the string


# Speculative decoding: the most draft tokens a step may verify per request, and the methods
# users of vLLM / Megatron may name that are not built.
MAX_SPECULATIVE_TOKENS = 64
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
MAX_CHAIN_STEPS = 64  # (actors/gpu/chain.py check_chain)
DRAFT_WEIGHT_POLICIES = ("keep", "disable", "refuse")
UNBUILT_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa")

# Field -> why it is refused when set. Shrinks as features land.
NOT_IMPLEMENTED = {
    "unified_memory_level": "unified memory is not supported",
    "pg_collection": "taipan wires its own process groups; a torch ProcessGroupCollection "
    "cannot be passed",
    "use_flashinfer_fused_rope": "flashinfer is not used",
    "materialize_only_last_token_logits": "taipan materializes only the logits a request "
    "asks for (return_log_probs includes the prompt's), so there is nothing to switch",
    "metrics_writer": "no metrics writer (wandb) integration",
    "sampling_backend": "only the torch sampling backend exists",
    "request_metadata_types": "per-request metadata tracking is not built",
}


@dataclasses.dataclass(frozen=True)
class RuntimePlan:
    """What one engine rank found out at start-up. Never mixed back into InferenceConfig."""

    num_blocks: int
    block_size: int
    max_requests: int
    max_tokens: int
    max_sequence_length: int
    eos_token_ids: tuple[int, ...]
    # Blocks paused requests may hold before the oldest are evicted (from
    # paused_buffer_size_gb); None: no cap, paused requests are evicted only when nothing else
    # can run.
    max_paused_blocks: int | None = None
    # Hybrid models: live Mamba state slots (one per request holding state: running or
    # paused); 0 = the model has no Mamba layers. Snapshot slots (prefix_caching_mamba_gb): 0 =
    # hybrids share KV prefixes but never skip prefill (DESIGN.md §6).
    mamba_slots: int = 0
    mamba_snapshot_slots: int = 0
    # Mixture-of-experts layers of the model (0: none, and return_routed_experts is refused).
    moe_layers: int = 0
    # The model's sliding window when every attention layer has one (ModelLoaded.sliding_window;
    # 0: some layer reads its whole context): the KV blocks behind it go back to the pool.
    sliding_window: int = 0
    # Per-layer-group KV (ModelLoaded.local_window): the window of the windowed layers of a
    # model whose other layers see their whole context, kept in a pool of their own of
    # `num_local_blocks` blocks handed out as rings (actors/engine/local_kv.py); 0: none.
    local_window: int = 0
    num_local_blocks: int = 0


# How many tokens a step may compute for a request whose ring wraps, when the window is fewer:
# a prompt step that no CUDA graph holds pays its kernel launches from Python whatever its size
# (17-27 ms on the 1B Gemma 3 shape, H200: tests/perf/eager_host.py), so chunks of only the
# window made a 4,096-token prompt's first token 4.5x later than one pool's (121 against 27 ms,
# 512-token window; 62 ms with chunks of 2,048). A ring costs W + c keys, so c is also held to
# the step's budget and to half of max_sequence_length less the window: a ring stays at most
# about half a whole request's keys (with the default 2,560 and Gemma 3's 512-token window:
# chunks of 768, rings of 6 blocks of 256), or the split would save little
# (actors/gpu/split_kv.py keeps one pool when a ring holds a whole request).
LOCAL_CHUNK_TOKENS = 2048


def local_chunk(
    window: int,
    block_size: int,
    max_tokens: int,
    max_sequence_length: int,
    num_speculative_tokens: int = 0,
) -> int:
    """The most tokens a step computes for a request whose local ring wraps (the contract in
    actors/engine/local_kv.py): the largest of the window, a block, a verify row's k + 1 and
    min(LOCAL_CHUNK_TOKENS, the step's token budget `max_tokens`, max_sequence_length // 2 -
    window)."""
    floor = min(LOCAL_CHUNK_TOKENS, max_tokens, max_sequence_length // 2 - window)
    return max(window, block_size, num_speculative_tokens + 1, floor)


def ring_blocks(window: int, block_size: int, chunk: int) -> int:
    """The local blocks a wrapping ring has: a chunk of `chunk` tokens reads and writes keys
    over at most window - 1 + chunk positions, which this many blocks hold with no two in one
    slot (one more for where the span starts inside a block)."""
    return -(-(window - 1 + chunk) // block_size) + 1


def mamba_snapshot_slots(budget_bytes: int, slot_bytes: int) -> int:
    """How many Mamba snapshot slots `prefix_caching_mamba_gb` (as bytes) holds (DESIGN.md §6).

    A snapshot goes straight into its slot (written by the conv and scan kernels inside a chunk,
    or copied from the live slot where a chunk ends on its block boundary), so no scratch is
    reserved (Megatron keeps extraction buffers for states inside a chunk): every byte goes to
    snapshots, budget // one slot's bytes. A budget <= 0 disables
    snapshots (0 slots; negative is Megatron's "disabled"); a positive one too small for a
    single slot is a ConfigError."""
    if slot_bytes < 1:
        raise ConfigError(f"a Mamba state slot must take >= 1 byte, not {slot_bytes}")
    if budget_bytes <= 0:
        return 0
    n = budget_bytes // slot_bytes
    if n < 1:
        raise ConfigError(
            f"prefix_caching_mamba_gb ({budget_bytes} bytes) holds no Mamba snapshot slot: one "
            f"(the conv and SSM state of every Mamba layer) takes {slot_bytes} bytes"
        )
    return n


DEFAULT_MAX_TOKENS = 16384
DEFAULT_MAX_REQUESTS = 128


def plan_limits(config: InferenceConfig) -> tuple[int, int]:
    """(max_requests, max_tokens) with the seed's defaults filled in."""
    max_tokens = config.max_tokens or DEFAULT_MAX_TOKENS
    max_requests = config.max_requests or min(DEFAULT_MAX_REQUESTS, max_tokens)
    return max_requests, max_tokens


GRAPH_FIELDS = (
    "num_cuda_graphs",
    "cuda_graph_mixed_prefill_count",
    "cuda_graph_sizing_distribution",
    "use_cuda_graphs_for_non_decode_steps",
    "cuda_graph_all_prefills",
)


def cuda_graph_sizes(
    config: InferenceConfig, device: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(decode-only sizes, mixed prefill sizes): the token counts to capture CUDA graphs for,
    ascending. A step runs the smallest graph that holds it, eagerly above the largest.

    Decode-only graphs hold up to max_requests one-token rows. Mixed graphs (any step, prefill
    chunks included; `use_cuda_graphs_for_non_decode_steps`) hold up to max_requests tokens, or
    max_tokens with `cuda_graph_all_prefills`. Sizes are spaced by
    `cuda_graph_sizing_distribution` (default exponential: halving from the bound down to 1;
    linear: 1, 2, 4, then steps of 8 to 256 and of 16 above). `num_cuda_graphs` caps the decode
    sizes and `cuda_graph_mixed_prefill_count` the mixed ones, keeping the largest and spreading
    the rest evenly; None keeps every size of the distribution, 0 captures none of that kind.
    `num_cuda_graphs=0` turns CUDA graphs off altogether (eager steps, as vLLM's enforce_eager).

    On a device other than CUDA there are no graphs: every field left at its default gives
    ((), ()); any field set otherwise (but num_cuda_graphs=0) is a ConfigError naming it.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(InferenceConfig)}
    if not device.startswith("cuda"):
        for name in GRAPH_FIELDS:
            value = getattr(config, name)
            if value != defaults[name] and not (name == "num_cuda_graphs" and value == 0):
                raise ConfigError(
                    f"{name}={value!r}: CUDA graphs need a CUDA device, and this runtime runs "
                    f"on {device!r}; leave it at its default {defaults[name]!r}"
                )
        return (), ()
    if config.num_cuda_graphs == 0:
        return (), ()
    max_requests, max_tokens = plan_limits(config)
    spacing = config.cuda_graph_sizing_distribution or CudaGraphSizingDistribution.EXPONENTIAL
    decode = _cap(_spaced(max_requests, spacing), config.num_cuda_graphs)
    mixed: tuple[int, ...] = ()
    if config.use_cuda_graphs_for_non_decode_steps:
        bound = max_tokens if config.cuda_graph_all_prefills else max_requests
        mixed = _cap(_spaced(bound, spacing), config.cuda_graph_mixed_prefill_count)
    return decode, mixed


def _spaced(bound: int, spacing: CudaGraphSizingDistribution) -> list[int]:
    """Sizes from 1 to `bound` (both included), ascending."""
    if spacing == CudaGraphSizingDistribution.LINEAR:
        sizes = {1, 2, 4, *range(8, 256, 8), *range(256, bound + 1, 16), bound}
        return sorted(x for x in sizes if x <= bound)
    sizes, n = {bound}, bound
    while n > 1:
        n = -(-n // 2)
        sizes.add(n)
    return sorted(sizes)


def _cap(sizes: list[int], count: int | None) -> tuple[int, ...]:
    """At most `count` of `sizes` (None: all): the largest, and the rest spread evenly."""
    if count is None or count >= len(sizes):
        return tuple(sizes)
    if count == 0:
        return ()
    if count == 1:
        return (sizes[-1],)
    step = (len(sizes) - 1) / (count - 1)
    return tuple(sorted({sizes[round(i * step)] for i in range(count)}))
