"""StepResult's log-prob arrays for one step, built from its logits and hidden states.

Owns which rows get log-probs (the sampled rows that ask, and every input token with a prompt
target), the padding of the arrays (NaN, and -1 ids), which sampled rows are processed
(StepPlan.logprobs_mode; prompt log-probs are always raw) and how many prompt or processed rows
go through the logits at a time. The math is ops/logprobs.py's. It runs after the step's forward
and sampling, on the logits they left (a graph's static buffer is read, never written), so it is
the same code eager or after a CUDA graph's replay. Must not touch the worker's state, the KV
cache or the sampled tokens: it reads tensors. On CUDA nothing here waits for the device: the
log-probs are computed on the stream and copied to pinned host memory without waiting
(`PendingLogProbs`), and their numpy arrays are built when the step is collected, after its end
event, so a step with log-probs (every step of an RL rollout) overlaps the next one's launch
as a step without does (it used to wait for its own forward in its launch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from taipan.actors.gpu.host_staging import to_device, to_host
from taipan.messages.gpu import StepPlan
from taipan.ops.logprobs import (
    log_probs_and_top_n,
    processed_log_probs_and_top_n,
    prompt_log_probs,
    token_log_probs,
)
from taipan.ops.sampling import GREEDY_EPS

# Prompt log-probs build fp32 logits at most this many rows, and elements, at a time.
PROMPT_LOGITS_MAX_ROWS = 1024
PROMPT_LOGITS_MAX_ELEMENTS = 1 << 26  # 256 MiB
# Processed log-probs sort this many logits at a time (64 MiB of fp32, and about 4x that in the
# sort's ids and the filters' temporaries).
PROCESSED_MAX_ELEMENTS = 1 << 24
PROCESSED_PARAMS = ("temperature", "top_k", "top_p", "min_p")  # processed_log_probs_and_top_n's


def wants_log_probs(plan: StepPlan) -> bool:
    return bool(plan.top_n.any() or plan.logprobs.any() or (plan.prompt_targets >= 0).any())


def log_probs_never_wait(plan: StepPlan) -> bool:
    """Whether computing `plan`'s log-probs only queues work on the stream: no top-n (a sorted
    top-k, which tests/perf/host_sync_probe.py found waiting for the stream) and no processed
    rows (sort-based filters), as an RL rollout's raw log-probs of its sampled tokens. Such a
    step may launch inline; the others launch from the worker's thread, as before."""
    return not plan.top_n.any() and not processed_rows(plan).any()


class PendingLogProbs:
    """A launched step's log-prob arrays, not read yet: device tensors queued to pinned host
    memory (`host`, CUDA; the tensors themselves elsewhere), and the steps that fill the numpy
    arrays from them (`then`), run by `take` once the step's end event has passed. The host
    copies land in the launch's pinned arena (actors/gpu/host_staging.py `to_host`), not in
    memory pinned for each (0.15-0.4 ms of host time apiece, tests/perf/host_sync_probe.py;
    an RL rollout's every step asks)."""

    def __init__(self, device: torch.device, out: dict[str, np.ndarray]):
        self.cuda = device.type == "cuda"
        self.out = out
        self._fill: list[Callable[[], None]] = []

    def host(self, t: torch.Tensor) -> Callable[[], np.ndarray]:
        """`t` queued to the host; returns what reads it there (at `take`)."""
        if not self.cuda:
            return lambda: t.numpy()
        return to_host(t).numpy

    def then(self, fill: Callable[[], None]) -> None:
        self._fill.append(fill)

    def take(self) -> dict[str, np.ndarray]:
        """The arrays (the step's end event has passed)."""
        for fill in self._fill:
            fill()
        self._fill.clear()
        return self.out


def no_log_probs(batch: int, n: int) -> dict[str, np.ndarray]:
    return {
        "log_probs": np.full(batch, np.nan, dtype=np.float32),
        "top_n_ids": np.full((batch, n), -1, dtype=np.int32),
        "top_n_log_probs": np.full((batch, n), np.nan, dtype=np.float32),
    }


@functools.lru_cache(maxsize=64)
def none_asked(batch: int) -> dict[str, np.ndarray]:
    """`no_log_probs(batch, 0)` for a step that asks for none, read-only and shared by every
    such step of `batch` sequences (a StepResult's arrays are read-only once handed over)."""
    out = no_log_probs(batch, 0)
    for a in out.values():
        a.flags.writeable = False
    return out


def log_prob_arrays(
    plan: StepPlan,
    rows: np.ndarray,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor | None,
    *,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    device: torch.device,
    processed_logits: torch.Tensor | None = None,
) -> PendingLogProbs | dict[str, np.ndarray]:
    """StepResult's log-prob arrays when the plan asks for any (pending until the step is
    collected: `PendingLogProbs.take`), else {}. The prompt ones read every token's hidden
    state, so only an eager step (`hidden` not None) has them. `processed_logits`: the logits
    after the plan's sampling controls (actors/gpu/sampling_controls.py), which processed rows
    are of; None: `logits` (no controls)."""
    if not wants_log_probs(plan):
        return {}
    n = int(plan.top_n.max(initial=0))
    both = (logits, logits if processed_logits is None else processed_logits)
    pending = PendingLogProbs(device, no_log_probs(len(plan.sample), n))
    _sampled_log_probs(pending, plan, rows, both, tokens, n, device)
    if hidden is not None:
        _prompt_log_probs(pending, plan, hidden, n, compute_logits, vocab_size, device)
    return pending


def _sampled_log_probs(
    pending: PendingLogProbs,
    plan: StepPlan,
    rows: np.ndarray,
    logits: tuple,
    tokens: torch.Tensor,
    n: int,
    device,
) -> None:
    """StepResult's log_probs / top_n arrays (n columns) for the sampled rows, into `pending`;
    device work only where a sampled row asks for it. `logits`: (raw, after the sampling
    controls)."""
    out = pending.out
    wanted, counts = plan.logprobs[rows] != 0, plan.top_n[rows]
    if not (wanted.any() or counts.any()):
        return
    processed = processed_rows(plan)[rows]
    # A greedy row's processed log-probs are the log-softmax of its controlled logits.
    controlled = processed_mode(plan)[rows] & ~processed
    raw = ~processed & ~controlled
    parts = ((raw, logits[0], False), (controlled, logits[1], False), (processed, logits[1], True))
    for part, part_logits, is_processed in parts:
        if not part.any():
            continue
        if part is raw and not counts[raw].any():  # (every row at once: no index, no top-n)
            _raw_log_probs(pending, rows[raw], wanted[raw], logits[0], tokens)
            continue
        picked, ids, values = _rows_log_probs(
            plan, rows[part], part_logits, tokens, counts[part], n, device, is_processed
        )
        at, keep = rows[part], wanted[part]
        got = (pending.host(picked), pending.host(ids), pending.host(values))

        def fill(at=at, keep=keep, got=got) -> None:
            out["log_probs"][at] = np.where(keep, got[0](), np.nan)
            out["top_n_ids"][at] = got[1]()
            out["top_n_log_probs"][at] = got[2]()

        pending.then(fill)


def _raw_log_probs(
    pending: PendingLogProbs, at: np.ndarray, keep: np.ndarray, logits, tokens
) -> None:
    """The raw log-probs of rows `at` (no top-n) into `pending`: computed for every sequence
    (logits and tokens: [sequences, ...]), which costs the device less than the host's copy of
    an index would, and read at `at`."""
    got = pending.host(token_log_probs(logits[: tokens.shape[0]], tokens))
    out = pending.out

    def fill() -> None:
        out["log_probs"][at] = np.where(keep, got()[at], np.nan)

    pending.then(fill)


def processed_rows(plan: StepPlan) -> np.ndarray:
    """bool[B]: the sequences whose sampled log-probs are processed (logprobs_mode 1), but for
    greedy ones, whose processed log-probs are those of their logits after the sampling
    controls (no temperature or filters: the raw ones, without controls)."""
    return processed_mode(plan) & (plan.temperature >= GREEDY_EPS)


def processed_mode(plan: StepPlan) -> np.ndarray:
    """bool[B]: the sequences that ask for processed log-probs (logprobs_mode 1)."""
    if not len(plan.logprobs_mode):
        return np.zeros(len(plan.seq_lens), dtype=bool)
    return plan.logprobs_mode != 0


def _rows_log_probs(
    plan: StepPlan, rows, logits, tokens, counts, n: int, device, processed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ops/logprobs.py's (log-prob, top-n ids, top-n log-probs) of sampled `rows`, raw or
    processed with the rows' sampling parameters."""
    index = to_device(rows, device, torch.int64)
    args = (logits[index], tokens[index], to_device(counts, device), n)
    if not processed:
        return log_probs_and_top_n(*args)
    params = [to_device(getattr(plan, name)[rows], device) for name in PROCESSED_PARAMS]
    chunk_rows = max(1, PROCESSED_MAX_ELEMENTS // logits.shape[1])
    return processed_log_probs_and_top_n(*args, *params, chunk_rows=chunk_rows)


def _prompt_log_probs(
    pending: PendingLogProbs,
    plan: StepPlan,
    hidden: torch.Tensor,
    n: int,
    compute_logits,
    vocab_size: int,
    device,
) -> None:
    """StepResult's prompt_* arrays, into `pending`: one row per input token with a prompt
    target."""
    out = pending.out
    tokens = np.flatnonzero(plan.prompt_targets >= 0)
    if len(tokens) == 0:
        out["prompt_log_probs"] = np.zeros(0, dtype=np.float32)
        out["prompt_top_n_ids"] = np.zeros((0, n), dtype=np.int32)
        out["prompt_top_n_log_probs"] = np.zeros((0, n), dtype=np.float32)
        return
    seq = np.searchsorted(plan.query_start_loc, tokens, side="right") - 1
    by_vocab = PROMPT_LOGITS_MAX_ELEMENTS // vocab_size
    picked, ids, values = prompt_log_probs(
        hidden[to_device(tokens, device, torch.int64)],
        to_device(plan.prompt_targets[tokens], device, torch.int64),
        to_device(plan.top_n[seq], device),
        n,
        compute_logits,
        chunk_rows=max(1, min(PROMPT_LOGITS_MAX_ROWS, by_vocab)),
    )
    got = (pending.host(picked), pending.host(ids), pending.host(values))

    def fill() -> None:
        out["prompt_log_probs"] = got[0]()
        out["prompt_top_n_ids"] = got[1]().astype(np.int32)
        out["prompt_top_n_log_probs"] = got[2]()

    pending.then(fill)
