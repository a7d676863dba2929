"""The gpu worker's grammar host work per "check" mode step, without a device (helper; not a
test): GrammarMasks (optimistic) over SmolLM2's tokenizer, B rows of the structured bench's
schema taking an indented JSON text, each step as the worker runs it: `masked` at the launch
(reading the last step's rows), `check_later`, `launched`, then `run_check` when collected
(after the next launch, as overlapped steps do). CPU tensors stand in for the device's.
Prints the median microseconds of each part per step (`skips_wait`: the launch's two questions,
`inline` and `skips_wait`, as the worker asks them); `--profile` adds cProfile's busiest
functions.

    python3 tests/perf/grammar_host_profile.py [BATCH] [STEPS] [--profile]   (64 200)
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import time
import types

import numpy as np
import torch

from taipan.actors.gpu.grammar_masks import GrammarMasks
from taipan.bench.structured import array_schema
from taipan.messages.gpu import GrammarStart
from taipan.messages.requests import StructuredOutput
from taipan.models import resolve
from taipan.ops.tokenizer import Tokenizer


def run(batch: int, steps: int, profile: bool) -> None:
    tok = Tokenizer.from_gguf(resolve("smollm2")[1])
    items = [f"note number {i} about the text" for i in range(steps)]
    text = tok.encode(json.dumps({"notes": items}, indent=4))[: steps + 2]
    spec = StructuredOutput("json_schema", array_schema(128))
    ids = np.arange(batch, dtype=np.int64)
    masks = GrammarMasks(tok, optimistic=True)
    vocab = 49152

    def plan(n: int):
        new = [GrammarStart(int(r), spec) for r in ids] if not n else []
        return types.SimpleNamespace(
            grammar_rows=ids, grammar_new=new,
            grammar_drop=np.zeros(0, np.int64), temperature=np.zeros(batch, np.float32),
            sample=np.ones(batch, np.int8), logprobs_mode=np.zeros(0, np.int8),
            num_drafts=np.zeros(0, np.int32),
            prev_rows=np.arange(batch, dtype=np.int32) if n else np.zeros(0, np.int32),
            query_start_loc=np.arange(batch + 1, dtype=np.int32),
        )  # fmt: skip

    logits = torch.zeros(batch, vocab)
    parts: dict[str, list[float]] = {
        k: [] for k in ("skips_wait", "masked", "check_later", "run_check")
    }
    prof = cProfile.Profile() if profile else None
    pending = None
    for n in range(steps):
        token = text[n]
        logits.zero_()
        logits[:, token] = 1.0
        timed = n >= 2
        if timed and prof is not None:
            prof.enable()
        step = plan(n)
        tw = time.perf_counter()
        masks.inline(step, False) and masks.skips_wait(step, False)  # (as the worker asks)
        t0 = time.perf_counter()
        masks.masked(step, logits, None)
        t1 = time.perf_counter()
        host = torch.full((batch,), token)
        # (the checked rows' logits copy is device work on a GPU; here a memcpy of [B, V]
        # that would swamp the host work timed: a narrow view stands in after the first step)
        check = masks.check_later(host, host.clone(), logits[:, :16] if n else logits)
        masks.launched(check)
        t2 = time.perf_counter()
        if pending is not None:
            masks.run_check(pending)
        t3 = time.perf_counter()
        if prof is not None:
            prof.disable()
        pending = check
        if timed:
            spans = ((tw, t0), (t0, t1), (t1, t2), (t2, t3))
            for key, (a, b) in zip(parts, spans, strict=True):
                parts[key].append((b - a) * 1e6)
    total = sum(statistics.median(v) for v in parts.values())
    cells = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in parts.items())
    print(f"batch {batch}, {steps} steps: {total:.0f} us a step ({cells})")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    run(int(args[0]) if args else 64, int(args[1]) if len(args) > 1 else 200,
        "--profile" in sys.argv)  # fmt: skip
