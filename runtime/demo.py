"""`make run`: start the runtime on the default model, send a few prompts through the client
library, print the completions, shut down cleanly."""

from __future__ import annotations

import sys
import time

from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning to code.",
    "Why do cats purr?",
]


def main() -> int:
    start = time.perf_counter()
    with Runtime("smollm2") as rt:
        print(f"runtime up at {rt.address} in {time.perf_counter() - start:.1f} s", flush=True)
        with Client(rt.address) as client:
            sampling = SamplingParams(max_tokens=48, temperature=0.0)
            t = time.perf_counter()
            done = client.generate(PROMPTS, sampling, chat=True)
            elapsed = time.perf_counter() - t
        for prompt, c in zip(PROMPTS, done, strict=True):
            print(f"\n>>> {prompt}\n{c.text.strip()}  [{c.finish_reason}]")
        tokens = sum(len(c.token_ids) for c in done)
        print(f"\n{tokens} tokens for {len(PROMPTS)} prompts in {elapsed:.1f} s", flush=True)
    print("runtime stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
