"""What a step's result does to each request, and what a request reports: the token append,
the stop checks, the log-probs (`append_token`, `take_prompt_log_probs`), and the next
RequestOutput of a request (`output_of`).

Pure: each function reads the StepResult's arrays and changes one EngineRequest; ending a
request (its blocks, its slot, the queues) is the scheduler's (`Scheduler._finish`), told by
the FinishReason returned here. No sockets, no torch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.actors.config import RuntimePlan
from taipan.actors.engine.request import EngineRequest
from taipan.messages.codec import encode_frame
from taipan.messages.gpu import StepResult
from taipan.messages.requests import (
    EventType,
    FinishReason,
    RequestOutput,
    StepOutputs,
    stream_frame,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Appending:
    """What every token appended from one step's result shares: the time its result came,
    the runtime plan (EOS ids), whether GENERATED_TOKEN events are kept, and the weight
    version that sampled the step."""

    now: float
    plan: RuntimePlan
    track_events: bool
    weight_version: int
    # The step's sampled tokens as Python ints (StepResult.token_ids.tolist(): one conversion
    # a step, not one a row); None when the step failed (nothing is appended then).
    tokens: list[int] | None


# A verify row's new token (one of several), its raw log-prob and top-n (ids, log-probs); the
# last two None where the request does not ask for them.
Verified = tuple[int, float | None, tuple[np.ndarray, np.ndarray] | None]


def append_token(
    r: EngineRequest, res: StepResult, i: int, step: Appending, verified: Verified | None = None
) -> FinishReason | None:
    """Append row i's sampled token (and its log-probs) to `r`, or the `verified` one instead;
    the reason `r` ends, if any."""
    now = step.now
    token, log_prob, top = (None, None, None) if verified is None else verified
    tok = step.tokens[i] if token is None else token
    r.generated.append(tok)
    if not r.weight_versions or r.weight_versions[-1][0] != step.weight_version:
        r.weight_versions.append((step.weight_version, len(r.generated) - 1))
    if r.first_token_time is None:
        r.first_token_time = now
    r.last_token_time = now
    s = r.sampling
    if s.return_log_probs:
        r.log_probs.append(float(res.log_probs[i]) if token is None else float(log_prob))
    if s.top_n_logprobs:
        n = s.top_n_logprobs
        if token is None:
            top = (res.top_n_ids[i, :n].copy(), res.top_n_log_probs[i, :n].copy())
        r.top_n.append(top)
    if step.track_events:
        r.add_event(EventType.GENERATED_TOKEN, now, tok)
    return stop_reason(r, tok, step.plan)


def take_prompt_log_probs(r: EngineRequest, res: StepResult, k: int, n: int) -> None:
    """`r`'s n prompt log-probs from offset k of the step's compacted prompt log-probs."""
    r.prompt_log_probs.extend(res.prompt_log_probs[k : k + n].tolist())
    top = r.sampling.top_n_logprobs
    if r.sampling.return_prompt_top_n_logprobs and top:
        for j in range(k, k + n):
            r.prompt_top_n.append(
                (res.prompt_top_n_ids[j, :top].copy(), res.prompt_top_n_log_probs[j, :top])
            )


def stop_reason(r: EngineRequest, tok: int, plan: RuntimePlan) -> FinishReason | None:
    """Why `r` ends with its new token `tok` (a completed stop word is dropped unless asked
    for), or None. Before `min_tokens` tokens only the length ends it (as vLLM's: EOS and
    stop tokens cannot be sampled then, and no stop word ends it)."""
    s = r.sampling
    if len(r.generated) >= s.min_tokens:
        if not s.ignore_eos and tok in plan.eos_token_ids:
            return FinishReason.STOP
        if tok in s.stop_token_ids:
            return FinishReason.STOP
        for word in s.stop_word_ids:
            if tuple(r.generated[-len(word) :]) == tuple(word):
                if not s.include_stop_word:
                    drop_tail(r, len(word))
                return FinishReason.STOP
    if len(r.generated) >= s.max_tokens or r.num_tokens >= plan.max_sequence_length:
        return FinishReason.LENGTH
    return None


def drop_tail(r: EngineRequest, n: int) -> None:
    """Remove a matched stop word (never streamed: `holdback` kept it back)."""
    n = min(n, len(r.generated) - r.num_streamed)
    del r.generated[len(r.generated) - n :]
    del r.log_probs[len(r.generated) :]
    del r.top_n[len(r.generated) :]
    while r.weight_versions and r.weight_versions[-1][1] >= len(r.generated):
        r.weight_versions.pop()


def output_of(r: EngineRequest) -> RequestOutput:
    """The next RequestOutput of `r`: its streamable tokens (all, once it has ended), their
    log-probs, and on the terminal output the prompt log-probs, events, timings and routed
    experts."""
    start = r.num_streamed
    stop = start + r.ready_to_stream() if r.stream else len(r.generated)
    if r.finish_reason is not None:
        stop = len(r.generated)
    r.num_streamed = stop
    finished = r.finish_reason is not None
    kw = {}
    if r.sampling.return_log_probs:
        kw["log_probs"] = np.asarray(r.log_probs[start:stop], dtype=np.float32)
    if r.sampling.top_n_logprobs:
        kw["top_n_ids"], kw["top_n_log_probs"] = _stack(r.top_n[start:stop], r.sampling)
    if stop > start:
        kw["weight_versions"] = version_spans(r.weight_versions, start, stop)
    if finished:
        if r.wants_prompt_log_probs:
            kw["prompt_log_probs"] = np.asarray(r.prompt_log_probs, dtype=np.float32)
        if r.prompt_top_n:
            kw["prompt_top_n_ids"], kw["prompt_top_n_log_probs"] = _stack(
                r.prompt_top_n, r.sampling
            )
        policy, kv = r.history.staleness(r.num_tokens)
        kw.update(
            events=tuple(r.events),
            ttft=r.ttft,
            tpot=r.tpot,
            policy_staleness=policy,
            kv_cache_staleness=kv,
        )
        if r.routed is not None:  # every position but the last token's (never run)
            kw["routed_experts"] = r.routed.first(r.num_tokens - 1)
    return RequestOutput(
        r.request_id,
        np.asarray(r.generated[start:stop], dtype=np.int32),
        finished,
        r.finish_reason,
        r.error,
        len(r.prompt),
        len(r.generated),
        r.num_cached_tokens,
        **kw,
    )


def step_outputs(requests: list[EngineRequest]) -> StepOutputs:
    """The StepOutputs reporting `requests` (each its `output_of`). A streaming request's
    output that is not its last, without log-probs and of one weight version, is packed
    straight into its frame (`stream_frame`, the same bytes): at batch 64 every step sends 64
    of them."""
    ids = np.empty(len(requests), dtype=np.int64)
    finished = np.zeros(len(requests), dtype=np.bool_)
    frames = []
    for i, r in enumerate(requests):
        ids[i] = r.request_id
        frame = _stream_frame(r)
        if frame is None:
            out = output_of(r)
            finished[i] = out.finished
            frame = encode_frame(out)
        frames.append(frame)
    return StepOutputs(ids, finished, tuple(frames))


def _stream_frame(r: EngineRequest) -> bytes | None:
    """`encode_frame(output_of(r))` for a streamed output that is not the last and carries
    tokens of one weight version and no log-probs; None (nothing changed) for any other."""
    s = r.sampling
    spans = r.weight_versions
    if r.finish_reason is not None or not r.stream or len(spans) != 1:
        return None
    if s.return_log_probs or s.top_n_logprobs:
        return None
    start = r.num_streamed
    stop = start + r.ready_to_stream()
    version, first = spans[0]
    if stop <= start or first >= stop:
        return None
    r.num_streamed = stop
    return stream_frame(
        r.request_id,
        r.generated[start:stop],
        len(r.prompt),
        len(r.generated),
        r.num_cached_tokens,
        ((version, max(first, start)),),
    )


def version_spans(spans: list[tuple[int, int]], start: int, stop: int) -> np.ndarray:
    """int64[S, 2]: the (version, first token index) spans of `spans` (over all generated
    tokens) that cover tokens [start, stop), the first one cut to begin at `start`."""
    out = []
    for j, (version, first) in enumerate(spans):
        end = spans[j + 1][1] if j + 1 < len(spans) else stop
        if first < stop and end > start:
            out.append((version, max(first, start)))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _stack(pairs, sampling) -> tuple[np.ndarray, np.ndarray]:
    n = sampling.top_n_logprobs
    if not pairs:
        return np.zeros((0, n), np.int32), np.zeros((0, n), np.float32)
    ids = np.stack([p[0] for p in pairs]).astype(np.int32)
    lps = np.stack([p[1] for p in pairs]).astype(np.float32)
    return ids, lps
