"""Speculative decoding on the engine's side: which requests speculate, their draft tokens for
the next step, and the acceptance counters (`Speculation`).

Pure: numpy and ints, no torch, no sockets. The scheduler (actors/engine/scheduler.py) asks
`drafts_for` while it plans a decode row and hands each verify row's result to
`append_verified`, which appends its tokens with the stop checks (outputs.py) and `count`s it;
the gpu actor verifies (actors/gpu/speculative.py, ops/speculative.py). Drafting is prompt
lookup (ops/ngram.py), one incremental index per request, kept on the request
(`ngram`), or a draft model on the gpu (speculative_method "draft_model", `on_gpu`): then a
row's drafts are placeholders, as many as the limits below allow, which the gpu fills
(actors/gpu/draft.py; StepPlan.draft_prev); requests with bad words do not speculate there
(their per-position biases follow the drafts' values). Or the checkpoint's own MTP head
(speculative_method "mtp", `mtp`): the gpu drafts at the end of the step that computed a
request's last token (ops/mtp.py), the drafts come back with that step's result
(StepResult.next_drafts, kept on the request by `take_drafts` with the token count they
follow) and are planned as n-gram drafts are (host-known tokens); every sampling row of a
speculating request asks for them (StepPlan.mtp_draft), and a prompt chunk that does not
sample hands the gpu its next prompt token (StepPlan.mtp_next: wire.py `mtp_arrays`).
With draft_weight_policy "disable" a weight update ends speculation (`new_weights`) until
the draft's own weights are updated (`draft_updated`).

The contract of a speculative row (InferenceConfig.num_speculative_tokens = k > 0):
- It is planned only when its request's last token is known on the host (no step in flight
  holds it: a speculative request never reads `prev_rows`, so with overlap it runs every other
  step at most). Its chunk holds 1 + d query tokens, the last known token and d <= k drafts
  (d may be 0), at positions start..start+d, each with a KV slot; d is cut so that the row fits
  the step's token budget and the free blocks, and so that d + 1 new tokens stay within
  max_tokens and max_sequence_length.
- The gpu scores all d + 1 positions and returns the accepted drafts and one more token
  (StepResult.spec_tokens). The scheduler appends them in order with the usual stop checks (a
  stop ends the request there and drops the tokens after it); the request's computed tokens
  are then start + 1 + accepted. The rejected drafts' KV lies beyond that and is overwritten by
  the next steps; their blocks stay with the request (at most the blocks of k more tokens, which
  its admission already counted: prompt + max_tokens), and go back when it ends.

Which requests speculate: those with `SamplingParams.speculative` (the default), grammars
(structured outputs) included: the gpu walks a greedy one's matcher along its scored positions
(each argmax kept where the grammar allows it, else the best token it allows; it stops at the
first that differs from its draft) and masks each scored position of any other as plain
decoding would after the drafts before it (actors/gpu/speculative.py): exactly the tokens
plain decoding under the grammar gives. Logit controls apply at every
verified position: logit_bias everywhere, penalties with the drafts before a position counted
as output tokens (actors/gpu/speculative.py), and min_tokens and bad words per position as the
drafts before it make them (control_arrays.py, StepPlan.bias_offsets). Log-probs and top-n,
raw or processed, come with each accepted token (StepResult.spec_log_probs / spec_top_n_*)
and routed experts with each accepted position (routing.py `take_step`): RL rollouts
speculate.
Hybrid (Mamba / GDN) models speculate too: the gpu keeps a verify row's recurrent states inside
the row and puts the last accepted position's back in the live slot (actors/gpu/forward.py
`_verify_snapshots`), so nothing changes here; their verify steps run eagerly.

Back-off: a speculating request gives up the overlap of plain decoding (its rows wait for its
last token), which a row that gains nothing pays for in full. After MISSES rows in a row that
gained nothing (no draft found, or none accepted) it decodes plainly for BACKOFF tokens, then
speculates again; each back-off with no accepted draft since the last doubles, up to
BACKOFF_MAX, and an accepted draft resets it. Decisions depend only on tokens (replay-safe),
and outputs do not change (verification is exact).

Batch size (InferenceConfig.speculative_disable_by_batch_size, vLLM's disable_by_batch_size):
a step planned while more requests run than that plans none of them as verify rows
(`active`), and lets them overlap as plain rows; the first step at or under it speculates
again. It depends on the running requests only (replay-safe too).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.actors.config import RuntimePlan
from taipan.actors.engine.batch import Chunk
from taipan.actors.engine.outputs import Appending, append_token
from taipan.actors.engine.request import EngineRequest
from taipan.messages.gpu import StepResult
from taipan.messages.requests import FinishReason, LogprobsMode
from taipan.ops.ngram import NgramDrafter, NgramIndex

__all__ = ["Backoff", "Speculation"]

MISSES = 4  # rows in a row that gained nothing before a request backs off
BACKOFF, BACKOFF_MAX = 8, 128  # plain tokens of a first back-off, and the most


@dataclasses.dataclass(slots=True)
class Backoff:
    """One request's back-off (the module docstring)."""

    misses: int = 0  # rows in a row that gained nothing
    length: int = 0  # plain tokens of the last back-off (0: none since the last accepted draft)
    resume_at: int = -1  # len(generated) at which it speculates again; -1: not backing off


class Speculation:
    """The drafter (`k` tokens at most per row) and its counters for one engine rank."""

    def __init__(
        self,
        k: int,
        ngram_min: int,
        ngram_max: int,
        on_gpu: bool = False,
        disable_on_update: bool = False,
        mtp: bool = False,
        chain_steps: int = 1,
        chain_max_rows: int = 4,
        off_above: int | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"speculation needs k >= 1 draft tokens, got {k}")
        self.k = k
        # A draft model on the gpu drafts (speculative_method "draft_model"): a row's drafts
        # are placeholders the gpu fills (Chunk.gpu_drafts), as many as the limits allow.
        self.on_gpu = on_gpu
        # An MTP head (speculative_method "mtp"): the drafts of a request come with the result
        # of the step that computed its last token (`take_drafts`); every row of a speculating
        # request that samples asks for them (StepPlan.mtp_draft).
        self.mtp = mtp
        # draft_weight_policy "disable": the first weight update ends speculation here.
        self.disable_on_update = disable_on_update
        self.disabled = False
        self.drafter = NgramDrafter(ngram_min, ngram_max, k)
        # Chained verify steps (InferenceConfig.speculative_chain_steps; `chain`): 1 = off.
        self.chain_steps, self.chain_max_rows = chain_steps, chain_max_rows
        self.chains = 0  # steps planned as chains
        # InferenceConfig.speculative_disable_by_batch_size (`active`): None = never off.
        self.off_above = off_above
        self.steps_off = 0  # steps planned with speculation off for their batch size
        self.draft_tokens = 0  # drafts verified
        self.accepted_tokens = 0  # of which accepted
        self.verify_rows = 0  # rows that verified at least one draft
        self.backoffs = 0  # times a request stopped speculating for a while
        self.accepted_per_position = [0] * k  # rows whose draft j was accepted

    def new_weights(self, requests) -> None:
        """A weight update landed (Scheduler.new_weights): with draft_weight_policy "disable"
        the draft no longer matches the target, so no request of `requests` (or later)
        speculates again."""
        if not self.disable_on_update:
            return
        self.disabled = True
        for r in requests:
            r.speculates = False

    def draft_updated(self, requests) -> None:
        """The draft model took new weights (UpdateWeights.draft): with draft_weight_policy
        "disable" it matches the target again, so speculation resumes for `requests` (each
        that may; one backing off at its back-off's end) and later ones."""
        if not self.disabled:
            return
        self.disabled = False
        for r in requests:
            if r.spec_backoff is None or r.spec_backoff.resume_at < 0:
                r.speculates = self.eligible(r)

    def active(self, running: int) -> bool:
        """Whether the requests that speculate do in a step planned while `running` requests
        run (InferenceConfig.speculative_disable_by_batch_size); a step where they do not
        plans them as plain rows, overlapped like any other (Scheduler.schedule counts such
        steps in `steps_off`)."""
        return self.off_above is None or running <= self.off_above

    def eligible(self, r: EngineRequest) -> bool:
        """Whether `r` speculates (the module docstring's rule)."""
        if self.disabled:
            return False
        if self.on_gpu and r.sampling.bad_words_ids:
            return False  # (its biases per position follow the drafts, unknown here)
        return bool(r.sampling.speculative)

    def propose(self, r: EngineRequest, limit: int) -> np.ndarray:
        """Up to min(k, limit) draft tokens (int32) to follow `r`'s known tokens. Its index
        takes in only the tokens that arrived since the last call. With a draft model on the
        gpu: min(k, limit) placeholders (it drafts them)."""
        if self.on_gpu:
            return np.zeros(max(0, min(self.k, limit)), np.int32)
        if self.mtp:
            fresh = r.mtp_drafts is not None and r.mtp_at == r.num_tokens
            return r.mtp_drafts[: max(0, limit)] if fresh else np.zeros(0, np.int32)
        index = r.ngram
        if index is None or index.num_tokens > r.num_tokens:
            index = r.ngram = NgramIndex(self.drafter)
        p, n = len(r.prompt), index.num_tokens
        if n < p:
            index.append(r.prompt[n:])
            n = p
        if n < r.num_tokens:
            index.append(np.asarray(r.generated[n - p :], dtype=np.int32))
        if limit <= 0:
            return np.zeros(0, np.int32)
        return index.lookup(limit)

    def drafts_for(
        self, req: EngineRequest, budget: int, free: int, plan: RuntimePlan
    ) -> np.ndarray | None:
        """The draft tokens a decode row of `req` verifies this step (int32, maybe none),
        within `budget` tokens and `free` blocks for the whole row; None: it is no decode row
        whose last token is known, or no draft was found (then it runs as a plain row)."""
        if req.num_pending or req.num_planned_tokens - req.num_computed_tokens != 1:
            return None
        limit = min(
            budget - 1,
            req.sampling.max_tokens - len(req.generated) - 1,
            plan.max_sequence_length - req.num_tokens - 1,
        )
        drafts = self.propose(req, limit)
        if not len(drafts):
            # (an MTP head that drafted nothing for this token yet, as after a back-off, has
            # not missed: the plain row asks it for drafts)
            unasked = self.mtp and req.mtp_at != req.num_tokens
            if limit > 0 and not unasked:
                self._missed(req)
            return None  # (a plain row)
        bs, start = plan.block_size, req.num_computed_tokens
        while len(drafts) and req.blocks_needed(start + 1 + len(drafts), bs) > free:
            drafts = drafts[:-1]
        return drafts

    def chain(self, chunks: list[Chunk], plan: RuntimePlan, waiting: bool) -> list[int]:
        """Whether a step of `chunks` chains its verify steps in the gpu (StepPlan.chain_steps):
        the tokens each row may gain in the chain (its chain_limit), or [] when it does not.
        It chains when every row verifies n-gram drafts of a request that asks nothing a
        chain cannot carry (top-n or processed log-probs, logit controls, a grammar:
        messages/gpu.py StepPlan.chain_steps), there are at most
        chain_max_rows rows and nothing `waiting` (a chain would hold it back)."""
        if self.chain_steps < 2 or waiting or not 0 < len(chunks) <= self.chain_max_rows:
            return []
        limits = []
        for c in chunks:
            r, s = c.request, c.request.sampling
            if c.drafts is None or not len(c.drafts) or c.gpu_drafts or not _chainable(r):
                return []
            limits.append(
                min(s.max_tokens - len(r.generated), plan.max_sequence_length - r.num_tokens)
            )
        self.chains += 1
        return limits

    def append_verified(
        self,
        r: EngineRequest,
        c: Chunk,
        result: StepResult,
        i: int,
        step: Appending,
    ) -> FinishReason | None:
        """Append verify row i's new tokens (its accepted drafts, then the one drawn) in order,
        each with the stop checks: a stop ends `r` there and drops the tokens after it."""
        if len(result.spec_tokens) != len(result.token_ids):
            raise ValueError(
                f"step {result.step} verified drafts but its result has no spec_tokens row "
                f"for each sequence ({len(result.spec_tokens)} for {len(result.token_ids)})"
            )
        row = result.spec_tokens[i]
        new = row[row >= 0].tolist()
        most = c.chain_limit if c.chain_limit else len(c.drafts) + 1
        if not 1 <= len(new) <= most:
            raise ValueError(
                f"step {result.step}, row {i}: {len(new)} new tokens for {len(c.drafts)} drafts"
                + (f" in a chain of at most {most}" if c.chain_limit else "")
            )
        if c.chain_limit and len(result.spec_chain) != len(result.token_ids):
            raise ValueError(
                f"step {result.step} chained its verify steps but its result has no "
                "spec_chain row for each sequence"
            )
        log_probs, tops = [None] * len(new), [None] * len(new)
        n = r.sampling.top_n_logprobs
        needed = [result.spec_log_probs] if r.sampling.return_log_probs else []
        needed += [result.spec_top_n_ids, result.spec_top_n_log_probs] if n else []
        if any(len(a) != len(result.token_ids) for a in needed):
            raise ValueError(
                f"step {result.step}, row {i}: its request asks for log-probs the result "
                "does not carry for each sequence (spec_log_probs / spec_top_n_*)"
            )
        if r.sampling.return_log_probs:
            log_probs = result.spec_log_probs[i, : len(new)].tolist()
        if n:
            ids, lps = result.spec_top_n_ids[i], result.spec_top_n_log_probs[i]
            tops = [(ids[j, :n].copy(), lps[j, :n].copy()) for j in range(len(new))]
        outcomes = [(len(c.drafts), len(new) - 1)]
        if c.chain_limit:  # (each inner step's drafts and acceptances)
            outcomes = [(int(d), int(a)) for d, a in result.spec_chain[i] if d >= 0]
        for drafted, accepted in outcomes:
            if not drafted:
                continue  # (an inner step that found no draft: a plain one)
            self.count(drafted, accepted)
            if accepted:
                self._hit(r)
            else:
                self._missed(r)
        for tok, lp, top in zip(new, log_probs, tops, strict=True):
            reason = append_token(r, result, i, step, (tok, lp, top))
            if reason is not None:
                return reason
        r.num_computed_tokens = c.start + len(new)  # its last token and the accepted drafts
        return None

    def take_drafts(self, r: EngineRequest, result: StepResult, i: int) -> None:
        """Row i's drafts of an MTP head (StepResult.next_drafts), kept on `r` for its next
        verify row: they follow the tokens `r` has now (after this step's)."""
        if not len(result.next_drafts):
            return
        if len(result.next_drafts) != len(result.token_ids):
            raise ValueError(
                f"step {result.step}: next_drafts has {len(result.next_drafts)} rows for "
                f"{len(result.token_ids)} sequences"
            )
        row = result.next_drafts[i]
        r.mtp_drafts, r.mtp_at = row[: int((row >= 0).sum())].astype(np.int32), r.num_tokens

    def resume(self, r: EngineRequest) -> None:
        """Before `r` is planned: a request backing off speculates again once it has decoded
        its back-off's tokens."""
        b = r.spec_backoff
        if b is not None and 0 <= b.resume_at <= len(r.generated):
            b.resume_at = -1
            r.speculates = not self.disabled

    def _missed(self, r: EngineRequest) -> None:
        b = r.spec_backoff
        if b is None:
            b = r.spec_backoff = Backoff()
        b.misses += 1
        if b.misses >= MISSES:
            b.misses = 0
            b.length = min(BACKOFF_MAX, 2 * b.length or BACKOFF)
            b.resume_at = len(r.generated) + b.length
            r.speculates = False
            self.backoffs += 1

    def _hit(self, r: EngineRequest) -> None:
        if r.spec_backoff is not None:
            r.spec_backoff.misses = r.spec_backoff.length = 0

    def count(self, drafted: int, accepted: int) -> None:
        """One verify row's outcome: `accepted` of its `drafted` drafts passed."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_rows += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def stats(self) -> dict:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_verify_rows": self.verify_rows,
            "spec_accepted_per_position": tuple(self.accepted_per_position),
            "spec_backoffs": self.backoffs,
            "spec_draft_disabled": int(self.disabled),
            "spec_chains": self.chains,
            "spec_batch_off_steps": self.steps_off,
        }


def _chainable(r: EngineRequest) -> bool:
    """Whether `r`'s rows can be chained (`Speculation.chain`): no top-n or processed
    log-probs, no logit controls, no grammar (greedy or sampled, raw log-probs or none,
    routed experts or none)."""
    s = r.sampling
    return (
        s.logprobs_mode is not LogprobsMode.PROCESSED
        and not s.top_n_logprobs  # (prompt log-probs: a verify row has no prompt position)
        and not r.has_controls
        and s.structured is None
    )
