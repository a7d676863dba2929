"""GPU family (tags 120-139): engine <-> gpu actor.

Contract: the gpu actor owns the weights and the KV cache tensors; it never decides what to run.
The engine sends one `StepPlan` per step and gets one `StepResult` back. Arrays are numpy.
"""

from __future__ import annotations

import numpy as np

from messages.codec import message


@message(120)
class LoadModel:
    """Load weights and size the KV cache: as many blocks as `kv_cache_gb` holds, at most
    `max_blocks` (more than every admissible request can use would only waste memory)."""

    model: str
    dtype: str
    device: str
    block_size: int
    max_blocks: int
    kv_cache_gb: float


@message(121)
class ModelLoaded:
    """`tokenizer` is the JSON wire form of ops.tokenizer.Tokenizer (see ModelInfo)."""

    model: str
    num_blocks: int
    block_size: int
    vocab_size: int
    max_position_embeddings: int
    tokenizer: str
    eos_token_ids: tuple[int, ...]


@message(122)
class StepPlan:
    """One forward over B sequences and T tokens (varlen, no padding).

    input_ids int32[T], positions int32[T], slot_mapping int64[T];
    query_start_loc int32[B+1], seq_lens int32[B] (context after this step), block_tables
    int32[B, max_blocks]; sample int8[B] (1 = this sequence's last token is sampled);
    temperature float32[B], top_k int32[B], top_p float32[B], seeds int64[B], gen_index int32[B].
    """

    step: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sample: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    gen_index: np.ndarray


@message(123)
class StepResult:
    """token_ids int32[B] (-1 where not sampled); `error` set if the forward failed."""

    step: int
    token_ids: np.ndarray
    error: str | None
    forward_seconds: float
