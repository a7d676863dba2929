"""Client and AsyncClient: talk to a running taipan runtime (coordinator address).

The client tokenizes (the tokenizer travels from the engine in ModelInfo, so no model files are
needed here), submits token ids, detokenizes incrementally and matches stop strings on the text
(ops/stop_strings.py: the engine matches token ids only; on a match it aborts the request).
It also drives the lifecycle (pause, suspend, update_weights, resume, unpause, stop, and the
weight transfer from a trainer's processes: init_weight_transfer, update_weights_from_distributed,
close_weight_transfer, and update_weights_from_ipc for a trainer on the same host, whose trainer
side is taipan.rl; see messages/lifecycle.py) with the runtime's control token (runtime/auth.py:
found by address for the user who started the runtime, or given as `control_token=` /
TAIPAN_CONTROL_TOKEN).
`timeout` is how long the runtime may stay silent before a waiting call fails with
`RuntimeUnreachable` (a busy runtime still answers; see actors/client/actor.py); `connect_timeout`
bounds the wait for an engine to load its model. `curve`: the client's Curve keys for a
runtime served over tcp beyond loopback (`load_client_keys(DIR)`, actors/curve.py; in direct
mode, where the client binds, the server's: `load_server_keys(DIR)`). No torch is imported.

With `direct=DirectEndpoint(...)` the client binds `address` and is the coordinator of the one
engine rank that connects to it (direct mode, actors/client/direct.py: what `LLM(...,
use_coordinator=False)` uses); the lifecycle methods then raise RuntimeError, and
`stop_engine` ends the engine. What a request gives back (Completion, Delta, RequestError) is
runtime/outputs.py's, re-exported here.

    async with AsyncClient("ipc:///tmp/taipan.sock") as c:
        [done] = await c.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        async for delta in c.stream("Hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")
        await c.pause(); await c.suspend()
        await c.update_weights(path="/ckpt/step-100")
        await c.resume(); await c.unpause()
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import numpy as np
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.client.actor import (
    DEFAULT_TIMEOUT_S,
    ClientActor,
    ControlError,
    RuntimeUnreachable,
)
from taipan.actors.client.direct import ENGINE_TIMEOUT_S, DirectActor, DirectEndpoint
from taipan.actors.curve import CurveClient, CurveServer
from taipan.auth import find_token
from taipan.messages.block_hash import block_hashes
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
from taipan.messages.requests import FinishReason, ModelInfo, SamplingParams
from taipan.messages.stats import Stats
from taipan.ops.stop_strings import StoppingDetokenizer
from taipan.ops.tokenizer import Tokenizer
from taipan.outputs import (
    Completion,
    Delta,
    RequestDetails,
    RequestError,
    TopN,
    join_versions,
    make_delta,
)

Prompt = str | Sequence[int] | Sequence[dict]

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "ControlAck",
    "ControlError",
    "Delta",
    "DirectEndpoint",
    "RequestError",
    "RuntimeUnreachable",
]


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


class AsyncClient:
    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
        direct: DirectEndpoint | None = None,
        curve: CurveClient | CurveServer | None = None,
    ):
        self.address = address
        self.direct = direct
        self.curve = curve
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S if direct is None else ENGINE_TIMEOUT_S
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._control_token = control_token
        self.tokenizer: Tokenizer | None = None
        self.model: str | None = None
        self.info: ModelInfo | None = None
        self._salt = 0  # the weight version block hashes are salted with
        self._ctx: zmq.asyncio.Context | None = None
        self._actor: ClientActor | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and fetch the model info (waits until an engine has loaded its model)."""
        self._ctx = zmq.asyncio.Context()
        # No receive limit: past it the coordinator's ROUTER would drop this client's outputs
        # (silently: a request could lose tokens or never end) while it is slow to read them.
        self._ctx.setsockopt(zmq.RCVHWM, 0)
        if self.direct is None:
            channel = make_socket(
                self._ctx,
                zmq.DEALER,
                self.address,
                bind=False,
                name="coordinator",
                curve=self.curve,
            )
            self._actor = ClientActor(channel, address=self.address, timeout=self.timeout)
        else:
            channel = make_socket(
                self._ctx,
                zmq.ROUTER,
                self.address,
                bind=True,
                name="engine",
                watch_peers=True,
                curve=self.curve,
            )
            self._actor = DirectActor(channel, self.direct, timeout=self.timeout)
        self._task = asyncio.create_task(self._actor.run())  # owned here; awaited in close()
        try:
            info = await asyncio.wait_for(self._actor.model_info(), self.connect_timeout)
        except BaseException:
            await self.close()
            raise
        self.info, self.model = info, info.model
        self._salt = info.weight_version
        self.tokenizer = Tokenizer.from_wire(json.loads(info.tokenizer))

    async def stop_engine(self, timeout: float = 30.0) -> bool:
        """Direct mode only: tell the engine to abort every request (each gets its terminal
        output) and exit; True once it acknowledged within `timeout` seconds."""
        if not isinstance(self._actor, DirectActor):
            raise RuntimeError("stop_engine is for a direct-mode client; use stop() otherwise")
        return await self._actor.stop_engine("its direct client asked to stop", timeout)

    async def close(self) -> None:
        if self._actor is not None:
            self._actor.stop()
            await self._task
            self._actor.channel.close()
            self._actor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- requests -----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt, chat: bool) -> tuple[str | None, np.ndarray]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            if chat:
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
            else:
                ids = tok.encode(prompt)
            return prompt, np.asarray(ids, dtype=np.int32)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return None, np.asarray(tok.apply_chat_template(list(prompt)), dtype=np.int32)
        return None, np.asarray(list(prompt), dtype=np.int32).reshape(-1)

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        raise_on_error: bool = True,
    ) -> list[Completion]:
        """Generate for every prompt concurrently; completions in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        done = await asyncio.gather(*(self._one(p, sampling, chat) for p in prompts))
        if raise_on_error:
            for c in done:
                if c.finish_reason == FinishReason.ERROR:
                    raise RequestError(c.error)
        return list(done)

    async def _one(self, prompt: Prompt, sampling: SamplingParams | None, chat: bool):
        text, ids = self._encode(prompt, chat)
        sampling = sampling or SamplingParams()
        texts: list[str] = []
        tokens: list[int] = []
        log_probs: list[float] | None = [] if sampling.return_log_probs else None
        top_n: TopN | None = [] if sampling.top_n_logprobs else None
        versions: list[tuple[int, int]] = []
        async for last in self._deltas(ids, sampling, stream=False):
            texts.append(last.text)
            tokens.extend(last.token_ids)
            versions = join_versions(versions, last.weight_versions)
            if log_probs is not None:
                log_probs.extend(last.log_probs)
            if top_n is not None:
                top_n.extend(last.top_n_logprobs)
        details = {f.name: getattr(last, f.name) for f in dataclasses.fields(RequestDetails)}
        details.update(log_probs=log_probs, top_n_logprobs=top_n, weight_versions=versions)
        return Completion(
            prompt=text,
            prompt_token_ids=ids.tolist(),
            text="".join(texts),
            token_ids=tokens,
            finish_reason=last.finish_reason,
            error=last.error,
            stop_reason=last.stop_reason,
            **details,
        )

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as tokens arrive; the last delta has `finished` set. Text that may
        still become a stop string is held back until it is known not to."""
        _, ids = self._encode(prompt, chat)
        async for delta in self._deltas(ids, sampling or SamplingParams(), stream=True):
            yield delta

    async def _deltas(
        self, ids: np.ndarray, sampling: SamplingParams, stream: bool
    ) -> AsyncIterator[Delta]:
        """The request's output as one Delta per RequestOutput, the last one `finished`.

        Stop strings are matched here, on the detokenized text, so a request with any is
        streamed from the engine even when the caller does not stream (`streaming_interval`
        still applies). On a match the text ends at the stop string, the engine is told to
        abort the request at once, and its terminal output (awaited: the abort may race a few
        more tokens) gives the final fields; tokens past the one that completed the stop string
        are dropped.
        """
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        stops = sampling.stop_strings()
        sampling = dataclasses.replace(sampling, stop=stops)
        reader = StoppingDetokenizer(
            self.tokenizer, ids.tolist(), stops, sampling.include_stop_word
        )
        num_tokens = len(ids)  # prompt + output tokens so far
        request_id, queue = await self._submit(ids, sampling, stream or bool(stops))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                new = out.new_token_ids.tolist()
                text, keep = reader.feed(new)
                if finished and reader.stop_reason is None:
                    text += reader.flush()
                end = out if finished else None
                if reader.stop_reason is not None and not finished:
                    await self._actor.abort(request_id)  # the engine need not go on
                    while not finished:
                        end = await queue.get()
                        finished = end.finished
                num_tokens += keep
                yield make_delta(out, end, sampling, new[:keep], text, reader, num_tokens)
                if reader.stop_reason is not None:
                    return
        finally:
            if not finished and self._actor is not None:
                await self._actor.abort(request_id)  # the caller stopped listening

    async def _submit(self, ids: np.ndarray, sampling: SamplingParams, stream: bool):
        """Send one request; (its id, the queue its outputs arrive in)."""
        hashes = None
        info = self.info
        if info is not None and info.prefix_caching and info.block_size:
            # Hashed here, where the tokens are (the coordinator routes by them); a stale salt
            # (weights updated by another client) only makes the coordinator hash again.
            hashes = block_hashes(ids, info.block_size, self._salt)
        return await self._actor.submit(ids, sampling, stream, hashes, self._salt)

    async def stats(self, fresh: bool = True) -> Stats:
        """The lifecycle state and every rank's latest counters (messages/stats.py); `fresh`
        False: the coordinator's latest reports, without asking the engines (one hop)."""
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        return await self._actor.stats(fresh)

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

    async def _control(self, msg) -> ControlAck:
        if self._actor is None:
            raise RuntimeError("the client is not connected")
        ack = await self._actor.control(msg)
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
    ) -> ControlAck:
        """While PAUSED or SUSPENDED, load new weights from `path` (GGUF file or Hugging Face
        directory, readable by the engine processes) or from `state` (HF parameter name ->
        array; a subset is allowed). Exactly one of the two. The weights' version (the prefix
        hash salt) becomes `weight_version` (None: the last + 1); the ack carries it."""
        if (path is None) == (state is None):
            raise ValueError("update_weights takes exactly one of path and state")
        token = self.control_token
        msg = (
            UpdateWeights(token, os.fspath(path), None, weight_version)
            if path is not None
            else UpdateWeights(token, None, _check_state_fits(state), weight_version)
        )
        return await self._control(msg)

    # --- weights from a trainer's processes (taipan.rl has the trainer's side) -----------------

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        """`rank_offset` trainer senders plus every gpu process of the runtime (each rank's
        tensor-parallel processes included): the world of init_weight_transfer."""
        info = self.info
        if info is None:
            raise RuntimeError("the client is not connected")
        return rank_offset + info.num_ranks * info.tensor_parallel_size

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
        self, buckets, *, weight_version: int | None = None, stage: bool = False
    ) -> ControlAck:
        """While PAUSED or SUSPENDED, take new weights the trainer broadcasts over the group,
        one flat buffer per bucket (`buckets`: lists of ops.weight_transfer.TensorSpec or
        (name, dtype, shape) triples, as taipan.rl.weight_buckets makes them). `stage`: hold
        them in a second buffer and copy them in only once every process has all of them."""
        wire = [[_weight_spec(s) for s in bucket] for bucket in buckets]
        msg = UpdateWeightsFromDistributed(self.control_token, wire, weight_version, bool(stage))
        return await self._control(msg)

    async def close_weight_transfer(self) -> ControlAck:
        return await self._control(CloseWeightTransfer(self.control_token))

    async def update_weights_from_ipc(
        self, tensors, *, weight_version: int | None = None, stage: bool = False
    ) -> ControlAck:
        """While PAUSED or SUSPENDED, take new weights from a trainer process on this host by
        CUDA IPC handles (`tensors`: IpcTensor records, as taipan.rl.ipc_handles makes them; no
        copy through the host): every gpu process opens them on their GPU and copies its part
        in, all or none. Keep the trainer's tensors alive and unchanged until this returns
        (taipan.rl.push_weights_ipc does both). `stage`: staged everywhere, then committed. A
        runtime on the CPU refuses it (ControlError)."""
        return await self._control(_ipc_message(self.control_token, tensors, weight_version, stage))

    async def stop(self) -> ControlAck:
        """Stop the whole runtime (legal from PAUSED or SUSPENDED: pause first): every request is
        aborted with its terminal output, every process exits."""
        return await self._control(Stop(self.control_token, "client asked to stop"))


class Client:
    """The blocking twin of AsyncClient (same arguments): its own event loop runs in a background
    thread."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        connect_timeout: float = 600.0,
        control_token: str | None = None,
        direct: DirectEndpoint | None = None,
        curve: CurveClient | CurveServer | None = None,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            address,
            timeout=timeout,
            connect_timeout=connect_timeout,
            control_token=control_token,
            direct=direct,
            curve=curve,
        )
        try:
            self._run(self._async.connect())
        except BaseException:
            self._shutdown_loop()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, coro):
        """Run a coroutine that uses `aio` on this client's loop and return its result (what
        LLM builds its batch calls on)."""
        return self._run(coro)

    @property
    def aio(self) -> AsyncClient:
        """The AsyncClient underneath: use it only through `run` (it lives on that loop)."""
        return self._async

    @property
    def tokenizer(self) -> Tokenizer:
        return self._async.tokenizer

    def generate(self, prompts, sampling: SamplingParams | None = None, **kw) -> list[Completion]:
        return self._run(self._async.generate(prompts, sampling, **kw))

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, **kw):
        agen = self._async.stream(prompt, sampling, **kw)

        def it() -> Iterator[Delta]:
            try:
                while True:
                    try:
                        yield self._run(agen.__anext__())
                    except StopAsyncIteration:
                        return
            finally:
                self._run(agen.aclose())

        return it()

    def stats(self, fresh: bool = True) -> Stats:
        return self._run(self._async.stats(fresh))

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
    ) -> ControlAck:
        return self._run(self._async.update_weights(path, state, weight_version=weight_version))

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        return self._async.weight_transfer_world_size(rank_offset)

    def init_weight_transfer(
        self, master_address, master_port, world_size, rank_offset=1, backend=None
    ) -> ControlAck:
        return self._run(
            self._async.init_weight_transfer(
                master_address, master_port, world_size, rank_offset, backend
            )
        )

    def update_weights_from_distributed(
        self, buckets, *, weight_version: int | None = None, stage: bool = False
    ) -> ControlAck:
        return self._run(
            self._async.update_weights_from_distributed(
                buckets, weight_version=weight_version, stage=stage
            )
        )

    def close_weight_transfer(self) -> ControlAck:
        return self._run(self._async.close_weight_transfer())

    def update_weights_from_ipc(
        self, tensors, *, weight_version: int | None = None, stage: bool = False
    ) -> ControlAck:
        return self._run(
            self._async.update_weights_from_ipc(tensors, weight_version=weight_version, stage=stage)
        )

    def stop(self) -> ControlAck:
        return self._run(self._async.stop())

    def stop_engine(self, timeout: float = 30.0) -> bool:
        return self._run(self._async.stop_engine(timeout))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
