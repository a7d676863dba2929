"""The model worker: the load (weights, the KV cache and Mamba state tensors, the step buffers
and the CUDA graphs captured over them) and one StepPlan's two halves, `launch` and `collect`;
log-prob arrays from actors/gpu/logprobs.py.

Runs in the gpu actor's dedicated thread, so a step and a control never overlap. Owns what the
load allocates (the persistent step buffers, actors/gpu/buffers.py; hybrid models' Mamba state
slots, ops/mamba.py; `mamba_state`: live slots, then snapshot slots) and the step's bookkeeping
around the device work: running the plan checks, copying the sampled tokens to the host, and
building the StepResult with its timings.

Must not touch: what a step computes (the engine's plan decides), sockets, the memory
arithmetic (actors/gpu/sizing.py), the plan checks (actors/gpu/plan_checks.py), what runs on the
device for a step (the forward, CUDA graphs, sampling, routed experts: actors/gpu/forward.py, a
base class), or the suspend / resume / weight-update state (actors/gpu/controls.py, the other
base class).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch

from taipan.actors.gpu import host_staging
from taipan.actors.gpu.buffers import StepBuffers
from taipan.actors.gpu.chain import run_chain
from taipan.actors.gpu.controls import WorkerControls
from taipan.actors.gpu.draft import SELF_PREFIX, DraftModel, check_draft_prev, load_draft
from taipan.actors.gpu.forward import WorkerForward, plan_arrays
from taipan.actors.gpu.grammar_check import Check
from taipan.actors.gpu.grammar_masks import GrammarMasks, grammar_mode, uses_grammar
from taipan.actors.gpu.graphs import StepGraphs
from taipan.actors.gpu.host_staging import ARENA_BYTES
from taipan.actors.gpu.logprobs import (
    PendingLogProbs,
    log_prob_arrays,
    log_probs_never_wait,
    none_asked,
    wants_log_probs,
)
from taipan.actors.gpu.mamba_config import has_recurrent_layers, mamba_config_for
from taipan.actors.gpu.mtp import MTPDrafter
from taipan.actors.gpu.plan_checks import (
    check_local_kv,
    check_logprobs_mode,
    check_mamba_slots,
    check_mtp,
    check_prev_rows,
    check_sampling_controls,
    inner_snapshots,
)
from taipan.actors.gpu.sampling_controls import controlled_logits
from taipan.actors.gpu.sizing import PoolSizes, available_host_memory, kv_budget, size_pools
from taipan.actors.gpu.speculative import check_drafts, draft_rows, verify_drafts
from taipan.actors.gpu.split_kv import SplitKV
from taipan.actors.gpu.window import kv_window
from taipan.messages.gpu import LoadModel, ModelLoaded, StepPlan, StepResult
from taipan.ops.custom_all_reduce import for_mode as custom_all_reduce_for
from taipan.ops.expert_parallel import (
    EPGroup,
    ExpertShare,
    init_ep,
    install_exchange,
)
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.mamba import MAX_SNAPS, allocate_mamba_state
from taipan.ops.models.llama import allocate_kv_cache, kv_cache_bytes_per_block
from taipan.ops.moe import moe_blocks, routing_buffer
from taipan.ops.parallel import SINGLE, TPGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_LAUNCHED = 2  # steps launched and not yet collected, at most (the gpu actor keeps to it)
HOST_TOKEN_BUFFERS = MAX_LAUNCHED + 1


@dataclasses.dataclass
class Launched:
    """A step whose device work is queued (ModelWorker.launch); `collect` waits for it."""

    plan: StepPlan
    rows: np.ndarray  # the rows that sample
    tokens: torch.Tensor  # [B] int64 on the host (pinned, filled once `ended` has passed)
    extra: PendingLogProbs | dict  # its log-prob arrays ({}: none asked; taken at collect)
    graphed: bool
    start: float  # perf_counter when launch began
    device_start: float
    began: torch.cuda.Event | None  # CUDA only
    ended: torch.cuda.Event | None
    routed: torch.Tensor | None = None  # [T, moe layers, k] on the host, when the plan asks
    spec: np.ndarray | None = None  # StepResult.spec_tokens, when the plan verifies drafts
    spec_log_probs: dict = dataclasses.field(default_factory=dict)  # StepResult's spec_*_probs
    check: Check | None = None  # greedy grammar rows to check before the tokens are read
    next_drafts: torch.Tensor | None = None  # StepResult.next_drafts (an MTP head's), host


SYNC_ENV = "TAIPAN_STEP_EVENT_SYNC"


def step_event_blocking() -> bool:
    """How the collecting thread waits for a step's end event on CUDA ($TAIPAN_STEP_EVENT_SYNC):
    "blocking" (the default: the thread sleeps until the device signals, a core free for the
    engine's thread, which launches the next step meanwhile) or "spin" (the driver polls: the
    fastest wake-up, a core busy). On an H200, 1B shape, four alternating runs (NOTES,
    twenty-third session): batch 64 1.53 / 1.60 ms a step blocking vs 1.69 / 1.85 spinning
    (GPU idle 7 % vs 12-18 %), batch 1 no worse. ValueError for any other value."""
    value = os.environ.get(SYNC_ENV, "blocking")
    if value not in ("spin", "blocking"):
        raise ValueError(f"{SYNC_ENV} must be 'spin' or 'blocking', got {value!r}")
    return value == "blocking"


def check_device(device: torch.device) -> None:
    """A clear error for a CUDA device this process cannot see (data-parallel rank r with
    tensor-parallel size T runs its peers on GPUs r*T .. r*T+T-1, so N ranks need N*T GPUs)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but CUDA is not available here")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device {device} does not exist: {count} CUDA device(s) visible (data-parallel "
            "rank r with tensor-parallel size T runs on GPUs r*T .. r*T+T-1 from the one named)"
        )


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing elsewhere): streams,
    events and graph launches go to the current device, and every thread starts on cuda:0."""
    if device.type == "cuda":  # "cuda" without an index: the first visible GPU, as torch's
        torch.cuda.set_device(0 if device.index is None else device.index)


class ModelWorker(WorkerForward, WorkerControls):
    """One rank's model: `load`, then steps (their device work: WorkerForward) and lifecycle
    controls (WorkerControls).

    A step comes in two halves. `launch`: pack the plan into the persistent buffers, one
    host-to-device copy, then either replay the CUDA graph of the smallest bucket that holds the
    step (forward + last-token logits into a static buffer) or run the forward eagerly, then
    sample and queue the copy of the tokens to pinned host memory, without waiting (a step that
    asks for log-probs waits for them here). `collect`: wait for that copy (the step's one
    device-to-host sync) and build the StepResult, with the device time of the step's work
    (CUDA events) and whether a graph ran. The gpu actor launches the next step before it
    collects this one, so the device runs them back to back (`step` does both halves at once).

    Routed experts (a MoE model, StepPlan.return_routed_experts): see actors/gpu/forward.py; the
    step's rows go to the host with its tokens.

    Expert parallel (LoadModel.expert_parallel_size > 1, ops/expert_parallel.py): the worker
    joins its group at load, holds its share of the routed experts, and every MoE layer
    exchanges tokens with the peers, so every rank of the group must forward in the same steps
    (the engines' consensus sees to it) with the same padded rows per rank. Before each forward
    the ranks agree on (tokens, any prefill, any eager step) with a host all-reduce
    (`_ep_shape`); from the same agreed values each picks the same CUDA graph bucket (or all run
    eagerly) and pads its exchange to its size. A StepPlan with no sequence is a dummy step: the
    MoE exchanges only, none of this rank's rows (`exchange_only`), no KV block or Mamba slot
    touched. An EP step never launches on the event loop's thread (the agreement blocks until
    the peers arrive). With tensor parallelism too, the gpu actor has joined both groups at
    once before the load (`init_tp_ep`): every process of a rank agrees and exchanges with the
    processes of the other ranks that hold its slice.

    Tensor parallel (`load(..., tp=...)`, ops/parallel.py): the worker holds this rank's
    shards, its KV cache this rank's kv heads and its Mamba state slots (a hybrid) this rank's
    share of every slot (the config's `mamba_state_for`; a snapshot copy copies each rank's
    own shard): the budget is per rank, the ranks agree on the smallest one, and on the block
    and slot counts (sizing.size_pools), so every slot and block id the engine names exists on
    every rank. Every rank of the group must run the same calls in the same order (load, every
    step's `launch`/`collect` with the same plan, every control): each forward and each logits
    computation holds collectives.
    """

    def __init__(self):
        super().__init__()
        self.model = None
        self.config = None
        self.kv_cache: torch.Tensor | None = None
        # Per-layer-group KV (actors/gpu/split_kv.py): the windowed layers' own pool, the
        # cache then one flat allocation that `model_kv` views per layer; None: one pool.
        self.split_kv: SplitKV | None = None
        # Hybrid models: every Mamba layer's (conv, ssm) state slots; None without Mamba layers
        # (and while suspended in offload or recompute mode).
        self.mamba_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mamba_slots = 0  # live + snapshot slots (the ones a plan may name)
        self._snapshot_slots = 0
        # Speculative decoding's k: each live slot s has scratch slots
        # _mamba_slots + s * k + j (the state after j + 1 tokens of its verify row).
        self._scratch_per_slot = 0
        self.buffers: StepBuffers | None = None  # the step inputs' fixed device addresses
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.block_size = 0
        self.kv_budget_source = ""  # how the KV cache size was chosen (for the start-up log)
        self._kv_shape: tuple[int, ...] = ()
        self.graphs: StepGraphs | None = None  # None: every step eager
        self.static_kv = False  # static_kv_memory_pointers: only persist mode may suspend
        self._logits: torch.Tensor | None = None  # [max_requests, V] fp32, the graphs' output
        self._graph_hidden: torch.Tensor | None = None  # [mixed tokens, H]: after mixed graphs
        # The last step's sampled tokens, on the device at a fixed address: a plan's prev_rows
        # read them. _prev_sampled: that step's rows that sampled (host copy), for the checks.
        self._sampled: torch.Tensor | None = None  # [max_requests] int64
        self._prev_sampled = np.zeros(0, dtype=bool)
        self.grammar_masks = GrammarMasks(None)  # structured outputs (a new one at each load)
        # Pinned host buffers the sampled tokens are copied into, one per launched step (the gpu
        # actor keeps fewer steps than this launched and uncollected); CUDA only.
        self._host_tokens: torch.Tensor | None = None
        self._arenas: host_staging.Arenas | None = None  # (CUDA: made at the first load)
        self._chain_arena: host_staging.StagingArena | None = None
        self._in_chain = False  # (a chain's inner steps are being launched: `launch`)
        self._launches = 0
        self.graph_capture_seconds = 0.0  # how long the last capture of every graph took
        self.tp = SINGLE  # this worker's tensor-parallel group (set at load)
        # The group as the model uses it, with the custom all-reduce when the peers agreed to
        # it (made once per group: a reload keeps it), and which sum the small ones take.
        self._tp_with_fast: TPGroup | None = None
        self.all_reduce_path = ""
        self.ep: EPGroup | None = None  # its expert-parallel group (set at load), None: none
        self.exchange = None  # the MoE layers' token exchange under expert parallelism
        # Routed experts: the model's MoE blocks and the buffer their routers' ids go to,
        # [max_tokens, MoE layers, top_k] (None: no MoE layer). The CUDA graphs always write it
        # (a graph cannot branch on the plan); an eager forward only when its plan asks.
        self._moe_blocks: list = []
        self._routing: torch.Tensor | None = None
        # speculative_method "draft_model": the draft and its KV cache (actors/gpu/draft.py).
        self.draft: DraftModel | None = None
        self._draft_graphable = False  # its forwards may be graphed (not a sharded self-draft)
        # speculative_method "mtp": the drafts per row of the checkpoint's MTP head (0: none),
        # and its drafter's buffers (actors/gpu/mtp.py; made with the graphs).
        self.mtp_k = 0
        self.mtp: MTPDrafter | None = None
        self._blocking_sync = False  # the step's end event ($TAIPAN_STEP_EVENT_SYNC)

    # ---- load ----------------------------------------------------------------------------------

    def load(self, msg: LoadModel, *, tp: TPGroup = SINGLE) -> ModelLoaded:
        """Load the model (this rank's shards under `tp`) and size the KV cache; every rank of
        `tp` calls this with the same message (block_bytes is one rank's)."""
        self._blocking_sync = step_event_blocking()
        grammar = grammar_mode()
        if msg.dtype not in DTYPES:
            raise ValueError(f"dtype {msg.dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[msg.dtype]
        self.device = torch.device(msg.device)
        check_device(self.device)
        use_device(self.device)
        model, config, tokenizer = self._load_weights(msg, dtype, tp)
        self.mtp_k = msg.num_speculative_tokens if msg.mtp else 0
        per_block = kv_cache_bytes_per_block(config, msg.block_size, dtype, self.tp)
        split = SplitKV.of(msg, model, config)
        local_bytes, local_wanted = 0, 0
        if split is not None:  # (the main pool's block: the other layers' share)
            per_block, local_bytes = split.block_bytes(per_block, config.num_kv_layers)
            local_wanted = split.wanted
        draft = load_draft(msg, model, config, dtype, self.device, self.tp)
        if draft is not None:  # (its KV blocks share the target's ids: one budget for both)
            per_block += kv_cache_bytes_per_block(draft[1], msg.block_size, dtype, draft[2])
        config = mamba_config_for(config, msg, dtype, self.tp)
        slot_bytes = self._slot_bytes(config, dtype)
        sizes = self._size_pools(msg, per_block, slot_bytes, local_bytes, local_wanted)
        if split is not None and sizes.num_local_blocks < split.ring_blocks:
            # A budget whose windowed share holds no whole ring would refuse requests one pool
            # serves: one pool then (every peer decides alike: the counts are agreed).
            split, per_block, local_bytes = None, per_block + local_bytes, 0
            sizes = self._size_pools(msg, per_block, slot_bytes)
        self.split_kv = split
        self._allocate_pools(msg, config, dtype, sizes)
        # (structured outputs; a recurrent state cannot take a void row back: hybrids wait)
        optimistic = grammar == "check" and self.mamba_state is None
        self.grammar_masks = GrammarMasks(tokenizer, grammar != "mask", optimistic)
        self.draft = None
        if draft is not None:
            kv = allocate_kv_cache(
                draft[1], sizes.num_blocks, msg.block_size, dtype, self.device, draft[2]
            )
            own = not msg.draft_model.startswith(SELF_PREFIX)
            self.draft = DraftModel(draft[0], kv, msg.block_size, self.device, None, draft[1], own)
            self._draft_graphable = draft[2].size == 1  # (a sharded self-draft runs eagerly)
        self.model, self.config, self.dtype = model, config, dtype
        self.weight_version, self.suspend_mode = 0, None
        self._kv_shape, self._kv_offloaded = tuple(self.kv_cache.shape), None
        self.static_kv = msg.static_kv_memory_pointers
        self._allocate_outputs(msg, config)
        return ModelLoaded(
            model=msg.model,
            num_blocks=sizes.num_blocks,
            block_size=msg.block_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            tokenizer=json.dumps(tokenizer.to_wire()),
            eos_token_ids=tuple(config.eos_token_ids),
            block_bytes=per_block,
            mamba_slots=sizes.live_slots,
            mamba_slot_bytes=slot_bytes,
            mamba_snapshot_slots=sizes.snapshot_slots,
            tensor_parallel_size=self.tp.size,
            moe_layers=len(self._moe_blocks),
            sliding_window=kv_window(config),
            draft_weights=self.draft is not None and self.draft.own_weights,
            local_window=0 if split is None else split.window,
            num_local_blocks=sizes.num_local_blocks,
            local_block_bytes=local_bytes,
        )

    def model_kv(self):
        """What the model's forward gets as its KV cache: the cache, or under per-layer-group
        KV its per-layer view (actors/gpu/split_kv.py)."""
        if self.split_kv is None or self.kv_cache is None:
            return self.kv_cache
        return self.split_kv.view(self.kv_cache)

    def _load_weights(self, msg: LoadModel, dtype, tp: TPGroup):
        """(model, config, tokenizer): this rank's weights, its expert-parallel group joined
        and its tensor-parallel sums set up first; sets `tp` to the group the model uses."""
        experts = self._expert_share(msg, tp)
        if msg.mtp and msg.num_speculative_tokens < 1:
            raise ValueError("speculative_method 'mtp' needs num_speculative_tokens >= 1")
        if tp.size > 1 or msg.custom_all_reduce is True:  # (true at size 1: the error says why)
            tp = self._with_custom_sums(tp, msg.custom_all_reduce)
        try:
            model, config, tokenizer = load_model(
                msg.model,
                dtype=dtype,
                device=self.device,
                tp=tp,
                expert_range=experts,
                mtp=msg.mtp,
            )
        except ModelLoadError as e:
            if experts is not None and "has no experts" in str(e):
                raise ModelLoadError(
                    f"expert_parallel_size={experts.size} needs a mixture-of-experts model: {e}"
                ) from e
            raise
        if self.ep is not None:
            self.exchange = install_exchange(model, self.ep)
        self.tp = tp
        return model, config, tokenizer

    def _expert_share(self, msg: LoadModel, tp: TPGroup) -> ExpertShare | None:
        """This rank's routed experts under expert parallelism (None: every expert)."""
        if msg.expert_parallel_size <= 1:
            return None
        if self.ep is None and tp.size > 1:
            raise ValueError(
                "expert parallelism with tensor parallelism: the process joins both groups "
                "at once (ops/expert_parallel.py init_tp_ep) before the load"
            )
        if self.ep is None:  # (joined once per process: a reload keeps the group)
            rank, size = msg.expert_parallel_rank, msg.expert_parallel_size
            self.ep = init_ep(rank, size, msg.expert_parallel_init, self.device)
        return ExpertShare(self.ep.rank, self.ep.size)

    def _with_custom_sums(self, tp: TPGroup, mode: bool | None) -> TPGroup:
        """`tp` as ops/custom_all_reduce.py `for_mode` gives it; the custom all-reduce is set up
        once per group (a reload keeps it). Every peer loads with the same mode at once."""
        kept = self._tp_with_fast
        if mode is not False and kept is not None and kept.group is tp.group:
            return kept
        tp, self.all_reduce_path = custom_all_reduce_for(tp, mode)
        if tp.fast is not None:
            self._tp_with_fast = tp
        return tp

    def _size_pools(
        self,
        msg: LoadModel,
        block_bytes: int,
        slot_bytes: int,
        local_block_bytes: int = 0,
        local_blocks: int = 0,
    ) -> PoolSizes:
        """The pools LoadModel's budget holds on this rank, agreed with its tensor-parallel
        peers (so a budget too small fails on every peer alike)."""
        budget, self.kv_budget_source = kv_budget(
            msg.kv_cache_gb,
            on_cpu=self.device.type == "cpu",
            available=available_host_memory(),
            ranks_on_host=msg.ranks_on_host,
        )
        return size_pools(
            budget,
            block_bytes,
            source=self.kv_budget_source,
            max_blocks=msg.max_blocks,
            slot_bytes=slot_bytes,
            max_requests=msg.max_requests,
            mamba_memory_ratio=msg.mamba_memory_ratio,
            mamba_snapshot_gb=msg.mamba_snapshot_gb,
            scratch_per_slot=msg.num_speculative_tokens if msg.speculative else 0,
            local_block_bytes=local_block_bytes,
            local_blocks=local_blocks,
            agree=self.tp.agree_min,
        )

    def _allocate_pools(self, msg: LoadModel, config, dtype, sizes: PoolSizes) -> None:
        """The KV cache, the Mamba state slots and the step buffers, at the agreed sizes."""
        self.block_size = msg.block_size
        if self.split_kv is None:
            self.kv_cache = allocate_kv_cache(
                config, sizes.num_blocks, msg.block_size, dtype, self.device, self.tp
            )
        else:  # (one allocation, so suspend and resume move it as one)
            self.kv_cache = self.split_kv.allocate(
                config, sizes.num_blocks, sizes.num_local_blocks, dtype, self.device, self.tp
            )
        # Hybrids: live slots 0..live-1 (one per request holding state), snapshots after them.
        self.mamba_state, self._mamba_offloaded = None, None
        self._mamba_slots, self._snapshot_slots = sizes.mamba_slots, sizes.snapshot_slots
        self._scratch_per_slot = sizes.scratch_per_slot
        self.dtype = dtype  # (the conv state is kept in the model's dtype)
        if sizes.live_slots:
            self.mamba_state = self._new_mamba_state(config)
        self.buffers = StepBuffers(
            self.device,
            max_tokens=msg.max_tokens,
            max_requests=msg.max_requests,
            max_blocks_per_seq=-(-msg.max_sequence_length // msg.block_size),
            local=self.split_kv is not None,
            # A hybrid's verify rows keep their states inside the row (scratch slots): in the
            # step buffers, so the mixed graphs take them (up to the kernels' MAX_SNAPS).
            snapshots=self._scratch_per_slot if self._scratch_per_slot <= MAX_SNAPS else 0,
        )

    def _allocate_outputs(self, msg: LoadModel, config) -> None:
        """The sampled tokens' device and host buffers, and the CUDA graphs with their logits
        buffer (captured here, against the KV cache just allocated)."""
        self.graphs = None
        self._sampled = torch.zeros(msg.max_requests, dtype=torch.int64, device=self.device)
        self._moe_blocks = moe_blocks(self.model)
        self._routing = routing_buffer(self._moe_blocks, msg.max_tokens, self.device)
        self._prev_sampled = np.zeros(0, dtype=bool)
        self.mtp = None
        if self.mtp_k:
            self.mtp = MTPDrafter(
                self.model, self.mtp_k, self.block_size, msg.max_requests, self.device,
                HOST_TOKEN_BUFFERS,
            )  # fmt: skip
        if self.device.type == "cuda":
            # (one row more: a chain's inner steps', below)
            shape = (HOST_TOKEN_BUFFERS + 1, msg.max_requests)
            self._host_tokens = torch.empty(shape, dtype=torch.int64, pin_memory=True)
            # (an arena is reused once the launch that used it was collected, as a row here)
            self._arenas = self._arenas or host_staging.Arenas(HOST_TOKEN_BUFFERS)
            # A chain's inner steps (each collected before the next) stage through an arena and
            # a token row of their own: a step launched before the chain may still be waiting
            # for its collect, its results in the rotating ones.
            self._chain_arena = self._chain_arena or host_staging.StagingArena(ARENA_BYTES)
        sizes = msg.cuda_graph_decode_sizes, msg.cuda_graph_mixed_sizes
        if any(sizes):
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
            self.graphs = StepGraphs(*sizes, max_requests=msg.max_requests)
            self._logits = torch.empty(
                msg.max_requests, config.vocab_size, dtype=torch.float32, device=self.device
            )
            # Every token's hidden state after a mixed graph (speculative verify rows score
            # each of their positions; a decode graph leaves it alone).
            self._graph_hidden = None
            if msg.speculative and msg.cuda_graph_mixed_sizes:
                shape = (max(msg.cuda_graph_mixed_sizes), config.hidden_size)
                self._graph_hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
            if self.draft is not None and self._draft_graphable:
                self.draft.use_graphs(msg)
            self._capture()

    def _slot_bytes(self, config, dtype) -> int:
        """One Mamba slot's bytes on this rank (its share of every recurrent layer, Mamba2 or
        GDN); 0: no recurrent layers."""
        if not has_recurrent_layers(config):
            return 0
        state = config.mamba_state_for(self.tp)
        return state.bytes_per_slot(dtype, DTYPES[config.ssm_state_dtype])

    def _new_mamba_state(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        ssm_dtype = DTYPES[config.ssm_state_dtype]
        slots = self._mamba_slots + self._scratch_per_slot * (
            self._mamba_slots - self._snapshot_slots
        )  # (live, snapshots, then the live slots' scratch)
        return allocate_mamba_state(
            config.mamba_state_for(self.tp), slots, self.dtype, ssm_dtype, self.device
        )

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepResult:
        """Launch and collect one step (what the gpu actor does in two halves)."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched | StepResult:
        """Queue the step's device work and the copy of its sampled tokens to the host, without
        waiting for them (a StepResult only when the step cannot run). Raw log-probs of the
        sampled tokens are queued too (read at collect); top-n and processed ones may wait for
        the stream here (`launches_inline`). `collect` turns the returned handle into the
        StepResult; the next step may be launched before that (the device runs it after this
        one). The small arrays the launch sends to the device go through its own pinned
        arena (actors/gpu/host_staging.py). A chain plan (StepPlan.chain_steps) runs its
        inner verify steps here, each launched and collected, and returns their StepResult."""
        if plan.chain_steps > 1:  # (verify steps one after the other: actors/gpu/chain.py)
            self._in_chain = True
            try:
                result = run_chain(plan, self.block_size, self._run_inner)
            finally:
                self._in_chain = False
            self._prev_sampled = np.zeros(len(plan.sample), dtype=bool)  # (none is read)
            return result
        arena = self._arenas.next() if self._arenas is not None else None
        with host_staging.active(arena):
            return self._launch(plan)

    def _run_inner(self, plan: StepPlan) -> StepResult:
        """One inner step of a chain, launched and collected (through the chain's own arena
        and token row)."""
        arena = self._chain_arena
        if arena is not None:
            arena.reset()
        with host_staging.active(arena):
            launched = self._launch(plan)
        return self.collect(launched)

    def _launch(self, plan: StepPlan) -> Launched | StepResult:
        start = time.perf_counter()
        previous, self._prev_sampled = self._prev_sampled, np.zeros(0, dtype=bool)
        refusal = self.step_refusal()
        if refusal is not None:
            self.grammar_masks.launched(None)  # (no tokens: none read from the last step)
            no_tokens = np.full(len(plan.sample), -1, dtype=np.int32)
            return StepResult(plan.step, no_tokens, refusal, 0.0)
        num_seqs = len(plan.seq_lens)
        if num_seqs == 0 and self.ep is not None:
            self.grammar_masks.launched(None)  # (no rows: none reads this step's tokens)
            return self._dummy(plan, start)
        check_prev_rows(plan, previous)
        check_mamba_slots(plan, self._mamba_slots, self._snapshot_slots)
        check_logprobs_mode(plan)
        check_sampling_controls(plan, self.config.vocab_size)
        num_local = self.split_kv.num_local if self.split_kv is not None else 0
        check_local_kv(plan, num_local, self.block_size)
        check_drafts(plan)
        check_draft_prev(plan, self.draft is not None, self.config.vocab_size)
        check_mtp(plan, bool(self.mtp_k), self.config.vocab_size)
        if self.draft is not None:  # (it fills the verify rows' draft tokens)
            plan = self.draft.fill(plan, self._sampled)
        inner_snaps = inner_snapshots(plan)
        verify_snaps = {}
        if self.mamba_state is not None and len(draft_rows(plan)):
            verify_snaps = self._verify_snapshots(plan)  # (a hybrid's verify rows)
            if inner_snaps or "snap_pos" not in self.buffers.fields:
                inner_snaps |= verify_snaps  # (with prefix snapshots: eager, all from here)
        bucket = self._bucket(plan, inner_snaps)
        sizes = {"num_tokens": bucket.tokens, "num_seqs": bucket.seqs} if bucket else {}
        arrays = plan_arrays(plan, self.buffers.fields, verify_snaps)
        staged = self.buffers.stage(arrays, **sizes)
        # (the grammar rows' tokens checked in the launch: what the step reports is final; a
        # plain step with no grammar work pending computes none of this)
        grammar = uses_grammar(plan) or self.grammar_masks.pending
        checks_in_launch = grammar and self._checks_in_launch(plan)
        if grammar and not self.grammar_masks.skips_wait(plan, checks_in_launch):
            self.grammar_masks.wait_check()  # (the last step's checked tokens, which it reads)
        # Device time: from the step's one host-to-device copy to its last kernel (the host
        # packing above is time the device waits between steps, unless a step is in flight).
        began = ended = None
        if self.device.type == "cuda":
            began = torch.cuda.Event(enable_timing=True)
            ended = torch.cuda.Event(enable_timing=True, blocking=self._blocking_sync)
            began.record()
        device_start = time.perf_counter()
        if len(plan.local_copy_src):  # (a prefix hit's cached windowed keys into its ring)
            self.split_kv.copy(self.kv_cache, plan.local_copy_src, plan.local_copy_dst)
        inputs, logits, hidden = self._forward_logits(plan, staged, bucket, inner_snaps)
        if len(plan.local_save_src):  # (computed prompt blocks' windowed keys into the cache)
            self.split_kv.copy(self.kv_cache, plan.local_save_src, plan.local_save_dst)
        routed = self._routed_to_host(plan)
        if len(plan.mamba_snap_dst):  # the chunk-end ones: after the forward that wrote them
            self._snapshot_chunk_ends(plan)
        controlled = controlled_logits(plan, logits, self._sampled)  # (logits: no controls)
        grammar = uses_grammar(plan) or self.grammar_masks.pending
        if grammar:  # (masks after the controls)
            controlled = self.grammar_masks.masked(plan, controlled, logits)
        tokens = self._sample(plan, inputs, controlled)  # [B]
        # (an MTP head reads the step's final tokens: no check left for collect)
        checks_later = grammar and not checks_in_launch
        if grammar and not checks_later:  # (greedy grammar rows: what the step reports is final)
            tokens = self.grammar_masks.checked(tokens, controlled, self.sample_keys)
        spec, spec_lp = None, {}
        if len(draft_rows(plan)):  # (speculative: actors/gpu/speculative.py; waits for the step)
            tokens, spec, spec_lp = verify_drafts(
                plan, inputs, hidden, tokens, self.model.compute_logits, self.grammar_masks
            )
            spec = spec.astype(np.int32)
            if self.mamba_state is not None:
                self._roll_back_states(plan, spec)
        next_drafts = None
        if self.mtp is not None:  # (queued: its drafts reach the host with the step's tokens)
            next_drafts = self._mtp_drafts(plan, bucket, inputs, hidden, tokens, spec)
        self._sampled[:num_seqs].copy_(tokens)  # what the next step's prev_rows read
        host = self._tokens_to_host(tokens, num_seqs) if ended is not None else tokens
        self.grammar_masks.sampled(host, ended)
        rows = np.flatnonzero(plan.sample)
        extra = log_prob_arrays(
            plan,
            rows,
            logits,
            tokens,
            hidden,
            processed_logits=controlled,
            compute_logits=self.model.compute_logits,
            vocab_size=self.config.vocab_size,
            device=self.device,
        )
        check = None
        if checks_later:  # (greedy grammar rows: checked at collect; "wait": the next forward
            # waits for it, and their candidates' copy to the host is queued here, before
            # `ended`; "check": their logits' copy, for a rejected row's replacement)
            check = self.grammar_masks.check_later(
                host, self._sampled, controlled, self.sample_keys
            )
        self.grammar_masks.launched(check)
        if ended is not None:
            ended.record()  # after the step's device work and the copies of its tokens
        self._prev_sampled = plan.sample != 0
        self._prev_sampled[draft_rows(plan)] = False  # (their tokens are several: not read)
        launched = Launched(
            plan, rows, host, extra, bucket is not None, start, device_start, began, ended, routed
        )
        launched.spec, launched.spec_log_probs, launched.check = spec, spec_lp, check
        launched.next_drafts = next_drafts
        return launched

    def _tokens_to_host(self, tokens: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """The sampled tokens' copy to pinned host memory, queued without waiting (collect()
        waits for it); the buffers rotate so a launched, uncollected step keeps its own."""
        if self._in_chain:  # (the chain's own row: each inner step is collected before the next)
            return self._host_tokens[HOST_TOKEN_BUFFERS][:num_seqs].copy_(tokens, non_blocking=True)
        self._launches += 1
        host = self._host_tokens[self._launches % HOST_TOKEN_BUFFERS][:num_seqs]
        return host.copy_(tokens, non_blocking=True)

    def finish_check(self, launched: Launched | StepResult, result: StepResult) -> StepResult:
        """`result` (of `collect(launched, deferred_check=True)`) with the grammar check it
        left run: its checked rows' tokens, and the rows whose replaced token the next step read
        (StepResult.grammar_fixed)."""
        check = None if isinstance(launched, StepResult) else launched.check
        if check is None or check.done.is_set() or result.error is not None:
            return result
        self.grammar_masks.run_check(check)
        if not len(check.fixed):
            return result
        token_ids = result.token_ids.copy()
        token_ids[check.fixed] = launched.tokens.numpy()[check.fixed]
        return dataclasses.replace(result, token_ids=token_ids, grammar_fixed=check.fixed)

    def _checks_in_launch(self, plan: StepPlan) -> bool:
        """Whether a grammar step's checked rows are checked in its launch (what it reports of
        them is computed there: log-probs, verified drafts, an MTP head's input)."""
        return wants_log_probs(plan) or bool(len(draft_rows(plan))) or bool(self.mtp_k)

    def launches_inline(self, plan: StepPlan) -> bool:
        """Whether `launch(plan)` is short host work that never waits for the device (a CUDA
        step without grammar work, not expert parallel; its raw log-probs are read at
        collect), so the caller may run it on its own thread."""
        grammar = uses_grammar(plan) or self.grammar_masks.pending
        if grammar and self.device.type == "cuda":  # (a grammar step may wait for the step
            # before it, or compile a grammar: not in "check" mode with greedy rows only)
            grammar = not self.grammar_masks.inline(plan, self._checks_in_launch(plan))
        # (top-n and processed log-probs may wait for the stream)
        waits = wants_log_probs(plan) and not log_probs_never_wait(plan)
        return (
            self.device.type == "cuda"
            and not waits
            and self.ep is None
            and not len(draft_rows(plan))  # (a verify step waits for its tokens)
            and not self.mtp_k  # (an MTP head's passes: eager ones are long host work)
            and not grammar
        )

    def launch_waits(self, plan: StepPlan) -> bool:
        """Whether `launch(plan)` waits for the step's device work on CUDA (its verified
        drafts come to the host in it, or a grammar step's log-probs read its checked rows),
        so that `collect` right after it, in the same thread, waits for almost nothing (the
        gpu actor then saves a hop to its collector). An MTP head's steps are collected there
        too: the engine plans the next step of a drafting request only with these drafts."""
        grammar_log_probs = wants_log_probs(plan) and (
            uses_grammar(plan) or self.grammar_masks.pending
        )
        return (
            self.device.type == "cuda"
            and self.ep is None
            and (grammar_log_probs or bool(len(draft_rows(plan))) or bool(self.mtp_k))
        )

    def collect(
        self, launched: Launched | StepResult, *, deferred_check: bool = False
    ) -> StepResult:
        """Wait for a launched step's device work and build its StepResult. Thread-safe with
        `launch` (it only waits on the step's event and reads its host buffers).
        `deferred_check`: a "check" mode grammar check is left to `finish_check`, on the
        caller's next thread (the gpu actor's loop: the check's Python there, not a third
        thread contending for the GIL; a launch that waits for it runs in the worker's thread,
        never inline, so the loop stays free to run it)."""
        if isinstance(launched, StepResult):
            return launched
        plan = launched.plan
        try:
            if launched.ended is not None:
                launched.ended.synchronize()
                device_seconds = launched.began.elapsed_time(launched.ended) / 1e3
            else:
                device_seconds = time.perf_counter() - launched.device_start
            check = launched.check
            if check is not None and not (deferred_check and check.optimistic):
                self.grammar_masks.run_check(check)  # (greedy grammar rows, before their tokens)
        except BaseException as e:
            if launched.check is not None and not launched.check.done.is_set():
                launched.check.fail(e)
            raise
        token_ids = np.full(len(plan.sample), -1, dtype=np.int32)
        rows = launched.rows
        token_ids[rows] = launched.tokens.numpy()[rows]
        extra = launched.extra
        if isinstance(extra, PendingLogProbs):  # (copied to the host before the end event)
            extra = extra.take()
        if not extra:
            extra = none_asked(len(plan.sample))
        if launched.routed is not None:  # (copied out: on CUDA the launch's arena, reused)
            extra = extra | {"routed_experts": launched.routed.numpy().copy()}
        if launched.spec is not None:
            extra = extra | {"spec_tokens": launched.spec}
        if launched.next_drafts is not None:  # (an MTP head's, on the host now)
            extra = extra | {"next_drafts": launched.next_drafts.numpy().astype(np.int32)}
        extra = extra | launched.spec_log_probs
        if check is not None and len(check.fixed):  # (their next step's rows are void)
            extra = extra | {"grammar_fixed": check.fixed}
        return StepResult(
            plan.step,
            token_ids,
            None,
            time.perf_counter() - launched.start,
            device_seconds=device_seconds,
            graphed=launched.graphed,
            **extra,
        )
