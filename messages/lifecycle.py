"""Lifecycle family (tags 40-59): control messages the coordinator drives, and their vocabulary.

Flow: a client sends a control message to the coordinator; the coordinator checks its `token`
(the runtime's control token: only clients that present it may change the lifecycle), checks the
command against its FSM (actors/coordinator/fsm.py, over `TRANSITIONS` below), forwards it to
every engine (with `token` emptied: the engine sockets are private to the runtime; each engine
checks it against the same table), and answers the client with one
`ControlAck` once every engine has acknowledged (or an `ErrorReply`: "not_authorized",
"illegal_transition" naming the current state, "busy", "bad_request" or "control_failed").
Engines answer the coordinator with `ControlAck` (or `ErrorReply`).

States: RUNNING -PAUSE-> PAUSED -SUSPEND-> SUSPENDED -RESUME-> PAUSED -UNPAUSE-> RUNNING;
STOP from PAUSED or SUSPENDED; UPDATE_WEIGHTS (from a path, a state dict, a trainer's
weight-transfer group or its CUDA IPC handles) and FLUSH_CACHE only while PAUSED or SUSPENDED
(an update sent `in_flight` while RUNNING too: `next_state_for`);
INIT_ / CLOSE_WEIGHT_TRANSFER
in any state but STOPPED (they change none).
- PAUSED: no steps run; new submissions queue. How a pause treats the requests in flight is
  its `PauseMode` (keep, abort, wait); `clear_cache` then drops the cached prefix (FlushCache).
- SUSPENDED: the big tensors are released as `mode` says (None: the config's
  `kv_cache_management_mode`, itself defaulting to "persist"): "persist" keeps them, "offload"
  copies the KV cache to host memory and frees the device copy (on a CPU device the KV already
  is host memory and stays where it is), "recompute" drops it (running requests re-prefill on
  resume).
"""

from __future__ import annotations

import enum

import numpy as np

from taipan.messages.codec import Array, message, struct


class LifecycleState(enum.StrEnum):
    """The runtime's lifecycle state (the coordinator's FSM; each engine keeps its own copy)."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"


class ControlCommand(enum.StrEnum):
    """A lifecycle command: the `ControlAck.command` of each control message below."""

    PAUSE = "pause"
    UNPAUSE = "unpause"
    SUSPEND = "suspend"
    RESUME = "resume"
    UPDATE_WEIGHTS = "update_weights"
    INIT_WEIGHT_TRANSFER = "init_weight_transfer"
    CLOSE_WEIGHT_TRANSFER = "close_weight_transfer"
    FLUSH_CACHE = "flush_cache"
    STOP = "stop"


# (state, command) -> the state after it; every pair not listed is illegal. The one table the
# coordinator's FSM (actors/coordinator/fsm.py) and every engine (actors/engine/actor.py) decide
# legality from.
TRANSITIONS: dict[tuple[LifecycleState, ControlCommand], LifecycleState] = {
    (LifecycleState.RUNNING, ControlCommand.PAUSE): LifecycleState.PAUSED,
    (LifecycleState.PAUSED, ControlCommand.UNPAUSE): LifecycleState.RUNNING,
    (LifecycleState.PAUSED, ControlCommand.SUSPEND): LifecycleState.SUSPENDED,
    (LifecycleState.PAUSED, ControlCommand.STOP): LifecycleState.STOPPED,
    (LifecycleState.SUSPENDED, ControlCommand.RESUME): LifecycleState.PAUSED,
    (LifecycleState.SUSPENDED, ControlCommand.UPDATE_WEIGHTS): LifecycleState.SUSPENDED,
    (LifecycleState.PAUSED, ControlCommand.UPDATE_WEIGHTS): LifecycleState.PAUSED,
    (LifecycleState.SUSPENDED, ControlCommand.STOP): LifecycleState.STOPPED,
    # Dropping the cached prefix needs every step stopped (running requests hold blocks).
    (LifecycleState.PAUSED, ControlCommand.FLUSH_CACHE): LifecycleState.PAUSED,
    (LifecycleState.SUSPENDED, ControlCommand.FLUSH_CACHE): LifecycleState.SUSPENDED,
    # Joining or leaving a trainer's weight-transfer group changes no state (any but STOPPED).
    **{
        (state, command): state
        for state in (LifecycleState.RUNNING, LifecycleState.PAUSED, LifecycleState.SUSPENDED)
        for command in (ControlCommand.INIT_WEIGHT_TRANSFER, ControlCommand.CLOSE_WEIGHT_TRANSFER)
    },
}


def next_state(state: LifecycleState, command: ControlCommand) -> LifecycleState | None:
    """The state `command` leads to from `state`, or None where it is illegal."""
    return TRANSITIONS.get((state, command))


def next_state_for(
    state: LifecycleState, command: ControlCommand, in_flight: bool = False
) -> LifecycleState | None:
    """`next_state`, where a weight update sent `in_flight` is legal while RUNNING too and
    leaves it RUNNING: it runs between two steps, and the requests in flight go on with the new
    weights (each token carries the version that produced it). The table's rule everywhere
    else: the coordinator and every engine decide by this."""
    if in_flight and command is ControlCommand.UPDATE_WEIGHTS and state is LifecycleState.RUNNING:
        return LifecycleState.RUNNING
    return next_state(state, command)


def legal_commands(state: LifecycleState) -> list[ControlCommand]:
    """The commands `state` allows, in declaration order."""
    return [c for c in ControlCommand if (state, c) in TRANSITIONS]


class KVCacheManagementMode(enum.StrEnum):
    """What SUSPEND does with the KV cache (the seed's name; InferenceConfig uses it too)."""

    PERSIST = "persist"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


# A weight travels as float16/32/64 (bfloat16 cannot be a numpy array), any shape.
WeightArray = Array[(np.float16, np.float32, np.float64), None]


@message(40)
class Stop:
    """Shut down: abort every request (each gets its terminal output), then exit."""

    token: str
    reason: str


@message(41)
class StopAck:
    name: str


class PauseMode(enum.StrEnum):
    """What PAUSE does with the requests in flight: KEEP them (with their KV) for UNPAUSE, ABORT
    them (each ends with finish_reason "abort" and the tokens it had; a trainer resubmits them
    as partial rollouts), or WAIT for them: admit no new request (submissions queue) and pause
    once every request that has started (running, or preempted after it started) has finished;
    requests still queued that never started stay queued for UNPAUSE (vLLM's "wait" too drains
    only the requests in flight)."""

    KEEP = "keep"
    ABORT = "abort"
    WAIT = "wait"


@message(42, required=1)  # (mode, clear_cache and timeout came later)
class Pause:
    """Finish the step in flight (mode wait: every request that has started), then run no more
    steps until Unpause; `mode` says what becomes of the requests in flight. `clear_cache`: once
    paused, drop the cached prefix as FlushCache does. `timeout`: seconds the coordinator waits
    for every rank to pause (None: its control timeout); past it, or when a rank fails or dies,
    every rank that paused is unpaused again and the pause fails naming the ranks (an Unpause
    to a rank still waiting withdraws its pause)."""

    token: str
    mode: PauseMode = PauseMode.KEEP
    clear_cache: bool = False
    timeout: float | None = None


@message(43)
class Unpause:
    token: str


@message(44)
class Suspend:
    """Release the big tensors as `mode` says (None: the config's kv_cache_management_mode)."""

    token: str
    mode: KVCacheManagementMode | None


@message(45)
class Resume:
    """Re-allocate (or copy back) what Suspend released; the runtime is PAUSED afterwards."""

    token: str


@message(46, required=3)  # (weight_version came later)
class UpdateWeights:
    """Load new weights while PAUSED or SUSPENDED: from `path` (a GGUF file or a Hugging Face
    directory with the same architecture) or from `state` (parameter name -> array, HF names as
    in the checkpoint, e.g. "model.layers.0.mlp.down_proj.weight"; a subset is allowed). Exactly
    one of the two is set. The weight version becomes `weight_version` (the trainer's; it is
    the prefix-hash salt), or the last one + 1 when None. `hold` (all three update messages; set
    by the coordinator, whatever the client sent): stage the weights, acknowledge, and swap them
    in only on the coordinator's `WeightsDecision` (all or none over the data-parallel ranks).
    `in_flight` (all three update messages): legal while RUNNING too (`next_state_for`): no
    pause and unpause around it, the update runs between two steps of the requests in flight.
    `draft`: the weights are the draft model's (speculative_method "draft_model" with a model
    of its own, not "self:N"), checked against its architecture; the target's weights and
    weight version stay, and a rank whose speculation draft_weight_policy "disable" ended
    speculates again."""

    token: str
    path: str | None
    state: dict[str, WeightArray] | None
    weight_version: int | None = None
    hold: bool = False
    in_flight: bool = False
    draft: bool = False


# The dtypes a weight may have in a transfer from a trainer (WeightSpec, IpcTensor).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32", "float64")


@struct
class WeightSpec:
    """One tensor of a weight-transfer bucket: its Hugging Face name, dtype ("bfloat16",
    "float16", "float32" or "float64") and shape (ops/weight_transfer.py TensorSpec)."""

    name: str
    dtype: str
    shape: list[int]


@struct
class WeightTransferGroup:
    """A trainer's weight-transfer group: a TCPStore at `master_address:master_port` hosted by
    the trainer, `world_size` processes in all, the trainer's senders ranks 0 .. rank_offset-1
    and taipan's gpu processes rank_offset + engine rank * tp_size + tp rank. `backend` "nccl",
    "gloo" or "" (nccl on CUDA, else gloo)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: str


@message(48)
class InitWeightTransfer:
    """Every gpu process of every rank joins the trainer's weight-transfer `group` (made once,
    reused for every update; the trainer joins at the same time)."""

    token: str
    group: WeightTransferGroup


@message(49)
class CloseWeightTransfer:
    """Leave the weight-transfer group (each process closes its side)."""

    token: str


@message(50, required=4)  # (hold came later)
class UpdateWeightsFromDistributed:
    """New weights broadcast by the trainer (group rank 0) over the weight-transfer group, one
    flat buffer per bucket in `buckets` order (ops/weight_transfer.py BucketLayout). Each
    process copies its shard in place (CUDA graphs stay valid). `stage`: receive everything into
    a second buffer first and copy in only once every process has all of it. Legal while PAUSED
    or SUSPENDED; `weight_version` and `hold` (with `stage` only) as UpdateWeights. `draft`:
    the buckets are the draft model's weights (as UpdateWeights.draft; whole on every
    process, always received into a second buffer first: all or none)."""

    token: str
    buckets: list[list[WeightSpec]]
    weight_version: int | None
    stage: bool
    hold: bool = False
    in_flight: bool = False
    draft: bool = False


@message(51)
class FlushCache:
    """While PAUSED or SUSPENDED: drop every cached prefix block (KV) and Mamba snapshot that no
    request holds; blocks a paused request holds stay its own, no longer shared (SGLang's
    flush_cache; vLLM's reset_prefix_cache)."""

    token: str


@struct
class IpcTensor:
    """One CUDA tensor a trainer shares with taipan by CUDA IPC, as torch.multiprocessing shares
    one (`torch.multiprocessing.reductions.reduce_tensor`: its fields but the two classes, plus
    the tensor's Hugging Face `name`; ops/weight_transfer.py `ipc_handles` makes them). Only
    data: the receiver rebuilds the tensor from them (`open_ipc_tensor`), nothing is unpickled.

    `dtype` as WeightSpec's; `shape`, `stride` and `storage_offset` (elements) place the tensor
    in its storage; `device` is the trainer's device index and `device_uuid` the GPU's UUID
    ("" if unknown), by which a receiver that numbers its GPUs differently finds it; `handle`
    (the cudaIpcMemHandle of the allocation holding the storage; None for an empty one),
    `storage_size_bytes` and `storage_offset_bytes` locate the storage in that allocation;
    `ref_counter_handle` / `ref_counter_offset` name the producer's shared counter of users,
    `event_handle` / `event_sync_required` the event the receiver waits on before reading."""

    name: str
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    device: int
    device_uuid: str
    handle: bytes | None
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@message(52, required=4)  # (hold came later)
class UpdateWeightsFromIpc:
    """New weights from a trainer process on the same host, by CUDA IPC handles (`tensors`, one
    per Hugging Face tensor; no copy through the host): every gpu process opens each one on the
    GPU it lives on, maps it onto its parameters (fused rows, its tensor-parallel shard, its
    experts) and copies it in place, all or none over the rank's processes and an
    expert-parallel group (every process opens and checks everything before any copies). The
    trainer keeps the tensors alive, unchanged, until the ack. `stage`: staged on every process
    and committed as a second control (the trainer's tensors are the second buffer). Legal
    while PAUSED or SUSPENDED; `weight_version` and `hold` (with `stage` only) as
    UpdateWeights. `draft`: the tensors are the draft model's (as UpdateWeights.draft). A
    runtime on the CPU refuses it."""

    token: str
    tensors: list[IpcTensor]
    weight_version: int | None
    stage: bool
    hold: bool = False
    in_flight: bool = False
    draft: bool = False


@message(53)
class WeightsDecision:
    """Coordinator -> engine only, after a weight update sent with `hold` that the engine
    acknowledged as staged: `commit` swaps the staged weights in (the ack carries the new
    weight version), else they are dropped and the old ones stay. The coordinator commits only
    when every data-parallel rank staged the update, so no rank serves weights the others
    refused. Answered with a ControlAck (command update_weights) or an ErrorReply."""

    token: str
    commit: bool


@message(47)
class ControlAck:
    """`state`: the lifecycle state after `command`; `weight_version`: the weights now loaded
    (0 = as started)."""

    command: ControlCommand
    state: LifecycleState
    weight_version: int


# Each control message and the command it carries.
CONTROL_MESSAGES: dict[type, ControlCommand] = {
    Pause: ControlCommand.PAUSE,
    Unpause: ControlCommand.UNPAUSE,
    Suspend: ControlCommand.SUSPEND,
    Resume: ControlCommand.RESUME,
    UpdateWeights: ControlCommand.UPDATE_WEIGHTS,
    UpdateWeightsFromDistributed: ControlCommand.UPDATE_WEIGHTS,
    UpdateWeightsFromIpc: ControlCommand.UPDATE_WEIGHTS,
    InitWeightTransfer: ControlCommand.INIT_WEIGHT_TRANSFER,
    CloseWeightTransfer: ControlCommand.CLOSE_WEIGHT_TRANSFER,
    FlushCache: ControlCommand.FLUSH_CACHE,
    Stop: ControlCommand.STOP,
}
