"""The model worker: weights, the KV cache tensor, forward + sampling (+ log-probs) for one
StepPlan, and the lifecycle controls between steps (suspend, resume, update_weights).

The only place in actors/ that imports torch. It runs in the gpu actor's dedicated thread, so a
step and a control never overlap; it never decides what to compute (the engine's plan does) and
never talks to sockets.

Hybrid models also hold Mamba state slots (ops/mamba.py; `mamba_state`, one slot per request
the rank may hold); every suspend mode treats them as the KV cache: kept, offloaded with it, or
dropped (resume then zeroes them: recomputed requests start from position 0).

Suspend modes (messages.gpu.GpuControl): "persist" keeps the KV tensor; "offload" copies a CUDA
KV cache to pinned host memory and frees the device tensor, after checking that the host has the
memory (else it refuses and changes nothing); on a CPU device the KV cache already is host memory,
so "offload" keeps it where it is (a copy would only double it); "recompute" frees it. Resume
allocates a fresh device tensor (with the offloaded contents, or uninitialized for "recompute"):
its address changes, so the CUDA graphs (actors/gpu/graphs.py), captured at load against the
old one, are dropped at such a suspend and captured again at resume; "persist" keeps both.

A step comes in two halves. `launch`: pack the plan into the persistent buffers
(actors/gpu/buffers.py), one host-to-device copy, then either replay the CUDA graph of the
smallest bucket that holds the step (forward + last-token logits into a static buffer) or run the
forward eagerly, then sample and queue the copy of the tokens to pinned host memory, without
waiting (a step that asks for log-probs waits for them here). `collect`: wait for that copy (the
step's one device-to-host sync) and build the StepResult, with the device time of the step's
work (CUDA events) and whether a graph ran. The gpu actor launches the next step before it
collects this one, so the device runs them back to back (`step` does both halves at once).

KV cache size: `LoadModel.kv_cache_gb`, or when it is None, DEFAULT_KV_GB on CUDA and on CPU
CPU_KV_SHARE of the memory available at load (at most DEFAULT_KV_GB), capped by `max_blocks`.

Expert parallel (LoadModel.expert_parallel_size > 1, ops/expert_parallel.py): the worker joins
its group at load, holds its share of the routed experts, and every MoE layer exchanges tokens
with the peers, so every rank of the group must forward in the same steps (the engines' consensus
sees to it) with the same padded rows per rank. Before each forward the ranks agree on (tokens,
any prefill, any eager step) with a host all-reduce (`_ep_shape`); from the same agreed values
each picks the same CUDA graph bucket (or all run eagerly) and pads its exchange to its size. A
StepPlan with no sequence is a dummy step: the MoE exchanges only, none of this rank's rows
(`exchange_only`), no KV block or Mamba slot touched. An EP step never launches on the event
loop's thread (the agreement blocks until the peers arrive). With tensor parallelism too, the
gpu actor has joined both groups at once before the load (`init_tp_ep`): every process of a
rank agrees and exchanges with the processes of the other ranks that hold its slice.

Tensor parallel (`load(..., tp=...)`, ops/parallel.py): the worker holds this rank's shards, its
KV cache this rank's kv heads and its Mamba state slots (a hybrid) this rank's share of every
slot (`NemotronHConfig.mamba_state_for`; a snapshot copy copies each rank's own shard): the
budget is per rank, the ranks agree on the smallest one, and on the block and slot counts, so
every slot and block id the engine names exists on every rank. Every rank of the group must run
the same calls in the same order (load, every step's `launch`/`collect` with the same plan,
every control): each forward and each logits computation holds collectives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch

from taipan.actors.config import ConfigError, mamba_snapshot_slots
from taipan.actors.gpu.buffers import StepBuffers
from taipan.actors.gpu.graphs import Bucket, StepGraphs
from taipan.messages.gpu import (
    GpuCommand,
    GpuControl,
    GpuControlReply,
    LoadModel,
    ModelLoaded,
    StepPlan,
    StepResult,
)
from taipan.messages.lifecycle import KVCacheManagementMode as Mode
from taipan.ops.custom_all_reduce import for_mode as custom_all_reduce_for
from taipan.ops.expert_parallel import (
    EPGroup,
    ExpertShare,
    exchange_only,
    init_ep,
    install_exchange,
)
from taipan.ops.loader import (
    ModelLoadError,
    load_model,
)
from taipan.ops.logprobs import log_probs_and_top_n, prompt_log_probs
from taipan.ops.mamba import MambaMetadata, allocate_mamba_state
from taipan.ops.models.llama import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from taipan.ops.models.nemotron_h import NemotronHConfig
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.sampling import sample
from taipan.ops.weight_updates import (
    WeightUpdateError,
    check_same_architecture,
    state_updates,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 1024**3
DEFAULT_KV_GB = 20.0  # the seed's buffer_size_gb
CPU_KV_SHARE = 0.2  # on CPU the KV cache is host memory: take a bounded share of what is free
HOST_RESERVE_BYTES = 2 * GIB  # an offload must leave at least this much host memory free
# Prompt log-probs build fp32 logits at most this many rows, and elements, at a time.
PROMPT_LOGITS_MAX_ROWS = 1024
PROMPT_LOGITS_MAX_ELEMENTS = 1 << 26  # 256 MiB
MAX_LAUNCHED = 2  # steps launched and not yet collected, at most (the gpu actor keeps to it)
HOST_TOKEN_BUFFERS = MAX_LAUNCHED + 1


@dataclasses.dataclass
class Launched:
    """A step whose device work is queued (ModelWorker.launch); `collect` waits for it."""

    plan: StepPlan
    rows: np.ndarray  # the rows that sample
    tokens: torch.Tensor  # [B] int64 on the host (pinned, filled once `ended` has passed)
    extra: dict  # the log-prob arrays, when the step asked for them (already on the host)
    graphed: bool
    start: float  # perf_counter when launch began
    device_start: float
    began: torch.cuda.Event | None  # CUDA only
    ended: torch.cuda.Event | None


class ControlError(Exception):
    """A GpuControl that cannot apply in the worker's current state; nothing was changed."""


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (Linux MemAvailable: free memory plus
    what the kernel can reclaim), or free physical pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def kv_budget(
    requested_gb: float | None, device: torch.device, ranks_on_host: int = 1
) -> tuple[int, str]:
    """(bytes for the KV cache, where that number comes from) for LoadModel.kv_cache_gb; the
    CPU default is split between the `ranks_on_host` engine ranks that share this memory."""
    if requested_gb is not None:
        return int(requested_gb * GIB), f"buffer_size_gb={requested_gb:g}"
    if device.type != "cpu":
        return int(DEFAULT_KV_GB * GIB), f"default buffer_size_gb={DEFAULT_KV_GB:g}"
    available = available_host_memory()
    budget = int(min(DEFAULT_KV_GB * GIB, CPU_KV_SHARE * available) / ranks_on_host)
    source = f"CPU default: {CPU_KV_SHARE:.0%} of {available / GIB:.1f} GiB available"
    if ranks_on_host > 1:
        source += f", split between {ranks_on_host} ranks"
    return budget, source


def mamba_state_config(
    config: NemotronHConfig, msg: LoadModel, dtype, tp: TPGroup = SINGLE
) -> NemotronHConfig:
    """The model's config with `mamba_inference_state_config` applied (LoadModel's JSON): the
    SSM state dtype may be chosen; the conv state stays in the model's dtype (the conv kernels
    read and write it in place); layer_type_list, the shapes (per layer and slot: conv [K-1,
    conv_dim] or Megatron's [conv_dim, K-1], SSM [heads, head_dim, state]; a tensor-parallel
    rank's own, as Megatron's) and mamba_chunk_size must be the model's own. Anything else is a
    ConfigError naming the key."""
    if not msg.mamba_state_config:
        return config
    state = json.loads(msg.mamba_state_config)
    shape = config.mamba_state_for(tp)
    conv = [shape.conv_kernel - 1, shape.conv_dim]
    expected = {
        "layer_type_list": config.pattern,
        "conv_states_shape": (conv, conv[::-1]),
        "ssm_states_shape": ([shape.num_heads, shape.head_dim, shape.state_size],),
        "mamba_chunk_size": config.chunk_size,
    }
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            continue
        if key == "layer_type_list":
            got = "".join(got)
        ok = list(got) in want if isinstance(want, tuple) else got == want
        if not ok:
            model = want[0] if isinstance(want, tuple) else want
            raise ConfigError(
                f"mamba_inference_state_config.{key} {got!r} is not the model's ({model!r})"
            )
    name = str(dtype).removeprefix("torch.")
    conv_dtype = str(state.get("conv_states_dtype") or name).removeprefix("torch.")
    if conv_dtype != name:
        raise ConfigError(
            f"mamba_inference_state_config.conv_states_dtype {conv_dtype} differs from the model "
            f"dtype {name}: taipan keeps the conv state in the model dtype"
        )
    ssm = state.get("ssm_states_dtype")
    if ssm is None:
        return config
    return dataclasses.replace(config, ssm_state_dtype=str(ssm).removeprefix("torch."))


def mamba_live_slots(msg: LoadModel, budget: int, slot_bytes: int) -> tuple[int, int]:
    """(live Mamba slots, what is left of the KV budget). With mamba_memory_ratio r the live
    states take the share r of the budget (as many slots as fit, at most max_requests) and the
    KV blocks the rest, as Megatron's `mamba_memory_ratio`; without it every request the rank
    may hold gets a slot besides the KV budget."""
    ratio = msg.mamba_memory_ratio
    if ratio is None:
        return msg.max_requests, budget
    share = int(budget * ratio)
    live = min(msg.max_requests, share // slot_bytes)
    if live < 1:
        raise ConfigError(
            f"mamba_memory_ratio={ratio:g} of the KV budget ({budget / GIB:.3g} GiB) is "
            f"{share} bytes, less than one live Mamba slot ({slot_bytes} bytes)"
        )
    return live, budget - share


def offload_problem(kv_bytes: int, available: int) -> str | None:
    """Why copying a KV cache of `kv_bytes` to host memory must be refused, or None."""
    if kv_bytes + HOST_RESERVE_BYTES <= available:
        return None
    return (
        f"offload needs {kv_bytes / GIB:.2f} GiB of host memory for the KV cache and keeps "
        f"{HOST_RESERVE_BYTES / GIB:.0f} GiB free, but only {available / GIB:.2f} GiB is "
        "available; nothing was changed: suspend in persist or recompute mode instead"
    )


class ModelWorker:
    def __init__(self):
        self.model = None
        self.config = None
        self.kv_cache: torch.Tensor | None = None
        # Hybrid models: every Mamba layer's (conv, ssm) state slots; None without Mamba layers
        # (and while suspended in offload or recompute mode: _mamba_offloaded holds offloaded
        # contents).
        self.mamba_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mamba_offloaded: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mamba_slots = 0  # live + snapshot slots
        self._snapshot_slots = 0
        self.buffers: StepBuffers | None = None  # the step inputs' fixed device addresses
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.block_size = 0
        self.weight_version = 0  # successful update_weights since load
        self.suspend_mode: Mode | None = None  # None: running
        self.kv_budget_source = ""  # how the KV cache size was chosen (for the start-up log)
        self._kv_shape: tuple[int, ...] = ()
        self._kv_offloaded: torch.Tensor | None = None  # the KV contents while offloaded
        self.graphs: StepGraphs | None = None  # None: every step eager
        self.static_kv = False  # static_kv_memory_pointers: only persist mode may suspend
        self._logits: torch.Tensor | None = None  # [max_requests, V] fp32, the graphs' output
        # The last step's sampled tokens, on the device at a fixed address: a plan's prev_rows
        # read them. _prev_sampled: that step's rows that sampled (host copy), for the checks.
        self._sampled: torch.Tensor | None = None  # [max_requests] int64
        self._prev_sampled = np.zeros(0, dtype=bool)
        # Pinned host buffers the sampled tokens are copied into, one per launched step (the gpu
        # actor keeps fewer steps than this launched and uncollected); CUDA only.
        self._host_tokens: torch.Tensor | None = None
        self._launches = 0
        self.graph_capture_seconds = 0.0  # how long the last capture of every graph took
        self.tp = SINGLE  # this worker's tensor-parallel group (set at load)
        # The group as the model uses it, with the custom all-reduce when the peers agreed to
        # it (made once per group: a reload keeps it), and which sum the small ones take.
        self._tp_with_fast: TPGroup | None = None
        self.all_reduce_path = ""
        self.ep: EPGroup | None = None  # its expert-parallel group (set at load), None: none
        self.exchange = None  # the MoE layers' token exchange under expert parallelism
        self._staged: list | None = None  # weights checked by STAGE_WEIGHTS, not yet copied in

    def load(self, msg: LoadModel, *, tp: TPGroup = SINGLE) -> ModelLoaded:
        """Load the model (this rank's shards under `tp`) and size the KV cache; every rank of
        `tp` calls this with the same message (block_bytes is one rank's)."""
        if msg.dtype not in DTYPES:
            raise ValueError(f"dtype {msg.dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[msg.dtype]
        self.device = torch.device(msg.device)
        check_device(self.device)
        use_device(self.device)
        experts = None
        if msg.expert_parallel_size > 1:
            if self.ep is None and tp.size > 1:
                raise ValueError(
                    "expert parallelism with tensor parallelism: the process joins both groups "
                    "at once (ops/expert_parallel.py init_tp_ep) before the load"
                )
            if self.ep is None:  # (joined once per process: a reload keeps the group)
                rank, size = msg.expert_parallel_rank, msg.expert_parallel_size
                self.ep = init_ep(rank, size, msg.expert_parallel_init, self.device)
            experts = ExpertShare(self.ep.rank, self.ep.size)
        if tp.size > 1 or msg.custom_all_reduce is True:  # (true at size 1: the error says why)
            tp = self._with_custom_sums(tp, msg.custom_all_reduce)
        try:
            model, config, tokenizer = load_model(
                msg.model, dtype=dtype, device=self.device, tp=tp, expert_range=experts
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
        per_block = kv_cache_bytes_per_block(config, msg.block_size, dtype, tp)
        budget, self.kv_budget_source = kv_budget(msg.kv_cache_gb, self.device, msg.ranks_on_host)
        # One budget for every peer: what is derived from it (slots, blocks) agrees, and a
        # budget too small fails on every peer alike (none waits for the others at a collective).
        budget = tp.agree_min(budget)
        live, snapshots, slot_bytes = 0, 0, 0
        if isinstance(config, NemotronHConfig):
            config = mamba_state_config(config, msg, dtype, tp)
            state = config.mamba_state_for(tp)  # this rank's share of a slot
            slot_bytes = state.bytes_per_slot(dtype, DTYPES[config.ssm_state_dtype])
            live, budget = mamba_live_slots(msg, budget, slot_bytes)
            snapshot_bytes = int((msg.mamba_snapshot_gb or 0) * GIB)
            snapshots = mamba_snapshot_slots(snapshot_bytes, slot_bytes)
            # The engine's slot ids must exist on every rank.
            live, snapshots = tp.agree_min(live), tp.agree_min(snapshots)
        elif msg.mamba_memory_ratio is not None or msg.mamba_snapshot_gb is not None:
            raise ConfigError(
                "mamba_memory_ratio and prefix_caching_mamba_gb are for hybrid models; "
                f"{msg.model} has no Mamba layers"
            )
        elif msg.mamba_state_config:
            raise ConfigError(
                f"mamba_inference_state_config is for hybrid models; {msg.model} has no Mamba "
                "layers"
            )
        num_blocks = budget // per_block
        if msg.max_blocks > 0:
            num_blocks = min(num_blocks, msg.max_blocks)
        num_blocks = tp.agree_min(num_blocks)  # the engine's block ids must exist on every rank
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget ({budget / GIB:.3g} GiB, {self.kv_budget_source}) holds no KV "
                f"block of {per_block} bytes"
            )
        self.block_size = msg.block_size
        self.kv_cache = allocate_kv_cache(
            config, num_blocks, msg.block_size, dtype, self.device, tp
        )
        # Hybrids: live slots 0..live-1 (one per request holding state), snapshots after them.
        self.mamba_state, self._mamba_offloaded = None, None
        self._mamba_slots, self._snapshot_slots = live + snapshots, snapshots
        self.dtype = dtype  # (the conv state is kept in the model's dtype)
        if live:
            self.mamba_state = self._new_mamba_state(config)
        self.buffers = StepBuffers(
            self.device,
            max_tokens=msg.max_tokens,
            max_requests=msg.max_requests,
            max_blocks_per_seq=-(-msg.max_sequence_length // msg.block_size),
        )
        self.model, self.config, self.dtype = model, config, dtype
        self.weight_version, self.suspend_mode = 0, None
        self._kv_shape, self._kv_offloaded = tuple(self.kv_cache.shape), None
        self.static_kv = msg.static_kv_memory_pointers
        self.graphs = None
        self._sampled = torch.zeros(msg.max_requests, dtype=torch.int64, device=self.device)
        self._prev_sampled = np.zeros(0, dtype=bool)
        if self.device.type == "cuda":
            shape = (HOST_TOKEN_BUFFERS, msg.max_requests)
            self._host_tokens = torch.empty(shape, dtype=torch.int64, pin_memory=True)
        sizes = msg.cuda_graph_decode_sizes, msg.cuda_graph_mixed_sizes
        if any(sizes):
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
            self.graphs = StepGraphs(*sizes, max_requests=msg.max_requests)
            self._logits = torch.empty(
                msg.max_requests, config.vocab_size, dtype=torch.float32, device=self.device
            )
            self._capture()
        return ModelLoaded(
            model=msg.model,
            num_blocks=num_blocks,
            block_size=msg.block_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            tokenizer=json.dumps(tokenizer.to_wire()),
            eos_token_ids=tuple(config.eos_token_ids),
            block_bytes=per_block,
            mamba_slots=live,
            mamba_slot_bytes=slot_bytes,
            mamba_snapshot_slots=snapshots,
        )

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

    def _new_mamba_state(self, config: NemotronHConfig) -> tuple[torch.Tensor, torch.Tensor]:
        ssm_dtype = DTYPES[config.ssm_state_dtype]
        return allocate_mamba_state(
            config.mamba_state_for(self.tp), self._mamba_slots, self.dtype, ssm_dtype, self.device
        )

    def _run_model(
        self,
        ids: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        attn: AttentionMetadata,
        inner_snaps: dict[int, list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """The model's forward over the step's buffers (a hybrid also gets its Mamba slots, and
        the snapshots its kernels store inside chunks: row -> [(position, slot)])."""
        if self.mamba_state is None:
            return self.model(ids, inputs["positions"], attn, self.kv_cache)
        conv, ssm = self.mamba_state
        mamba = MambaMetadata(
            conv, ssm, inputs["mamba_init"], inputs["mamba_out"], attn.query_start_loc,
            attn.num_decodes,
        )  # fmt: skip
        if inner_snaps:
            rows = range(attn.num_decodes, len(attn.query_start_loc) - 1)
            width = max(len(v) for v in inner_snaps.values())
            table = [(inner_snaps.get(r, []) + [(1, -1)] * width)[:width] for r in rows]
            mamba.snap_pos = self._tensor(np.asarray([[p for p, _ in t] for t in table]))
            mamba.snap_slots = self._tensor(np.asarray([[s for _, s in t] for t in table]))
        return self.model(ids, inputs["positions"], attn, self.kv_cache, mamba)

    @staticmethod
    def _inner_snapshots(plan: StepPlan) -> dict[int, list[tuple[int, int]]]:
        """The plan's snapshots inside chunks (before the chunk's last token), which the
        kernels store: row -> [(position, slot)]. Such a row has at least two tokens, so it is
        a prefill row. The step runs eagerly (they are rare: a few per shared prefix)."""
        out: dict[int, list[tuple[int, int]]] = {}
        lens = np.diff(plan.query_start_loc)
        for row, pos, dst in zip(
            plan.mamba_snap_row.tolist(), plan.mamba_snap_pos.tolist(),
            plan.mamba_snap_dst.tolist(), strict=True,
        ):  # fmt: skip
            if pos < lens[row]:
                out.setdefault(row, []).append((int(pos), int(dst)))
        return out

    def _tensor(self, a: np.ndarray, dtype=None) -> torch.Tensor:
        # np.frombuffer views are read-only; torch wants writable memory.
        t = torch.from_numpy(np.array(a, copy=True))
        return t.to(self.device, dtype=dtype, non_blocking=True)

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepResult:
        """Launch and collect one step (what the gpu actor does in two halves)."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched | StepResult:
        """Queue the step's device work and the copy of its sampled tokens to the host, without
        waiting for them (a StepResult only when the step cannot run). Steps with log-probs
        wait for theirs here. `collect` turns the returned handle into the StepResult; the
        next step may be launched before that (the device runs it after this one)."""
        start = time.perf_counter()
        previous, self._prev_sampled = self._prev_sampled, np.zeros(0, dtype=bool)
        if self.suspend_mode is not None:
            no_tokens = np.full(len(plan.sample), -1, dtype=np.int32)
            return StepResult(plan.step, no_tokens, "the gpu worker is suspended", 0.0)
        num_seqs = len(plan.seq_lens)
        if num_seqs == 0 and self.ep is not None:
            return self._dummy(plan, start)
        self._check_prev_rows(plan, previous)
        self._check_mamba_slots(plan)
        bucket = None
        inner_snaps = self._inner_snapshots(plan)
        eager = self.graphs is None or (plan.prompt_targets >= 0).any() or bool(inner_snaps)
        all_decode = bool((np.diff(plan.query_start_loc) == 1).all())
        if self.ep is not None:
            bucket = self._ep_shape(len(plan.input_ids), all_decode, eager)
        elif not eager:
            bucket = self.graphs.pick(len(plan.input_ids), num_seqs, all_decode)
        sizes = {"num_tokens": bucket.tokens, "num_seqs": bucket.seqs} if bucket else {}
        staged = self.buffers.stage(_plan_arrays(plan), **sizes)
        # Device time: from the step's one host-to-device copy to its last kernel (the host
        # packing above is time the device waits between steps, unless a step is in flight).
        began = ended = None
        if self.device.type == "cuda":
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            began.record()
        device_start = time.perf_counter()
        inputs = self.buffers.upload(staged)
        if bucket is not None:
            self.graphs.replay(bucket)
            inputs = self.buffers.views(num_tokens=len(plan.input_ids), num_seqs=num_seqs)
            logits, hidden = self._logits[:num_seqs], None
        else:
            hidden = self._forward(plan, inputs, inner_snaps)  # [T, H]
            # Logits for every sequence's last token (rows that do not sample are ignored):
            # their positions come from the device's query starts, so nothing travels for them.
            last = inputs["query_start_loc"][1:].long() - 1
            logits = self.model.compute_logits(hidden[last])  # [B, V] fp32
        if len(plan.mamba_snap_dst):  # the chunk-end ones: after the forward that wrote them
            self._snapshot_chunk_ends(plan)
        tokens = self._sample(plan, inputs, logits)  # [B]
        self._sampled[:num_seqs].copy_(tokens)  # what the next step's prev_rows read
        host = tokens
        if ended is not None:  # to pinned memory, asynchronously: collect() waits for it
            self._launches += 1
            host = self._host_tokens[self._launches % len(self._host_tokens)][:num_seqs]
            host.copy_(tokens, non_blocking=True)
        rows = np.flatnonzero(plan.sample)
        n = int(plan.top_n.max(initial=0))
        extra = {}
        if _wants_log_probs(plan):  # these wait for the device here
            extra = self._log_probs(plan, rows, logits, tokens, n)
            if hidden is not None:
                extra.update(self._prompt_log_probs(plan, hidden, n))
        if ended is not None:
            ended.record()  # after the step's device work and the copy of its tokens
        self._prev_sampled = plan.sample != 0
        return Launched(
            plan, rows, host, extra, bucket is not None, start, device_start, began, ended
        )

    def launches_inline(self, plan: StepPlan) -> bool:
        """Whether `launch(plan)` is short host work that never waits for the device (a CUDA
        step without log-probs, not expert parallel), so the caller may run it on its own
        thread."""
        return self.device.type == "cuda" and not _wants_log_probs(plan) and self.ep is None

    def _ep_shape(self, num_tokens: int, all_decode: bool, eager: bool):
        """Agree with the group on this step's shape; returns the graph bucket every rank runs
        (None: all eager) and sets the exchange's rows per rank to its size (eager: the
        largest token count of the group). A dummy step takes part with 0 tokens."""
        tokens, mixed, any_eager = self.ep.agree([num_tokens, int(not all_decode), int(eager)])
        bucket = None
        if not any_eager and self.graphs is not None:
            # A function of the agreed values alone (a mixed bucket that holds `tokens` holds
            # any rank's sequences), so every rank picks the same one.
            bucket = self.graphs.pick(tokens, 1, all_decode=not mixed)
        self.exchange.tokens = bucket.tokens if bucket is not None else tokens
        return bucket

    def _dummy(self, plan: StepPlan, start: float) -> StepResult:
        """A dummy step (module docstring): this rank's experts serve the peers' rows."""
        self._ep_shape(0, True, False)
        with torch.inference_mode():
            exchange_only(self.model, self.dtype, self.device)
        elapsed = time.perf_counter() - start
        no_tokens = np.zeros(0, dtype=np.int32)
        return StepResult(plan.step, no_tokens, None, elapsed, device_seconds=elapsed)

    def collect(self, launched: Launched | StepResult) -> StepResult:
        """Wait for a launched step's device work and build its StepResult. Thread-safe with
        `launch` (it only waits on the step's event and reads its host buffers)."""
        if isinstance(launched, StepResult):
            return launched
        plan = launched.plan
        if launched.ended is not None:
            launched.ended.synchronize()
            device_seconds = launched.began.elapsed_time(launched.ended) / 1e3
        else:
            device_seconds = time.perf_counter() - launched.device_start
        token_ids = np.full(len(plan.sample), -1, dtype=np.int32)
        rows = launched.rows
        token_ids[rows] = launched.tokens.numpy()[rows]
        extra = launched.extra
        if not extra:
            extra = self._no_log_probs(len(plan.sample), 0)
        return StepResult(
            plan.step,
            token_ids,
            None,
            time.perf_counter() - launched.start,
            device_seconds=device_seconds,
            graphed=launched.graphed,
            **extra,
        )

    def _forward(
        self, plan: StepPlan, inputs: dict[str, torch.Tensor], inner_snaps=None
    ) -> torch.Tensor:
        attn = AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
        ).with_layout(plan.query_start_loc, plan.seq_lens, self.block_size)
        ids = inputs["input_ids"]
        if len(plan.prev_rows):  # only then: the gather costs launches
            ids = self._ids_with_previous_tokens(inputs)
        return self._run_model(ids, inputs, attn, inner_snaps)

    def _ids_with_previous_tokens(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """input_ids, where prev_rows says so replaced by the last step's sampled tokens (on
        the device: no host round trip). [T] int64."""
        prev = inputs["prev_rows"]
        previous = self._sampled[prev.clamp(min=0).long()]
        return torch.where(prev >= 0, previous, inputs["input_ids"].long())

    def _check_mamba_slots(self, plan: StepPlan) -> None:
        """Every Mamba slot the plan names must exist (the kernels index them unchecked):
        init and out slots are -1 or any slot, snapshot copies go from a live slot to a
        snapshot slot (ValueError)."""
        n, live = self._mamba_slots, self._mamba_slots - self._snapshot_slots
        init, out = plan.mamba_init, plan.mamba_out
        row, pos, dst = plan.mamba_snap_row, plan.mamba_snap_pos, plan.mamba_snap_dst
        if not n:
            if len(init) or len(out) or len(dst) or len(row) or len(pos):
                raise ValueError("the plan names Mamba slots, but the model has no Mamba layers")
            return
        if len(init) != len(plan.seq_lens) or len(out) != len(plan.seq_lens):
            raise ValueError("mamba_init and mamba_out need one slot per sequence")
        for name, a in (("mamba_init", init), ("mamba_out", out)):
            if len(a) and (a.min() < -1 or a.max() >= n):
                raise ValueError(f"{name} names slots outside -1..{n - 1}: {a.tolist()[:8]}")
        if not len(row) == len(pos) == len(dst):
            raise ValueError("mamba_snap_row, mamba_snap_pos and mamba_snap_dst must match")
        if not len(dst):
            return
        num_seqs = len(plan.seq_lens)
        if row.min() < 0 or row.max() >= num_seqs:
            raise ValueError(f"mamba_snap_row must name sequences 0..{num_seqs - 1}")
        lens = np.diff(plan.query_start_loc)[row]
        if (pos < 1).any() or (pos > lens).any():
            raise ValueError("mamba_snap_pos must lie in 1..the query length of its sequence")
        if ((pos == lens) & ((out[row] < 0) | (out[row] >= live))).any():
            raise ValueError("a snapshot at a chunk's end copies its out slot: a live slot")
        if dst.min() < live or dst.max() >= n or len(set(dst.tolist())) < len(dst):
            raise ValueError(f"mamba_snap_dst must name distinct snapshot slots {live}..{n - 1}")
        if set(dst.tolist()) & set(init.tolist()):
            raise ValueError("a snapshot slot the step writes cannot be one it reads")

    def _snapshot_chunk_ends(self, plan: StepPlan) -> None:
        """The snapshots at a chunk's end: copies of its out slot into snapshot slots (every
        layer; queued after the forward, so the next step's forward reads them)."""
        ends = plan.mamba_snap_pos == np.diff(plan.query_start_loc)[plan.mamba_snap_row]
        if not ends.any():
            return
        s = self._tensor(plan.mamba_out[plan.mamba_snap_row[ends]], torch.long)
        d = self._tensor(plan.mamba_snap_dst[ends], torch.long)
        for t in self.mamba_state:
            t.index_copy_(1, d, t.index_select(1, s))

    def _check_prev_rows(self, plan: StepPlan, previous: np.ndarray) -> None:
        """prev_rows must name rows the previous step (`previous`: which of its rows sampled)
        had and sampled (ValueError)."""
        prev = plan.prev_rows
        if not len(prev):
            return
        if len(prev) != len(plan.input_ids):
            raise ValueError(
                f"prev_rows has {len(prev)} entries for {len(plan.input_ids)} input tokens"
            )
        if prev.min() < -1:
            raise ValueError(f"prev_rows must be -1 or a row index, got {int(prev.min())}")
        wanted = prev[prev >= 0]
        if len(wanted) and (wanted.max() >= len(previous) or not previous[wanted].all()):
            sampled = np.flatnonzero(previous)[:8].tolist()
            raise ValueError(
                f"prev_rows {sorted(set(wanted.tolist()))[:8]} name rows the previous step "
                f"did not sample (it sampled rows {sampled})"
            )

    def _sample(
        self, plan: StepPlan, inputs: dict[str, torch.Tensor], logits: torch.Tensor
    ) -> torch.Tensor:
        if not (plan.temperature[plan.sample != 0] > 0).any():
            return logits.argmax(dim=-1)  # all greedy: skip the filters and the noise
        names = ("temperature", "top_k", "top_p", "seeds", "gen_index", "min_p")
        return sample(logits, **{name: inputs[name] for name in names})

    # ---- CUDA graphs ---------------------------------------------------------------------------

    def _graph_body(self, bucket: Bucket) -> None:
        """What a graph records: the forward over the buffers at the bucket's size, and the
        logits of each sequence's last token into the static logits buffer."""
        inputs = self.buffers.views(num_tokens=bucket.tokens, num_seqs=bucket.seqs)
        if self.exchange is not None:  # every rank captures this bucket at this size
            self.exchange.tokens = bucket.tokens
        attn = AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
            num_decodes=bucket.seqs if bucket.decode else 0,
            max_query_len=1 if bucket.decode else bucket.tokens,
        )
        ids = self._ids_with_previous_tokens(inputs)  # 3 tiny kernels, so always recorded
        hidden = self._run_model(ids, inputs, attn)
        # Padding rows repeat the last query start: they read a real row (or row 0).
        last = (inputs["query_start_loc"][1:].long() - 1).clamp(min=0)
        self.model.compute_logits(hidden[last], out=self._logits[: bucket.seqs])

    def _neutral_step(self, bucket: Bucket) -> None:
        """Fill the step buffers with an empty step padded to the bucket: no sequence attends
        anything or writes a slot (what the captures run on)."""
        empty = {
            name: np.zeros((0, f.width) if f.width else 0, dtype=f.dtype)
            for name, f in self.buffers.fields.items()
        }
        self.buffers.load(empty, num_tokens=bucket.tokens, num_seqs=bucket.seqs)

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        self.graphs.capture(self._graph_body, self._neutral_step)
        self.graph_capture_seconds = time.perf_counter() - start

    def _log_probs(
        self,
        plan: StepPlan,
        rows: np.ndarray,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        n: int,
    ) -> dict[str, np.ndarray]:
        """StepResult's log_probs / top_n arrays (n columns) for the sampled rows; device work
        only where a sampled row asks for it."""
        out = self._no_log_probs(len(plan.sample), n)
        wanted, counts = plan.logprobs[rows] != 0, plan.top_n[rows]
        if wanted.any() or counts.any():
            index = self._tensor(rows, torch.int64)
            picked, ids, values = log_probs_and_top_n(
                logits[index], tokens[index], self._tensor(counts), n
            )
            out["log_probs"][rows] = np.where(wanted, picked.cpu().numpy(), np.nan)
            out["top_n_ids"][rows] = ids.cpu().numpy()
            out["top_n_log_probs"][rows] = values.cpu().numpy()
        return out

    @staticmethod
    def _no_log_probs(batch: int, n: int) -> dict[str, np.ndarray]:
        return {
            "log_probs": np.full(batch, np.nan, dtype=np.float32),
            "top_n_ids": np.full((batch, n), -1, dtype=np.int32),
            "top_n_log_probs": np.full((batch, n), np.nan, dtype=np.float32),
        }

    def _prompt_log_probs(
        self, plan: StepPlan, hidden: torch.Tensor, n: int
    ) -> dict[str, np.ndarray]:
        """StepResult's prompt_* arrays: one row per input token with a prompt target."""
        tokens = np.flatnonzero(plan.prompt_targets >= 0)
        if len(tokens) == 0:
            return {
                "prompt_log_probs": np.zeros(0, dtype=np.float32),
                "prompt_top_n_ids": np.zeros((0, n), dtype=np.int32),
                "prompt_top_n_log_probs": np.zeros((0, n), dtype=np.float32),
            }
        seq = np.searchsorted(plan.query_start_loc, tokens, side="right") - 1
        by_vocab = PROMPT_LOGITS_MAX_ELEMENTS // self.config.vocab_size
        picked, ids, values = prompt_log_probs(
            hidden[self._tensor(tokens, torch.int64)],
            self._tensor(plan.prompt_targets[tokens], torch.int64),
            self._tensor(plan.top_n[seq]),
            n,
            self.model.compute_logits,
            chunk_rows=max(1, min(PROMPT_LOGITS_MAX_ROWS, by_vocab)),
        )
        return {
            "prompt_log_probs": picked.cpu().numpy(),
            "prompt_top_n_ids": ids.cpu().numpy().astype(np.int32),
            "prompt_top_n_log_probs": values.cpu().numpy(),
        }

    # ---- lifecycle controls --------------------------------------------------------------------

    @property
    def kv_valid(self) -> bool:
        """False while the KV contents are dropped (suspended in mode "recompute")."""
        return self.suspend_mode != Mode.RECOMPUTE

    def control(self, msg: GpuControl) -> GpuControlReply:
        """Apply one lifecycle command between steps. One that cannot apply (unknown command or
        mode, wrong state, weights that do not fit) comes back as `error`, nothing changed."""
        handlers = {
            GpuCommand.SUSPEND: self._suspend,
            GpuCommand.RESUME: self._resume,
            GpuCommand.UPDATE_WEIGHTS: self._update_weights,
            GpuCommand.STAGE_WEIGHTS: self._stage_weights,
            GpuCommand.COMMIT_WEIGHTS: self._commit_weights,
            GpuCommand.DISCARD_WEIGHTS: self._discard_weights,
        }
        try:
            if self.model is None:
                raise ControlError("no model is loaded")
            if msg.command not in handlers:
                raise ControlError(
                    f"unknown gpu control {msg.command!r} (expected {', '.join(handlers)})"
                )
            kv_valid = handlers[msg.command](msg)
        except (ControlError, ModelLoadError, WeightUpdateError) as e:
            return GpuControlReply(msg.command, str(e), self.kv_valid, self.weight_version)
        return GpuControlReply(msg.command, None, kv_valid, self.weight_version)

    def _suspend(self, msg: GpuControl) -> bool:
        if self.suspend_mode is not None:
            raise ControlError(
                f"cannot suspend: the gpu worker is already suspended (mode {self.suspend_mode})"
            )
        if msg.mode is None:
            raise ControlError(f"suspend needs a mode ({', '.join(Mode)})")
        if self.static_kv and msg.mode != Mode.PERSIST:
            raise ControlError(
                f"cannot suspend in mode {msg.mode}: static_kv_memory_pointers keeps the KV "
                "cache at its address, which only persist mode can do here"
            )
        on_device = self.device.type != "cpu"  # on a CPU device the KV already is host memory
        if msg.mode == Mode.OFFLOAD and on_device:
            self._kv_offloaded = self._copy_to_host()
            if self.mamba_state is not None:  # small next to the KV: no separate check
                self._mamba_offloaded = tuple(
                    torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
                    for t in self.mamba_state
                )
        if msg.mode == Mode.RECOMPUTE or (msg.mode == Mode.OFFLOAD and on_device):
            self.kv_cache = self.mamba_state = None
            if self.graphs is not None:
                self.graphs.release()  # they hold the old KV address and their own memory
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the memory back for others (e.g. training)
        self.suspend_mode = msg.mode
        self._prev_sampled = np.zeros(0, dtype=bool)  # no step after this one reads them
        return self.kv_valid

    def _copy_to_host(self) -> torch.Tensor:
        """The KV cache in pinned host memory (DMA copies), if the host has room for it."""
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        problem = offload_problem(kv_bytes, available_host_memory())
        if problem is not None:
            raise ControlError(problem)
        try:
            host = torch.empty(self._kv_shape, dtype=self.dtype, pin_memory=True)
        except RuntimeError as e:  # the pinned allocation itself failed
            raise ControlError(f"offload could not allocate pinned host memory: {e}") from None
        return host.copy_(self.kv_cache)

    def _resume(self, msg: GpuControl) -> bool:
        if self.suspend_mode is None:
            raise ControlError("cannot resume: the gpu worker is running (not suspended)")
        mode = self.suspend_mode
        if self.kv_cache is None:  # released by offload (on a device) or recompute
            kv = torch.empty(self._kv_shape, dtype=self.dtype, device=self.device)
            if mode == Mode.OFFLOAD:
                kv.copy_(self._kv_offloaded)
            self.kv_cache, self._kv_offloaded = kv, None
            if self._mamba_slots:
                # Recompute: every request restarts from position 0 (its state from zeros).
                state = self._new_mamba_state(self.config)
                if self._mamba_offloaded is not None:
                    for t, saved in zip(state, self._mamba_offloaded, strict=True):
                        t.copy_(saved)
                self.mamba_state, self._mamba_offloaded = state, None
        self.suspend_mode = None
        if self.graphs is not None and not self.graphs.captured:
            self._capture()  # the KV cache moved: capture against its new address
        return mode != Mode.RECOMPUTE

    def _update_weights(self, msg: GpuControl) -> bool:
        self._stage_weights(msg)
        return self._commit_weights(msg)

    def _stage_weights(self, msg: GpuControl) -> bool:
        """Check the new weights (every failure is here) and hold them; nothing changes."""
        if self.suspend_mode is None:
            raise ControlError("update_weights needs a suspended gpu worker; it is running")
        if (msg.path is None) == (msg.state is None):
            raise ControlError("update_weights needs exactly one of path and state")
        self._staged = None
        if msg.path is not None:
            self._staged = self._updates_from_path(msg.path)
        else:
            self._staged = state_updates(msg.state, self.model)
        return self.kv_valid

    def _commit_weights(self, msg: GpuControl) -> bool:
        if self._staged is None:
            raise ControlError("commit_weights: no weights are staged")
        updates, self._staged = self._staged, None
        params = self.model.state_dict()  # views of the live parameters: copy in place
        with torch.no_grad():
            for name, rows, values in updates:
                params[name][rows].copy_(_as_tensor(values))
        self.weight_version += 1
        return self.kv_valid

    def _discard_weights(self, msg: GpuControl) -> bool:
        self._staged = None
        return self.kv_valid

    def _updates_from_path(self, path: str) -> list[tuple[str, slice, torch.Tensor]]:
        """Every parameter of the checkpoint at `path`, loaded on the CPU and checked to have the
        loaded model's architecture and shapes (a MoE model: only the experts it holds)."""
        experts = getattr(self.model, "expert_range", None)
        model, config, _ = load_model(
            path, dtype=self.dtype, device="cpu", expert_range=experts, tp=self.tp
        )
        check_same_architecture(self.config, config, path)
        ours, new = self.model.state_dict(), model.state_dict()
        if set(ours) != set(new):
            raise WeightUpdateError(
                f"{path}: parameters differ (missing {sorted(set(ours) - set(new))[:5]}, "
                f"unexpected {sorted(set(new) - set(ours))[:5]})"
            )
        for name, tensor in new.items():
            if tensor.shape != ours[name].shape:
                raise WeightUpdateError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(ours[name].shape)}"
                )
        return [(name, slice(None), tensor) for name, tensor in new.items()]


def _as_tensor(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    values = np.ascontiguousarray(values)
    # Arrays decoded off the wire are read-only views; torch.from_numpy wants writable memory.
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _wants_log_probs(plan: StepPlan) -> bool:
    return bool(plan.top_n.any() or plan.logprobs.any() or (plan.prompt_targets >= 0).any())


def _plan_arrays(plan: StepPlan) -> dict[str, np.ndarray]:
    """The StepPlan's arrays by StepBuffers field name (empty prev_rows, mamba_*: all -1)."""
    arrays = {name: getattr(plan, name) for name in StepBuffers.FIELD_NAMES}
    if not len(plan.prev_rows):
        arrays["prev_rows"] = np.full(len(plan.input_ids), -1, dtype=np.int32)
    for name in ("mamba_init", "mamba_out"):  # empty: no Mamba layers
        if not len(arrays[name]):
            arrays[name] = np.full(len(plan.seq_lens), -1, dtype=np.int32)
    return arrays
