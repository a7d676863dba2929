"""A launched step's grammar check (actors/gpu/grammar_masks.py owns the matchers and runs
it): the `Check` a step with greedy grammar rows leaves for its collect, which of the next
step's rows are void because they read a token it replaced ("check" mode), and the device work
around a rejected row: its best candidates, and its replacement from its own logits (the best
allowed token, or a drawn row drawn again over the allowed tokens with its noise).

Must not touch the step's buffers; the matchers only through the Grammars a caller passes
(GrammarMasks, under its lock, or the verify path: actors/gpu/speculative.py).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from taipan.actors.gpu.host_staging import to_device, to_host
from taipan.messages.gpu import StepPlan
from taipan.ops.grammar import masked_argmax, masked_draw
from taipan.ops.sampling import GREEDY_EPS

CHECK_TIMEOUT_S = 60.0  # a step's check waits for that step's collect, which waits for the device
# "wait" mode: a checked row's best candidates (logit and id) come to the host with its step's
# tokens (the next forward waits for the check, so a device round trip there would cost every
# step; "check" mode's costs only the collect, on a side stream, and skips the top-k): where
# its grammar rejects the greedy token, the first candidate it allows is the masked argmax
# (when strictly above the K-th logit: every token of that logit is then among them), found
# with `try_consume` alone, no mask and no device round trip before the next step's forward.
# SmolLM2 on the CPU, 32 json_schema streams: 32 candidates take 78 % of the rejected rows (8:
# 58 %, 128: 82 %), and a step's check fell from 3.1 ms to 1.7 ms (8: 2.0 ms).
CHECK_CANDIDATES = 32


def seq_prev_rows(plan: StepPlan) -> np.ndarray:
    """For each sequence of `plan`, the previous step's row its first token is read from
    (StepPlan.prev_rows; -1: from the plan's input ids)."""
    if not len(plan.prev_rows):
        return np.full(len(plan.sample), -1, dtype=np.int64)
    return plan.prev_rows[plan.query_start_loc[:-1]].astype(np.int64)


@dataclasses.dataclass
class Check:
    """A launched step's checked rows, checked when the step is collected (`run_check`)."""

    ids: np.ndarray  # their request ids
    rows: np.ndarray  # their rows in the step
    host: torch.Tensor  # [B] the step's tokens on the host (filled once the step has ended)
    sampled: torch.Tensor  # [>= B] the device tokens the next step's prev_rows read
    # [B, V] the step's controlled logits ("wait": not overwritten before `done`), or, when the
    # next step does not wait, [rows, V] the checked rows' own copy.
    logits: torch.Tensor
    # ([rows, K] logits, [rows, K] ids) of each row's best candidates, on the host once the
    # step has ended (None: none taken).
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    # The next step does not wait ("check"): the replaced tokens stay off the device, and
    # `fixed` lists their rows (StepResult.grammar_fixed). `prev`: the previous step's row each
    # checked row read its input from (-1: none), and `before`, that step's Check when it was
    # not waited for: a row that read a token it replaced is void (`void`), not checked.
    optimistic: bool = False
    # ("check" mode) the checked rows' temperatures and noise keys ([rows], on the device)
    # when any of them is drawn, not greedy: a refused draw is drawn again with its own key.
    temps: np.ndarray | None = None
    keys: torch.Tensor | None = None
    prev: np.ndarray | None = None
    before: Check | None = None
    fixed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    void: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """The step's collect failed before the check could run: the next launch raises."""
        self.error = error
        self.done.set()


def wait_done(check: Check) -> None:
    if not check.done.wait(CHECK_TIMEOUT_S):
        raise RuntimeError(
            f"structured outputs: the previous step's grammar check did not run within "
            f"{CHECK_TIMEOUT_S:.0f} s (its collect never came)"
        )
    if check.error is not None:
        raise RuntimeError(
            f"structured outputs: the previous step's grammar check failed: {check.error!r}"
        )


def void_of(prev: np.ndarray, before: Check | None) -> np.ndarray:
    """Which of the rows whose inputs came from `prev` (rows of the step before) read a token
    that step's check replaced (`before`, collected: its check has run)."""
    if before is None or not before.optimistic:
        return np.zeros(len(prev), dtype=bool)
    wait_done(before)  # (collected before this one: at once)
    if not len(before.fixed):  # (most steps: it replaced nothing)
        return np.zeros(len(prev), dtype=bool)
    return np.isin(prev, before.fixed) & (prev >= 0)


def rows_of(t: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """A copy of `rows` of `t` (on its device; consecutive rows by a slice, no index upload)."""
    lo = int(rows[0])
    if int(rows[-1]) - lo + 1 == len(rows):
        return t[lo : lo + len(rows)].clone()
    return t.index_select(0, to_device(rows, t.device))


def queued_candidates(rows: np.ndarray, logits: torch.Tensor):
    """("wait" mode) the rows' best CHECK_CANDIDATES (logits, ids), copied to the host
    without waiting (the step's end event, recorded after this, covers the copy)."""
    k = min(CHECK_CANDIDATES, logits.shape[1])
    # (unsorted: `first_allowed` orders them; torch's sorted top-k waited on
    # the host for the step's forward to end, the unsorted one does not:
    # tests/perf/host_sync_probe.py, H200, 546 ms against 0.30 ms behind a 0.5 s kernel)
    rows_on = logits.index_select(0, to_device(rows, logits.device))
    values, ids = torch.topk(rows_on, k, sorted=False)
    if logits.device.type != "cuda":
        return values, ids
    return to_host(values), to_host(ids)


def top_candidates(at: np.ndarray, saved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best CHECK_CANDIDATES (logits, ids) of the checked rows `at` (their own logits
    `saved`, [rows, V]), on the host."""
    picked = saved[torch.from_numpy(at).to(saved.device)]
    values, ids = torch.topk(picked, min(CHECK_CANDIDATES, saved.shape[1]), sorted=False)
    return values.cpu(), ids.cpu()


def best_allowed(masks: np.ndarray, rows: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
    """The best token under `masks` of each of `rows` of `logits` ([N, V]), on the host (a
    check's: its step has ended)."""
    on = torch.from_numpy(masks).to(logits.device)
    return masked_argmax(logits[torch.from_numpy(rows).to(logits.device)], on).cpu()


def replacements(masks, at, logits, temps=None, keys=None) -> torch.Tensor:
    """Rejected rows `at` of `logits` ([N, V], a check's copy): each one's token under its mask
    (`masks`, one row per entry of `at`), on the host: the best, or for a drawn row (`temps`
    per row of `logits`, at or above GREEDY_EPS) the draw again with its own noise (`keys` per
    row of `logits`; `masked_draw`: the token masking first gives)."""
    drawn = temps[at] >= GREEDY_EPS if temps is not None else np.zeros(len(at), dtype=bool)
    if not drawn.any():
        return best_allowed(masks, at, logits)
    out = torch.empty(len(at), dtype=torch.int64)
    if not drawn.all():
        out[torch.from_numpy(~drawn)] = best_allowed(masks[~drawn], at[~drawn], logits)
    device = logits.device
    on = torch.from_numpy(at[drawn]).to(device)
    temps_on = torch.from_numpy(temps[at[drawn]]).to(device)
    got = masked_draw(logits[on], to_device(masks[drawn], device), temps_on, keys[on])
    out[torch.from_numpy(drawn)] = got.cpu()
    return out


def first_allowed(grammars, ids: np.ndarray, at: np.ndarray, top, drawn=None) -> np.ndarray:
    """For each rejected greedy row (request `ids[i]`, index `at[i]` into the candidates `top`,
    ([rows, K] logits, [rows, K] ids) on the host), the first of its candidates (by logit, then
    lowest id, as argmax) that its grammar takes, consumed (`grammars`, ops/grammar.py); -1
    where none strictly above the K-th logit does, and for a drawn row (`drawn[i]`: its
    replacement is drawn again, `replacements`)."""
    best = np.full(len(ids), -1, dtype=np.int64)
    if top is None:
        return best
    values, tokens = top[0].numpy(), top[1].numpy()
    for i, rid in enumerate(ids.tolist()):
        if drawn is not None and drawn[i]:
            continue
        row_values, row_tokens = values[at[i]], tokens[at[i]]
        floor = row_values.min()
        for j in np.lexsort((row_tokens, -row_values)).tolist():
            if row_values[j] <= floor:
                break
            if grammars.try_consume(rid, int(row_tokens[j])):
                best[i] = row_tokens[j]
                break
    return best


def masked_best(grammars, ids: np.ndarray, rows: np.ndarray, logits: torch.Tensor):
    """The best token of each of `rows`' logits under its request's mask (`grammars`), device
    int64."""
    device = logits.device
    masks = to_device(grammars.masks(ids), device)
    return masked_argmax(logits.index_select(0, to_device(rows, device)), masks)
