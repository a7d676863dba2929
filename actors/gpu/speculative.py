"""The verify half of speculative decoding in the gpu worker: the plan checks of a step with
draft tokens (`check_drafts`) and, after its forward, the verification of every sequence that
carries drafts (`verify_drafts`).

A plan's sequence i with num_drafts[i] = d > 0 (messages/gpu.py StepPlan.num_drafts) has its
last d + 1 input tokens as (its last known token, d drafts); the logits at those d + 1
positions are verified: when every verifying row is greedy, on the host by the rule of
ops/speculative.py `verify_greedy` (`_greedy_on_host`: one copy of the argmax, no chain of
small device ops); otherwise by ops/speculative.py `verify`, seeded with the plan's keys, whose
point-mass drafts make a seeded request draw what plain decoding draws.
The result is StepResult.spec_tokens; the sequence's first new token also replaces its entry
in the step's sampled tokens. Such a step replays a mixed CUDA graph, which in a speculative
config keeps every token's hidden state (eagerly without graphs or under expert parallelism:
forward.py `_bucket`); the logits of every verified position come from those hidden states,
and a sequence's logit controls (penalties, logit_bias) apply at each (`scored_controls`).
Log-probs (and top-n) of the new tokens, where a sequence asks, go in StepResult's
spec_log_probs (spec_top_n_*): raw, or processed (StepPlan.logprobs_mode) as plain decoding
computes them (actors/gpu/logprobs.py `processed_rows`). A greedy sequence with a grammar
walks it over its scored positions (`_walk`: the argmax kept where
the grammar allows it); any other sequence with a grammar has each scored position masked as
plain decoding masks it after the drafts before it (`_masked_along`, copies of its matcher
following the drafts), and its matcher takes the new tokens after. The engine sends no prompt
log-probs, conditional biases or prev_rows for these sequences (actors/engine/speculation.py);
`check_drafts` refuses a plan that does.

Must not touch: the worker's buffers, the KV cache or the sampled-token buffer (worker.py
writes the tokens returned here into it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from taipan.actors.gpu.grammar_check import masked_best
from taipan.actors.gpu.host_staging import to_device
from taipan.actors.gpu.logprobs import (
    PROCESSED_MAX_ELEMENTS,
    PROCESSED_PARAMS,
    processed_mode,
    processed_rows,
)
from taipan.actors.gpu.sampling_controls import allow, penalised_rows
from taipan.messages.gpu import StepPlan
from taipan.ops.grammar import apply_masks
from taipan.ops.logit_controls import add_biases, apply_penalties
from taipan.ops.logprobs import log_probs_and_top_n, processed_log_probs_and_top_n
from taipan.ops.sampling import GREEDY_EPS
from taipan.ops.speculative import verify

__all__ = ["check_drafts", "draft_rows", "verify_drafts"]


def draft_rows(plan: StepPlan) -> np.ndarray:
    """The sequences that verify drafts (int64 indices; empty: a plain step)."""
    if not len(plan.num_drafts):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(plan.num_drafts > 0)


def check_drafts(plan: StepPlan) -> None:
    """ValueError for a plan whose drafts the verify path cannot take."""
    nd = plan.num_drafts
    if not len(nd):
        return
    batch = len(plan.seq_lens)
    if len(nd) != batch:
        raise ValueError(f"num_drafts has {len(nd)} entries for {batch} sequences")
    query = np.diff(plan.query_start_loc)
    if (nd < 0).any() or (nd >= query).any():
        raise ValueError("num_drafts[i] must be in [0, query length of sequence i)")
    rows = draft_rows(plan)
    if not plan.sample[rows].all():
        raise ValueError("a sequence with drafts must sample")
    tokens = _tokens_of(plan, rows)
    if (plan.prompt_targets[tokens] >= 0).any():
        raise ValueError("a sequence with drafts cannot ask for prompt log-probs")
    if len(plan.prev_rows) and (plan.prev_rows[tokens] >= 0).any():
        raise ValueError("a sequence with drafts cannot read the previous step's tokens")
    if len(plan.bias_rows) and (plan.bias_if_last[np.isin(plan.bias_rows, rows)] >= 0).any():
        raise ValueError("a sequence with drafts cannot have a conditional bias (bad words)")


def _tokens_of(plan: StepPlan, rows: np.ndarray) -> np.ndarray:
    """The input token indices of sequences `rows`."""
    qsl = plan.query_start_loc.astype(np.int64)
    return np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in rows] or [np.zeros(0, int)])


def verify_drafts(
    plan: StepPlan,
    inputs: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    grammar=None,
) -> tuple[torch.Tensor, np.ndarray, dict[str, np.ndarray]]:
    """(the step's sampled tokens [B] with each verifying sequence's first new token in its
    row; spec_tokens [B, K+1] int64, -1 but the verifying rows' new tokens; StepResult's
    spec_log_probs / spec_top_n_* arrays of those tokens where a row asks, else {}). Waits for
    the step (the spec arrays are on the host).
    `hidden` [T, H]: the eager forward's; `inputs`: the staged step inputs on the device;
    `grammar`: the worker's GrammarMasks (StepPlan.grammar_rows): it walks the grammar of a
    greedy row with raw log-probs and masks every scored position of any other."""
    rows = draft_rows(plan)
    nd = plan.num_drafts[rows].astype(np.int64)  # [R]
    ends = plan.query_start_loc[1:][rows].astype(np.int64)  # one past each row's last token
    counts = nd + 1
    # Row r's positions ends[r] - counts[r] .. ends[r] - 1: its last known token, its drafts.
    scored = _spread(ends - counts, counts)  # [rows]
    offsets = scored - np.repeat(ends - counts, counts)
    is_draft = offsets > 0
    device = hidden.device
    # (Index uploads from pinned memory: one from pageable memory would wait for the forward
    # before the rest of the step could be queued behind it.)
    raw = compute_logits(hidden[to_device(scored, device, torch.int64)])  # [rows, V] fp32
    logits = scored_controls(plan, rows, nd, scored, raw)  # (raw itself without controls)
    masked = _grammar_rows(plan, rows, walked=False)
    if len(masked):  # (masks at every scored position of those rows)
        logits = _mask_positions(plan, rows, nd, scored, masked, logits, raw, grammar)
    if bool((plan.temperature[rows] < GREEDY_EPS).all()):
        tokens, out, chosen = _greedy_on_host(
            plan, rows, nd, scored, is_draft, logits, tokens, grammar
        )
    else:
        tokens, out, chosen = _verify_on_device(
            plan, inputs, rows, nd, scored, is_draft, logits, tokens, grammar
        )
    for row in masked.tolist():  # (their matchers take the new tokens)
        rid = int(plan.grammar_rows[row])  # (each allowed where it was drawn)
        for token in out[row][out[row] >= 0].tolist():
            grammar.grammars.consume(rid, token)
    return tokens, out, _log_prob_arrays(plan, rows, nd, (raw, logits), chosen, out)


def _verify_on_device(plan, inputs, rows, nd, scored, is_draft, logits, tokens, grammar):
    """`verify_drafts` when some verifying row samples: ops/speculative.py `verify` over every
    verifying row (greedy ones by its point-mass rule), then the walked grammars' rows redone
    on the host. Returns (tokens, spec_tokens on the host, the token each scored row keeps)."""
    device = logits.device
    counts = nd + 1
    offsets = scored - np.repeat(scored[np.cumsum(counts) - counts], counts)
    drafts = inputs["input_ids"][to_device(scored[is_draft], device, torch.int64)].long()
    num_drafts = torch.from_numpy(nd)
    index = to_device(rows, device, torch.int64)
    names = ("temperature", "top_k", "top_p", "seeds", "gen_index", "min_p")
    params = {name: inputs[name][index] for name in names}
    verified = verify(logits, drafts, num_drafts, **params, with_logprobs=False)
    shape = (len(plan.seq_lens), int(nd.max()) + 1)
    out = torch.full(shape, -1, dtype=torch.int64, device=device)
    at = (to_device(np.repeat(rows, counts), device, torch.int64), to_device(offsets, device))
    out[at] = verified.tokens
    tokens = tokens.clone()
    tokens[index] = out[index, 0]
    out = out.cpu().numpy()
    chosen = verified.tokens
    if len(_grammar_rows(plan, rows, walked=True)):  # (greedy ones beside sampled rows)
        target = logits.argmax(dim=-1).cpu().numpy()
        drafts = np.asarray(plan.input_ids)[scored[is_draft]].astype(np.int64)
        chosen = _walk_grammars(plan, rows, nd, target, drafts, logits, chosen, out, grammar)
        tokens[index] = to_device(out[rows, 0], device, tokens.dtype)
    return tokens, out, chosen


def _grammar_rows(plan: StepPlan, rows: np.ndarray, walked: bool) -> np.ndarray:
    """The verifying sequences with a grammar that `_walk` walks (greedy, raw
    log-probs: `walked`) or, else, that are masked at every scored position."""
    if not len(plan.grammar_rows):
        return np.zeros(0, dtype=np.int64)
    greedy = plan.temperature[rows] < GREEDY_EPS
    if len(plan.logprobs_mode):
        greedy &= plan.logprobs_mode[rows] == 0
    return rows[(plan.grammar_rows[rows] >= 0) & (greedy == walked)]


def _mask_positions(plan, rows, nd, scored, masked, logits, raw, grammar) -> torch.Tensor:
    """`_masked_along` over the verifying sequences `masked` (a subset of rows)."""
    counts = nd + 1
    first = np.cumsum(counts) - counts  # each verifying sequence's first scored row
    which = np.searchsorted(rows, masked)
    drafts = [plan.input_ids[scored[first[i] + 1 : first[i] + counts[i]]].tolist() for i in which]
    at = _spread(first[which], counts[which])
    return _masked_along(grammar.grammars, plan.grammar_rows[masked], drafts, at, logits, raw)


def _masked_along(grammars, request_ids, drafts, at: np.ndarray, logits, raw) -> torch.Tensor:
    """Verify rows whose grammar is not walked (sampled, or processed log-probs): each scored
    position of `request_ids[i]` (its drafts `drafts[i]`; its scored rows of `logits` [rows, V]
    listed in `at`, in order) masked as plain decoding masks it after the drafts before it (a
    position past a draft its grammar rejects is never reached: no mask). Returns the masked
    logits (a copy when `logits` is `raw`, which raw log-probs read)."""
    matchers = [m for rid, d in zip(request_ids, drafts, strict=True)
                for m in grammars.along(int(rid), d)]  # fmt: skip
    masks = torch.from_numpy(grammars.masks_of(matchers)).to(logits.device)
    if logits is raw:
        logits = logits.clone()
    apply_masks(logits, torch.from_numpy(at).to(logits.device), masks)
    return logits


def _walk_grammars(plan, rows, nd, target, drafts, logits, chosen, out, grammar):
    """Each walked verifying sequence (`_grammar_rows`) walks its grammar (`_walk`)
    over its scored rows' argmax `target` and its `drafts` (the host's, all rows'), its new
    tokens written into `out` (spec_tokens, on the host); returns `chosen` (the token each
    scored row keeps, for the log-probs) with those sequences' rows set to theirs (-1 past
    the last)."""
    walked = np.zeros(len(plan.seq_lens), dtype=bool)
    walked[_grammar_rows(plan, rows, walked=True)] = True
    at, values = [], []
    t0 = d0 = 0
    for row, d in zip(rows.tolist(), nd.tolist(), strict=True):
        if walked[row]:
            got, _ = _walk(
                grammar.grammars,
                int(plan.grammar_rows[row]),
                target[t0 : t0 + d + 1].tolist(),
                drafts[d0 : d0 + d].tolist(),
                logits[t0 : t0 + d + 1],
            )
            out[row] = -1
            out[row, : len(got)] = got
            at += range(t0, t0 + d + 1)
            values += got + [-1] * (d + 1 - len(got))
        t0, d0 = t0 + d + 1, d0 + d
    chosen = chosen.clone()
    device = chosen.device
    chosen[to_device(np.asarray(at), device, torch.int64)] = to_device(
        np.asarray(values), device, chosen.dtype
    )
    return chosen


def _walk(grammars, request_id: int, target, drafts, logits: torch.Tensor) -> tuple[list, list]:
    """A greedy verify row under its grammar (`grammars`, ops/grammar.py): along its scored
    positions, each position's argmax (`target`) is kept where the grammar allows it, else the
    best token of that position's `logits` the grammar allows; every kept token is consumed;
    the walk stops after the first that differs from its draft (`drafts`, one fewer than the
    positions), as plain greedy decoding under the grammar would. Returns (the new tokens, the
    positions whose argmax was replaced)."""
    out, replaced = [], []
    for j, t in enumerate(target):
        if not (grammars.live(request_id) and grammars.try_consume(request_id, t)):
            t = int(masked_best(grammars, np.array([request_id]), np.array([j]), logits)[0])
            grammars.consume(request_id, t)
            replaced.append(j)
        out.append(t)
        if j == len(drafts) or drafts[j] != t:
            break
    return out, replaced


def scored_controls(
    plan: StepPlan, rows: np.ndarray, nd: np.ndarray, scored: np.ndarray, raw: torch.Tensor
) -> torch.Tensor:
    """The scored rows' logits [S, V] after their sequences' logit controls, as plain decoding
    applies them at each position: each bias entry at its offset (StepPlan.bias_offsets: the
    min_tokens and bad-word entries the drafts before a position make) or, at -1, at every
    position (logit_bias), and the penalties counting the drafts before a position as output
    tokens (after the sequence's own tokens, which the plan lists); allowed tokens at every
    position. `raw` itself when no verifying sequence has a control."""
    pen = penalised_rows(plan)
    bias_of = np.isin(plan.bias_rows, rows) if len(plan.bias_rows) else np.zeros(0, bool)
    allow_of = np.isin(plan.allow_rows, rows) if len(plan.allow_rows) else np.zeros(0, bool)
    if not (bias_of.any() or allow_of.any() or np.isin(rows, pen).any()):
        return raw
    counts = nd + 1
    first = np.cumsum(counts) - counts  # each verifying sequence's first scored row
    out = raw.clone()
    dev = out.device
    if allow_of.any():  # (each entry at every scored position of its sequence)
        at = np.searchsorted(rows, plan.allow_rows[allow_of])
        virtual = _spread(first[at], counts[at])
        allow(out, virtual, np.repeat(plan.allow_tokens[allow_of], counts[at]))
    if bias_of.any():
        at = np.searchsorted(rows, plan.bias_rows[bias_of])  # (rows ascend)
        offsets = plan.bias_offsets[bias_of] if len(plan.bias_offsets) else np.full(len(at), -1)
        # An entry at every position of its row, or at its one offset.
        spread = np.where(offsets < 0, counts[at], 1)
        virtual = _spread(first[at] + np.maximum(offsets, 0), spread)
        tokens = np.repeat(plan.bias_tokens[bias_of], spread)
        values = np.repeat(plan.bias_values[bias_of], spread)
        add_biases(
            out,
            *(to_device(a, dev, torch.int64) for a in (virtual, tokens)),
            to_device(values, dev),
        )
    seqs = np.flatnonzero(np.isin(rows, pen))  # indices into rows
    if len(seqs):
        _scored_penalties(plan, rows, seqs, first, counts, scored, out)
    return out


def _scored_penalties(plan, rows, seqs, first, counts, scored, out: torch.Tensor) -> None:
    """apply_penalties over the scored rows of verifying sequences `seqs` (indices into
    `rows`): the scored row at offset j of its sequence sees the sequence's entries, then its
    first j drafts (each an output token, count 1)."""
    virtual, owners, seen_rows, seen_tokens, seen_counts = [], [], [], [], []
    for i in seqs.tolist():
        seq, row0, c = int(rows[i]), int(first[i]), int(counts[i])
        mine = plan.penalty_rows == seq
        tokens, cnt = plan.penalty_tokens[mine], plan.penalty_counts[mine]
        drafts = plan.input_ids[scored[row0 + 1 : row0 + c]]
        for j in range(c):
            seen_rows.append(np.full(len(tokens) + j, len(virtual), np.int64))
            seen_tokens.append(np.concatenate([tokens, drafts[:j]]))
            seen_counts.append(np.concatenate([cnt, np.ones(j, np.int32)]))
            virtual.append(row0 + j)
            owners.append(seq)
    dev, owners = out.device, np.asarray(owners)
    params = [
        to_device(a[owners], dev)
        for a in (plan.presence_penalty, plan.frequency_penalty, plan.repetition_penalty)
    ]
    seen = (
        to_device(np.concatenate(seen_rows), dev, torch.int64),
        to_device(np.concatenate(seen_tokens), dev, torch.int64),
        to_device(np.concatenate(seen_counts).astype(np.int32), dev),
    )
    apply_penalties(out, to_device(np.asarray(virtual), dev, torch.int64), *params, *seen)


def _spread(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ranges starts[i] .. starts[i] + counts[i] - 1, concatenated (int64)."""
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts).astype(np.int64) + within


def _log_prob_arrays(
    plan: StepPlan,
    rows: np.ndarray,
    nd: np.ndarray,
    logits: tuple[torch.Tensor, torch.Tensor],
    chosen: torch.Tensor,
    out: np.ndarray,
) -> dict[str, np.ndarray]:
    """StepResult's spec_log_probs [B, K+1] and, where a row asks for top-n, spec_top_n_ids /
    spec_top_n_log_probs [B, K+1, N] for each verifying row's new tokens (`out`, spec_tokens
    on the host), whose scored rows pick `chosen` [scored rows] (the argmax or the draw; < 0:
    not kept): what plain decoding returns for them (`_scored_log_probs`; `logits`: the
    scored rows' raw and controlled logits). NaN / -1 elsewhere; {} when no verifying row
    asks."""
    n = int(plan.top_n[rows].max(initial=0))
    if not (plan.logprobs[rows].any() or n):
        return {}
    picked, ids, values = _scored_log_probs(plan, rows, nd, logits, chosen.clamp(min=0), n)
    lp = np.full(out.shape, np.nan, dtype=np.float32)
    top_ids = np.full((*out.shape, n), -1, dtype=np.int32)
    top_lp = np.full((*out.shape, n), np.nan, dtype=np.float32)
    t0 = 0
    for row, d in zip(rows.tolist(), nd.tolist(), strict=True):
        m = int((out[row] >= 0).sum())
        lp[row, :m], top_ids[row, :m], top_lp[row, :m] = (
            picked[t0 : t0 + m],
            ids[t0 : t0 + m],
            values[t0 : t0 + m],
        )
        t0 += d + 1
    lp[plan.logprobs == 0] = np.nan
    arrays = {"spec_log_probs": lp}
    if n:
        arrays |= {"spec_top_n_ids": top_ids, "spec_top_n_log_probs": top_lp}
    return arrays


def _scored_log_probs(
    plan: StepPlan, rows: np.ndarray, nd: np.ndarray, logits: tuple, chosen, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log-prob, top-n ids, top-n log-probs) on the host of every scored row's `chosen`
    token, as plain decoding computes them (actors/gpu/logprobs.py): raw (of the raw logits)
    unless the sequence asks for processed ones; those of a greedy sequence are of its
    controlled logits, those of a sampled one of the controlled logits after its filters
    (`processed_log_probs_and_top_n` with its sampling parameters)."""
    raw_logits, controlled = logits
    device = raw_logits.device
    counts = nd + 1
    tops = torch.from_numpy(np.repeat(plan.top_n[rows], counts)).to(device)
    mode = np.repeat(processed_mode(plan)[rows], counts)
    processed = np.repeat(processed_rows(plan)[rows], counts)
    picked = np.full(len(chosen), np.nan, np.float32)
    ids = np.full((len(chosen), n), -1, np.int32)
    values = np.full((len(chosen), n), np.nan, np.float32)
    for part, source in ((~mode, raw_logits), (mode & ~processed, controlled)):
        if part.any():
            at = torch.from_numpy(np.flatnonzero(part)).to(device)
            got = log_probs_and_top_n(source[at], chosen[at], tops[at], n)
            picked[part], ids[part], values[part] = (t.cpu().numpy() for t in got)
    if processed.any():
        at_np = np.flatnonzero(processed)
        at = torch.from_numpy(at_np).to(device)
        params = [
            torch.from_numpy(np.repeat(getattr(plan, name)[rows], counts)[at_np]).to(device)
            for name in PROCESSED_PARAMS
        ]
        chunk_rows = max(1, PROCESSED_MAX_ELEMENTS // controlled.shape[1])
        got = processed_log_probs_and_top_n(
            controlled[at], chosen[at], tops[at], n, *params, chunk_rows=chunk_rows
        )
        picked[processed], ids[processed], values[processed] = (t.cpu().numpy() for t in got)
    return picked, ids, values


def _greedy_on_host(
    plan: StepPlan,
    rows: np.ndarray,
    nd: np.ndarray,
    scored: np.ndarray,
    is_draft: np.ndarray,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    grammar=None,
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """`verify_drafts` when every verifying row is greedy: the scored positions' argmax comes
    to the host (one copy, which waits for the step, as the result must anyway) and the
    accepted prefixes are found there against the plan's own draft tokens, instead of a chain
    of small device ops and index uploads, each of which waited for the step too (py-spy on
    an H100: about half of a SmolLM2 verify step's host time). The same rule as
    ops/speculative.py `verify_greedy`: drafts are accepted while each equals the argmax
    before it (ties to the lowest id), then the argmax at the first mismatch or the bonus row
    is added; a row with a grammar walks it instead (`_walk`). Returns (tokens,
    spec_tokens on the host, the chosen token of every scored row on the device, for the
    log-probs)."""
    chosen = logits.argmax(dim=-1)  # [rows]
    target = chosen.cpu().numpy()
    drafts = np.asarray(plan.input_ids)[scored[is_draft]].astype(np.int64)
    out = np.full((len(plan.seq_lens), int(nd.max()) + 1), -1, dtype=np.int64)
    walked = np.zeros(len(plan.seq_lens), dtype=bool)
    walked[_grammar_rows(plan, rows, walked=True)] = True
    t0 = d0 = 0
    for row, d in zip(rows.tolist(), nd.tolist(), strict=True):
        if not walked[row]:
            t, dr = target[t0 : t0 + d + 1], drafts[d0 : d0 + d]
            missed = np.flatnonzero(dr != t[:d])
            accepted = int(missed[0]) if len(missed) else d
            out[row, : accepted + 1] = t[: accepted + 1]
        t0, d0 = t0 + d + 1, d0 + d
    if walked.any():
        chosen = _walk_grammars(plan, rows, nd, target, drafts, logits, chosen, out, grammar)
    tokens = tokens.clone()
    index = to_device(rows, tokens.device, torch.int64)
    tokens[index] = to_device(out[rows, 0], tokens.device, tokens.dtype)
    return tokens, out, chosen
