"""The gpu worker's lifecycle controls between steps: suspend, resume and weight updates
(messages.gpu.GpuControl -> GpuControlReply), as WorkerControls, a base of ModelWorker.

Suspend modes: "persist" keeps the KV tensor; "offload" copies a CUDA KV cache to pinned host
memory and frees the device tensor, after checking that the host has the memory (else it
refuses and changes nothing); on a CPU device the KV cache already is host memory, so "offload"
keeps it where it is (a copy would only double it); "recompute" frees it. Hybrid models' Mamba
state slots go along with the KV cache (kept, offloaded, or dropped: resume then zeroes them).
Resume allocates a fresh device tensor (offloaded contents, or uninitialized for "recompute"):
its address changes, so the CUDA graphs captured against the old one are dropped at such a
suspend and captured again at resume; "persist" keeps both.

Weight updates come from a checkpoint `path`, a `state` dict, `buckets` broadcast by a trainer
over the weight-transfer group this process joined (init_weight_transfer; ops/weight_transfer.py:
the group is rank_offset + this process's tensor-parallel rank, the engine having added its own
base), or `ipc` handles of a trainer's CUDA tensors on this host (CUDA only). A staged update
holds everything (for buckets: the received buffers, a second copy of the weights; for ipc: the
trainer's tensors opened in place, views of its memory) and copies it in at commit; an unstaged
bucket update copies each bucket in as it arrives, so one that fails part way leaves
`weights_incomplete` set: steps are refused until a complete update lands. The engine sends
updates only while paused or suspended.

Owns: suspend_mode, weight_version, the offloaded contents, the staged weights, the weight
transfer group. Must not touch how a step runs (worker.py) or how big the pools are (sizing.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from taipan.actors.gpu.draft import DraftModel
from taipan.actors.gpu.graphs import StepGraphs
from taipan.actors.gpu.sizing import available_host_memory, offload_problem
from taipan.messages.gpu import GpuCommand, GpuControl, GpuControlReply
from taipan.messages.lifecycle import KVCacheManagementMode as Mode
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.weight_transfer import (
    DTYPES,
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    open_ipc_tensor,
)
from taipan.ops.weight_updates import (
    WeightUpdateError,
    check_same_architecture,
    direct_view,
    state_updates,
)


class ControlError(Exception):
    """A GpuControl that cannot apply in the worker's current state; nothing was changed."""


class WorkerControls:
    """The controls' half of ModelWorker, run in the worker's thread between steps. They
    replace `kv_cache` and `mamba_state` (None while released), release `graphs`, and read the
    rest of what the load set (annotated below); WorkerForward (ModelWorker's other base)
    provides `_capture`. A load resets the state they own (a fresh model runs)."""

    # Set by ModelWorker.load.
    model: torch.nn.Module | None
    config: object
    device: torch.device
    dtype: torch.dtype
    tp: TPGroup
    kv_cache: torch.Tensor | None
    mamba_state: tuple[torch.Tensor, torch.Tensor] | None
    graphs: StepGraphs | None
    draft: DraftModel | None  # its graphs go with the target's (actors/gpu/draft_graphs.py)
    static_kv: bool
    _kv_shape: tuple[int, ...]
    _mamba_slots: int
    _prev_sampled: np.ndarray

    def __init__(self):
        self.weight_version = 0  # successful update_weights since load
        self.suspend_mode: Mode | None = None  # None: running
        self._kv_offloaded: torch.Tensor | None = None  # the KV contents while offloaded
        # The Mamba slots' contents while offloaded (the state itself is then None).
        self._mamba_offloaded: tuple[torch.Tensor, torch.Tensor] | None = None
        self._staged: list | None = None  # weights checked by STAGE_WEIGHTS, not yet copied in
        self._staged_version: int | None = None  # the version they carry (None: last + 1)
        self._staged_draft = False  # the staged weights are the draft model's
        self._draft_touched = False  # the control being answered moved the draft's weights
        self.transfer: WeightGroup | None = None  # the trainer's weight-transfer group, joined
        self.weights_incomplete = False  # an unstaged transfer failed part way
        # Wall-clock marks of the last transfer (logged with the control: where the time went,
        # next to the trainer's `push_weights(timings=)`): received, first_posted, posted, synced.
        self.transfer_marks: dict[str, float] = {}
        # The live parameters by name, and the last bucket layout found to fit them: a trainer
        # sends the same layout every update, so later updates skip both (each takes ms).
        self._params: tuple[object, dict] | None = None  # (the model they are of, its params)
        self._fitting_buckets: tuple | None = None
        self._side_stream = None  # CUDA: the stream received buckets are copied in on

    def _capture(self) -> None:
        raise NotImplementedError  # ModelWorker's: capture every CUDA graph

    def _new_mamba_state(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # ModelWorker's: zeroed state for every Mamba slot

    def step_refusal(self) -> str | None:
        """Why no step may run now (suspended, or weights left mixed by a failed transfer)."""
        if self.suspend_mode is not None:
            return "the gpu worker is suspended"
        if self.weights_incomplete:
            return "the weights are incomplete: a weight transfer failed part way"
        return None

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
            GpuCommand.INIT_WEIGHT_TRANSFER: self._init_transfer,
            GpuCommand.CLOSE_WEIGHT_TRANSFER: self._close_transfer,
        }
        self._draft_touched = False
        try:
            if self.model is None:
                raise ControlError("no model is loaded")
            if msg.command not in handlers:
                raise ControlError(
                    f"unknown gpu control {msg.command!r} (expected {', '.join(handlers)})"
                )
            kv_valid = handlers[msg.command](msg)
        except (ControlError, ModelLoadError, WeightUpdateError, WeightTransferError) as e:
            return self._reply(msg, str(e), self.kv_valid)
        return self._reply(msg, None, kv_valid)

    def _reply(self, msg: GpuControl, error: str | None, kv_valid: bool) -> GpuControlReply:
        return GpuControlReply(
            msg.command,
            error,
            kv_valid,
            self.weight_version,
            self.weights_incomplete,
            draft=self._draft_touched and error is None,
        )

    # ---- suspend and resume --------------------------------------------------------------------

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
            if self.draft is not None and self.draft.graphs is not None:
                self.draft.graphs.release()  # (captured again with the target's at resume)
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

    # ---- weight updates ------------------------------------------------------------------------

    def _update_weights(self, msg: GpuControl) -> bool:
        if msg.buckets is not None and not msg.draft:  # (a draft's are staged: all or none)
            self._check_source(msg)
            return self._receive_in_place(msg)
        self._stage_weights(msg)
        return self._commit_weights(msg)

    def _stage_weights(self, msg: GpuControl) -> bool:
        """Check the new weights (every failure is here) and hold them; nothing changes."""
        self._check_source(msg)
        self._staged = None
        model, config, tp = (
            self._draft_to_update() if msg.draft else (self.model, self.config, self.tp)
        )
        if msg.path is not None:
            staged = self._updates_from_path(msg.path, model, config, tp)
        elif msg.state is not None:
            staged = state_updates(msg.state, model)
        elif msg.ipc is not None:
            staged = self._ipc_updates(msg.ipc, model)
        else:
            staged = []  # this process's shards, copied out of the whole received buckets
            self._receive_buckets(
                msg, lambda ups: staged.extend((n, r, v.clone()) for n, r, v in ups), model=model
            )
        self._staged, self._staged_version = staged, msg.weight_version
        self._staged_draft = self._draft_touched = msg.draft
        return self.kv_valid

    def _draft_to_update(self) -> tuple[torch.nn.Module, object, TPGroup]:
        """(model, config, tensor-parallel group) of the draft whose weights an update with
        `draft` replaces: whole on every tensor-parallel process."""
        if self.draft is None or not self.draft.own_weights:
            raise ControlError(
                "update_weights(draft=True): no draft model with weights of its own is loaded "
                "(a 'self:N' draft follows the target's weights)"
            )
        return self.draft.model, self.draft.config, SINGLE

    def _check_source(self, msg: GpuControl) -> None:
        sources = [msg.path, msg.state, msg.buckets, msg.ipc]
        if sum(source is not None for source in sources) != 1:
            raise ControlError("update_weights needs exactly one of path, state, buckets and ipc")
        if msg.ipc is not None and self.device.type != "cuda":
            raise ControlError(
                f"update_weights_from_ipc needs taipan on a CUDA device; its weights are on "
                f"{self.device} (CUDA IPC shares GPU memory: use update_weights_from_distributed "
                "or update_weights(state=...) instead)"
            )
        if msg.buckets is not None and self.transfer is None:
            raise ControlError(
                "update_weights_from_distributed: no weight-transfer group "
                "(call init_weight_transfer first)"
            )

    def _receive_buckets(self, msg: GpuControl, apply, into=None, model=None) -> None:
        """Receive every bucket of `msg` from the trainer and `apply` each one's updates (this
        process's shards of `model`: the target's when None, or its draft). Names and shapes
        are checked before the first bucket arrives; when they or an update fail, the rest is
        still received and dropped, so the trainer's broadcasts complete; then the error is
        raised."""
        marks = self.transfer_marks = {"received": time.time()}
        model = self.model if model is None else model
        transfer, params = self.transfer, self._live_params(model)
        problem = self._bucket_problem(msg.buckets, params, model)
        side = self._copy_stream()
        for specs in msg.buckets:
            specs = [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in specs]
            tensors = transfer.receive(specs, into=into if problem is None else None)
            if problem is None:
                try:
                    if side is None:
                        apply(state_updates(tensors, model, params))
                    else:
                        self._apply_beside(side, tensors, apply, params, model)
                except WeightUpdateError as e:
                    problem = str(e)
            marks.setdefault("first_posted", time.time())
        marks["posted"] = time.time()
        if self.device.type == "cuda":
            # The copies are queued behind each broadcast: the weights are in place only once
            # the device has run them (the ack, and the trainer's timing, mean "done").
            torch.cuda.synchronize(self.device)
        marks["synced"] = time.time()
        if problem is not None:
            raise WeightUpdateError(problem)

    def _copy_stream(self):
        """On CUDA, the stream a received bucket is copied into the parameters on, so that the
        next bucket's broadcast (which waits for the current stream) runs during the copies;
        None elsewhere."""
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _apply_beside(self, side, tensors: dict, apply, params: dict, model) -> None:
        """`apply` a received bucket's updates (of `model`) on `side`, after the broadcast that
        filled them (an event on the current stream, which waits for it); its buffers stay out
        of the allocator's reach until `side` has read them (record_stream)."""
        updates = state_updates(tensors, model, params)  # (checks and views: no copies)
        done = torch.cuda.Event()
        done.record()
        side.wait_event(done)
        with torch.cuda.stream(side):
            apply(updates)
        for t in tensors.values():
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(side)

    def _live_params(self, model=None) -> dict:
        """The state dict (views of the live parameters) of `model` (the target's when None;
        the draft's is small: made anew), the target's kept while the model is."""
        if model is not None and model is not self.model:
            return model.state_dict()
        if self._params is None or self._params[0] is not self.model:
            self._params, self._fitting_buckets = (self.model, self.model.state_dict()), None
        return self._params[1]

    def _bucket_problem(self, buckets, params: dict, model) -> str | None:
        """What is wrong with the buckets' names and shapes for `model` (on meta tensors:
        nothing is allocated), or None; a layout that fitted the same model before is not
        checked again."""
        key = (id(model), *((s.name, s.dtype, tuple(s.shape)) for specs in buckets for s in specs))
        if key == self._fitting_buckets:
            return None
        meta = {
            s.name: torch.empty(tuple(s.shape), dtype=DTYPES[s.dtype], device="meta")
            for specs in buckets
            for s in specs
        }
        try:
            state_updates(meta, model, params)
        except WeightUpdateError as e:
            return str(e)
        self._fitting_buckets = key
        return None

    def _ipc_updates(self, records, model=None) -> list:
        """The trainer's tensors opened by their CUDA IPC handles (views of its memory, no copy)
        and mapped onto this process's parameters of `model` (the target's when None, or its
        draft: its shard, its experts). Names, dtypes and shapes are checked before any handle
        is opened; nothing is copied here."""
        model = self.model if model is None else model
        params = self._live_params(model)
        for r in records:
            if r.dtype not in DTYPES:
                raise WeightUpdateError(
                    f"update_weights_from_ipc: {r.name}: dtype {r.dtype!r} cannot travel"
                )
        problem = self._bucket_problem([records], params, model)
        if problem is not None:
            raise WeightUpdateError(f"update_weights_from_ipc: {problem}")
        tensors = {r.name: open_ipc_tensor(r) for r in records}
        return state_updates(tensors, model, params)

    def _receive_in_place(self, msg: GpuControl) -> bool:
        """Every bucket into the live parameters as it arrives (no second copy of the weights):
        a large tensor whose rows here are a contiguous view lands there straight from the
        broadcast, the rest is copied in. A failure after the first write leaves the weights
        mixed: say so."""
        params = self._live_params()
        copied = False

        def apply(updates):
            nonlocal copied
            copied = True
            self._copy_in(params, updates)

        def into(spec: TensorSpec):
            nonlocal copied
            view = direct_view(spec, params, self.model.config, self.tp)
            copied = copied or view is not None
            return view

        try:
            self._receive_buckets(msg, apply, into)
        except (WeightTransferError, WeightUpdateError) as e:
            if not copied:
                raise
            self.weights_incomplete = True
            raise type(e)(
                f"{e} (the weights are incomplete: steps and unpause are refused until a "
                "complete update lands)"
            ) from None
        self._set_version(msg.weight_version)
        return self.kv_valid

    def _copy_in(self, params: dict, updates: list) -> None:
        with torch.no_grad():
            for name, rows, values in updates:
                params[name][rows].copy_(_as_tensor(values))

    def _set_version(self, version: int | None) -> None:
        self.weight_version = self.weight_version + 1 if version is None else version
        self.weights_incomplete = False

    def _commit_weights(self, msg: GpuControl) -> bool:
        if self._staged is None:
            raise ControlError("commit_weights: no weights are staged")
        updates, self._staged = self._staged, None
        draft = self._draft_touched = self._staged_draft
        model = self.draft.model if draft else self.model
        try:
            self._copy_in(model.state_dict(), updates)  # views of the live parameters
        except RuntimeError as e:  # (a device error part way: some weights are new)
            if draft:  # (only acceptance can suffer: verification stays exact)
                text = f"the draft's commit_weights failed part way: {e}"
                raise WeightTransferError(text) from None
            self.weights_incomplete = True
            raise WeightTransferError(
                f"commit_weights failed part way: {e} (the weights are incomplete: steps and "
                "unpause are refused until a complete update lands)"
            ) from None
        if self.device.type == "cuda":
            # The copies are queued: done before the ack (a trainer's IPC tensors, read by
            # them on its GPU, are its own again once it has the ack).
            sources = {v.device for _, _, v in updates if isinstance(v, torch.Tensor) and v.is_cuda}
            for device in sources | {self.device}:
                torch.cuda.synchronize(device)
        if not draft:  # (the draft's weights leave the target's version as it is)
            self._set_version(self._staged_version)
        return self.kv_valid  # (`updates` go: the IPC views close)

    def _discard_weights(self, msg: GpuControl) -> bool:
        self._staged = None
        return self.kv_valid

    # ---- the weight-transfer group -------------------------------------------------------------

    def _init_transfer(self, msg: GpuControl) -> bool:
        """Join the trainer's group as rank_offset + this tensor-parallel rank (blocks until
        every member has joined, or the group's timeout)."""
        spec = msg.transfer
        if spec is None:
            raise ControlError("init_weight_transfer needs its group")
        if self.transfer is not None:
            raise ControlError("init_weight_transfer: already in a group (close it first)")
        backend = spec.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        rank = spec.rank_offset + self.tp.rank
        self.transfer = WeightGroup(
            spec.master_address, spec.master_port, spec.world_size, rank, backend, self.device
        )
        return self.kv_valid

    def _close_transfer(self, msg: GpuControl) -> bool:
        if self.transfer is None:
            raise ControlError("close_weight_transfer: not in a weight-transfer group")
        group, self.transfer = self.transfer, None
        group.close()
        return self.kv_valid

    def _updates_from_path(
        self, path: str, target: torch.nn.Module, target_config, tp: TPGroup
    ) -> list[tuple[str, slice, torch.Tensor]]:
        """Every parameter of the checkpoint at `path`, loaded on the CPU (this process's shards
        under `tp`) and checked to have the architecture and shapes of `target` (the loaded
        model or its draft; a MoE model: only the experts it holds)."""
        experts = getattr(target, "expert_range", None)
        mtp = bool(getattr(target_config, "num_mtp_layers", 0))  # (its head comes with it)
        model, config, _ = load_model(
            path, dtype=self.dtype, device="cpu", expert_range=experts, tp=tp, mtp=mtp
        )
        check_same_architecture(target_config, config, path)
        ours, new = target.state_dict(), model.state_dict()
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
