"""Structured outputs in the gpu worker: the step's grammar rows masked before sampling
(StepPlan.grammar_rows / grammar_new / grammar_drop; ops/grammar.py holds the matchers).

Each grammar request's matcher must have consumed the token sampled for it in the step before
the mask of this step is computed. With overlapped steps that token is still on the device when
this step is launched, so `GrammarMasks` keeps the last grammar step's sampled tokens (their
host copy and the event after it) and consumes them first thing in the next grammar step: a
wait for the previous step only, while this step's forward is already queued behind it. A
plan with grammar rows is therefore never launched inline on the event loop
(ModelWorker.launches_inline): that wait would block the loop.

Must not touch anything but the logits it is given and its own matchers.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.messages.gpu import StepPlan
from taipan.ops.grammar import Grammars, GrammarSpec, apply_masks


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
        self._consume_last()
        for rid in plan.grammar_drop.tolist():
            g.drop(rid)
        for start in plan.grammar_new:
            g.start(start.request_id, GrammarSpec(start.structured.kind, start.structured.spec))
        rows = np.flatnonzero(plan.grammar_rows >= 0)
        if not len(rows):
            return logits
        ids = plan.grammar_rows[rows]
        masks = torch.from_numpy(g.masks(ids)).to(logits.device, non_blocking=True)
        if logits is raw:
            logits = logits.clone()
        apply_masks(logits, torch.from_numpy(rows).to(logits.device), masks)
        self._rows = (ids, rows)
        return logits

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
