"""Greedy outputs at several parallel sizes against one GPU (issue 12's two-GPU acceptance):

    python3 tests/perf/parallel_greedy.py --model random:llama-8b --tensor-parallel-size 2
    python3 tests/perf/parallel_greedy.py --model random:llama-1b --data-parallel-size 2
    python3 tests/perf/parallel_greedy.py --model random:llama-8b --data-parallel-size 2 \
        --tensor-parallel-size 2
    python3 tests/perf/parallel_greedy.py --model /tmp/qwen3-30b-a3b-4l --data-parallel-size 4 \
        --expert-parallel-size 4 --make-qwen3-30b-a3b-4l

Serves the model once at size 1 and once at the size given (fp32 by default, TF32 off: random
weights give near-flat logits, which bf16 rounding flips between batch shapes), generates the
same prompts greedily, and prints one JSON line: whether every output is identical, how many
are, and the first that differs. An output that differs is a near tie when, at its first
differing token, each run's token is in the other's top 5 and the size-1 run's log-probs of the
two tokens are within `--tie-margin` (random weights give flat logits, and a different batch
shape changes fp32 sums in the last bits, as vLLM's `check_logprobs_close` allows). Exit code 0
only when every output is identical or a near tie. `--device cpu` and a
Hugging Face directory run it on the CPU (how it is tested).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

TOP_N = 5


def _prompts(n: int, length: int, seed: int, top: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, top, length + i % 7).tolist() for i in range(n)]


def _generate(args, sizes: dict) -> tuple[list[list[int]], float]:
    from taipan import LLM, SamplingParams

    greedy = SamplingParams(
        max_tokens=args.output_len,
        temperature=0.0,
        ignore_eos=True,
        return_log_probs=True,
        skip_prompt_log_probs=True,
        top_n_logprobs=TOP_N,
    )
    prompts = _prompts(args.num_prompts, args.prompt_len, args.seed, args.max_token_id)
    config = {"max_requests": args.num_prompts, "buffer_size_gb": args.kv_gb}
    with LLM(args.model, device=args.device, dtype=args.dtype, **sizes, **config) as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"{sizes}: {len(errors)} requests failed, the first: {errors[0]}")
    return [(o.token_ids, o.top_n_logprobs) for o in outs], seconds


def _tie(want, got, margin: float) -> dict | None:
    """The first differing token of one output when it is a near tie, else None."""
    (a, a_top), (b, b_top) = want, got
    j = next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    if b[j] not in a_top[j] or a[j] not in b_top[j]:
        return None
    gap = a_top[j][a[j]] - a_top[j][b[j]]
    return {"token": j, "log_prob_gap": round(gap, 6)} if gap <= margin else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--expert-parallel-size", type=int, default=1)
    p.add_argument(
        "--make-qwen3-30b-a3b-4l",
        action="store_true",
        help="first write a random Qwen3-30B-A3B-shaped MoE of 4 layers at --model (bf16 values)",
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-gb", type=float, default=2.0, help="buffer_size_gb per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-token-id", type=int, default=20000, help="prompt ids below this")
    p.add_argument(
        "--tie-margin",
        type=float,
        default=1e-3,
        help="largest size-1 log-prob gap between two differing tokens that counts as a near tie",
    )
    args = p.parse_args(argv)
    sizes = {
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "expert_parallel_size": args.expert_parallel_size,
    }
    if args.make_qwen3_30b_a3b_4l:
        import torch

        from tests.random_moe import QWEN3_30B_A3B_4L, make_random_qwen3_moe

        shape = dict(QWEN3_30B_A3B_4L, save_dtype=torch.bfloat16)
        make_random_qwen3_moe(args.model, device=args.device, **shape)
    want, one_s = _generate(args, {})
    got, many_s = _generate(args, sizes)
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a[0] != b[0]]
    ties = {i: _tie(want[i], got[i], args.tie_margin) for i in differ}
    real = [i for i in differ if ties[i] is None]
    row = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        **sizes,
        "prompts": len(want),
        "identical": len(want) - len(differ),
        "all_identical": not differ,
        "first_differing": differ[0] if differ else None,
        "near_ties": {str(i): t for i, t in ties.items() if t is not None},
        "all_identical_or_near_ties": not real,
        "seconds_size_1": round(one_s, 3),
        "seconds_parallel": round(many_s, 3),
        "command": " ".join(["python3 tests/perf/parallel_greedy.py", *sys.argv[1:]]),
    }
    print(json.dumps(row))
    return 0 if not real else 1


if __name__ == "__main__":
    sys.exit(main())
