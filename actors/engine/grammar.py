"""Structured outputs on the engine's side (SamplingParams.structured): which sampled rows of a
step keep to a grammar, and which grammars the gpu must start or may forget (`GrammarBook`),
as the StepPlan's grammar_rows / grammar_new / grammar_drop (messages/gpu.py).

The gpu worker holds one matcher per such request (ops/grammar.py), advanced by the tokens it
samples for it, across steps, preemption and recompute alike; the engine only tells it when a
request first samples (its grammar) and when it has ended. Pure: no sockets, no torch.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.engine.batch import StepBatch
from taipan.messages.gpu import GrammarStart


class GrammarBook:
    """The requests whose grammar the gpu holds (sent in a plan's grammar_new, not yet
    dropped). Owned by the scheduler; only `arrays` (building a plan) changes it."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def arrays(self, batch: StepBatch, requests: dict) -> dict:
        """The plan's grammar fields for `batch` (none when no row has a grammar and nothing
        is to be dropped); `requests`: the scheduler's live requests (an id missing there has
        ended)."""
        rows, new = [], []
        for c in batch.chunks:
            g = c.request.sampling.structured
            rid = c.request.request_id
            if g is None or not c.samples:
                rows.append(-1)
                continue
            rows.append(rid)
            if rid not in self.live:
                self.live.add(rid)
                new.append(GrammarStart(rid, g))
        drop = sorted(rid for rid in self.live if rid not in requests)
        self.live.difference_update(drop)
        out = {}
        if new or max(rows, default=-1) >= 0:
            out["grammar_rows"] = np.asarray(rows, dtype=np.int64)
            out["grammar_new"] = new
        if drop:
            out["grammar_drop"] = np.asarray(drop, dtype=np.int64)
        return out


def grammar_problem(structured) -> str | None:
    """Why a request's grammar (a StructuredOutput) cannot run, or None: the engine refuses it
    at submission, naming why, rather than failing a step."""
    from taipan.ops.grammar import grammar_problem as problem

    why = problem(structured.kind, structured.spec)
    return None if why is None else f"structured: {why}"
