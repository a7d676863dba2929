"""The `shared-prefix` workload of `taipan bench`: prefix caching off, then on (a fresh runtime
each), on two scenarios of `--num-prompts` requests submitted at once: `system` (one
`--prefix-len` system prompt + a distinct short question each) and `samples` (one prompt n
times, as RL rollouts sample it). Greedy, so the outputs must not change with caching on; one
row per scenario. A hybrid (NemotronH) model's "on" also sets `prefix_caching_mamba_gb`
(`--mamba-gb`): Mamba snapshots, without which a hybrid shares KV blocks but skips no prompt
token. The HF side (transformers has no prefix cache): `--hf-prompts` of each scenario's prompts
one at a time, each one's TTFT and the output tokens a second of `generate` at batch 1.
tests/perf/NOTES.md defines every figure.

Never imports torch itself: HF and the GPU's name come from taipan.ops.hf_bench and
taipan.ops.hardware, imported inside the functions that use them.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from taipan.bench.common import greedy, optional_mode, random_prompt, rounded, with_sets
from taipan.models import has_mamba_layers

QUESTION_LENS = (16, 64)  # each question's length (tokens), seeded uniform in this range
SCENARIOS = ("system", "samples")


def shared_prefix_prompts(n: int, prefix_len: int, seed: int, tag: int) -> dict[str, list]:
    """{scenario: n prompts of token ids}. `system`: one prefix + n distinct questions;
    `samples`: another prefix + one question, n times (so the scenarios share no block). `tag`
    0 gives the timed prompts, 1 the warm-up's: other ids, the same lengths."""
    rng = np.random.default_rng([seed, 2, tag])
    lengths = np.random.default_rng([seed, 3]).integers(*QUESTION_LENS, endpoint=True, size=n)
    system = random_prompt(rng, prefix_len)
    questions = [random_prompt(rng, int(k)) for k in lengths]
    sample = random_prompt(rng, prefix_len) + questions[0]
    return {"system": [system + q for q in questions], "samples": [sample] * n}


def _mamba_gb(args) -> float:
    if args.mamba_gb is not None:
        return args.mamba_gb
    return 2.0 if args.device.startswith("cuda") else 0.01


def _prefix_sets(args, on: bool, hybrid: bool = False) -> list[str]:
    if on:
        sets = ["enable_prefix_caching=true", f"prefix_caching_eviction_policy={args.eviction}"]
        if hybrid:
            sets.append(f"prefix_caching_mamba_gb={_mamba_gb(args)}")
        return sets
    # (the user's own eviction/routing settings would fail validation with caching off)
    off = ("enable_prefix_caching=false", "prefix_caching_eviction_policy=none")
    return [*off, "prefix_caching_coordinator_policy=none"]


def _prefix_counters(client) -> dict[str, int]:
    """The prefix counters of messages/stats.py RankStats, summed over ranks (zeros when off)."""
    keys = ("prefix_prompt_tokens", "prefix_cached_tokens", "prefill_tokens_computed")
    merged = client.stats().merged()
    return {k: getattr(merged, k) for k in (*keys, "blocks_hashed")}


def _timed_scenario(client, prompts: list[list[int]], output_len: int) -> tuple[dict, list]:
    """(figures, generated token ids) of one scenario: every prompt submitted at once."""
    before = _prefix_counters(client)
    start = time.perf_counter()
    done = client.generate(prompts, greedy(output_len))
    seconds = time.perf_counter() - start
    after = _prefix_counters(client)
    if sorted({len(c.token_ids) for c in done}) != [output_len]:
        raise RuntimeError(f"ours generated other token counts than {output_len}")
    ttft = np.array([c.ttft for c in done], dtype=np.float64)
    prompt_tokens = sum(map(len, prompts))
    cached = sum(c.num_cached_tokens for c in done)
    engine = {k: after[k] - before[k] for k in before}
    figures = {
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.median(ttft)),
        "seconds": seconds,
        "output_tok_s": len(prompts) * output_len / seconds,
        "prompt_tokens_computed": prompt_tokens - cached,
        "prompt_tokens_cached": cached,
        "hit_rate": cached / prompt_tokens,
        "engine_prefill_tokens": engine["prefill_tokens_computed"],
        "engine_hit_rate": engine["prefix_cached_tokens"] / max(1, engine["prefix_prompt_tokens"]),
        "blocks_hashed": after["blocks_hashed"],
    }
    return figures, [c.token_ids for c in done]


def _ours_shared_prefix(
    args, on: bool, hybrid: bool = False
) -> dict[str, tuple[dict, list, list | None]]:
    """{scenario: (figures, token ids, token ids of a repeat)} from one fresh runtime, caching
    `on` or off. Each scenario runs once untimed with other ids of the same lengths first (the
    same step shapes; with caching on it also caches blocks no timed prompt shares). With
    caching off the timed prompts run once more, untimed: how far greedy outputs reproduce
    without caching at all (bf16 rows differ with the batch's composition) is the baseline a
    mismatch is read against."""
    from taipan.client import Client
    from taipan.launcher import runtime_from_args

    n, out = args.num_prompts, {}
    warm = shared_prefix_prompts(n, args.prefix_len, args.seed, tag=1)
    timed = shared_prefix_prompts(n, args.prefix_len, args.seed, tag=0)
    with runtime_from_args(with_sets(args, *_prefix_sets(args, on, hybrid))) as rt:
        with Client(rt.address) as client:
            for name in SCENARIOS:
                client.generate(warm[name], greedy(args.output_len))
                figures, tokens = _timed_scenario(client, timed[name], args.output_len)
                repeat = None
                if not on:
                    repeat = client.generate(timed[name], greedy(args.output_len))
                    repeat = [c.token_ids for c in repeat]
                out[name] = (figures, tokens, repeat)
    return out


def _check_shared_prefix_args(args) -> int:
    """Validate the sizes against the config; returns its block size."""
    from taipan.actors.config import InferenceConfig

    args.output_len = args.output_len or 64
    args.num_prompts = 32 if args.num_prompts is None else args.num_prompts
    if args.prefix_len is None:
        args.prefix_len = 1024 if args.device.startswith("cuda") else 512
    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    config = InferenceConfig.from_cli(args.config, args.set)
    block_size = config.block_size_tokens
    if args.prefix_len < block_size:
        raise ValueError(
            f"--prefix-len {args.prefix_len} is below block_size_tokens ({block_size}): no block "
            f"could be shared; raise it or --set block_size_tokens=..."
        )
    longest = args.prefix_len + QUESTION_LENS[1] + args.output_len
    if longest > config.max_sequence_length:
        raise ValueError(
            f"a request may need {longest} tokens, above max_sequence_length "
            f"({config.max_sequence_length}); lower --prefix-len or --set max_sequence_length=..."
        )
    return block_size


def shared_prefix_workload(args) -> list[dict]:
    from taipan.models import resolve
    from taipan.ops.hardware import gpu_name

    block_size = _check_shared_prefix_args(args)
    name, model_path = resolve(args.model)
    hybrid = has_mamba_layers(model_path)
    off = _ours_shared_prefix(args, on=False, hybrid=hybrid)
    on = _ours_shared_prefix(args, on=True, hybrid=hybrid)
    prompts = shared_prefix_prompts(args.num_prompts, args.prefix_len, args.seed, tag=0)
    hf, errors = {}, {}
    if not args.no_hf:
        hf = optional_mode("hf", lambda: _hf_shared_prefix(args, model_path, prompts), errors) or {}
    rows = []
    for scenario in SCENARIOS:
        lengths = list(map(len, prompts[scenario]))
        row = {
            "workload": "shared-prefix",
            "scenario": scenario,
            "model": name,
            "gpu": gpu_name(args.device),
            "batch": None,  # all submitted at once: the scheduler's own steps
            "dtype": args.dtype,
            "device": args.device,
            "num_prompts": args.num_prompts,
            "prefix_len": args.prefix_len,
            "prompt_tokens": f"{min(lengths)}-{max(lengths)}",
            "output_len": args.output_len,
            "block_size": block_size,
            "eviction_policy": args.eviction,
            "sampling": "greedy",
            "hybrid": hybrid,
            "mamba_gb": _mamba_gb(args) if hybrid else None,
        }
        row = _shared_prefix_row(row, off[scenario], on[scenario])
        if hf:
            row |= {f"hf_{k}": v for k, v in hf[scenario].items()}
        else:
            row["hf_error"] = errors.get("hf_error", "skipped (--no-hf)")
        rows.append(rounded(row))
    return rows


def _hf_shared_prefix(args, model_path: str, prompts: dict[str, list]) -> dict[str, dict]:
    """{scenario: HF figures} on the first `--hf-prompts` prompts of each scenario."""
    from taipan.ops.hf_bench import hf_one_at_a_time

    k = min(args.hf_prompts, args.num_prompts)
    return {
        name: hf_one_at_a_time(model_path, args.dtype, args.device, ps[:k], args.output_len)
        for name, ps in prompts.items()
    }


def _shared_prefix_row(row: dict, off: tuple, on: tuple) -> dict:
    """Both settings' figures, the on/off speedups (> 1: caching helps), and whether every
    greedy output is the same with caching on (a mismatch is a failure: stderr and exit 1;
    None where outputs do not even reproduce with caching off);
    `off`, `on`: `_ours_shared_prefix`'s (figures, token ids, repeat) of one scenario."""
    for setting, (figures, *_) in (("off", off), ("on", on)):
        if setting == "off":  # the engine counts prefixes only with caching on
            figures = {k: v for k, v in figures.items() if not k.startswith(("engine", "blocks"))}
        row.update({f"{setting}_{k}": v for k, v in figures.items()})
    row["ttft_speedup"] = row["off_ttft_mean_s"] / row["on_ttft_mean_s"]
    row["ttft_p50_speedup"] = row["off_ttft_p50_s"] / row["on_ttft_p50_s"]
    row["throughput_speedup"] = row["on_output_tok_s"] / row["off_output_tok_s"]
    n = len(off[1])
    same = sum(a == b for a, b in zip(off[1], on[1], strict=True))
    repeat = sum(a == b for a, b in zip(off[1], off[2], strict=True))
    row["outputs_identical"] = f"{same}/{n}"
    row["off_repeat_identical"] = f"{repeat}/{n}"
    # Equality is a test only where greedy output reproduces without caching (fp32): in bf16 a
    # random model's near-flat logits flip with the batch's composition, caching or not.
    row["outputs_equal"] = same == n if repeat == n else None
    if row["outputs_equal"] is False:
        print(
            f"taipan bench: FAILED: shared-prefix {row['scenario']}: only {same}/{n} greedy "
            f"outputs are the same with prefix caching on as off",
            file=sys.stderr,
        )
    elif row["outputs_equal"] is None:
        print(
            f"taipan bench: shared-prefix {row['scenario']}: outputs not compared: without "
            f"caching the same prompts run again give {repeat}/{n} identical greedy outputs "
            f"(on vs off: {same}/{n}); compare in float32",
            file=sys.stderr,
        )
    return row


def shared_prefix_summary(row: dict) -> str:
    """The row's human line."""
    return (
        f"shared-prefix {row['scenario']} ({row['num_prompts']} prompts, {row['prefix_len']}-token "
        f"prefix, {row['output_len']} out): TTFT mean {row['off_ttft_mean_s']} -> "
        f"{row['on_ttft_mean_s']} s ({row['ttft_speedup']}x), output tok/s "
        f"{row['off_output_tok_s']} -> {row['on_output_tok_s']} ({row['throughput_speedup']}x), "
        f"prompt tokens computed {row['off_prompt_tokens_computed']} -> "
        f"{row['on_prompt_tokens_computed']} (hit rate {row['on_hit_rate']}), "
        f"outputs equal {row['outputs_equal']} ({row['outputs_identical']})"
        + (
            f"; HF transformers (batch 1, {row['hf_prompts']} prompts) TTFT mean "
            f"{row['hf_ttft_mean_s']} s, {row['hf_output_tok_s']} tok/s"
            if "hf_ttft_mean_s" in row
            else ""
        )
    )
