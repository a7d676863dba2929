"""Structured outputs in the gpu worker: the step's grammar rows masked before sampling
(StepPlan.grammar_rows / grammar_new / grammar_drop; ops/grammar.py holds the matchers).

Each grammar request's matcher must have consumed the token sampled for it in the step before
the mask of this step is computed. With overlapped steps that token is still on the device when
this step is launched, so `GrammarMasks` keeps the last grammar step's sampled tokens (their
host copy and the event after it) and consumes them first thing in the next grammar step: a
wait for the previous step only, while this step's forward is already queued behind it. A
plan with grammar rows is therefore never launched inline on the event loop
(ModelWorker.launches_inline): that wait would block the loop.

Greedy rows are checked, not masked: a greedy row's grammar-free choice (after the logit
controls) that its grammar allows there is exactly the choice under the mask (masking only
removes tokens), so its mask is computed only when the grammar rejects that token, and the row
then takes the masked logits' best token. Masks cost the host ~2 ms per step for 64 JSON rows
on an H100's host (tests/perf/NOTES.md), and a step's sampling waits for them; a check costs
microseconds per row once the step's tokens are on the host. So, in "check" mode, is a
temperature draw with no top-k, top-p or min-p: the sampler's race keeps its unmasked winner
whenever that is allowed, and a refused draw is drawn again over the allowed tokens with the
same noise (`_checked_kind`). Rows whose log-probs are "processed" (of the masked distribution)
and other sampled rows keep their masks.

The check runs after the step, not inside its launch (`check_later`, then `run_check` where the
step is collected, on the host copy its collect waits for anyway). A step with log-probs or
drafts checks in its launch (`checked`): what it reports of its tokens is computed there.

What the next step's forward does meanwhile (`TAIPAN_GRAMMAR_MASKS`, `grammar_mode`):
- "check" (the default; "wait" on a model with recurrent layers): the next step does not wait
  for the check. Its rows read the unchecked tokens, so where the check replaced a row's token
  (StepResult.grammar_fixed) that request's row in the next step is void: the engine drops its
  token and plans the position again with the replaced token (the rewrite of its KV slot makes
  the void one harmless), and the check of the next step skips it. Greedy outputs are those of
  the waiting path; a rejected token costs its request one step (about 4 % of the structured
  bench's rows, most in its first steps), where waiting cost every step a host round trip and
  its thread hand-offs (structured cost 0.26-0.45 at batch 64 on an H200, NOTES). Such steps
  launch inline on the gpu actor's loop like plain ones. A request's first token, and the row
  that computes a void position again, are masked as well as checked (their matchers are
  current at the launch, and a model's choice there is the likeliest to be refused: SmolLM2's
  rejected tokens on the structured bench 59 -> 45 of 2,048 on the CPU). A rejected row takes
  the first of its best candidates its grammar allows, else the argmax under its mask, both
  from its own copy of its logits on a side stream (the step's logits are the next step's by
  then, and the main stream runs it).
- "wait": the next step's forward waits for the check (`wait_check`) and reads the replaced
  tokens (written back to the device): no void rows. A rejected row's replacement is, most of
  the time, among its best CHECK_CANDIDATES copied with its step's tokens. A recurrent state
  cannot take a void row back, so hybrids always wait.
- "mask": every grammar row masked in the launch, which waits for the last step's tokens; no
  check. (On an H200 no faster than waiting for the check: NOTES, twenty-third session, also
  for masks computed by a thread of their own with the stream waiting on a host flag: no
  faster, and a deadlock hazard.)
The matchers are shared by the launching thread and the collecting one (`run_check`): one lock.
A step's Check, its void rows and a rejected row's device work are in grammar_check.py.

Must not touch anything but the logits it is given and its own matchers.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from taipan.actors.gpu.grammar_check import (
    Check,
    best_allowed,
    first_allowed,
    masked_best,
    queued_candidates,
    replacements,
    rows_of,
    seq_prev_rows,
    top_candidates,
    void_of,
    wait_done,
)
from taipan.actors.gpu.host_staging import to_device
from taipan.messages.gpu import StepPlan
from taipan.ops.grammar import Grammars, GrammarSpec, apply_masks
from taipan.ops.sampling import GREEDY_EPS

MODE_ENV = "TAIPAN_GRAMMAR_MASKS"
MODES = ("check", "wait", "mask")


def grammar_mode() -> str:
    """$TAIPAN_GRAMMAR_MASKS: "check" (the default), "wait" or "mask" (the module docstring);
    ValueError for any other value."""
    value = os.environ.get(MODE_ENV, "check")
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def uses_grammar(plan: StepPlan) -> bool:
    return bool(len(plan.grammar_rows) or plan.grammar_new or len(plan.grammar_drop))


class GrammarMasks:
    """The worker's structured-output state: its matchers (built at the first grammar step,
    from the model's tokenizer), the last grammar step's sampled tokens not yet consumed, and
    the last launched step's Check."""

    def __init__(self, tokenizer, check_greedy: bool = True, optimistic: bool = False) -> None:
        self.tokenizer = tokenizer
        self.check_greedy = check_greedy  # (grammar_mode() "check" or "wait")
        self.optimistic = optimistic and check_greedy  # ("check" on a model that allows it)
        self.grammars: Grammars | None = None
        self._lock = threading.RLock()  # (the matchers: the launching and collecting threads)
        # (request ids, rows, their prev rows) of the last grammar step's masked rows, then its
        # tokens (host tensor) and the event after their copy (None on the CPU: already there),
        # and the Check before that step (its void rows are not consumed).
        self._rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._tokens: tuple[torch.Tensor, object] | None = None
        self._rows_before: Check | None = None
        self._before: Check | None = None  # (this launch's: `_last` when it was not waited for)
        # (request ids, rows, their prev rows, their temperatures) of this step's checked
        # rows, until `checked` or `check_later` takes them; then the launched step's Check,
        # until the next launch has waited for it. `_last`: the last launched step's Check
        # (None: it had none).
        self._lazy: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._check: Check | None = None
        self._last: Check | None = None
        # Requests whose token a "check" mode check replaced: the row that computes the next
        # position again is masked as well as checked (`_masked`).
        self._redo: set[int] = set()
        self._device: torch.device | None = None  # (the logits': set at the first grammar step)
        # The last launch's grammar rows when every one was checked and nothing was masked:
        # (its `_signature`, then its checked ids, rows, temperatures). A decode step of the
        # same requests in the same rows checks them alike: `_masked` reuses them (most steps
        # of a structured batch).
        self._steady: tuple | None = None
        self._side_stream = None  # (CUDA: the stream a void-mode check's device work runs on)

    @property
    def pending(self) -> bool:
        """Whether a grammar step's tokens wait to be consumed or checked (every later step
        waits for that, grammar rows or not, unless `skips_wait`: the host buffers they sit in
        are reused, and its forward reads the checked tokens). A "check" mode check that has
        run leaves nothing pending: plain steps after the last grammar request do no grammar
        work."""
        if self._rows is not None and self._tokens is not None:
            return True
        check = self._check
        return check is not None and not (check.optimistic and check.done.is_set())

    def skips_wait(self, plan: StepPlan, checks_in_launch: bool) -> bool:
        """Whether `plan`'s launch may skip `wait_check` (the last step's check): "check" mode,
        and no grammar work of its own in the launch that reads checked matchers (a check
        there: log-probs or drafts; masks: a sampled grammar row, or the last step's masked
        rows to consume)."""
        if not self.optimistic or checks_in_launch or self._rows is not None:
            return False
        if self._is_steady(plan):  # (the last launch's rows, all checked: so are these)
            return True
        rows = np.flatnonzero(plan.grammar_rows >= 0)
        if not len(rows):
            return True
        return bool(((plan.sample[rows] != 0) & self._checked_kind(plan, rows)).all())

    def _checked_kind(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` sample a kind of draw a check keeps exact: greedy, or ("check"
        mode) a temperature's race with no top-k, top-p or min-p. The sampler's race over
        allowed tokens, with the row's noise, picks what its unmasked race picked whenever
        that is allowed (masking scales every allowed probability alike); a refused draw is
        drawn again with the same noise over the allowed tokens (`replacements`), so a checked
        row takes the token masking first gives. A nucleus filter cuts the masked
        distribution elsewhere: such rows keep their masks."""
        greedy = plan.temperature[rows] < GREEDY_EPS
        if not self.optimistic or greedy.all():
            return greedy
        race = (plan.top_k[rows] == 0) & (plan.top_p[rows] >= 1.0) & (plan.min_p[rows] <= 0.0)
        return greedy | race

    def inline(self, plan: StepPlan, checks_in_launch: bool) -> bool:
        """Whether a launch of `plan` does no grammar work that waits or takes long on the
        host: "check" mode, no check in the launch (log-probs, drafts, MTP), no grammar to
        compile, no masks to compute or tokens to consume (its grammar rows greedy; no masked
        rows before it)."""
        return not plan.grammar_new and self.skips_wait(plan, checks_in_launch)

    def launched(self, check: Check | None) -> None:
        """Every launch ends here: the step's Check (None: it has none), which the next step's
        void rows are found against."""
        self._last = check

    def masked(self, plan: StepPlan, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """`logits` with each grammar row's disallowed tokens at -inf (a copy when `logits` is
        `raw`, the model's own logits, which the raw log-probs read); `logits` itself when no
        row of `plan` has a grammar."""
        with self._lock:
            return self._masked(plan, logits, raw)

    def _masked(self, plan: StepPlan, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, logits.shape[1])
            self._device = logits.device
        g = self.grammars
        self._lazy = None  # (a step that failed between `masked` and `checked` left its own)
        before, self._before = self._last, None
        self._consume_last()
        steady = self._steady_rows(plan)
        if steady is not None:  # (the last launch's rows, all checked: `_steady`)
            ids, rows, temps = steady
            prev = seq_prev_rows(plan)[rows]
            if before is not None and before.done.is_set():  # (its void rows: left out)
                keep = ~void_of(prev, before)
                if not keep.all():
                    ids, rows, prev, temps = ids[keep], rows[keep], prev[keep], temps[keep]
                before = None
            self._before = before
            self._lazy = (ids, rows, prev, temps) if len(rows) else None
            return logits
        for rid in plan.grammar_drop.tolist():
            g.drop(rid)
            self._redo.discard(rid)
        for start in plan.grammar_new:
            g.start(start.request_id, GrammarSpec(start.structured.kind, start.structured.spec))
        all_rows = np.flatnonzero(plan.grammar_rows >= 0)
        rows = all_rows
        if len(plan.num_drafts):  # (verify rows: actors/gpu/speculative.py, `_walk` and
            # `_masked_along`)
            rows = rows[plan.num_drafts[rows] == 0]
        prev = seq_prev_rows(plan)[rows]
        whole = len(rows) == len(all_rows)
        if before is not None and before.done.is_set():  # (its void rows: known, left out)
            keep = ~void_of(prev, before)
            whole &= bool(keep.all())
            rows, prev, before = rows[keep], prev[keep], None
        self._before = before  # (not checked yet: the rows' check or consumption finds them)
        lazy = self._checkable(plan, rows)
        if lazy.all():  # (most steps: every row checked after sampling)
            temps = plan.temperature[rows]
            ids = plan.grammar_rows[rows]
            self._lazy = (ids, rows, prev, temps) if len(rows) else None
            if not plan.grammar_new and not self._redo:  # (and none masked as well)
                if whole and len(rows):
                    self._steady = (*self._signature(plan), ids, rows, temps)
                return logits
        elif lazy.any():
            at = rows[lazy]
            self._lazy = (plan.grammar_rows[at], at, prev[lazy], plan.temperature[at])
        # A request's first token is masked too (its matcher has taken nothing, so its mask
        # waits for no step), and checked with the others: a model rarely opens with what its
        # schema wants ("JSON", "```" for "{": most of SmolLM2's first tokens were rejected).
        # So is the row that computes again the position after a replaced token (its matcher
        # took that token at the check, which has run): the schema's next fixed part is as
        # unlikely ("text" for the key "notes" after "{").
        ids = plan.grammar_rows[rows]
        first = np.zeros(len(rows), dtype=bool)
        if plan.grammar_new:
            first |= np.isin(ids, [n.request_id for n in plan.grammar_new])
        if self._redo:
            first |= np.isin(ids, list(self._redo)) & (prev < 0)
        first &= lazy
        if first.any():
            self._redo.difference_update(ids[first].tolist())
        elif lazy.all():  # (every row checked after sampling: nothing to mask)
            return logits
        own = ~lazy  # (masked here, consumed at the next launch; the rest at their check)
        rows, prev, own = rows[own | first], prev[own | first], own[own | first]
        if not len(rows):
            return logits
        ids = plan.grammar_rows[rows]
        # (pinned, queued: a blocking copy here waited for this step's forward, so the next
        # step was launched only after it: tests/perf/host_sync_probe.py)
        masks = to_device(g.masks(ids), logits.device)
        if logits is raw:
            logits = logits.clone()
        apply_masks(logits, to_device(rows, logits.device), masks)
        if own.any():
            self._rows, self._rows_before = (ids[own], rows[own], prev[own]), before
        return logits

    def _signature(self, plan: StepPlan) -> tuple[bytes, int]:
        """What decides `plan`'s checked rows besides its requests' own sampling parameters
        and what `_steady_rows` rules out: its grammar rows (a row has one only where it
        samples) and how many matchers have stopped (a stop needs no start or drop)."""
        return plan.grammar_rows.tobytes(), len(self.grammars.dead)

    def _steady_rows(self, plan: StepPlan):
        """(ids, rows, temperatures) of `plan`'s checked rows when they are the last launch's
        (`_steady`): nothing to start, drop or redo, no drafts, the same rows of the
        same requests sampling, no matcher started or stopped since (a request's sampling
        parameters are its own, so its rows are checked alike); else None."""
        if self._redo or not self._is_steady(plan):
            self._steady = None
            return None
        return self._steady[2:]

    def _is_steady(self, plan: StepPlan) -> bool:
        """Whether `plan` has the last launch's grammar rows, all checked (`_steady`), with
        nothing to start or drop and no drafts."""
        steady = self._steady
        return not (
            steady is None
            or plan.grammar_new
            or len(plan.grammar_drop)
            or len(plan.num_drafts)
            or steady[:2] != self._signature(plan)
        )

    def _checkable(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray:
        """Which of the grammar `rows` are checked after sampling instead of masked before:
        greedy (or, in "check" mode, an unfiltered temperature draw: `_checked_kind`), sampled
        this step, raw log-probs, and a matcher that still takes tokens (none unless
        TAIPAN_GRAMMAR_MASKS is "check" or "wait")."""
        if not self.check_greedy:
            return np.zeros(len(rows), dtype=bool)
        ok = (plan.sample[rows] != 0) & self._checked_kind(plan, rows)
        if len(plan.logprobs_mode):
            ok &= plan.logprobs_mode[rows] == 0
        ids = plan.grammar_rows[rows]
        g = self.grammars
        if g.dead:  # (stopped or broken: masked, end-of-sequence tokens only)
            ok &= ~np.isin(ids, list(g.dead))
        known = g.matchers
        gone = [i for i, r in enumerate(ids.tolist()) if r not in known]
        ok[gone] = False
        return ok

    def check_later(
        self, host: torch.Tensor, sampled: torch.Tensor, logits: torch.Tensor, keys=None
    ) -> Check | None:
        """This step's checked rows as a Check for its collect (None: it has none); `host`
        receives the step's tokens, `sampled` holds them on the device for the next step;
        `keys`: the step's noise keys ([B], None when every row was greedy)."""
        if self._lazy is None:
            return None
        (ids, rows, prev, temps), self._lazy = self._lazy, None
        if self.optimistic:  # (a rejected row's best allowed token: from its own logits, on
            # a side stream at the check; a top-k's host work here cost the step ~0.6 ms on
            # an H200, with ~4 % of rows rejected)
            rows_on = rows_of(logits, rows)
            check = Check(ids, rows, host, sampled, rows_on)
            if (temps >= GREEDY_EPS).any():  # (a drawn row is drawn again with its noise)
                check.temps, check.keys = temps, rows_of(keys, rows)
        else:
            check = Check(ids, rows, host, sampled, logits, queued_candidates(rows, logits))
        check.optimistic, check.prev, check.before = self.optimistic, prev, self._before
        self._check = check
        return check

    @torch.inference_mode()  # (the step's tensors are inference tensors)
    def run_check(self, check: Check) -> None:
        """Check a collected step's rows (its tokens are on the host): each row's token kept
        where its grammar allows it, else replaced, in `host` (and, unless the next step did
        not wait, on the device), by the best token of its masked logits. Rows that read a
        token the step before replaced are void: left alone. Wakes `wait_check` however it
        ends. The lock is held for the matchers' work only, not for the device's (the next
        launch's `masked` waits for it)."""
        try:
            self._run_check(check)
        except BaseException as e:
            check.fail(e)
            raise
        check.done.set()

    def _run_check(self, check: Check) -> None:
        with self._lock:
            g = self.grammars
            keep = None  # (all)
            if check.before is not None:  # (its rows were not known to be void at the launch)
                void = void_of(check.prev, check.before)
                check.before = None  # (no chain of Checks kept alive)
                if void.any():
                    keep = ~void
            at = np.flatnonzero(keep) if keep is not None else None
            ids, rows = (check.ids, check.rows) if at is None else (check.ids[at], check.rows[at])
            took = g.advance(ids.tolist(), check.host.numpy()[rows].tolist())
            if took.min(initial=1) == 1:  # (most steps: every token taken, nothing void)
                if keep is not None:
                    check.void = check.rows[~keep]
                return
            if keep is None:
                keep, at = np.ones(len(rows), dtype=bool), np.arange(len(rows))
            keep[at[took < 0]] = False  # (a request dropped meanwhile: its row is nobody's)
            check.void = check.rows[~keep]
            bad = np.flatnonzero(took == 0)
            if not len(bad):
                return
            ids, rows, at = ids[bad], rows[bad], at[bad]
        drawn = check.temps[at] >= GREEDY_EPS if check.temps is not None else None
        if check.optimistic:  # (the rejected rows' candidates, from their own logits)
            greedy = at if drawn is None else at[~drawn]
            top = self._side(lambda: top_candidates(greedy, check.logits)) if len(greedy) else None
            where = np.cumsum(~drawn) - 1 if drawn is not None else np.arange(len(at))
        else:
            top, where = check.top, at
        with self._lock:
            best = first_allowed(g, ids, where, top, drawn)  # (-1: none taken)
            rest = np.flatnonzero(best < 0)
            masks = g.masks(ids[rest]) if len(rest) else None
        if len(rest):  # (their masks, on the device; their matchers wait in their state)
            if check.optimistic:  # (its rows' own logits, on the side stream)
                got = self._side(
                    lambda: replacements(masks, at[rest], check.logits, check.temps, check.keys)
                )
            else:  # (the step's logits: the next forward waits for this)
                got = best_allowed(masks, rows[rest], check.logits)
            with self._lock:
                self._consume(ids[rest], got)
            best[rest] = got.numpy()
        if check.optimistic:
            check.fixed = rows.astype(np.int32)
            with self._lock:
                self._redo.update(ids.tolist())  # (their next rows: masked, `_masked`)
        else:
            device = check.sampled.device
            check.sampled[to_device(rows, device)] = to_device(best, device, check.sampled.dtype)
        check.host[torch.from_numpy(rows)] = torch.from_numpy(best).to(check.host.dtype)

    def _side(self, fn):
        """`fn()` with its device work on a side stream (CUDA; else as it is): a void-mode
        check's, while the main stream runs the next step (the step that wrote the logits it
        reads has ended). Its results come to the host: waits for that stream only."""
        device = self._device
        if device is None or device.type != "cuda":
            return fn()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._side_stream):
            return fn()

    def wait_check(self) -> None:
        """Wait (before a step's forward) until the last launched step's Check has run."""
        check, self._check = self._check, None
        if check is not None:
            wait_done(check)

    def checked(self, tokens: torch.Tensor, logits: torch.Tensor, keys=None) -> torch.Tensor:
        """The step's tokens with each checked row's choice kept where its grammar allows it
        (and consumed), else replaced by the best token of the row's masked `logits` (the
        controlled, unmasked ones), or for a drawn row its draw again over them with its own
        noise key (`keys`, the step's); waits for the step's sampling when any row is checked
        (a step whose log-probs or drafts are computed in its launch, after `wait_check`: its
        void rows were left out)."""
        if self._lazy is None:
            return tokens
        (ids, rows, _, temps), self._lazy = self._lazy, None
        with self._lock:
            got = tokens[torch.from_numpy(rows).to(tokens.device)].cpu().numpy()
            bad = self._rejected(ids, got)
            if not len(bad):
                return tokens
            drawn = temps[bad] >= GREEDY_EPS
            if drawn.any():  # (masks, then each row's own draw or argmax under its mask)
                saved, at = rows_of(logits, rows[bad]), np.arange(len(bad))
                masks = self.grammars.masks(ids[bad])
                best = replacements(masks, at, saved, temps[bad], rows_of(keys, rows[bad]))
                best = best.to(logits.device)
            else:
                best = masked_best(self.grammars, ids[bad], rows[bad], logits)
            tokens = tokens.clone()
            tokens[torch.from_numpy(rows[bad]).to(tokens.device)] = best.to(tokens.dtype)
            self._consume(ids[bad], best.cpu())
        return tokens

    def _rejected(self, ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Indices of the rows whose token their grammar rejects (the others consumed it)."""
        return np.flatnonzero(self.grammars.advance(ids.tolist(), tokens.tolist()) <= 0)

    def _consume(self, ids: np.ndarray, tokens: torch.Tensor) -> None:
        for rid, token in zip(ids.tolist(), tokens.tolist(), strict=True):
            self.grammars.consume(rid, token)

    def sampled(self, host: torch.Tensor, ended) -> None:
        """The step just launched sampled into `host` (copied there once `ended`, a CUDA event,
        has passed; None: already there): its grammar rows' tokens, consumed next time."""
        if self._rows is not None:
            self._tokens = (host, ended)

    def _consume_last(self) -> None:
        if self._rows is None or self._tokens is None:
            return
        (ids, rows, prev), (host, ended) = self._rows, self._tokens
        self._rows = self._tokens = None
        before, self._rows_before = self._rows_before, None
        if ended is not None:
            ended.synchronize()  # (the step that sampled them, not the one queued after it)
        tokens = host.numpy()[rows] if host.device.type == "cpu" else host[rows].cpu().numpy()
        keep = ~void_of(prev, before)  # (a void row's token is nobody's)
        for rid, token in zip(ids[keep].tolist(), tokens[keep].tolist(), strict=True):
            self.grammars.consume(rid, token)
