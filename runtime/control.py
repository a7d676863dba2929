"""The client's lifecycle controls: AsyncClientControls and ClientControls, the bases of
AsyncClient and Client (runtime/client.py) that hold their control methods.

Owns: building each control message from the caller's arguments (the argument checks, with a
ValueError the caller can act on; the weight specs and IPC records of a trainer's update, checked
before they are sent), sending it with the runtime's control token (runtime/auth.py) and taking
the weight version of the ack as the prefix-hash salt. The controls: pause, flush_cache,
unpause, suspend, resume, update_weights, stop, and the weight transfer from a trainer's
processes (init_weight_transfer, update_weights_from_distributed, close_weight_transfer, and
update_weights_from_ipc for a trainer on the same host, whose trainer side is taipan.rl); see
messages/lifecycle.py. Must not touch: the connection, requests or stats (runtime/client.py's),
or the control wire itself (actors/client/actor.py sends it and raises ControlError). No torch
is imported.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np

from taipan.actors.client.actor import ClientActor
from taipan.auth import find_token
from taipan.messages.codec import INLINE_ARRAY_BYTES, MAX_FRAMES, MessageError, decode, encode
from taipan.messages.lifecycle import (
    CloseWeightTransfer,
    ControlAck,
    FlushCache,
    InitWeightTransfer,
    IpcTensor,
    KVCacheManagementMode,
    Pause,
    PauseMode,
    Resume,
    Stop,
    Suspend,
    Unpause,
    UpdateWeights,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromIpc,
    WeightSpec,
    WeightTransferGroup,
)
from taipan.messages.requests import ModelInfo


def _no_version_for_a_draft(command: str, draft: bool, weight_version: int | None) -> None:
    if draft and weight_version is not None:
        raise ValueError(f"{command}(draft=True) takes no weight_version (the target's)")


def _weight_spec(spec) -> WeightSpec:
    """A bucket entry (a TensorSpec or a (name, dtype, shape) triple) as it travels."""
    name, dtype, shape = (spec.name, spec.dtype, spec.shape) if hasattr(spec, "name") else spec
    return WeightSpec(str(name), str(dtype).removeprefix("torch."), [int(n) for n in shape])


def _ipc_message(token: str, tensors, weight_version, stage) -> UpdateWeightsFromIpc:
    """UpdateWeightsFromIpc of `tensors` (IpcTensor records, or mappings of their fields), its
    field types checked by the wire's own decoder before it is sent (ValueError naming the
    field): a malformed record is the caller's error, not the runtime's."""
    records = []
    for i, t in enumerate(tensors):
        if isinstance(t, Mapping):
            try:
                t = IpcTensor(**t)
            except TypeError as e:  # a missing or unknown field
                raise ValueError(f"IPC record {i}: {e}") from None
        elif not isinstance(t, IpcTensor):
            raise ValueError(
                f"IPC record {i} is a {type(t).__name__}, not an IpcTensor (taipan.rl.ipc_handles "
                "makes them) or a mapping of its fields"
            )
        records.append(t)
    msg = UpdateWeightsFromIpc(token, records, weight_version, bool(stage))
    try:
        return decode(encode(msg))
    except (MessageError, TypeError) as e:
        raise ValueError(f"update_weights_from_ipc: {e}") from None


def _check_state_fits(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays for UpdateWeights.state; refuse, before sending, what the wire cannot carry."""
    arrays = {str(k): np.asarray(v) for k, v in state.items()}
    big = sum(1 for a in arrays.values() if a.nbytes > INLINE_ARRAY_BYTES)
    if big + 1 > MAX_FRAMES:
        raise ValueError(
            f"update_weights(state=...) has {big} arrays over {INLINE_ARRAY_BYTES} bytes but one "
            f"message carries at most {MAX_FRAMES - 1}; pass a checkpoint path instead"
        )
    return arrays


class AsyncClientControls:
    """The lifecycle controls of AsyncClient, its base: every method sends one control through
    the connected client actor. AsyncClient sets what they read (annotated below)."""

    # Set by AsyncClient.__init__ and connect.
    address: str
    info: ModelInfo | None
    _control_token: str | None
    _actor: ClientActor | None
    _salt: int

    # --- lifecycle ----------------------------------------------------------------------------
    # Each returns the runtime's ControlAck (`state` after it, `weight_version`) once every engine
    # has acknowledged, and raises ControlError when the runtime refuses (e.g. code
    # "illegal_transition": resume while RUNNING) or an engine fails it (the state stays).

    @property
    def control_token(self) -> str:
        """The token controls carry: the one given, else the one the runtime at this address
        wrote for this user (looked up at each control: the runtime may start after the client
        is made, or restart), else "" (the runtime then refuses with "not_authorized")."""
        return self._control_token or find_token(self.address) or ""

    async def _control(self, msg, on_sent=None) -> ControlAck:
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        ack = await self._actor.control(msg, on_sent)
        self._salt = ack.weight_version
        return ack

    async def pause(
        self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None
    ) -> ControlAck:
        """RUNNING -> PAUSED: the step in flight finishes, no more run; new submissions queue.
        `mode` "keep": requests keep their KV for unpause; "abort": every request in flight
        ends with finish_reason "abort" and the tokens it had (resubmit it as a partial
        rollout); "wait": no new request starts, and the pause completes once every request
        that started has finished (normally); requests that never started stay queued for
        the unpause. `clear_cache`: once paused, drop the cached prefix (as flush_cache).
        Every rank pauses or none: past `timeout` seconds (None: the runtime's control
        timeout), or when a rank fails, every rank runs again and ControlError names the rank."""
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PauseMode)}") from None
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ValueError(f"pause timeout {timeout!r} must be a positive number of seconds")
        msg = Pause(self.control_token, mode, bool(clear_cache), timeout)
        return await self._control(msg)

    async def flush_cache(self) -> ControlAck:
        """While PAUSED or SUSPENDED: drop every cached prefix block (KV) and Mamba snapshot
        no request holds, on every rank (SGLang's flush_cache; vLLM calls it
        reset_prefix_cache). Refused while RUNNING: pause first, or pause(clear_cache=True)."""
        return await self._control(FlushCache(self.control_token))

    async def unpause(self) -> ControlAck:
        """PAUSED -> RUNNING."""
        return await self._control(Unpause(self.control_token))

    async def suspend(self, mode: str | None = None) -> ControlAck:
        """PAUSED -> SUSPENDED: release the big tensors as `mode` says ("persist", "offload",
        "recompute"; None: the runtime's kv_cache_management_mode)."""
        if mode is not None:
            try:
                mode = KVCacheManagementMode(mode)
            except ValueError:
                choices = ", ".join(KVCacheManagementMode)
                raise ValueError(f"suspend mode {mode!r} is not one of {choices}") from None
        return await self._control(Suspend(self.control_token, mode))

    async def resume(self) -> ControlAck:
        """SUSPENDED -> PAUSED: bring back what suspend released."""
        return await self._control(Resume(self.control_token))

    async def update_weights(
        self,
        path: str | os.PathLike | None = None,
        state: Mapping | None = None,
        *,
        weight_version: int | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        """While PAUSED or SUSPENDED, load new weights from `path` (GGUF file or Hugging Face
        directory, readable by the engine processes) or from `state` (HF parameter name ->
        array; a subset is allowed). Exactly one of the two. The weights' version (the prefix
        hash salt) becomes `weight_version` (None: the last + 1); the ack carries it.
        `in_flight`: also while RUNNING, without a pause: it runs between two steps, and the
        requests in flight take the new weights from the next step (each token carries its
        weight version). `draft`: the weights are the draft model's (a speculative_model of
        its own): the target's weights and version stay, and speculation that
        draft_weight_policy "disable" ended starts again."""
        if (path is None) == (state is None):
            raise ValueError("update_weights takes exactly one of path and state")
        _no_version_for_a_draft("update_weights", draft, weight_version)
        token = self.control_token
        msg = (
            UpdateWeights(token, os.fspath(path), None, weight_version)
            if path is not None
            else UpdateWeights(token, None, _check_state_fits(state), weight_version)
        )
        msg = dataclasses.replace(msg, in_flight=bool(in_flight), draft=bool(draft))
        return await self._control(msg)

    # --- weights from a trainer's processes (taipan.rl has the trainer's side) -----------------

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        """`rank_offset` trainer senders plus every gpu process of the runtime (each rank's
        tensor-parallel processes included): the world of init_weight_transfer."""
        info = self.info
        if info is None:
            raise RuntimeError("the client is not connected")
        return rank_offset + info.num_ranks * info.tensor_parallel_size

    def has_draft_weights(self) -> bool:
        """Whether the runtime's draft model has weights of its own (the updates with
        `draft=True` apply to it)."""
        if self.info is None:
            raise RuntimeError("the client is not connected")
        return self.info.draft_weights

    async def init_weight_transfer(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str | None = None,
    ) -> ControlAck:
        """Every gpu process joins the trainer's torch.distributed group (a TCPStore the trainer
        hosts at master_address:master_port; `backend` "nccl", "gloo" or None: nccl on CUDA,
        else gloo); returns once all joined, which needs the trainer to join at the same time
        (taipan.rl.join does both). Made once, reused for every update."""
        if backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend {backend!r} is not one of nccl, gloo")
        group = WeightTransferGroup(
            master_address, int(master_port), int(world_size), int(rank_offset), backend or ""
        )
        return await self._control(InitWeightTransfer(self.control_token, group))

    async def update_weights_from_distributed(
        self,
        buckets,
        *,
        weight_version: int | None = None,
        stage: bool = False,
        on_sent: Callable[[], None] | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        """While PAUSED or SUSPENDED (or RUNNING `in_flight`, as `update_weights`), take new
        weights the trainer broadcasts over the group,
        one flat buffer per bucket (`buckets`: lists of ops.weight_transfer.TensorSpec or
        (name, dtype, shape) triples, as taipan.rl.weight_buckets makes them). `stage`: hold
        them in a second buffer and copy them in only once every process has all of them.
        `on_sent`: called (on the client's loop) once the command has left; a trainer that
        broadcasts from the same process starts then (taipan.rl.push_weights). `draft`: the
        buckets are the draft model's weights (as `update_weights`)."""
        _no_version_for_a_draft("update_weights_from_distributed", draft, weight_version)
        wire = [[_weight_spec(s) for s in bucket] for bucket in buckets]
        msg = UpdateWeightsFromDistributed(
            self.control_token,
            wire,
            weight_version,
            bool(stage),
            in_flight=bool(in_flight),
            draft=bool(draft),
        )
        return await self._control(msg, on_sent)

    async def close_weight_transfer(self) -> ControlAck:
        return await self._control(CloseWeightTransfer(self.control_token))

    async def update_weights_from_ipc(
        self,
        tensors,
        *,
        weight_version: int | None = None,
        stage: bool = False,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        """While PAUSED or SUSPENDED (or RUNNING `in_flight`, as `update_weights`), take new
        weights from a trainer process on this host by
        CUDA IPC handles (`tensors`: IpcTensor records, as taipan.rl.ipc_handles makes them; no
        copy through the host): every gpu process opens them on their GPU and copies its part
        in, all or none. Keep the trainer's tensors alive and unchanged until this returns
        (taipan.rl.push_weights_ipc does both). `stage`: staged everywhere, then committed. A
        runtime on the CPU refuses it (ControlError). `draft`: the tensors are the draft
        model's (as `update_weights`)."""
        _no_version_for_a_draft("update_weights_from_ipc", draft, weight_version)
        msg = _ipc_message(self.control_token, tensors, weight_version, stage)
        msg = dataclasses.replace(msg, in_flight=bool(in_flight), draft=bool(draft))
        return await self._control(msg)

    async def stop(self) -> ControlAck:
        """Stop the whole runtime (legal from PAUSED or SUSPENDED: pause first): every request is
        aborted with its terminal output, every process exits."""
        return await self._control(Stop(self.control_token, "client asked to stop"))


class ClientControls:
    """The blocking twins of AsyncClientControls, the base of Client: each runs its async twin
    on the client's loop (Client._run) and returns its result."""

    _async: AsyncClientControls

    def _run(self, coro):
        raise NotImplementedError  # Client's: run the coroutine on its loop and wait

    def pause(
        self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None
    ) -> ControlAck:
        return self._run(self._async.pause(mode, clear_cache, timeout))

    def flush_cache(self) -> ControlAck:
        return self._run(self._async.flush_cache())

    def unpause(self) -> ControlAck:
        return self._run(self._async.unpause())

    def suspend(self, mode: str | None = None) -> ControlAck:
        return self._run(self._async.suspend(mode))

    def resume(self) -> ControlAck:
        return self._run(self._async.resume())

    def update_weights(
        self,
        path: str | os.PathLike | None = None,
        state: Mapping | None = None,
        *,
        weight_version: int | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        return self._run(
            self._async.update_weights(
                path, state, weight_version=weight_version, in_flight=in_flight, draft=draft
            )
        )

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        return self._async.weight_transfer_world_size(rank_offset)

    def has_draft_weights(self) -> bool:
        return self._async.has_draft_weights()

    def init_weight_transfer(
        self, master_address, master_port, world_size, rank_offset=1, backend=None
    ) -> ControlAck:
        return self._run(
            self._async.init_weight_transfer(
                master_address, master_port, world_size, rank_offset, backend
            )
        )

    def update_weights_from_distributed(
        self,
        buckets,
        *,
        weight_version: int | None = None,
        stage: bool = False,
        on_sent: Callable[[], None] | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        return self._run(
            self._async.update_weights_from_distributed(
                buckets,
                weight_version=weight_version,
                stage=stage,
                on_sent=on_sent,
                in_flight=in_flight,
                draft=draft,
            )
        )

    def close_weight_transfer(self) -> ControlAck:
        return self._run(self._async.close_weight_transfer())

    def update_weights_from_ipc(
        self,
        tensors,
        *,
        weight_version: int | None = None,
        stage: bool = False,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        return self._run(
            self._async.update_weights_from_ipc(
                tensors,
                weight_version=weight_version,
                stage=stage,
                in_flight=in_flight,
                draft=draft,
            )
        )

    def stop(self) -> ControlAck:
        return self._run(self._async.stop())
