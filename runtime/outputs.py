"""What a client hands back for a request: a `Completion` (generate) or `Delta`s (stream), both
carrying `RequestDetails` (log-probs, events, timings, staleness), and `RequestError` for a
request that ended in error. `make_delta` builds a Delta from the engine's RequestOutput
(messages/requests.py) and the text the client's detokenizer made of it (ops/stop_strings.py);
the client (runtime/client.py) gathers a request's deltas into its Completion. Plain data and
conversion: no sockets, no torch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.messages.requests import FinishReason, RequestEvent, RequestOutput, SamplingParams
from taipan.ops.stop_strings import StoppingDetokenizer

TopN = list[dict[int, float]]  # per token: {token id: log-prob} of its top-n candidates


class RequestError(RuntimeError):
    """A request ended with finish_reason "error"; the text says why."""


@dataclasses.dataclass(kw_only=True)
class RequestDetails:
    """What Completion and Delta carry beside tokens and text. Log-prob fields are None unless
    asked for in SamplingParams: `log_probs` (one per token, with `return_log_probs`),
    `top_n_logprobs` (with `top_n_logprobs` > 0), both raw or processed as
    SamplingParams.logprobs_mode says, `prompt_log_probs` (one per prompt token after the
    first) and `prompt_top_n_logprobs` (always raw). `events`, `ttft` and `tpot` come from the
    engine (seconds); `policy_staleness` / `kv_cache_staleness` count, per token of prompt +
    generated, the weight updates since it was produced / since its K/V were computed (RL).
    `num_cached_tokens`: prompt tokens whose K/V came from the prefix cache (0 without
    prefix caching). `weight_versions`: the weight version of each generated token as spans
    (version, first token index), over the request's generated tokens (a Delta's cover its own
    tokens, with indices counted from the request's first token); a new span starts where the
    version changes (a weight update while the request was paused), so with versions that
    grow by one per update, the spans starting after a token are its policy staleness.
    `routed_experts` (with SamplingParams.return_routed_experts; a MoE model): an int16 (int32
    past 32767 experts) numpy array [N, MoE layers, top_k], the expert ids each MoE layer chose
    for positions 0..N-1 of prompt + output, N = tokens - 1 (the last token is never run
    through the model), each the routing of the forward that first computed it (kept through
    preemption, recompute and prefix-cache hits); on Completion and the last Delta only."""

    log_probs: list[float] | None = None
    top_n_logprobs: TopN | None = None
    prompt_log_probs: list[float] | None = None
    prompt_top_n_logprobs: TopN | None = None
    events: list[RequestEvent] = dataclasses.field(default_factory=list)
    ttft: float | None = None
    tpot: float | None = None
    policy_staleness: list[int] | None = None
    kv_cache_staleness: list[int] | None = None
    num_cached_tokens: int = 0
    weight_versions: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass
class Completion(RequestDetails):
    """One finished request (see RequestDetails for the optional fields). `stop_reason` (as
    vLLM's): the stop string that ended it, or the stop token id (one of `stop_token_ids`) that
    did; None otherwise (EOS, a stop word given as ids, any other finish reason)."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None = None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class Delta(RequestDetails):
    """New text of a streamed request, with the log-probs of its tokens (None unless asked).
    The last delta (`finished`) also carries the prompt log-probs, events, timings, staleness
    and `stop_reason` (as Completion's)."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None
    stop_reason: str | int | None = None


def _top_n(ids: np.ndarray, log_probs: np.ndarray) -> TopN:
    return [
        dict(zip(i, lp, strict=True))
        for i, lp in zip(ids.tolist(), log_probs.tolist(), strict=True)
    ]


def delta_versions(out: RequestOutput, n: int) -> list[tuple[int, int]]:
    """The weight-version spans of the first `n` tokens of `out` (those the client keeps)."""
    spans = [(int(v), int(first)) for v, first in out.weight_versions.tolist()]
    if not spans or n == 0:
        return []
    end = spans[0][1] + n
    return [s for s in spans if s[1] < end]


def join_versions(
    spans: list[tuple[int, int]], more: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """`spans` followed by the spans of the tokens after them (`more`), as one list: a span
    that goes on with the same version is not started again."""
    out = list(spans)
    for version, first in more:
        if not out or out[-1][0] != version:
            out.append((version, first))
    return out


def _token_log_probs(out: RequestOutput, sampling: SamplingParams):
    """(log_probs, top_n) of the tokens in `out`, each None when the request did not ask."""
    log_probs = out.log_probs.tolist() if sampling.return_log_probs else None
    top = _top_n(out.top_n_ids, out.top_n_log_probs) if sampling.top_n_logprobs else None
    return log_probs, top


def _final_fields(out: RequestOutput, sampling: SamplingParams, num_tokens: int) -> dict:
    """What only the terminal output carries, as Completion/Delta keyword arguments; per-token
    staleness cut to the `num_tokens` of prompt + output (the engine may have generated past a
    stop string before its abort arrived)."""
    fields: dict = {
        "events": list(out.events),
        "ttft": out.ttft,
        "tpot": out.tpot,
        "policy_staleness": out.policy_staleness[:num_tokens].tolist(),
        "kv_cache_staleness": out.kv_cache_staleness[:num_tokens].tolist(),
        "num_cached_tokens": out.num_cached_tokens,
    }
    if sampling.return_log_probs and not sampling.skip_prompt_log_probs:
        fields["prompt_log_probs"] = out.prompt_log_probs.tolist()
    if sampling.return_prompt_top_n_logprobs:
        fields["prompt_top_n_logprobs"] = _top_n(out.prompt_top_n_ids, out.prompt_top_n_log_probs)
    if sampling.return_routed_experts:  # a copy: the decoded array is a view of the frame
        fields["routed_experts"] = np.array(out.routed_experts[: max(0, num_tokens - 1)])
    return fields


def make_delta(
    out: RequestOutput,
    end: RequestOutput | None,
    sampling: SamplingParams,
    token_ids: list[int],
    text: str,
    reader: StoppingDetokenizer,
    num_tokens: int,
) -> Delta:
    """The Delta of `out` (its first `len(token_ids)` tokens); `end`, the request's terminal
    output, when this is the last."""
    log_probs, top_n = _token_log_probs(out, sampling)
    n = len(token_ids)
    reason, error, stop_reason = out.finish_reason, out.error, reader.stop_reason
    if stop_reason is not None:
        reason, error = FinishReason.STOP, None
    elif reason == FinishReason.STOP and token_ids and token_ids[-1] in sampling.stop_token_ids:
        stop_reason = token_ids[-1]
    return Delta(
        text,
        token_ids,
        end is not None,
        reason if end is not None else None,
        error,
        stop_reason,
        log_probs=None if log_probs is None else log_probs[:n],
        top_n_logprobs=None if top_n is None else top_n[:n],
        weight_versions=delta_versions(out, n),
        **({} if end is None else _final_fields(end, sampling, num_tokens)),
    )
