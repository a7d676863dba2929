"""`taipan bench`: output tokens/s, ours vs Hugging Face transformers vs the hardware limit.

Measured side by side in one run on the same prompts (same token ids, mixed lengths), greedy,
every request generating exactly `--output-len` tokens (EOS ignored on both sides). Ours is
timed from the first submission to the last completion through the real runtime (client ->
coordinator -> engine -> gpu actor); HF is `generate` on one left-padded batch. The hardware
limit is a floor on step time from measured matmul throughput and memory bandwidth (weights read
once per decode step). Each run appends its JSON rows to tests/perf/results.jsonl.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

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

RESULTS = os.path.join("tests", "perf", "results.jsonl")


def add_arguments(p) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON object per workload")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face side")
    p.add_argument("--results", default=RESULTS, help="JSONL file each run appends to")


def mixed_prompts(n: int) -> list[str]:
    """n prompts of mixed lengths (about 10 to 150 tokens), as a serving mix has them: prompt i
    repeats its seed sentence 1 + (5 * i) % 11 times. Equal lengths would hide the padding
    that a static batch pays."""
    out = []
    for i in range(n):
        seed = SEED_PROMPTS[i % len(SEED_PROMPTS)]
        out.append(" ".join([seed] * (1 + (5 * i) % 11)) + f" ({i})")
    return out


def _ours(args, prompts: list[str]) -> tuple[float, list[list[int]], list[list[int]]]:
    from taipan.client import Client
    from taipan.launcher import runtime_from_args
    from taipan.messages.requests import SamplingParams

    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with runtime_from_args(args) as rt, Client(rt.address) as client:
        client.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        start = time.perf_counter()
        done = client.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
    return elapsed, [c.prompt_token_ids for c in done], [c.token_ids for c in done]


def run(args) -> int:
    from taipan.models import resolve
    from taipan.ops.bench import hardware_limit, hf_generate  # torch lives in ops/, not runtime/

    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    prompts = mixed_prompts(args.num_prompts)
    _, model_path = resolve(args.model)
    ours_s, prompt_ids, ours_tokens = _ours(args, prompts)
    total = args.num_prompts * args.output_len
    row = {
        "workload": f"generate-{args.num_prompts}x{args.output_len}",
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "num_prompts": args.num_prompts,
        "prompt_tokens": f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))}",
        "output_len": args.output_len,
        "ours_seconds": round(ours_s, 3),
        "ours_output_tok_s": round(total / ours_s, 1),
    }
    if not args.no_hf:
        hf_s, hf_tokens = hf_generate(args, model_path, prompt_ids)
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
        row.update(
            hf_seconds=round(hf_s, 3),
            hf_output_tok_s=round(total / hf_s, 1),
            ratio=round(hf_s / ours_s, 3),
            identical_outputs=f"{same}/{args.num_prompts}",
        )
    row.update(
        {k: round(v, 1) for k, v in hardware_limit(args, model_path, args.num_prompts).items()}
    )
    row.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        command="taipan " + " ".join(sys.argv[1:]),
    )
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")
    if args.json:
        print(json.dumps(row))
    else:
        print(f"workload {row['workload']}: ours {row['ours_output_tok_s']} output tok/s", end="")
        if "hf_output_tok_s" in row:
            print(
                f", HF transformers {row['hf_output_tok_s']} tok/s, ratio {row['ratio']}x, "
                f"identical {row['identical_outputs']}",
                end="",
            )
        print(f", hardware limit {row['hw_limit_output_tok_s']} tok/s")
    return 0
