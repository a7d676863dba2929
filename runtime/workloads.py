"""The `decode` and `offline` workloads of `taipan bench` (runtime/bench.py owns the CLI, the
`generate` workload and the results file; tests/perf/NOTES.md defines every figure).

`decode`: per batch B of `--batches`, the decode step time, for ours in each of its modes
(`ours_modes`: CUDA graphs and overlapping steps, the default config; without graphs; without
overlap; under tensor parallelism with NCCL-only all-reduces), for HF `generate` with its dynamic
cache and with a static cache that transformers compiles (CUDA only), against the floor: (weight
bytes + the batch's KV bytes at mid-generation) / copy bandwidth measured on `--copy-gib` GiB.
Ours: the engine's own time per output token over a run of B prompts of `--prompt-len` ids and
1 + `--output-len` tokens (`_ours_decode` says why not a difference of two runs); HF: (TN - T1) /
output_len from `generate` runs of 1 and 1 + output_len tokens, medians of `--hf-repeats`. Each
of ours warms up first with the batch's shapes and with a step that mixes decode rows and
prefills (`_warm_mixed`). One row per batch; a row whose step beats the floor is marked
`invalid` (`decode_invalid`), and runtime/bench.py refuses to record it.

`offline`: `--num-requests` requests of seeded ShareGPT-like prompt and output lengths
(`sharegpt_like`), all submitted at once; HF in static batches of `--hf-batch` and with
continuous batching, on the first `--hf-requests` requests (ours is timed again on those for
`ours_vs_hf`). One row.

`shared-prefix`: runtime/prefix_bench.py; `http-load`: runtime/http_bench.py. The prompt makers
the workloads share live here (`random_prompt`, `mixed_prompts`, `sharegpt_like`).

Torch (HF, bandwidth, matmul rate) lives in ops/bench.py, imported lazily; this module never
imports torch itself (dtypes travel as their names).
"""

from __future__ import annotations

import asyncio
import copy
import math
import statistics
import sys
import time

import numpy as np

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


def _with_sets(args, *sets: str):
    """A copy of `args` whose InferenceConfig gets `sets` (FIELD=VALUE) after the user's own."""
    out = copy.copy(args)
    out.set = [*args.set, *sets]
    return out


def _sampling(max_tokens: int):
    from taipan.messages.requests import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _timed_generate(client, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """(seconds from submitting every prompt to the last completion, the completions); each must
    have exactly `max_tokens` tokens (greedy, EOS ignored)."""
    start = time.perf_counter()
    done = client.generate(prompts, _sampling(max_tokens))
    elapsed = time.perf_counter() - start
    lengths = sorted({len(c.token_ids) for c in done})
    if lengths != [max_tokens]:
        raise RuntimeError(f"ours generated {lengths} tokens, not all {max_tokens}")
    return elapsed, done


def _rank_counters(client) -> tuple[float, int, int, float]:
    """(device_seconds_total per rank, steps_total, steps_graphed, gc_seconds_total per rank)
    summed over the ranks (messages/stats.py; the times averaged, so that 1 - the device time's
    growth / wall time is each device's idle share, and the GC time's growth / wall time each
    engine process's share of time in the garbage collector)."""
    stats = client.stats()
    merged, n = stats.merged(), len(stats.ranks)
    return (
        merged.device_seconds_total / n,
        merged.steps_total,
        merged.steps_graphed,
        merged.gc_seconds_total / n,
    )


def _optional(name: str, fn, errors: dict):
    """Run one optional mode (an HF mode, ours without CUDA graphs); a failure is recorded as
    `<name>_error` (and printed), not fatal: the rows keep every other figure."""
    try:
        return fn()
    except Exception as exc:  # transformers raises many kinds; the row says which
        errors[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"taipan bench: {name} failed: {exc!r}", file=sys.stderr)
        return None


def _rounded(row: dict) -> dict:
    """Floats to 5 significant digits (a floor of 0.013 ms and a rate of 3000 GB/s alike)."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}


# ---- decode: step time at batch B vs the floor -----------------------------------------------


# Ours' modes and the --set lines each adds to the run's own; the first mode that applies is the
# default config and adds none (on a CPU that is `eager`: CUDA graphs exist only on CUDA).
OURS_MODES = {
    "graphs": (),  # CUDA graphs, overlapping steps and, under TP, the custom all-reduce
    "eager": ("num_cuda_graphs=0",),
    "serial": ("overlap_steps=false",),  # each step planned after the previous one's result
    "nccl": ("custom_all_reduce=false",),  # every all-reduce through NCCL
}


def ours_modes(args) -> list[str]:
    """The modes of ours a decode run times, the default config's first: those `--ours-modes`
    names (a comma list), else every one that applies: on CUDA graphs, eager, serial, and nccl
    with --tensor-parallel-size > 1; on a CPU one eager run."""
    cuda = args.device.startswith("cuda")
    tp = getattr(args, "tensor_parallel_size", 1)
    applies = ["graphs", "eager", "serial", *(["nccl"] if tp > 1 else [])] if cuda else ["eager"]
    given = getattr(args, "ours_modes", None)
    if not given:
        return applies
    wanted = {m.strip() for m in given.split(",") if m.strip()}
    unknown = sorted(wanted - set(OURS_MODES))
    if unknown:
        raise ValueError(
            f"--ours-modes: no mode {','.join(unknown)} (modes: {','.join(OURS_MODES)})"
        )
    elsewhere = sorted(wanted - set(applies))
    if elsewhere:
        raise ValueError(
            f"--ours-modes: {','.join(elsewhere)} does not apply to this run (these do: "
            f"{','.join(applies)}): graphs, serial and nccl need CUDA, nccl also "
            "--tensor-parallel-size > 1"
        )
    if applies[0] not in wanted:
        raise ValueError(f"--ours-modes must include {applies[0]}: the row's ratios are against it")
    return [m for m in applies if m in wanted]


def _decode_prompts(args, batches: list[int]) -> dict[int, dict[str, list[list[int]]]]:
    """Per batch: "warmup", "t1" and "tn" runs of B prompts of --prompt-len ids each, every run
    its own prompts (so no run can reuse another's KV, whatever the config says)."""
    runs = {}
    for b in batches:
        runs[b] = {}
        for i, name in enumerate(("warmup", "t1", "tn")):
            rng = np.random.default_rng([args.seed, b, i])
            runs[b][name] = [random_prompt(rng, args.prompt_len) for _ in range(b)]
    return runs


def _ours_decode(args, runs: dict, output_len: int) -> dict[int, dict]:
    """Per batch, through the real runtime: the step (`step_ms`) is the median over the B
    requests of a run of 1 + output_len tokens each (TN) of the engine's TPOT (Completion.tpot:
    last token time - first token time, over the output_len steps between, on the engine's
    clock), so only decode steps are in it. Kept for reference: `diff_ms` = (TN - T1) /
    output_len, T1 a run of 1 token (prefill only) on other prompts. That difference of two
    wall-clock runs subtracts from TN's few steps any one-off cost that lands in T1 only (the
    batch reaching the engine over two steps, an eager mixed step, a compile, client or
    coordinator jitter): on an H100, 16 steps of ~1.3 ms came out at 0.47x the floor. Over TN:
    the GPU's idle share (1 - the device time of the steps / wall time) and the share of steps
    run from a CUDA graph."""
    from taipan.client import Client
    from taipan.launcher import runtime_from_args

    out = {}
    with runtime_from_args(args) as rt, Client(rt.address) as client:
        for b, prompts in runs.items():
            client.generate(prompts["warmup"], _sampling(4))  # this batch's shapes, once
            asyncio.run(_warm_mixed(rt.address, prompts["warmup"]))
            t1, _ = _timed_generate(client, prompts["t1"], 1)
            dev0, steps0, graphed0, gc0 = _rank_counters(client)
            tn, done = _timed_generate(client, prompts["tn"], 1 + output_len)
            dev1, steps1, graphed1, gc1 = _rank_counters(client)
            out[b] = {
                "t1_s": t1,
                "tn_s": tn,
                "step_ms": 1e3 * _median_tpot(done),
                "diff_ms": 1e3 * (tn - t1) / output_len,
                "gpu_idle_share": 1 - (dev1 - dev0) / tn,
                "steps_graphed_share": (graphed1 - graphed0) / max(1, steps1 - steps0),
                "gc_share": (gc1 - gc0) / tn,
            }
    return out


def _median_tpot(done: list) -> float:
    tpots = [c.tpot for c in done]
    if None in tpots:
        raise RuntimeError("the engine reported no TPOT for a request of 2 or more tokens")
    return statistics.median(tpots)


async def _warm_mixed(address: str, prompts: list[list[int]]) -> None:
    """Steps that mix decode rows with prefill chunks, run once untimed: the B requests of a
    timed run may reach the engine over two steps, and the first such step runs eagerly with
    shapes (and kernels to compile) no pure prefill or decode step had (one 8B batch-8 run paid
    ~1 s of it inside its timed run). One request starts; once it decodes, the rest join."""
    from taipan.client import AsyncClient

    if len(prompts) < 2:
        return
    async with AsyncClient(address) as client:
        decoding = asyncio.Event()

        async def lead():
            async for delta in client.stream(prompts[0], _sampling(16)):
                if delta.token_ids:
                    decoding.set()

        task = asyncio.ensure_future(lead())
        await decoding.wait()
        await client.generate(prompts[1:], _sampling(4))
        await task


def _decode_hf(args, model_path: str, runs: dict, output_len: int, errors: dict) -> dict:
    """{mode: {batch: {"t1_s", "tn_s", "step_ms"}}} for HF's `hf` (dynamic cache) and
    `hf_static` (static cache, compiled by transformers: CUDA only) modes."""
    from taipan.ops import bench as torch_side

    model = torch_side.load_hf(model_path, args.dtype, args.device)
    modes = {"hf": False}
    if args.device.startswith("cuda"):
        modes["hf_static"] = True
    repeats = args.hf_repeats

    def timed(static: bool):
        return _hf_decode(model, runs, output_len, static, repeats)

    return {mode: _optional(mode, lambda s=s: timed(s), errors) for mode, s in modes.items()}


def _hf_decode(model, runs: dict, output_len: int, static: bool, repeats: int) -> dict[int, dict]:
    """Per batch: step = (median TN - median T1) / output_len over `repeats` timed pairs of
    `generate` runs, 1 and 1 + output_len new tokens (ops/bench.py `hf_decode_seconds`, each pair
    after its own warm-up). HF gives no per-token clock from outside, so this stays a difference
    of two wall-clock runs: a one-off cost in T1 (or in TN) moves the step by its size /
    output_len, and the medians drop it only where it hits fewer than half of the repeats; the
    shorter output_len, the larger what is left."""
    from taipan.ops.bench import hf_decode_seconds

    per_batch = {}
    for b, prompts in runs.items():
        times = [hf_decode_seconds(model, prompts, output_len, static) for _ in range(repeats)]
        t1 = statistics.median(t["t1"] for t in times)
        tn = statistics.median(t["tn"] for t in times)
        per_batch[b] = {"t1_s": t1, "tn_s": tn, "step_ms": 1e3 * (tn - t1) / output_len}
    return per_batch


def _decode_batches(args) -> list[int]:
    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise ValueError(
            f"--batches must be comma-separated integers, got {args.batches!r}"
        ) from None
    if not batches or batches[0] < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches!r}")
    return batches


def _decode_config_sets(args, batches: list[int]) -> list[str]:
    """Every decode batch must fit in one step: max_requests >= the largest batch."""
    from taipan.actors.config import InferenceConfig

    config = InferenceConfig.from_cli(args.config, args.set)
    if config.max_requests is None:
        return [f"max_requests={batches[-1]}"]
    if config.max_requests < batches[-1]:
        raise ValueError(
            f"max_requests ({config.max_requests}) is below the largest batch ({batches[-1]})"
        )
    return []


def decode_workload(args) -> list[dict]:
    from taipan.models import resolve
    from taipan.ops import bench as torch_side

    args.output_len = args.output_len or 128
    if args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--prompt-len and --output-len must be >= 1")
    if getattr(args, "hf_repeats", 1) < 1:
        raise ValueError("--hf-repeats must be >= 1")
    batches = _decode_batches(args)
    modes = ours_modes(args)
    name, model_path = resolve(args.model)
    runs = _decode_prompts(args, batches)
    sets = _decode_config_sets(args, batches)
    errors: dict = {}
    # Ours first: its engine process must have the GPU to itself. The default config's mode is
    # the row's own figure and must succeed; the others are optional.
    ours = {}
    for mode in modes:
        extra = () if mode == modes[0] else OURS_MODES[mode]
        mode_args = _with_sets(args, *sets, *extra)

        def timed(a=mode_args):
            return _ours_decode(a, runs, args.output_len)

        ours[mode] = timed() if mode == modes[0] else _optional(f"ours_{mode}", timed, errors)
    hw = torch_side.model_bytes(model_path, args.dtype)
    hw["copy_gb_s"] = torch_side.copy_bandwidth(args.device, args.copy_gib) / 1e9
    hw["matmul_tflop_s"] = torch_side.matmul_rate(args.device, args.dtype) / 1e12
    hf = {} if args.no_hf else _decode_hf(args, model_path, runs, args.output_len, errors)
    common = {
        "workload": "decode",
        "model": name,
        "gpu": torch_side.gpu_name(args.device),
        "dtype": args.dtype,
        "device": args.device,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        **errors,
    }
    return [_rounded(_decode_row(args, dict(common, batch=b), b, ours, hf, hw)) for b in batches]


def _decode_row(args, row: dict, b: int, ours: dict, hf: dict, hw: dict) -> dict:
    """Every figure of batch b, the floor, the ratios, and `invalid` where a step beats the
    floor (`decode_invalid`). `ours` maps each mode (`ours_modes`, the default config's first)
    to its per-batch figures, or None where it failed; `hf` likewise for HF's modes."""
    for mode, per_batch in ours.items():
        if per_batch is None:
            continue
        r, p = per_batch[b], f"ours_{mode}"
        row.update({f"{p}_ms": r["step_ms"], f"{p}_diff_ms": r["diff_ms"]})
        row.update({f"{p}_t1_s": r["t1_s"], f"{p}_tn_s": r["tn_s"]})
        row[f"{p}_gpu_idle_share"] = r["gpu_idle_share"]
        row[f"{p}_steps_graphed_share"] = r["steps_graphed_share"]
        row[f"{p}_gc_share"] = r.get("gc_share")
    for mode, per_batch in hf.items():
        if per_batch is not None:
            r = per_batch[b]
            row.update({f"{mode}_ms": r["step_ms"], f"{mode}_t1_s": r["t1_s"]})
            row[f"{mode}_tn_s"] = r["tn_s"]
    row["step_source"] = "ours: median engine TPOT of the TN run's requests"
    if hf:
        row["hf_repeats"] = repeats = getattr(args, "hf_repeats", 1)
        row["step_source"] += f"; HF: (median TN - median T1) / output_len of {repeats} runs"
    main = next(iter(ours))
    row["ours_step_ms"] = step = row[f"ours_{main}_ms"]
    row["ours_output_tok_s"] = 1e3 * b / step if step > 0 else None
    row["gpu_idle_share"] = row[f"ours_{main}_gpu_idle_share"]
    row["steps_graphed_share"] = row[f"ours_{main}_steps_graphed_share"]
    row["gc_share"] = row[f"ours_{main}_gc_share"]
    if main == "eager":
        row["graphs_skipped"] = "needs CUDA: one eager run (CUDA graphs exist only on CUDA)"
    elif step > 0:
        for mode, ratio in (
            ("eager", "graphs_speedup"),
            ("serial", "overlap_speedup"),
            ("nccl", "custom_all_reduce_speedup"),
        ):
            if row.get(f"ours_{mode}_ms"):
                row[ratio] = row[f"ours_{mode}_ms"] / step
    # The floor: one step reads the weights once and the batch's KV at mid-generation; under
    # tensor parallelism each of the T devices reads its 1/T of both, at once.
    context = args.prompt_len + args.output_len / 2
    kv_bytes = b * context * hw["kv_bytes_per_token"]
    tp = getattr(args, "tensor_parallel_size", 1)
    row.update(
        params=hw["params"],
        weight_bytes=hw["weight_bytes"],
        kv_bytes=int(kv_bytes),
        copy_gib=args.copy_gib,
        copy_gb_s=hw["copy_gb_s"],
        floor_ms=1e3 * (hw["weight_bytes"] + kv_bytes) / tp / (hw["copy_gb_s"] * 1e9),
        matmul_tflop_s=hw["matmul_tflop_s"],
        # 2 FLOPs per weight read and token (attention's own FLOPs left out: small here).
        compute_floor_ms=1e3 * 2 * hw["read_params"] * b / tp / (hw["matmul_tflop_s"] * 1e12),
    )
    row["step_vs_floor"] = step / row["floor_ms"]
    if not args.device.startswith("cuda"):
        row["hf_static_skipped"] = "needs CUDA (transformers compiles static-cache decode there)"
    hf_steps = {m: row[f"{m}_ms"] for m in ("hf", "hf_static") if f"{m}_ms" in row}
    if hf_steps and step > 0:
        best = min(hf_steps, key=hf_steps.get)
        row.update(hf_best=best, hf_best_ms=hf_steps[best], ours_vs_hf=hf_steps[best] / step)
    invalid = decode_invalid(row)
    if invalid:
        row["invalid"] = invalid
    return row


def decode_invalid(row: dict) -> str | None:
    """Why a decode row breaks physics, or None: a step time (any mode of ours or of HF) below
    `floor_ms`, the time to read the weights once and the batch's KV at the copy bandwidth just
    measured. Such a figure is a measuring error, never a fast step (the `*_diff_ms` reference
    figures are not checked: they are known to carry that error)."""
    floor = row["floor_ms"]
    figures = [f"ours_{mode}_ms" for mode in OURS_MODES] + ["hf_ms", "hf_static_ms"]
    below = [f"{k} {row[k]:.4g}" for k in figures if row.get(k) is not None and row[k] < floor]
    if not below:
        return None
    return (
        f"{', '.join(below)} ms below floor_ms {floor:.4g} ms (the weights and batch "
        f"{row['batch']}'s KV read once at {row['copy_gb_s']:.4g} GB/s): a measuring error"
    )


# ---- offline: many requests of their own lengths ---------------------------------------------

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


async def _submit_all(address: str, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Every request submitted at once, each with its own max_tokens; seconds to the last."""
    from taipan.client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate([prompts[0][:8]], _sampling(2))  # warm-up
        start = time.perf_counter()
        done = await asyncio.gather(
            *(client.generate(p, _sampling(n)) for p, n in zip(prompts, output_lens, strict=True))
        )
        elapsed = time.perf_counter() - start
    got = [len(c.token_ids) for [c] in done]
    if got != output_lens:
        raise RuntimeError("ours generated other token counts than each request asked for")
    return elapsed


def _offline_hf(args, model_path: str, prompts, output_lens, errors: dict) -> dict:
    """Seconds of HF's `hf_generate` (static batches of --hf-batch) and `hf_continuous`
    (continuous batching) modes on the given requests."""
    from taipan.ops import bench as torch_side

    model = torch_side.load_hf(model_path, args.dtype, args.device)
    out = {
        "hf_generate": _optional(
            "hf_generate",
            lambda: torch_side.hf_static_batches_seconds(
                model, prompts, output_lens, args.hf_batch
            ),
            errors,
        ),
        "hf_continuous": _optional(
            "hf_continuous",
            lambda: torch_side.hf_continuous_seconds(model, prompts, output_lens),
            errors,
        ),
    }
    return {k: v for k, v in out.items() if v is not None}


def offline_workload(args) -> list[dict]:
    from taipan.actors.config import InferenceConfig
    from taipan.launcher import runtime_from_args
    from taipan.models import resolve
    from taipan.ops.bench import gpu_name

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
        ours = {"all": asyncio.run(_submit_all(rt.address, prompts, output_lens))}
        if k < n:  # the ratio compares the same requests
            ours["k"] = asyncio.run(_submit_all(rt.address, prompts[:k], output_lens[:k]))
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
        "hf_requests": k,
        "hf_batch": args.hf_batch,
        **errors,
    }
    return [_rounded(_offline_ratios(row, ours, hf, output_lens[:k]))]


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
