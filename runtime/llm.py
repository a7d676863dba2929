"""`LLM` and `AsyncLLM`: the two objects most users need (DESIGN.md §11, the seed's "simple and
stable inference APIs", in the shape of vLLM's `LLM` / `AsyncLLM`).

Each either starts an embedded runtime from a model and InferenceConfig fields, or connects to a
running one (`address=`), and talks to it through a client. Two modes (`use_coordinator`):

- coordinator mode (the default): coordinator + engine processes (`Runtime`); the coordinator
  routes requests and owns the lifecycle (pause, unpause, suspend, resume, update_weights).
- direct mode (`use_coordinator=False`): one engine rank process and no coordinator; this
  object's client binds the engine's coordinator endpoint and speaks that protocol for its own
  rank (actors/client/direct.py): one hop less per message. The lifecycle methods raise
  RuntimeError naming the mode. One LLM drives one rank in direct mode (`data_parallel_size`
  > 1 needs coordinator mode); with several ranks each process would own one rank and shard its
  prompts itself (the seed's "user-managed ranks"), so `is_primary_rank` is True everywhere.

    with LLM("smollm2", max_requests=16) as llm:
        outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16))
        # vLLM's logit controls: penalties, logit_bias (token id -> bias), min_tokens, bad words
        outs = llm.generate("Hello", SamplingParams(presence_penalty=0.5, logit_bias={13: -100}))

    async with AsyncLLM("smollm2") as llm:
        async for delta in llm.generate("Hello", SamplingParams(max_tokens=16)):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from taipan.actors.client.direct import DirectEndpoint
from taipan.actors.config import InferenceConfig
from taipan.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from taipan.client import AsyncClient, Client, Completion, Delta, Prompt
from taipan.launcher import Runtime
from taipan.messages.lifecycle import ControlAck
from taipan.messages.requests import SamplingParams
from taipan.messages.stats import Stats
from taipan.ops.chat_template import template_source

__all__ = ["LLM", "AsyncLLM"]


def _runtime(model, config, config_fields, address, direct: bool, **kw) -> Runtime | None:
    """A Runtime to start (None when connecting to `address`)."""
    if address is not None:
        if direct:
            raise ValueError(
                "address= connects to a running runtime's coordinator; direct mode "
                "(use_coordinator=False) starts its own engine rank: pass one or the other"
            )
        sizes = tuple(kw.get(f"{kind}_parallel_size", 1) for kind in ("data", "tensor", "expert"))
        if config is not None or config_fields or sizes != (1, 1, 1):
            raise ValueError(
                "address= connects to a running runtime, whose config and ranks are its own: "
                "pass no config, InferenceConfig fields or parallel sizes (data_parallel_size, "
                "tensor_parallel_size, expert_parallel_size) with it"
            )
        return None
    if config is not None and config_fields:
        raise ValueError("pass either config= or InferenceConfig fields, not both")
    return Runtime(model, config or InferenceConfig(**config_fields), direct=direct, **kw)


def _samplings(prompts: list, sampling) -> list[SamplingParams]:
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * len(prompts)
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(
            f"one SamplingParams per prompt: got {len(sampling)} for {len(prompts)} prompts"
        )
    return sampling


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, or a chat conversation) or a list of them -> a list."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int | dict)
    ):
        return [prompts]
    return list(prompts)


def _prompt_ids(client, prompts) -> list[list[int]]:
    """Prompts (text or token ids, one or a list) as token ids."""
    tok = client.tokenizer
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in _prompt_list(prompts)]


def _chats(tokenizer, messages, template, kwargs, add_generation_prompt) -> list:
    """`messages` (a conversation, a text, or a list of them) as chat prompts: as they are for
    the model's own rendering (the request's `chat`), or rendered here into token ids when a
    template (a source or a file's path), template variables or no generation prompt are asked
    for (vLLM's LLM.chat arguments)."""
    prompts = _prompt_list(messages)
    if template is None and not kwargs and add_generation_prompt:
        return prompts
    source = None if template is None else template_source(template)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}] if isinstance(p, str) else list(p),
            add_generation_prompt,
            template=source,
            **(kwargs or {}),
        )
        for p in prompts
    ]


class _Base:
    """What LLM and AsyncLLM share: the constructor's arguments and the runtime they start (or
    the address they connect to). `model`: "smollm2", a .gguf file or an HF directory;
    `config` or InferenceConfig fields (not with `address`); `dtype`, `device`, `record_dir`,
    `data_parallel_size` (engine ranks behind the coordinator; coordinator mode only) and
    `tensor_parallel_size` (processes each rank's weights are split over) and
    `expert_parallel_size` (a mixture-of-experts model's experts split over groups of that many
    ranks) as for `taipan serve`; `control_token` for a running runtime started by another
    user."""

    def __init__(
        self,
        model: str = "smollm2",
        *,
        config: InferenceConfig | None = None,
        address: str | None = None,
        use_coordinator: bool = True,
        dtype: str = "float32",
        device: str = "cpu",
        record_dir: str | None = None,
        control_token: str | None = None,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        **config_fields: Any,
    ) -> None:
        self.use_coordinator = use_coordinator
        self._runtime = _runtime(
            model, config, config_fields, address, not use_coordinator, dtype=dtype,
            device=device, record_dir=record_dir, data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel_size=expert_parallel_size,
        )  # fmt: skip
        self._address = address
        self._control_token = control_token

    @property
    def is_primary_rank(self) -> bool:
        """Whether this process feeds prompts and collects outputs: in coordinator mode the one
        process that holds the LLM (every output comes back through the coordinator to it); in
        direct mode every rank's, each for its own share of the prompts."""
        return True

    def _client_kwargs(self) -> dict:
        """How this object's client reaches the runtime: its address and control token, or in
        direct mode the engine endpoint it binds."""
        rt = self._runtime
        if rt is None:
            return {"address": self._address, "control_token": self._control_token}
        if not self.use_coordinator:
            endpoint = DirectEndpoint(
                rt.model_name,
                rt.config.max_sequence_length,
                rt.config.enable_prefix_caching,
                rt.engine_pid,
            )
            return {"address": rt.engine_address, "direct": endpoint}
        return {"address": rt.address, "control_token": rt.control_token}

    def _lifecycle(self, name: str) -> None:
        if not self.use_coordinator:
            raise RuntimeError(
                f"{name} needs coordinator mode: in direct mode (use_coordinator=False) no "
                "coordinator owns the lifecycle"
            )


class AsyncLLM(_Base):
    """An asyncio LLM: `async with AsyncLLM(model, **config_fields) as llm` (or `await
    llm.start()` ... `await llm.shutdown()`). `generate` streams one request's deltas; run many
    concurrently. Lifecycle methods go through the coordinator (they need the control token,
    which an embedded runtime's owner has)."""

    client: AsyncClient | None = None

    async def start(self) -> AsyncLLM:
        if self.client is not None:
            return self
        if self._runtime is not None:
            await asyncio.to_thread(self._runtime.start)  # it runs its own event loop
        client = AsyncClient(**self._client_kwargs())
        try:
            await client.connect()
        except BaseException:
            await self._stop_runtime()
            raise
        self.client = client
        return self

    def _connected(self) -> AsyncClient:
        if self.client is None:
            raise RuntimeError("the AsyncLLM is not started: use `async with` or `await start()`")
        return self.client

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """One request's deltas as they come; the last has `finished` set."""
        async for delta in self._connected().stream(prompt, sampling, chat=chat):
            yield delta

    async def generate_all(self, prompts, sampling=None, *, chat: bool = False) -> list[Completion]:
        """Every prompt at once (one SamplingParams, or one per prompt); completions in order."""
        client = self._connected()
        prompts = _prompt_list(prompts)
        samplings = _samplings(prompts, sampling)
        done = await asyncio.gather(
            *(client.generate([p], s, chat=chat) for p, s in zip(prompts, samplings, strict=True))
        )
        return [d[0] for d in done]

    async def chat(
        self,
        messages,
        sampling=None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[Completion]:
        """A conversation (list of {"role", "content"}) or a list of them, through the model's
        chat template (or `chat_template`: its source or a file's path), with
        `chat_template_kwargs` as the template's variables."""
        prompts = _chats(
            self._connected().tokenizer, messages, chat_template, chat_template_kwargs,
            add_generation_prompt,
        )  # fmt: skip
        return await self.generate_all(prompts, sampling, chat=True)

    async def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's best `params.beam_width` sequences, best
        first (runtime/beam_search.py); prompts: text or token ids, one or a list."""
        client = self._connected()
        return await beam_search(client, _prompt_ids(client, prompts), params)

    async def stats(self, fresh: bool = True) -> Stats:
        return await self._connected().stats(fresh)

    async def pause(
        self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None
    ) -> ControlAck:
        """AsyncClient.pause: modes keep, abort, wait; clear_cache; all ranks or none."""
        self._lifecycle("pause")
        return await self._connected().pause(mode, clear_cache, timeout)

    async def flush_cache(self) -> ControlAck:
        """AsyncClient.flush_cache: drop the cached prefix while paused or suspended."""
        self._lifecycle("flush_cache")
        return await self._connected().flush_cache()

    async def unpause(self) -> ControlAck:
        self._lifecycle("unpause")
        return await self._connected().unpause()

    async def suspend(self, mode: str | None = None) -> ControlAck:
        self._lifecycle("suspend")
        return await self._connected().suspend(mode)

    async def resume(self) -> ControlAck:
        self._lifecycle("resume")
        return await self._connected().resume()

    async def update_weights(
        self,
        path: str | os.PathLike | None = None,
        state: Mapping | None = None,
        *,
        weight_version: int | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        self._lifecycle("update_weights")
        return await self._connected().update_weights(
            path, state, weight_version=weight_version, in_flight=in_flight, draft=draft
        )

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        return self._connected().weight_transfer_world_size(rank_offset)

    def has_draft_weights(self) -> bool:
        return self._connected().has_draft_weights()

    async def init_weight_transfer(self, *args, **kw) -> ControlAck:
        """AsyncClient.init_weight_transfer (the trainer side: taipan.rl)."""
        self._lifecycle("init_weight_transfer")
        return await self._connected().init_weight_transfer(*args, **kw)

    async def update_weights_from_distributed(self, buckets, **kw) -> ControlAck:
        self._lifecycle("update_weights_from_distributed")
        return await self._connected().update_weights_from_distributed(buckets, **kw)

    async def close_weight_transfer(self) -> ControlAck:
        self._lifecycle("close_weight_transfer")
        return await self._connected().close_weight_transfer()

    async def update_weights_from_ipc(self, tensors, **kw) -> ControlAck:
        """AsyncClient.update_weights_from_ipc (the trainer side: taipan.rl.ipc_handles)."""
        self._lifecycle("update_weights_from_ipc")
        return await self._connected().update_weights_from_ipc(tensors, **kw)

    async def serve(self, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
        """The OpenAI-compatible server on host:port in this event loop, until cancelled
        (runtime/server/app.py `serve`: served_model_name, api_key, max_queued, queue_timeout,
        options (a ServerOptions: prompt_tokens_details, chat_template, ...), log_level)."""
        from taipan.server import serve

        await serve(self._connected(), host, port, **kw)

    async def shutdown(self) -> None:
        """Close the client and stop an embedded runtime (idempotent). In direct mode the
        client stops the engine first (every request gets its terminal output)."""
        stopped = False
        if self.client is not None:
            client, self.client = self.client, None
            if client.direct is not None:
                stopped = await client.stop_engine()
            await client.close()
        await self._stop_runtime(stopped)

    async def _stop_runtime(self, stopped: bool = False) -> None:
        if self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            await asyncio.to_thread(runtime.shutdown, stopped=stopped)

    async def __aenter__(self) -> AsyncLLM:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


class LLM(_Base):
    """The blocking LLM: starts (or connects to) a runtime at construction; `generate` and
    `chat` return completions in input order, with a progress bar (tqdm; `use_tqdm` defaults to
    whether stderr is a terminal; TQDM_DISABLE=1 in the environment hides it always)."""

    client: Client | None = None

    def __init__(self, model: str = "smollm2", **kw: Any) -> None:
        super().__init__(model, **kw)
        try:
            if self._runtime is not None:
                self._runtime.start()
            self.client = Client(**self._client_kwargs())
        except BaseException:
            self.shutdown()
            raise

    @property
    def tokenizer(self):
        return self._connected().tokenizer

    def _connected(self) -> Client:
        if self.client is None:
            raise RuntimeError("the LLM was shut down")
        return self.client

    def generate(
        self, prompts, sampling=None, *, use_tqdm: bool | None = None, chat: bool = False
    ) -> list[Completion]:
        """prompts: text, token ids, or a list of them (with `chat`, conversations); sampling:
        one SamplingParams or one per prompt."""
        client = self._connected()
        prompts = _prompt_list(prompts)
        samplings = _samplings(prompts, sampling)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        # tqdm reads TQDM_DISABLE once, when first imported; the user's choice counts at each call.
        show = show and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")
        return client.run(_gather_with_progress(client.aio, prompts, samplings, chat, show))

    def chat(
        self,
        messages,
        sampling=None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[Completion]:
        """AsyncLLM.chat's twin."""
        prompts = _chats(
            self.tokenizer, messages, chat_template, chat_template_kwargs, add_generation_prompt
        )
        return self.generate(prompts, sampling, use_tqdm=use_tqdm, chat=True)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """AsyncLLM.beam_search's twin."""
        client = self._connected()
        return client.run(beam_search(client.aio, _prompt_ids(client, prompts), params))

    def stats(self, fresh: bool = True) -> Stats:
        return self._connected().stats(fresh)

    def pause(
        self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None
    ) -> ControlAck:
        self._lifecycle("pause")
        return self._connected().pause(mode, clear_cache, timeout)

    def flush_cache(self) -> ControlAck:
        self._lifecycle("flush_cache")
        return self._connected().flush_cache()

    def unpause(self) -> ControlAck:
        self._lifecycle("unpause")
        return self._connected().unpause()

    def suspend(self, mode: str | None = None) -> ControlAck:
        self._lifecycle("suspend")
        return self._connected().suspend(mode)

    def resume(self) -> ControlAck:
        self._lifecycle("resume")
        return self._connected().resume()

    def update_weights(
        self,
        path: str | os.PathLike | None = None,
        state: Mapping | None = None,
        *,
        weight_version: int | None = None,
        in_flight: bool = False,
        draft: bool = False,
    ) -> ControlAck:
        self._lifecycle("update_weights")
        return self._connected().update_weights(
            path, state, weight_version=weight_version, in_flight=in_flight, draft=draft
        )

    def weight_transfer_world_size(self, rank_offset: int = 1) -> int:
        return self._connected().weight_transfer_world_size(rank_offset)

    def has_draft_weights(self) -> bool:
        return self._connected().has_draft_weights()

    def init_weight_transfer(self, *args, **kw) -> ControlAck:
        """Client.init_weight_transfer (the trainer side: taipan.rl.join does both at once)."""
        self._lifecycle("init_weight_transfer")
        return self._connected().init_weight_transfer(*args, **kw)

    def update_weights_from_distributed(self, buckets, **kw) -> ControlAck:
        self._lifecycle("update_weights_from_distributed")
        return self._connected().update_weights_from_distributed(buckets, **kw)

    def close_weight_transfer(self) -> ControlAck:
        self._lifecycle("close_weight_transfer")
        return self._connected().close_weight_transfer()

    def update_weights_from_ipc(self, tensors, **kw) -> ControlAck:
        """Client.update_weights_from_ipc (taipan.rl.push_weights_ipc shares and sends)."""
        self._lifecycle("update_weights_from_ipc")
        return self._connected().update_weights_from_ipc(tensors, **kw)

    def shutdown(self) -> None:
        """Close the client and stop an embedded runtime (idempotent). In direct mode the
        client stops the engine first (every request gets its terminal output)."""
        stopped = False
        if self.client is not None:
            client, self.client = self.client, None
            if self._runtime is not None and not self.use_coordinator:
                stopped = client.stop_engine()
            client.close()
        if self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            runtime.shutdown(stopped=stopped)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _gather_with_progress(
    client: AsyncClient, prompts: list, samplings: list, chat: bool, show: bool
) -> list[Completion]:
    bar = None
    if show:
        from tqdm import tqdm

        # disable=False: `show` decided (tqdm's own TQDM_DISABLE default is read at import).
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=False)

    async def one(p, s) -> Completion:
        [c] = await client.generate([p], s, chat=chat)
        if bar is not None:
            bar.update(1)
        return c

    try:
        return list(
            await asyncio.gather(*(one(p, s) for p, s in zip(prompts, samplings, strict=True)))
        )
    finally:
        if bar is not None:
            bar.close()
