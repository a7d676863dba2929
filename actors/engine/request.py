"""The engine's view of one request: its tokens, its KV progress, its blocks, how it ends.

Owned by the scheduler (actors/engine/scheduler.py); only it mutates these objects.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from messages.requests import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class EngineRequest:
    request_id: int
    prompt: np.ndarray  # int32[P]
    sampling: SamplingParams
    stream: bool
    arrival_time: float
    seed: int  # resolved: the request's own seed, or one the engine drew for it
    status: Status = Status.WAITING
    generated: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_streamed: int = 0  # generated tokens already sent to the client
    aborted: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may still generate: what its blocks must cover at most."""
        return len(self.prompt) + self.sampling.max_tokens

    def token_slice(self, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of prompt + generated, as int32."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        gen = np.asarray(self.generated[max(0, start - p) : stop - p], dtype=np.int32)
        if start >= p:
            return gen
        return np.concatenate([self.prompt[start:], gen])

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks to add so that `num_tokens` tokens have a KV slot."""
        return max(0, -(-num_tokens // block_size) - len(self.blocks))
