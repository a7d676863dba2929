"""Requests family (tags 20-39): submitting, streaming, aborting; model info for clients.

Ids: a client numbers its own requests (`SubmitRequest.request_id`, unique per client
connection); the coordinator maps (client, id) to a global id that engines see. Every accepted
request ends with exactly one `RequestOutput` whose `finished` is true.
"""

from __future__ import annotations

import numpy as np

from messages.codec import message, struct

FINISH_REASONS = ("stop", "length", "abort", "error")


@struct
class SamplingParams:
    """How to sample one request. `max_tokens` counts generated tokens (OpenAI's meaning).

    temperature 0 is greedy; top_k 0 and top_p 1.0 are off; seed None draws from fresh entropy
    (the engine picks one), a given seed makes the draws reproducible whatever the batch holds.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        """What is wrong with these parameters, as sentences a user can act on."""
        out = []
        if self.max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            out.append("stop_token_ids must be non-negative")
        return out


@message(20)
class SubmitRequest:
    """Client -> coordinator. `prompt_token_ids` is a 1-D int32 array."""

    request_id: int
    prompt_token_ids: np.ndarray
    sampling: SamplingParams
    stream: bool


@message(21)
class EngineSubmit:
    """Coordinator -> engine: a request under its global id."""

    request_id: int
    prompt_token_ids: np.ndarray
    sampling: SamplingParams
    stream: bool
    arrival_time: float


@message(22)
class RequestOutput:
    """Engine -> coordinator -> client: new tokens of one request, and whether it ended.

    Streaming requests get a delta per step; others get one output with every generated token.
    The terminal output (`finished`) carries `finish_reason` in FINISH_REASONS and, for
    "error", the `error` text.
    """

    request_id: int
    new_token_ids: np.ndarray
    finished: bool
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_generated_tokens: int


@message(23)
class AbortRequest:
    request_id: int


@message(24)
class GetModelInfo:
    """Client -> coordinator. Answered with ModelInfo once an engine has loaded its model."""


@message(25)
class ModelInfo:
    """What a client needs to tokenize and detokenize: the tokenizer travels with the model."""

    model: str
    tokenizer: str
    max_sequence_length: int
    num_ranks: int
