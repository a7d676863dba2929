"""Beam search, as vLLM runs it: on the client, one engine step per generated token.

Each round asks the engine for one token of every live beam (a whole sequence as the prompt,
greedy, with its 2 x beam_width most likely next tokens and their log-probs), extends each beam by
each candidate, and keeps the beam_width best by score; a candidate that is EOS (unless
`ignore_eos`) completes its beam. After `max_tokens` rounds (or when no beam is live) the best
beam_width of the completed and live beams come back, best first. A beam's score is its
cumulative log-prob divided by its length (prompt included, a final EOS not) to the power
`length_penalty` (vLLM's `get_beam_search_score`). With prefix caching on, each round's
sequences share their cached blocks, so a round computes about one token per beam.

The engine's log-probs are the model's (raw), as vLLM's beam search ranks them; BeamSearchParams
has no temperature (the HTTP server takes one only at 0 or 1, which change nothing).

Owns: the search loop over an AsyncClient's `generate`. No torch, no sockets of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from taipan.messages.requests import MAX_TOP_N, SamplingParams

MAX_BEAM_WIDTH = MAX_TOP_N // 2  # (a round asks 2 x beam_width candidates per beam)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` sequences come back (at most MAX_BEAM_WIDTH),
    each of at most `max_tokens` generated tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def problems(self) -> list[str]:
        out = []
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            out.append(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        return out


@dataclasses.dataclass
class BeamSequence:
    """One beam: `tokens` (prompt included, as vLLM's), its cumulative log-prob, the text of
    its generated tokens and why it ended ("stop": EOS, "length": max_tokens)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: str = "length"


@dataclasses.dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos: set[int], penalty: float) -> float:
    """vLLM's score: cum_logprob / len ** length_penalty, a final EOS not counted."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cum_logprob / (max(length, 1) ** penalty)


async def beam_search(
    client, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Beam search for every prompt (token ids) on `client` (an AsyncClient); ValueError for
    bad params."""
    problems = params.problems()
    if problems:
        raise ValueError("; ".join(problems))
    eos = set() if params.ignore_eos else set(client.tokenizer.eos_token_ids)
    step = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, return_log_probs=True,
        skip_prompt_log_probs=True, top_n_logprobs=2 * params.beam_width,
    )  # fmt: skip
    return list(await asyncio.gather(*(_one(client, p, params, step, eos) for p in prompts)))


async def _one(client, prompt: list[int], params, step, eos: set[int]) -> BeamSearchOutput:
    width, penalty = params.beam_width, params.length_penalty

    def score(b: BeamSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, eos, penalty)

    beams = [BeamSequence(list(prompt))]
    done: list[BeamSequence] = []
    for _ in range(params.max_tokens):
        if not beams:
            break
        outs = await asyncio.gather(*(client.generate([b.tokens], step) for b in beams))
        grown: list[BeamSequence] = []
        for beam, [out] in zip(beams, outs, strict=True):
            for token, lp in out.top_n_logprobs[0].items():
                new = BeamSequence(beam.tokens + [token], beam.cum_logprob + lp)
                if token in eos:
                    new.finish_reason = "stop"
                    done.append(new)
                else:
                    grown.append(new)
        beams = sorted(grown, key=score, reverse=True)[:width]
    best = sorted(done + beams, key=score, reverse=True)[:width]
    tok = client.tokenizer
    for b in best:
        generated = b.tokens[len(prompt) :]
        if b.finish_reason == "stop" and not params.include_stop_str_in_output:
            generated = generated[:-1]
        b.text = tok.decode(generated)
    return BeamSearchOutput(best)
