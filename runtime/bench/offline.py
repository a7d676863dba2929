"""The `offline` workload of `taipan bench`: `--num-requests` requests of seeded ShareGPT-like
prompt and output lengths (`sharegpt_like`), all submitted at once through the real runtime; HF
in static batches of `--hf-batch` and with continuous batching, on the first `--hf-requests`
requests (ours is timed again on those for `ours_vs_hf`). One row, no fixed batch and no floor
to check. tests/perf/NOTES.md defines every figure.

Never imports torch itself: HF comes from taipan.ops.hf_bench, imported inside the functions that
use it.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from taipan.bench.common import greedy, optional_mode, random_prompt, rounded

# ShareGPT-like lengths (tokens), seeded: lognormal with median 200 and sigma 1.0 (mean ~330,
# a long right tail) for prompts and for outputs, rounded and clipped to [4, --max-len].
SHAREGPT_MEDIAN, SHAREGPT_SIGMA, MIN_LEN = 200, 1.0, 4


def sharegpt_like(n: int, seed: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """n (prompt token ids, output length) pairs, the same for the same (n, seed, max_len)."""
    rng = np.random.default_rng([seed, 0])

    def lengths() -> list[int]:
        raw = rng.lognormal(math.log(SHAREGPT_MEDIAN), SHAREGPT_SIGMA, n)
        return np.clip(np.rint(raw), MIN_LEN, max_len).astype(int).tolist()

    prompt_lens, output_lens = lengths(), lengths()
    ids = np.random.default_rng([seed, 1])
    return [random_prompt(ids, p) for p in prompt_lens], output_lens


async def _submit_all(
    address: str, prompts: list[list[int]], output_lens: list[int]
) -> tuple[float, int, int]:
    """Every request submitted at once, each with its own max_tokens: (seconds to the last,
    the steps the ranks ran for them, how many of those replayed a CUDA graph)."""
    from taipan.client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate([prompts[0][:8]], greedy(2))  # warm-up
        before = (await client.stats()).merged()
        start = time.perf_counter()
        done = await asyncio.gather(
            *(client.generate(p, greedy(n)) for p, n in zip(prompts, output_lens, strict=True))
        )
        elapsed = time.perf_counter() - start
        after = (await client.stats()).merged()
    got = [len(c.token_ids) for [c] in done]
    if got != output_lens:
        raise RuntimeError("ours generated other token counts than each request asked for")
    steps = after.steps_total - before.steps_total
    return elapsed, steps, after.steps_graphed - before.steps_graphed


def _offline_hf(args, model_path: str, prompts, output_lens, errors: dict) -> dict:
    """Seconds of HF's `hf_generate` (static batches of --hf-batch) and `hf_continuous`
    (continuous batching) modes on the given requests."""
    from taipan.ops import hf_bench as hf

    model = hf.load_hf(model_path, args.dtype, args.device)
    out = {
        "hf_generate": optional_mode(
            "hf_generate",
            lambda: hf.hf_static_batches_seconds(model, prompts, output_lens, args.hf_batch),
            errors,
        ),
        "hf_continuous": optional_mode(
            "hf_continuous",
            lambda: hf.hf_continuous_seconds(model, prompts, output_lens),
            errors,
        ),
    }
    return {k: v for k, v in out.items() if v is not None}


def offline_workload(args) -> list[dict]:
    from taipan.actors.config import InferenceConfig
    from taipan.launcher import runtime_from_args
    from taipan.models import resolve
    from taipan.ops.hardware import gpu_name

    n, max_len = args.num_requests, args.max_len
    if n < 1 or max_len < MIN_LEN or args.hf_batch < 1:
        raise ValueError(f"--num-requests and --hf-batch must be >= 1, --max-len >= {MIN_LEN}")
    config = InferenceConfig.from_cli(args.config, args.set)
    if 2 * max_len > config.max_sequence_length:
        raise ValueError(
            f"--max-len {max_len}: a request may need {2 * max_len} tokens, above "
            f"max_sequence_length ({config.max_sequence_length}); --set max_sequence_length=..."
        )
    k = min(n, args.hf_requests or n)
    name, model_path = resolve(args.model)
    prompts, output_lens = sharegpt_like(n, args.seed, max_len)
    with runtime_from_args(args) as rt:
        seconds, steps, graphed = asyncio.run(_submit_all(rt.address, prompts, output_lens))
        ours = {"all": seconds}
        if k < n:  # the ratio compares the same requests
            ours["k"] = asyncio.run(_submit_all(rt.address, prompts[:k], output_lens[:k]))[0]
    errors: dict = {}
    hf = {}
    if not args.no_hf:
        hf = _offline_hf(args, model_path, prompts[:k], output_lens[:k], errors)
    row = {
        "workload": "offline",
        "model": name,
        "gpu": gpu_name(args.device),
        "batch": None,  # no fixed batch: the scheduler's (ours) and HF's own choices
        "dtype": args.dtype,
        "device": args.device,
        "num_requests": n,
        "lengths": f"lognormal median {SHAREGPT_MEDIAN} sigma {SHAREGPT_SIGMA}, "
        f"[{MIN_LEN}, {max_len}], seed {args.seed}",
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": sum(output_lens),
        "ours_seconds": ours["all"],
        "ours_output_tok_s": sum(output_lens) / ours["all"],
        "ours_total_tok_s": (sum(output_lens) + sum(map(len, prompts))) / ours["all"],
        # How many steps the run took and what share replayed a CUDA graph (a step no graph
        # holds launches its kernels from Python: cuda_graph_all_prefills graphs prompt chunks).
        "ours_steps": steps,
        "ours_steps_graphed_share": graphed / steps if steps else 0.0,
        "hf_requests": k,
        "hf_batch": args.hf_batch,
        **errors,
    }
    return [rounded(_offline_ratios(row, ours, hf, output_lens[:k]))]


def _offline_ratios(row: dict, ours: dict, hf: dict, hf_output_lens: list[int]) -> dict:
    out_tokens = sum(hf_output_lens)
    ours_k = ours.get("k", ours["all"])
    if "k" in ours:
        row["note"] = f"HF timed on the first {row['hf_requests']} requests; ours_vs_hf on those"
        row.update(ours_k_seconds=ours_k, ours_k_output_tok_s=out_tokens / ours_k)
    for mode, seconds in hf.items():
        row.update({f"{mode}_seconds": seconds, f"{mode}_output_tok_s": out_tokens / seconds})
    if hf:
        best = min(hf, key=hf.get)
        row.update(hf_best=best, hf_best_output_tok_s=out_tokens / hf[best])
        row["ours_vs_hf"] = hf[best] / ours_k  # (ours tok/s) / (HF's faster tok/s)
    return row


def offline_summary(row: dict) -> str:
    """The row's human line."""
    return (
        f"offline {row['num_requests']} requests: ours {row['ours_output_tok_s']} output "
        f"tok/s in {row['ours_steps']} steps ({row['ours_steps_graphed_share']} graphed); "
        f"HF best {row.get('hf_best_output_tok_s')} tok/s on "
        f"{row.get('hf_requests')} requests, ours_vs_hf {row.get('ours_vs_hf')}"
    )
