"""Structured outputs in the gpu worker: the step's grammar rows masked before sampling
(StepPlan.grammar_rows / grammar_new / grammar_drop; ops/grammar.py holds the matchers).

Each grammar request's matcher must have consumed the token sampled for it in the step before
the mask of this step is computed. With overlapped steps that token is still on the device when
this step is launched, so `GrammarMasks` keeps the last grammar step's sampled tokens (their
host copy and the event after it) and consumes them first thing in the next grammar step: a
wait for the previous step only, while this step's forward is already queued behind it. A
plan with grammar rows is therefore never launched inline on the event loop
(ModelWorker.launches_inline): that wait would block the loop.

Greedy rows are checked, not masked (`checked`): a greedy row's grammar-free choice (after the
logit controls) that its grammar allows there is exactly the choice under the mask (masking only
removes tokens), so its mask is computed only when the grammar rejects that token, and the row
then takes the masked logits' best token. Masks cost the host ~2 ms per step for 64 JSON rows
on an H100's host (tests/perf/NOTES.md), and a step's sampling waits for them; a check costs a
wait for the step's own tokens and microseconds per row. Rows whose log-probs are "processed"
(of the masked distribution) and sampled rows keep their masks.

Must not touch anything but the logits it is given and its own matchers.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.messages.gpu import StepPlan
from taipan.ops.grammar import Grammars, GrammarSpec, apply_masks
from taipan.ops.sampling import GREEDY_EPS


def uses_grammar(plan: StepPlan) -> bool:
    return bool(len(plan.grammar_rows) or plan.grammar_new or len(plan.grammar_drop))


class GrammarMasks:
    """The worker's structured-output state: its matchers (built at the first grammar step,
    from the model's tokenizer) and the last grammar step's sampled tokens not yet consumed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.grammars: Grammars | None = None
        # (request ids, rows) of the last grammar step, then its tokens (host tensor) and the
        # event after their copy (None on the CPU: already there).
        self._rows: tuple[np.ndarray, np.ndarray] | None = None
        self._tokens: tuple[torch.Tensor, object] | None = None
        # (request ids, rows) of this step's checked rows, until `checked` has seen its tokens.
        self._lazy: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def pending(self) -> bool:
        """Whether a grammar step's tokens wait to be consumed (every later step consumes
        them, grammar rows or not: the host buffers they sit in are reused)."""
        return self._rows is not None and self._tokens is not None

    def masked(self, plan: StepPlan, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """`logits` with each grammar row's disallowed tokens at -inf (a copy when `logits` is
        `raw`, the model's own logits, which the raw log-probs read); `logits` itself when no
        row of `plan` has a grammar."""
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, logits.shape[1])
        g = self.grammars
        self._lazy = None  # (a step that failed between `masked` and `checked` left its own)
        self._consume_last()
        for rid in plan.grammar_drop.tolist():
            g.drop(rid)
        for start in plan.grammar_new:
            g.start(start.request_id, GrammarSpec(start.structured.kind, start.structured.spec))
        rows = np.flatnonzero(plan.grammar_rows >= 0)
        lazy = self._checkable(plan, rows)
        if lazy.any():
            self._lazy = (plan.grammar_rows[rows[lazy]], rows[lazy])
            rows = rows[~lazy]
        if not len(rows):
            return logits
        ids = plan.grammar_rows[rows]
        masks = torch.from_numpy(g.masks(ids)).to(logits.device, non_blocking=True)
        if logits is raw:
            logits = logits.clone()
        apply_masks(logits, torch.from_numpy(rows).to(logits.device), masks)
        self._rows = (ids, rows)
        return logits

    def _checkable(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray:
        """Which of the grammar `rows` are checked after sampling instead of masked before:
        greedy, sampled this step, raw log-probs, and a matcher that still takes tokens."""
        ok = (plan.temperature[rows] < GREEDY_EPS) & (plan.sample[rows] != 0)
        if len(plan.logprobs_mode):
            ok &= plan.logprobs_mode[rows] == 0
        ids = plan.grammar_rows[rows]
        return ok & np.array([self.grammars.live(int(r)) for r in ids], dtype=bool)

    def checked(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The step's tokens with each checked row's choice kept where its grammar allows it
        (and consumed), else replaced by the best token of the row's masked `logits` (the
        controlled, unmasked ones); waits for the step's sampling when any row is checked."""
        if self._lazy is None:
            return tokens
        (ids, rows), self._lazy = self._lazy, None
        g, device = self.grammars, tokens.device
        got = tokens[torch.from_numpy(rows).to(device)].cpu().numpy()
        bad = [i for i, (rid, t) in enumerate(zip(ids.tolist(), got.tolist(), strict=True))
               if not g.try_consume(rid, t)]  # fmt: skip
        if not bad:
            return tokens
        bad_ids, at = ids[bad], torch.from_numpy(rows[bad]).to(device)
        masks = torch.from_numpy(g.masks(bad_ids)).to(device, non_blocking=True)
        sub = logits.index_select(0, at)
        apply_masks(sub, torch.arange(len(bad), device=device), masks)
        best = sub.argmax(dim=-1)
        tokens = tokens.clone()
        tokens[at] = best.to(tokens.dtype)
        for rid, token in zip(bad_ids.tolist(), best.cpu().tolist(), strict=True):
            g.consume(rid, token)
        return tokens

    def sampled(self, host: torch.Tensor, ended) -> None:
        """The step just launched sampled into `host` (copied there once `ended`, a CUDA event,
        has passed; None: already there): its grammar rows' tokens, consumed next time."""
        if self._rows is not None:
            self._tokens = (host, ended)

    def _consume_last(self) -> None:
        if self._rows is None or self._tokens is None:
            return
        (ids, rows), (host, ended) = self._rows, self._tokens
        self._rows = self._tokens = None
        if ended is not None:
            ended.synchronize()  # (the step that sampled them, not the one queued after it)
        tokens = host.numpy()[rows] if host.device.type == "cpu" else host[rows].cpu().numpy()
        for rid, token in zip(ids.tolist(), tokens.tolist(), strict=True):
            self.grammars.consume(rid, token)
