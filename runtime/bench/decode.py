"""The `decode` workload of `taipan bench`: per batch B of `--batches`, the decode step time of
ours in each of its modes (`ours_modes`: CUDA graphs and overlapping steps, the default config;
without graphs; without overlap; under tensor parallelism with NCCL-only all-reduces) and of HF
`generate` (dynamic cache; static cache, compiled by transformers, CUDA only), against the floor:
(weight bytes + the batch's KV bytes at mid-generation) / copy bandwidth measured on `--copy-gib`
GiB. Ours: the engine's TPOT over a run of B prompts of `--prompt-len` ids and 1 + `--output-len`
tokens (`_ours_decode` says why); HF: the median of the TN runs' decode steps, each stamped by a
streamer, over `--hf-repeats` runs. One row per batch; a row whose step beats the floor is
marked `invalid` (`decode_invalid`), and taipan.bench.command refuses to record it.
tests/perf/NOTES.md defines every figure.

Never imports torch itself: HF and the hardware figures come from taipan.ops.hf_bench and
taipan.ops.hardware, imported inside the functions that use them (dtypes travel as names).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import numpy as np

from taipan.bench.common import greedy, optional_mode, random_prompt, rounded, with_sets

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


def _timed_generate(
    client, prompts: list[list[int]], max_tokens: int, log_probs: bool = False
) -> tuple[float, list]:
    """(seconds from submitting every prompt to the last completion, the completions); each must
    have exactly `max_tokens` tokens (greedy, EOS ignored; `log_probs`: with the log-probs of
    the generated tokens, not the prompt's, as an RL rollout asks: a prompt's log-probs make
    its prefill an eager step, which the difference of two runs would count)."""
    sampling = greedy(max_tokens)
    if log_probs:
        sampling = dataclasses.replace(sampling, return_log_probs=True, skip_prompt_log_probs=True)
    start = time.perf_counter()
    done = client.generate(prompts, sampling)
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
            client.generate(prompts["warmup"], greedy(4))  # this batch's shapes, once
            asyncio.run(_warm_mixed(rt.address, prompts["warmup"]))
            log_probs = bool(getattr(args, "log_probs", False))
            t1, _ = _timed_generate(client, prompts["t1"], 1, log_probs)
            dev0, steps0, graphed0, gc0 = _rank_counters(client)
            tn, done = _timed_generate(client, prompts["tn"], 1 + output_len, log_probs)
            if log_probs and any(len(c.log_probs) != 1 + output_len for c in done):
                raise RuntimeError("ours returned fewer log-probs than tokens")
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
            async for delta in client.stream(prompts[0], greedy(16)):
                if delta.token_ids:
                    decoding.set()

        task = asyncio.ensure_future(lead())
        await decoding.wait()
        await client.generate(prompts[1:], greedy(4))
        await task


def _decode_hf(args, model_path: str, runs: dict, output_len: int, errors: dict) -> dict:
    """{mode: {batch: {"t1_s", "tn_s", "step_ms"}}} for HF's `hf` (dynamic cache) and
    `hf_static` (static cache, compiled by transformers: CUDA only) modes."""
    from taipan.ops.hf_bench import load_hf

    model = load_hf(model_path, args.dtype, args.device)
    modes = {"hf": False}
    if args.device.startswith("cuda"):
        modes["hf_static"] = True
    repeats = args.hf_repeats

    def timed(static: bool):
        return _hf_decode(model, runs, output_len, static, repeats)

    return {mode: optional_mode(mode, lambda s=s: timed(s), errors) for mode, s in modes.items()}


def _hf_decode(model, runs: dict, output_len: int, static: bool, repeats: int) -> dict[int, dict]:
    """Per batch: step = the median of every decode step of `repeats` TN runs (1 + output_len new
    tokens), each step stamped on its own by a streamer (taipan.ops.hf_bench
    `hf_decode_seconds`): a one-off cost moves one step, which the median drops. Kept for
    reference, as ours' `diff_ms`: (median TN - median T1) / output_len, a difference of two
    wall-clock runs, which a one-off cost moves by its size / output_len (on a loaded 2-core box
    it once came out below zero)."""
    from taipan.ops.hf_bench import hf_decode_seconds

    per_batch = {}
    for b, prompts in runs.items():
        times = [hf_decode_seconds(model, prompts, output_len, static) for _ in range(repeats)]
        t1 = statistics.median(t["t1"] for t in times)
        tn = statistics.median(t["tn"] for t in times)
        steps = statistics.median(s for t in times for s in t["steps"])
        per_batch[b] = {
            "t1_s": t1,
            "tn_s": tn,
            "step_ms": 1e3 * steps,
            "diff_ms": 1e3 * (tn - t1) / output_len,
        }
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
    from taipan.ops import hardware

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
        mode_args = with_sets(args, *sets, *extra)

        def timed(a=mode_args):
            return _ours_decode(a, runs, args.output_len)

        ours[mode] = timed() if mode == modes[0] else optional_mode(f"ours_{mode}", timed, errors)
    hw = hardware.model_bytes(model_path, args.dtype)
    hw["copy_gb_s"] = hardware.copy_bandwidth(args.device, args.copy_gib) / 1e9
    hw["matmul_tflop_s"] = hardware.matmul_rate(args.device, args.dtype) / 1e12
    hf = {} if args.no_hf else _decode_hf(args, model_path, runs, args.output_len, errors)
    common = {
        "workload": "decode",
        "model": name,
        "gpu": hardware.gpu_name(args.device),
        "dtype": args.dtype,
        "device": args.device,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        **({"log_probs": True} if getattr(args, "log_probs", False) else {}),
        **errors,
    }
    return [rounded(_decode_row(args, dict(common, batch=b), b, ours, hf, hw)) for b in batches]


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
            row[f"{mode}_diff_ms"] = r["diff_ms"]
    row["step_source"] = "ours: median engine TPOT of the TN run's requests"
    if hf:
        row["hf_repeats"] = repeats = getattr(args, "hf_repeats", 1)
        row["step_source"] += f"; HF: median decode step of {repeats} TN runs, each step stamped"
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
    # Layers with a sliding window read at most the window's keys (kv_read_share).
    context = args.prompt_len + args.output_len / 2
    share = _kv_read_share(hw.get("kv_windows"), context)
    kv_bytes = b * context * hw["kv_bytes_per_token"] * share
    # A mixture of experts reads only the experts its batch chose (hardware.step_weight_bytes):
    # floor_ms under uniform routing, floor_min_ms with every token choosing the same experts.
    tp = getattr(args, "tensor_parallel_size", 1)
    weights, least = step_weight_bytes(hw, b)
    per_ms = 1e3 / tp / (hw["copy_gb_s"] * 1e9)
    active = hw["read_params"]  # (the parameters one token uses)
    if hw.get("experts"):
        active -= hw["expert_params"] * (1 - hw["experts"][1] / hw["experts"][0])
    row.update(
        params=hw["params"],
        weight_bytes=int(weights),
        kv_bytes=int(kv_bytes),
        copy_gib=args.copy_gib,
        copy_gb_s=hw["copy_gb_s"],
        floor_ms=(weights + kv_bytes) * per_ms,
        matmul_tflop_s=hw["matmul_tflop_s"],
        # 2 FLOPs per weight a token uses (its top_k experts only; attention's own FLOPs
        # left out: small here).
        compute_floor_ms=1e3 * 2 * active * b / tp / (hw["matmul_tflop_s"] * 1e12),
    )
    if hw.get("experts"):
        row["floor_min_ms"] = (least + kv_bytes) * per_ms
        row["experts"] = "{} of {} per token; floor_ms under uniform routing".format(
            *reversed(hw["experts"])
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


def step_weight_bytes(hw: dict, batch: int) -> tuple[float, float]:
    """(expected, least) weight bytes one decode step of `batch` tokens reads (`hw` from
    model_bytes). Dense: both `weight_bytes`. A mixture of experts reads each expert chosen by
    at least one token once: at least top_k of num_experts per layer (every token choosing the
    same ones: the physical floor), and under uniform routing (a random router's, about) the
    expected share 1 - (1 - top_k / num_experts) ** batch of them."""
    if not hw.get("experts"):
        return hw["weight_bytes"], hw["weight_bytes"]
    num_experts, top_k = hw["experts"]
    dense = hw["weight_bytes"] - hw["expert_bytes"]
    expected = 1 - (1 - top_k / num_experts) ** batch
    return dense + hw["expert_bytes"] * expected, dense + hw["expert_bytes"] * top_k / num_experts


def decode_invalid(row: dict) -> str | None:
    """Why a decode row breaks physics, or None: a step time (any mode of ours or of HF) below
    `floor_ms`, the time to read the weights once and the batch's KV at the copy bandwidth just
    measured (a mixture of experts: `floor_min_ms`, one token's experts per layer). Such a
    figure is a measuring error, never a fast step (the `*_diff_ms` reference
    figures are not checked: they are known to carry that error)."""
    key = "floor_min_ms" if "floor_min_ms" in row else "floor_ms"  # (MoE: one token's experts)
    floor = row[key]
    figures = [f"ours_{mode}_ms" for mode in OURS_MODES] + ["hf_ms", "hf_static_ms"]
    below = [f"{k} {row[k]:.4g}" for k in figures if row.get(k) is not None and row[k] < floor]
    if not below:
        return None
    return (
        f"{', '.join(below)} ms below {key} {floor:.4g} ms (the weights and batch "
        f"{row['batch']}'s KV read once at {row['copy_gb_s']:.4g} GB/s): a measuring error"
    )


def decode_summary(row: dict) -> str:
    """The row's human line."""
    return (
        f"decode batch {row['batch']}: ours {row['ours_step_ms']} ms/step "
        f"({row['step_vs_floor']}x the floor of {row['floor_ms']} ms; by differencing "
        f"{row.get('ours_graphs_diff_ms', row.get('ours_eager_diff_ms'))}), HF best "
        f"{row.get('hf_best_ms')} ms, ours_vs_hf {row.get('ours_vs_hf')}, "
        f"GPU idle {row.get('gpu_idle_share')}, GC {row.get('gc_share')}"
    )


def _kv_read_share(windows: list | None, context: float) -> float:
    """The share of the KV bytes at `context` tokens one step reads when layers have sliding
    windows (1.0 without): a windowed layer reads min(context, window) keys."""
    if not windows or context <= 0:
        return 1.0
    return sum(min(context, w) if w else context for w in windows) / (len(windows) * context)
