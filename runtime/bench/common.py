"""What the workload families of `taipan bench` share: the prompt makers (`random_prompt`,
`mixed_prompts`), greedy sampling with EOS ignored (`greedy`), a run's config with more `--set`
lines (`with_sets`), an optional mode whose failure is recorded, not fatal (`optional_mode`), and
the rounding of a row's floats (`rounded`).

No workload, no runtime, no torch: plain Python and numpy, so any family may import it.
"""

from __future__ import annotations

import copy
import sys

# Prompt token ids are drawn from [0, 256): valid in every vocabulary we load (byte-level BPE),
# and a step costs the same whichever ids it runs.
PROMPT_ID_RANGE = 256


def random_prompt(rng, length: int) -> list[int]:
    return rng.integers(0, PROMPT_ID_RANGE, size=length).tolist()


SEED_PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in simple terms:",
    "def fibonacci(n):",
    "Three facts about octopuses:",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "The main difference between a list and a tuple in Python is",
    "Translate to French: The cat sleeps on the warm windowsill.",
]


def mixed_prompts(n: int) -> list[str]:
    """n prompts of mixed lengths (about 10 to 150 tokens), as a serving mix has them: prompt i
    repeats its seed sentence 1 + (5 * i) % 11 times. Equal lengths would hide the padding
    that a static batch pays."""
    out = []
    for i in range(n):
        seed = SEED_PROMPTS[i % len(SEED_PROMPTS)]
        out.append(" ".join([seed] * (1 + (5 * i) % 11)) + f" ({i})")
    return out


def with_sets(args, *sets: str):
    """A copy of `args` whose InferenceConfig gets `sets` (FIELD=VALUE) after the user's own."""
    out = copy.copy(args)
    out.set = [*args.set, *sets]
    return out


def greedy(max_tokens: int):
    """SamplingParams for exactly `max_tokens` greedy tokens (EOS neither stops nor is masked)."""
    from taipan.messages.requests import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def optional_mode(name: str, fn, errors: dict):
    """Run one optional mode (an HF mode, ours without CUDA graphs); a failure is recorded as
    `<name>_error` (and printed), not fatal: the rows keep every other figure."""
    try:
        return fn()
    except Exception as exc:  # transformers raises many kinds; the row says which
        errors[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"taipan bench: {name} failed: {exc!r}", file=sys.stderr)
        return None


def rounded(row: dict) -> dict:
    """Floats to 5 significant digits (a floor of 0.013 ms and a rate of 3000 GB/s alike)."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}
