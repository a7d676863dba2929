"""The coordinator's side of the engine protocol, for whoever plays it: the coordinator actor
(actors/coordinator/actor.py, every rank) and the direct client (actors/client/direct.py, a
client that is its one rank's coordinator).

Owns: which engine connection serves which rank and when each was last heard from; when an
engine's silence makes it dead; the `ModelInfo` a rank's `ModelLoaded` makes of what the engines
report and what the runtime serves (`ServedModel`); whether the runtime is ready (every rank has
loaded its model and none failed to) and why its start failed. Must not touch: sockets, the
requests of a rank, the texts sent to clients — the caller owns those. It tells `EngineLinks` what
arrived (`join`, `heard`, `loaded_model`, `load_failed`) and asks what follows (`silent`,
`gone`, `start_failure`).

`EngineLinks` is pure: no zmq, no clock (every time is an argument: the envelope's receive time
in the actors), so the coordinator's replay check re-drives the same decisions. The two asyncio
helpers at the end only wait: `watch_silence` until the next engine's silence runs out,
`watch_process` until an engine's process exits (the third way an engine dies, beside its
connection closing and its silence).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable

from taipan.messages.gpu import ModelLoaded
from taipan.messages.requests import ModelInfo

# An engine heartbeats every second and its event loop stays free while its device works (the
# forward runs in a thread), so a silence this long means a hung process, not a long step.
ENGINE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a coordinator tells its clients beyond what the engines report: `ModelInfo`'s
    other fields."""

    model_name: str
    max_sequence_length: int
    num_ranks: int
    prefix_caching: bool = False


def model_info(loaded: ModelLoaded, served: ServedModel, weight_version: int) -> ModelInfo:
    """The `ModelInfo` clients are answered with, from a rank's `ModelLoaded` (its KV cache
    stands for every rank's: they run one config)."""
    return ModelInfo(
        served.model_name,
        loaded.tokenizer,
        served.max_sequence_length,
        served.num_ranks,
        loaded.num_blocks * loaded.block_size,
        loaded.num_blocks * loaded.block_bytes,
        loaded.block_size,
        served.prefix_caching,
        weight_version,
        loaded.tensor_parallel_size,
        loaded.draft_weights,
    )


class EngineLinks:
    """The engine ranks one coordinator speaks to. Only its owner (one actor, once per inbound
    message or watch wake-up) mutates it."""

    def __init__(self, served: ServedModel, timeout: float = ENGINE_TIMEOUT_S):
        self.served = served
        self.timeout = timeout
        self.engines: dict[int, bytes] = {}  # rank -> engine identity, live ranks only
        self.heard_at: dict[bytes, float] = {}  # live engine identity -> its last message
        self.loaded: set[int] = set()  # ranks that have loaded their model (ever)
        self.info: ModelInfo | None = None  # from the first ModelLoaded
        self.load_error: str | None = None

    # --- who is who ---------------------------------------------------------------------------

    def join(self, rank: int, identity: bytes, now: float) -> None:
        """`identity` said Hello as `rank` (the caller checked that it may): its silence counts
        from `now` on."""
        self.engines[rank] = identity
        self.heard_at[identity] = now

    def heard(self, identity: bytes | None, now: float) -> None:
        """Any message from a live engine proves it alive."""
        if identity in self.heard_at:
            self.heard_at[identity] = now

    def is_live(self, identity: bytes | None) -> bool:
        return identity in self.heard_at

    def rank_of(self, identity: bytes | None) -> int | None:
        return next((r for r, i in self.engines.items() if i == identity), None)

    def name(self, identity: bytes | None) -> str:
        """An engine as error texts and logs name it."""
        rank = self.rank_of(identity)
        return f"engine {rank}" if rank is not None else f"engine {identity!r}"

    # --- the model ----------------------------------------------------------------------------

    def loaded_model(self, rank: int, msg: ModelLoaded, weight_version: int) -> str | None:
        """`rank` loaded its model: why it cannot serve in this runtime, or None (then it counts
        toward `ready`, and the first such rank's report makes `info`)."""
        if self.info is not None and msg.block_size != self.info.block_size:
            return (
                f"its block size {msg.block_size} differs from the runtime's "
                f"{self.info.block_size} (every rank must run the same config)"
            )
        self.loaded.add(rank)
        if self.info is None:
            self.info = model_info(msg, self.served, weight_version)
        return None

    @property
    def block_size(self) -> int:
        """The ranks' KV block size; 0 until one has loaded its model."""
        return 0 if self.info is None else self.info.block_size

    @property
    def ready(self) -> bool:
        """Whether the runtime serves: every one of `num_ranks` ranks has loaded its model (as
        vLLM, a data-parallel runtime starts whole or not at all) and none failed to."""
        return self.load_error is None and len(self.loaded) >= self.served.num_ranks

    def load_failed(self, text: str) -> None:
        self.load_error = text

    def set_weight_version(self, version: int) -> None:
        """The engines acknowledged a new weight version: clients are told it from now on."""
        if self.info is not None and self.info.weight_version != version:
            self.info = dataclasses.replace(self.info, weight_version=version)

    # --- liveness -----------------------------------------------------------------------------

    def silent(self, now: float) -> list[tuple[bytes, float]]:
        """(identity, seconds silent) of every live engine silent for `timeout` or longer."""
        heard = self.heard_at.items()
        return [(i, now - t) for i, t in heard if now - t >= self.timeout]

    def next_check(self, now: float) -> float:
        """Seconds until the next live engine would have been silent for `timeout`."""
        deadline = min(self.heard_at.values(), default=now) + self.timeout
        return max(deadline - now, 0.0)

    def gone(self, identity: bytes | None) -> int | None:
        """The engine is dead (its connection closed, it went silent, its process exited):
        forget it and return its rank, or None when it was no live rank."""
        rank = self.rank_of(identity)
        if rank is not None:
            del self.engines[rank]
        self.heard_at.pop(identity, None)
        return rank

    def start_failure(self, rank: int, reason: str) -> str | None:
        """`rank` died (`reason`). A runtime starts whole or not at all: a rank dead before
        every rank was up fails the start; returns that error (now `load_error`), else None."""
        if self.ready or self.load_error is not None:
            return None
        self.load_error = f"engine rank {rank} died before the runtime was ready ({reason})"
        return self.load_error


async def watch_silence(
    links: EngineLinks, on_silent: Callable[[bytes, float], Awaitable[None]]
) -> None:
    """Forever: wake when the next live engine's silence would reach `links.timeout` and call
    `on_silent(identity, seconds silent)` for each that did. `on_silent` must forget it
    (`links.gone`). Times are the wall clock, as the envelopes' receive times are."""
    while True:
        for identity, silent in links.silent(time.time()):
            await on_silent(identity, silent)
        # 0: an engine that on_silent kept is still silent; look again in a while, not at once.
        await asyncio.sleep(links.next_check(time.time()) or links.timeout)


async def watch_process(pid: int) -> str | None:
    """Wait, without polling, for process `pid` to exit (a pidfd turns readable); returns why
    the engine is gone. None at once where there are no pidfds (not Linux): the connection and
    silence watches remain."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:  # already reaped: the process is gone
        return f"its process {pid} is not running ({e.strerror})"
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return f"its process {pid} exited (see its log above)"
