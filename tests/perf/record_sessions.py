"""Record three small sessions with whatever taipan is on the path (CPU, the default model), so
that a later tree can replay them: `python3 tests/perf/record_sessions.py OUT_DIR`, then
`taipan replay OUT_DIR/<name> --check --allow-unchecked` with the other tree. Used to check that
a refactor leaves recorded logs replayable (issue 25): run it with the older tree staged first on
`PYTHONPATH` (`python -c "from tests.lint_imports import stage; ..."`).

Sessions: `plain`, `overlap` (overlapping steps) and `prefix` (prefix caching with chunked
prefill, prompts sharing a prefix).
"""

from __future__ import annotations

import sys

from taipan import Client, SamplingParams
from taipan.actors.config import InferenceConfig
from taipan.launcher import Runtime
from taipan.models import resolve

BASE = dict(
    block_size_tokens=16, max_tokens=256, max_requests=32, buffer_size_gb=1, max_sequence_length=512
)
SESSIONS = {
    "plain": {},
    "overlap": {"overlap_steps": True},
    "prefix": {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_tokens": 64},
}


def main(out: str) -> None:
    model = resolve("smollm2")[1]
    shared = "You are a helpful assistant. Please answer briefly and well. " * 4
    for name, extra in SESSIONS.items():
        config = InferenceConfig(**{**BASE, **extra})
        with Runtime(model, config, record_dir=f"{out}/{name}") as rt, Client(rt.address) as c:
            prompts = [shared + f"Count to {i}:" for i in range(6)]
            c.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
            c.generate(["One more"], SamplingParams(max_tokens=5, temperature=0.7, seed=3))
        print("recorded", f"{out}/{name}")


if __name__ == "__main__":
    main(sys.argv[1])
