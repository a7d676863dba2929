"""The StepPlan's sampling-control arrays (messages/gpu.py: allowed tokens, penalties, logit
biases) for a planned step: `control_arrays`.

Owns how SamplingParams' logit controls become per-step arrays: the allowed tokens (row,
token), per-row penalty floats, the penalised rows' tokens (row, token, count), and additive
biases (row, token, value, if-last):
logit_bias, -inf on EOS and stop_token_ids while min_tokens is not reached, -inf on the last
token of a bad word whose other tokens end the output. Nothing at all when no sampled row uses a
control, so the common step costs one flag per row. Pure: reads the chunks and their requests,
writes only each request's `controls` cache. No sockets, no torch.

Overlap: a step may be planned while the previous one is sampling a row's last token (at most
one step is in flight). That token is its input (StepPlan.prev_rows), known only on the device:
the gpu counts it for the penalties itself, and a bad word whose next-to-last token it would be
gets a conditional entry (`bias_if_last`), which the gpu checks against it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from taipan.actors.engine.batch import Chunk
from taipan.actors.engine.request import EngineRequest

NO_TOKEN = -1  # bias_if_last: the entry holds whatever the last input token is


@dataclasses.dataclass
class RowControls:
    """What a controlled request's rows reuse from step to step: its logit_bias as arrays,
    the tokens min_tokens forbids, its allowed tokens (None: any), and its output tokens as
    int32 (extended, not rebuilt)."""

    bias_tokens: np.ndarray  # int32
    bias_values: np.ndarray  # float32
    min_tokens_ban: np.ndarray  # int32: EOS (unless ignore_eos) and stop_token_ids
    allowed: np.ndarray | None = None  # int32, distinct
    output: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    @classmethod
    def of(cls, r: EngineRequest, eos_token_ids: tuple[int, ...]) -> RowControls:
        s = r.sampling
        bias = s.logit_bias_ids()
        ban = (() if s.ignore_eos else tuple(eos_token_ids)) + tuple(s.stop_token_ids)
        allowed = s.allowed_token_ids
        return cls(
            np.fromiter(bias.keys(), np.int32, len(bias)),
            np.fromiter(bias.values(), np.float32, len(bias)),
            np.asarray(sorted(set(ban)), np.int32),
            None if allowed is None else np.unique(np.asarray(allowed, np.int32)),
        )

    def output_tokens(self, generated: list[int]) -> np.ndarray:
        """`generated` as int32, from the cached copy plus the tokens appended since."""
        n = len(self.output)
        if n > len(generated):  # (a stop word dropped at the end: rebuild)
            self.output = np.asarray(generated, np.int32)
        elif n < len(generated):
            self.output = np.concatenate([self.output, np.asarray(generated[n:], np.int32)])
        return self.output


class _Entries:
    """(row, token, value, if-last, offset) entries gathered per row as a run of tokens that
    share a row, an if-last and an offset (and, unless given per token, a value), joined once."""

    def __init__(self):
        self.rows: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.values: list = []  # one per run: a scalar, or an array of one per token
        self.if_last: list[int] = []
        self.offsets: list[int] = []  # a verify row's scored position, or -1: every one

    def add(self, row: int, tokens, value, if_last: int = NO_TOKEN, offset: int = -1) -> None:
        self.rows.append(row)
        self.tokens.append(np.asarray(tokens, np.int32).reshape(-1))
        self.values.append(value)
        self.if_last.append(if_last)
        self.offsets.append(offset)

    def arrays(self, value_dtype) -> tuple[np.ndarray, ...]:
        """(rows, tokens, values, if_last, offsets), int32 but the values; all empty without
        runs."""
        if not self.rows:
            return tuple(
                np.zeros(0, d) for d in (np.int32, np.int32, value_dtype) + (np.int32,) * 2
            )
        lens = [len(t) for t in self.tokens]
        if any(isinstance(v, np.ndarray) for v in self.values):
            runs = zip(self.values, lens, strict=True)
            values = np.concatenate(
                [np.broadcast_to(np.asarray(v, value_dtype), n) for v, n in runs]
            )
        else:  # (a scalar per run: the common case, and one call)
            values = np.repeat(np.asarray(self.values, value_dtype), lens)
        return (
            np.repeat(np.asarray(self.rows, np.int32), lens),
            np.concatenate(self.tokens),
            values,
            np.repeat(np.asarray(self.if_last, np.int32), lens),
            np.repeat(np.asarray(self.offsets, np.int32), lens),
        )


def control_arrays(chunks: list[Chunk], eos_token_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The StepPlan's control arrays for a step of `chunks` (row i = chunks[i]); {} when no
    row that samples uses a control (the plan's defaults: empty, all off)."""
    rows = [i for i, c in enumerate(chunks) if c.samples and c.request.has_controls]
    if not rows:
        return {}
    out: dict[str, np.ndarray] = {}
    allowed = [(i, a) for i in rows if (a := _controls(chunks[i].request, eos_token_ids).allowed)
               is not None]  # fmt: skip
    if allowed:
        out["allow_rows"] = np.repeat(
            np.asarray([i for i, _ in allowed], np.int32), [len(a) for _, a in allowed]
        )
        out["allow_tokens"] = np.concatenate([a for _, a in allowed])
    penalised = [i for i in rows if _penalised(chunks[i].request)]
    if penalised:
        out |= _penalty_arrays(chunks, penalised, eos_token_ids)
    bias = _Entries()
    for i in rows:
        _bias_entries(bias, i, chunks[i], eos_token_ids)
    *arrays, offsets = bias.arrays(np.float32)
    if len(arrays[0]):
        names = ("bias_rows", "bias_tokens", "bias_values", "bias_if_last")
        out |= dict(zip(names, arrays, strict=True))
        if (offsets >= 0).any():  # (a verify row's min_tokens or bad-word entries)
            out["bias_offsets"] = offsets
    return out


def _penalised(r: EngineRequest) -> bool:
    s = r.sampling
    return bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)


def _controls(r: EngineRequest, eos_token_ids: tuple[int, ...]) -> RowControls:
    if r.controls is None:
        r.controls = RowControls.of(r, eos_token_ids)
    return r.controls


def _penalty_arrays(chunks: list[Chunk], penalised: list[int], eos_token_ids) -> dict:
    """Per-row penalties (neutral for rows without) and the penalised rows' known tokens:
    each output token once with count 1, each prompt token with count 0 when the row has a
    repetition penalty (the gpu adds up entries of one token)."""
    n = len(chunks)
    presence, frequency = np.zeros(n, np.float32), np.zeros(n, np.float32)
    repetition = np.ones(n, np.float32)
    seen = _Entries()
    for i in penalised:
        r = chunks[i].request
        s = r.sampling
        presence[i], frequency[i], repetition[i] = (
            s.presence_penalty, s.frequency_penalty, s.repetition_penalty,
        )  # fmt: skip
        seen.add(i, _controls(r, eos_token_ids).output_tokens(r.generated), 1)
        if s.repetition_penalty != 1.0:
            seen.add(i, r.prompt, 0)
    rows, tokens, counts, _, _ = seen.arrays(np.int32)
    return {
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "repetition_penalty": repetition,
        "penalty_rows": rows,
        "penalty_tokens": tokens,
        "penalty_counts": counts,
    }


def _bias_entries(bias: _Entries, i: int, c: Chunk, eos_token_ids) -> None:
    """Row i's logit_bias, min_tokens and bad-word entries; a verify row's min_tokens and
    bad-word entries per scored position (offset j: after its first j drafts)."""
    r = c.request
    s = r.sampling
    ctl = _controls(r, eos_token_ids)
    if len(ctl.bias_tokens):
        bias.add(i, ctl.bias_tokens, ctl.bias_values)
    if c.drafts is not None and len(c.drafts):
        _verify_bias_entries(bias, i, c, ctl)
        return
    if c.gen_index < s.min_tokens and len(ctl.min_tokens_ban):
        bias.add(i, ctl.min_tokens_ban, -np.inf)
    for word in s.bad_words_ids:
        if_last = _bad_word_condition(r.generated, c.gen_index, word)
        if if_last is not None:
            bias.add(i, word[-1], -np.inf, if_last)


def _verify_bias_entries(bias: _Entries, i: int, c: Chunk, ctl: RowControls) -> None:
    """A verify row's min_tokens and bad-word entries at each scored position j, as plain
    decoding would make them with its first j drafts accepted (its last token is known: no
    step in flight holds it, so no entry is conditional)."""
    r, s = c.request, c.request.sampling
    drafts = [int(t) for t in c.drafts]
    for j in range(len(drafts) + 1):
        if c.gen_index + j < s.min_tokens and len(ctl.min_tokens_ban):
            bias.add(i, ctl.min_tokens_ban, -np.inf, NO_TOKEN, j)
        if s.bad_words_ids:
            context = r.generated + drafts[:j]
            for word in s.bad_words_ids:
                if _bad_word_condition(context, len(context), word) is not None:
                    bias.add(i, word[-1], -np.inf, NO_TOKEN, j)


def _bad_word_condition(generated: list[int], gen_index: int, word) -> int | None:
    """Whether `word`'s last token is forbidden for the token at `gen_index`: None (no), -1
    (yes), or a token id (yes if that is the row's last input token: the one the step in
    flight samples, when `generated` lacks it)."""
    prefix = list(word[:-1])
    if not prefix:
        return NO_TOKEN
    in_flight = gen_index - len(generated)  # 0, or 1 with the previous step in flight
    known = prefix[:-1] if in_flight else prefix
    if len(known) > len(generated) or generated[len(generated) - len(known) :] != known:
        return None
    return prefix[-1] if in_flight else NO_TOKEN
