"""Speculative decoding on the engine's side: which requests speculate, their draft tokens for
the next step, and the acceptance counters (`Speculation`).

Pure: numpy and ints, no torch, no sockets. The scheduler (actors/engine/scheduler.py) asks
`propose` while it plans a decode row and hands each verify row's result to `count`; the gpu
actor verifies (actors/gpu/speculative.py, ops/speculative.py). Drafting is prompt lookup
(actors/engine/ngram.py), one incremental index per request, kept on the request (`ngram`).

The contract of a speculative row (InferenceConfig.num_speculative_tokens = k > 0):
- It is planned only when its request's last token is known on the host (no step in flight
  holds it: a speculative request never reads `prev_rows`, so with overlap it runs every other
  step at most). Its chunk holds 1 + d query tokens, the last known token and d <= k drafts
  (d may be 0), at positions start..start+d, each with a KV slot; d is cut so that the row fits
  the step's token budget and the free blocks, and so that d + 1 new tokens stay within
  max_tokens and max_sequence_length.
- The gpu scores all d + 1 positions and returns the accepted drafts and one more token
  (StepResult.spec_tokens). The scheduler appends them in order with the usual stop checks (a
  stop ends the request there and drops the tokens after it); the request's computed tokens
  are then start + 1 + accepted. The rejected drafts' KV lies beyond that and is overwritten by
  the next steps; their blocks stay with the request (at most the blocks of k more tokens, which
  its admission already counted: prompt + max_tokens), and go back when it ends.

Which requests speculate (v1): those with `SamplingParams.speculative` (the default) and none
of log-probs or top-n, logit controls (penalties, logit_bias, min_tokens, bad words), a grammar
(structured outputs) or routed experts: those decode one token per step as without
speculation (each needs per-position work the verify step does not do yet). Hybrid (Mamba /
GDN) models refuse speculation at start-up (their recurrent state would have to be rolled back
to the last accepted position; not built). Verify steps run eagerly, never from a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.engine.ngram import NgramDrafter, NgramIndex
from taipan.actors.engine.request import EngineRequest

__all__ = ["Speculation"]


class Speculation:
    """The drafter (`k` tokens at most per row) and its counters for one engine rank."""

    def __init__(self, k: int, ngram_min: int, ngram_max: int) -> None:
        if k < 1:
            raise ValueError(f"speculation needs k >= 1 draft tokens, got {k}")
        self.k = k
        self.drafter = NgramDrafter(ngram_min, ngram_max, k)
        self.draft_tokens = 0  # drafts verified
        self.accepted_tokens = 0  # of which accepted
        self.verify_rows = 0  # rows that verified at least one draft
        self.accepted_per_position = [0] * k  # rows whose draft j was accepted

    @staticmethod
    def eligible(r: EngineRequest) -> bool:
        """Whether `r` speculates (the module docstring's v1 rule)."""
        s = r.sampling
        return bool(
            s.speculative
            and not (s.return_log_probs or s.top_n_logprobs)
            and not s.has_controls
            and s.structured is None
            and not s.return_routed_experts
        )

    def propose(self, r: EngineRequest, limit: int) -> np.ndarray:
        """Up to min(k, limit) draft tokens (int32) to follow `r`'s known tokens. Its index
        takes in only the tokens that arrived since the last call."""
        index = r.ngram
        if index is None or index.num_tokens > r.num_tokens:
            index = r.ngram = NgramIndex(self.drafter)
        p, n = len(r.prompt), index.num_tokens
        if n < p:
            index.append(r.prompt[n:])
            n = p
        if n < r.num_tokens:
            index.append(np.asarray(r.generated[n - p :], dtype=np.int32))
        if limit <= 0:
            return np.zeros(0, np.int32)
        return index.lookup(limit)

    def count(self, drafted: int, accepted: int) -> None:
        """One verify row's outcome: `accepted` of its `drafted` drafts passed."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_rows += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def stats(self) -> dict:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_verify_rows": self.verify_rows,
            "spec_accepted_per_position": tuple(self.accepted_per_position),
        }
