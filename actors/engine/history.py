"""A request's history across checkpoints, and its staleness counters (RL weight updates).

Megatron's `DynamicInferenceRequestRecord` keeps one request object per checkpoint: when a
request is evicted its prompt becomes prompt + generated so far, and `merge` stitches the pieces
back into one request. taipan keeps prompt and generated tokens apart in `EngineRequest`, so a
checkpoint here records *where* the request was cut (how many tokens it had) and what it lost
(its KV); `merge` returns the spans that were computed together.

Staleness, per token of prompt + generated: `policy_staleness` counts weight updates since the
token was produced (prompt tokens: since the request arrived); `kv_cache_staleness` counts
weight updates since the token's K/V were computed, and is reset by a checkpoint (the KV is
recomputed with the current weights). Pure Python + numpy; owned by the scheduler.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)
class RequestHistory:
    checkpoints: list[int] = dataclasses.field(default_factory=list)  # num_tokens at each cut
    policy_staleness: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int32)
    )
    kv_cache_staleness: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int32)
    )

    def checkpoint(self, num_tokens: int) -> None:
        """The request was evicted holding `num_tokens` tokens: its KV is gone, so every token's
        KV will be fresh after recompute."""
        self.checkpoints.append(num_tokens)
        self.kv_cache_staleness = np.zeros(num_tokens, dtype=np.int32)

    def merge(self, num_tokens: int) -> list[tuple[int, int]]:
        """The [start, stop) token spans between checkpoints, covering all `num_tokens`."""
        cuts = [0, *self.checkpoints, num_tokens]
        return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    @staticmethod
    def _grow(counts: np.ndarray, total: int) -> np.ndarray:
        if len(counts) >= total:
            return counts
        return np.concatenate([counts, np.zeros(total - len(counts), dtype=np.int32)])

    def increment_staleness(self, num_tokens: int, policy_only: bool = False) -> None:
        """One weight update happened. Tokens not yet tracked start at 1. `policy_only`: the
        request holds no KV (evicted or not started), so there is no KV to age."""
        self.policy_staleness = self._grow(self.policy_staleness, num_tokens) + 1
        if not policy_only:
            self.kv_cache_staleness = self._grow(self.kv_cache_staleness, num_tokens) + 1

    def staleness(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(policy, kv) counters for every token, zeros for tokens newer than the last update."""
        return (
            self._grow(self.policy_staleness, num_tokens)[:num_tokens],
            self._grow(self.kv_cache_staleness, num_tokens)[:num_tokens],
        )
