"""`taipan bench --json` runs both sides in one process and appends its rows to the results file:
the `generate` workload on the default model, `decode` and `offline` on a tiny random-weight
model (CPU), and both of those at small sizes on CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from taipan import bench
from taipan.bench import generate
from taipan.bench.spec import spec_summary


@pytest.mark.slow  # ~30 s (ours and HF on the real model); the row logic's stubbed tests stay in
def test_bench_json_row(tmp_path, model_path):
    results = tmp_path / "results.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "taipan.cli",
        "bench",
        "--model",
        model_path,
        "--num-prompts",
        "2",
        "--output-len",
        "4",
        "--json",
        "--results",
        str(results),
        "--set",
        "block_size_tokens=16",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    for key in (
        "workload",
        "ours_output_tok_s",
        "hf_output_tok_s",
        "ratio",
        "hw_limit_output_tok_s",
        "date",
        "machine",
        "command",
    ):
        assert key in row
    assert row["workload"] == "generate-2x4" and row["ours_output_tok_s"] > 0
    # Every request generates exactly output_len tokens on both sides: EOS neither stops nor is
    # masked (ours ignore_eos, HF without an eos_token_id).
    assert row["ours_output_tokens"] == row["hf_output_tokens"] == 2 * 4
    # fp32 on CPU: the floor the bench itself applies (EXPECTED_IDENTICAL_SHARE, 2/2 here).
    same, total = map(int, row["identical_outputs"].split("/"))
    assert row["dtype"] == "float32" and total == 2
    assert row["identical_expected"] == math.ceil(generate.EXPECTED_IDENTICAL_SHARE["float32"] * 2)
    assert same >= row["identical_expected"]
    assert "identical_warning" not in row and "taipan bench: warning" not in done.stderr
    assert json.loads(results.read_text().splitlines()[-1]) == row


def test_bench_warns_below_expected_identical(tmp_path, monkeypatch, capsys):
    """Fewer identical continuations than the dtype's floor: a stderr line and a flag in the row.
    Both sides are stubbed: this checks the bookkeeping, not the models."""
    ours = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    hf = [[1, 2, 3], [4, 5, 0], [7, 0, 9], [1, 1, 1]]  # 2 of 4 identical; fp32 expects 3
    args = _stub_generate(tmp_path, monkeypatch, ours, hf, limit=1e6)
    assert bench.run(args) == 0
    out, err = capsys.readouterr()
    row = json.loads(out.strip().splitlines()[-1])
    assert row["identical_outputs"] == "2/4" and row["identical_expected"] == 3
    assert row["identical_warning"] is True
    assert row["ours_output_tokens"] == row["hf_output_tokens"] == 12
    assert (
        "taipan bench: warning: only 2/4 outputs identical to HF; expected at least 3 for float32"
        in err
    )


def _stub_generate(tmp_path, monkeypatch, ours, hf, limit: float) -> argparse.Namespace:
    """The generate workload's arguments (4 prompts x 3 tokens) with both sides stubbed: ours
    took 1 s for `ours`, HF 2 s for `hf`, the hardware limit is `limit` tok/s."""
    import taipan.models
    import taipan.ops.hardware
    import taipan.ops.hf_bench

    monkeypatch.setattr(taipan.models, "resolve", lambda name: ("stub", "stub.gguf"))
    monkeypatch.setattr(generate, "_ours", lambda args, prompts: (1.0, [[5]] * 4, ours))
    monkeypatch.setattr(taipan.ops.hf_bench, "hf_generate", lambda args, path, ids: (2.0, hf))
    monkeypatch.setattr(
        taipan.ops.hardware,
        "hardware_limit",
        lambda args, path, n: {"hw_limit_output_tok_s": limit},
    )
    return _stub_args(tmp_path, "--num-prompts", "4", "--output-len", "3", "--json")


def _stub_args(tmp_path, *argv: str) -> argparse.Namespace:
    """`taipan bench ARGV` as parsed, writing to a fresh results file, for stubbed workloads."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(list(argv))
    args.results = str(tmp_path / "results.jsonl")
    args.model, args.dtype, args.device = "stub", "float32", "cpu"
    return args


def test_generate_faster_than_the_hardware_limit_is_refused(tmp_path, monkeypatch, capsys):
    """Ours' 12 tokens in 1 s are 12 tok/s, above a limit of 8 (HF's 6 tok/s are not): the row
    is printed, flagged, not written, and the run exits 1 (stubbed sides, as above)."""
    tokens = [[1, 2, 3]] * 4
    args = _stub_generate(tmp_path, monkeypatch, tokens, tokens, limit=8.0)
    assert bench.run(args) == 1
    out, err = capsys.readouterr()
    row = json.loads(out.strip().splitlines()[-1])
    assert row["invalid"].startswith("ours_output_tok_s 12.0 above hw_limit_output_tok_s 8.0")
    assert "hf_output_tok_s" not in row["invalid"]
    assert "taipan bench: INVALID generate-4x3, not written to" in err
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.slow
def test_bench_full_workload_is_identical_to_hf(tmp_path, model_path):
    """The README's bench workload (32 prompts x 64 tokens, fp32): every continuation equals
    HF's, now that both sides treat EOS alike. Slow (two minutes): `make test-slow`."""
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--model", model_path, "--json"]
    done = subprocess.run(
        [*cmd, "--results", str(results)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["workload"] == "generate-32x64" and row["identical_outputs"] == "32/32"


def _bench_rows(tmp_path, *args: str, timeout: int = 300) -> list[dict]:
    """Run `taipan bench ARGS --json` into a fresh results file; its rows (also printed)."""
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", *args, "--json", "--results", str(results)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows == [json.loads(line) for line in done.stdout.strip().splitlines()[-len(rows) :]]
    for row in rows:
        for key in ("date", "gpu", "command", "workload", "model", "batch", "dtype", "machine"):
            assert key in row, key
        assert not any(k.endswith("_error") for k in row), row
    return rows


def test_decode_workload_rows_on_cpu(tmp_path):
    """One row per batch: ours' step from the engine's TPOT and HF's from its streamed steps
    (each from T1/TN too, for reference), the floor and the ratios. On the CPU there is one eager
    run of ours and no static-cache HF mode; each row says so."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "decode", "--model", "random:tiny", "--batches", "2,1"),
        *("--output-len", "12", "--prompt-len", "8", "--copy-gib", "0.0625"),
        *("--hf-repeats", "2"),
    )  # (HF's step was once (TN - T1) / 12, which came out below zero on a loaded box: the bench
    # rightly refused it; each step is now stamped on its own)
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["workload"] == "decode" and row["model"] == "tiny-shape"
        assert row["gpu"] is None and row["output_len"] == 12 and row["prompt_len"] == 8
        assert "graphs_skipped" in row and "hf_static_skipped" in row
        assert row["ours_step_ms"] == row["ours_eager_ms"] and "ours_graphs_ms" not in row
        # (TN > T1 is not asserted: 12 steps of a tiny model are within this machine's noise)
        assert row["ours_eager_tn_s"] > 0 and row["ours_eager_t1_s"] > 0
        assert "ours_eager_diff_ms" in row and "invalid" not in row and row["hf_repeats"] == 2
        assert row["step_source"].startswith("ours: median engine TPOT of the TN run")
        # 12 steps take at least 12 step times: TN's wall time bounds the engine's TPOT
        assert 0 < row["ours_eager_ms"] <= 1e3 * row["ours_eager_tn_s"] / 12
        assert 0 < row["hf_ms"] <= 1e3 * row["hf_tn_s"] / 12 and "hf_diff_ms" in row
        assert "HF: median decode step of 2 TN runs" in row["step_source"]
        assert row["hf_best"] == "hf" and row["hf_best_ms"] == row["hf_ms"]
        assert row["ours_vs_hf"] == pytest.approx(row["hf_ms"] / row["ours_step_ms"], rel=1e-3)
        assert row["floor_ms"] > 0 and row["copy_gb_s"] > 0 and row["copy_gib"] == 0.0625
        assert row["step_vs_floor"] == pytest.approx(
            row["ours_step_ms"] / row["floor_ms"], rel=1e-3
        )
        assert 0 <= row["steps_graphed_share"] <= 1 and row["gpu_idle_share"] <= 1
        assert 0 <= row["gc_share"] < 1
        # weights once (tied: the embedding is the LM head) + the batch's KV at mid-generation
        assert row["weight_bytes"] == 4 * row["params"]
        assert row["kv_bytes"] == row["batch"] * (8 + 12 / 2) * 2 * 2 * 2 * 16 * 4


def _fake_decode_row(steps: dict, b: int = 1, device: str = "cuda", hf: dict | None = None):
    """`_decode_row` on made-up figures, a floor of 1 ms (1 GB of weights at 1000 GB/s, no KV):
    `steps` maps ours' modes to step ms (diff figures half of those), `hf` HF's modes."""
    from taipan.bench.decode import _decode_row

    args = argparse.Namespace(
        prompt_len=8, output_len=16, copy_gib=1.0, device=device, tensor_parallel_size=1
    )
    args.hf_repeats = 3

    def figures(ms: float) -> dict:
        return {"step_ms": ms, "diff_ms": ms / 2, "t1_s": 0.01, "tn_s": 0.03}

    ours = {
        mode: {b: dict(figures(ms), gpu_idle_share=0.1, steps_graphed_share=1.0)}
        for mode, ms in steps.items()
    }
    hf_modes = {mode: {b: figures(ms)} for mode, ms in (hf or {}).items()}
    hw = {"params": 5 * 10**8, "read_params": 5 * 10**8, "weight_bytes": 10**9}
    hw.update(kv_bytes_per_token=0, copy_gb_s=1000.0, matmul_tflop_s=500.0)
    return _decode_row(args, {"workload": "decode", "batch": b}, b, ours, hf_modes, hw)


def test_decode_workload_with_log_probs_on_cpu(tmp_path):
    """--log-probs: every request asks its generated tokens' log-probs (an RL rollout's
    steps, no prompt log-probs); the row says so, and ours returned one per token (the
    workload checks it)."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "decode", "--model", "random:tiny", "--batches", "2"),
        *("--output-len", "6", "--prompt-len", "8", "--copy-gib", "0.0625", "--no-hf"),
        "--log-probs",
    )
    assert [r["batch"] for r in rows] == [2] and rows[0]["log_probs"] is True
    assert rows[0]["ours_eager_ms"] > 0 and "invalid" not in rows[0]


def test_decode_row_figures_and_ratios():
    row = _fake_decode_row(
        {"graphs": 1.5, "eager": 3.0, "serial": 2.0, "nccl": 1.8}, hf={"hf": 6.0}
    )
    assert row["floor_ms"] == pytest.approx(1.0) and "invalid" not in row
    assert row["ours_step_ms"] == row["ours_graphs_ms"] == 1.5
    # the difference is kept for reference, and not held to the floor
    assert row["ours_graphs_diff_ms"] == 0.75 and row["ours_nccl_t1_s"] == 0.01
    assert row["graphs_speedup"] == pytest.approx(2.0)
    assert row["overlap_speedup"] == pytest.approx(2.0 / 1.5)
    assert row["custom_all_reduce_speedup"] == pytest.approx(1.2)
    assert row["ours_vs_hf"] == pytest.approx(4.0) and row["hf_repeats"] == 3
    assert row["step_source"].startswith("ours: median engine TPOT") and "HF" in row["step_source"]


def test_decode_row_below_the_floor_is_invalid():
    """A step shorter than reading the weights once is a measuring error, in any of ours'
    modes or HF's, on CUDA or on a CPU."""
    row = _fake_decode_row({"graphs": 0.467, "eager": 3.0, "serial": 0.9})
    assert row["invalid"].startswith("ours_graphs_ms 0.467, ours_serial_ms 0.9 ms below floor_ms 1")
    assert "eager" not in row["invalid"] and "1000 GB/s" in row["invalid"]
    assert "ours_vs_hf" not in row and "hf_repeats" not in row
    assert "hf_ms 0.8" in _fake_decode_row({"graphs": 1.5}, hf={"hf": 0.8})["invalid"]
    assert "ours_eager_ms 0.5" in _fake_decode_row({"eager": 0.5}, device="cpu")["invalid"]
    assert "ours_nccl_ms" in _fake_decode_row({"graphs": 1.5, "nccl": 0.99})["invalid"]


def test_decode_rows_below_the_floor_are_refused(tmp_path, monkeypatch, capsys):
    """`taipan bench` writes the valid rows, prints every row (the invalid ones flagged), says
    INVALID on stderr and exits 1. The workload is stubbed: this checks the refusal only."""
    import taipan.bench.decode

    good, bad = _fake_decode_row({"graphs": 1.5}), _fake_decode_row({"graphs": 0.5}, b=8)
    monkeypatch.setattr(taipan.bench.decode, "decode_workload", lambda args: [good, bad])
    assert bench.run(_stub_args(tmp_path, "--workload", "decode")) == 1
    out, err = capsys.readouterr()
    written = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in written] == [1] and "invalid" not in written[0]
    lines = out.strip().splitlines()
    assert lines[-2].startswith("decode batch 1: ours 1.5 ms/step")
    assert lines[-1].startswith("INVALID decode batch 8: ours 0.5 ms/step")
    assert "taipan bench: INVALID decode batch 8, not written to" in err
    assert "ours_graphs_ms 0.5 ms below floor_ms 1" in err and "batch 1," not in err


def test_ours_modes_default_and_chosen():
    from taipan.bench.decode import ours_modes

    def modes(device: str, given: str | None = None, tp: int = 1) -> list[str]:
        args = argparse.Namespace(device=device, ours_modes=given, tensor_parallel_size=tp)
        return ours_modes(args)

    assert modes("cpu") == ["eager"] and modes("cpu", "eager", tp=2) == ["eager"]
    assert modes("cuda") == ["graphs", "eager", "serial"]
    assert modes("cuda", tp=2) == ["graphs", "eager", "serial", "nccl"]
    assert modes("cuda:1", " nccl,graphs", tp=2) == ["graphs", "nccl"]
    with pytest.raises(ValueError, match="must include graphs"):
        modes("cuda", "eager,serial")
    with pytest.raises(ValueError, match="nccl does not apply"):
        modes("cuda", "graphs,nccl")
    with pytest.raises(ValueError, match="graphs,serial does not apply"):
        modes("cpu", "graphs,eager,serial")
    with pytest.raises(ValueError, match="no mode fast"):
        modes("cuda", "graphs,fast")


@pytest.mark.slow  # (the default run stays under ~15 min on the 2-core CI box)
def test_offline_workload_row_on_cpu(tmp_path):
    """ShareGPT-like lengths, every request exactly its own output length on both sides; HF
    timed on the first 4 of 6 requests, and ours again on those for the ratio."""
    from taipan.bench.offline import sharegpt_like

    rows = _bench_rows(
        tmp_path,
        *("--workload", "offline", "--model", "random:tiny", "--num-requests", "6"),
        *("--hf-requests", "4", "--hf-batch", "3", "--max-len", "16", "--seed", "3"),
    )
    [row] = rows
    prompts, output_lens = sharegpt_like(6, 3, 16)
    assert row["workload"] == "offline" and row["batch"] is None and row["num_requests"] == 6
    assert row["output_tokens"] == sum(output_lens) and row["prompt_tokens"] == sum(
        map(len, prompts)
    )
    assert row["hf_requests"] == 4 and "first 4 requests" in row["note"]
    assert row["ours_steps"] > 0 and row["ours_steps_graphed_share"] == 0  # (no graphs on CPU)
    for mode in ("hf_generate", "hf_continuous"):
        assert row[f"{mode}_output_tok_s"] > 0
    best = row["hf_best_output_tok_s"]
    assert best == max(row["hf_generate_output_tok_s"], row["hf_continuous_output_tok_s"])
    assert row["ours_vs_hf"] == pytest.approx(row["ours_k_output_tok_s"] / best, rel=1e-3)


def test_sharegpt_like_lengths_are_seeded_and_clipped():
    from taipan.bench.offline import sharegpt_like

    prompts, outputs = sharegpt_like(1000, 0, 1024)
    assert (prompts, outputs) == sharegpt_like(1000, 0, 1024)
    lengths = sorted(map(len, prompts))
    assert lengths[0] >= 4 and lengths[-1] <= 1024 and 150 < lengths[500] < 260
    assert 4 <= min(outputs) and max(outputs) <= 1024 and outputs != list(map(len, prompts))


@pytest.mark.gpu
@pytest.mark.timeout(900)  # HF's static-cache decode compiles once per batch size
def test_decode_workload_on_cuda(tmp_path):
    """The decode workload as the issue runs it, at small sizes: a Llama-3.2-1B-shaped random
    model in bf16, CUDA graphs on and off, HF dynamic and compiled static cache."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "decode", "--model", "random:llama-1b", "--device", "cuda"),
        *("--dtype", "bfloat16", "--batches", "1,8", "--output-len", "16", "--prompt-len", "32"),
        timeout=900,
    )
    for row in rows:
        assert row["gpu"] and row["model"] == "llama-1b-shape"
        for key in ("ours_graphs_ms", "ours_eager_ms", "hf_ms", "hf_static_ms", "floor_ms"):
            assert row[key] > 0, key
        # The step is the engine's TPOT; the old difference of two runs is kept beside it (it
        # read 0.467x the floor here once: bench.run would now refuse such a row and exit 1).
        assert row["ours_graphs_ms"] >= row["floor_ms"] and "invalid" not in row
        assert "ours_graphs_diff_ms" in row and "ours_eager_diff_ms" in row
        assert row["step_source"].startswith("ours: median engine TPOT")
        assert row["step_vs_floor"] >= 1 and row["graphs_speedup"] > 0 and row["ours_vs_hf"] > 0
        assert row["steps_graphed_share"] > 0 and 0 <= row["gpu_idle_share"] < 1


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_offline_workload_on_cuda(tmp_path):
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "offline", "--model", "random:llama-1b", "--device", "cuda"),
        *("--dtype", "bfloat16", "--num-requests", "32", "--max-len", "64"),
        timeout=900,
    )
    assert row["gpu"] and row["ours_output_tok_s"] > 0 and row["ours_vs_hf"] > 0
    assert row["hf_generate_output_tok_s"] > 0 and row["hf_continuous_output_tok_s"] > 0


def test_the_cli_and_the_workload_families_import_no_torch():
    """The bench imports torch only through taipan.ops.hf_bench and taipan.ops.hardware, on use:
    `taipan --help`, the bench's flags and every workload family's module (the relay's processes
    too) load without it."""
    families = ("command", "generate", "decode", "offline", "shared_prefix", "http_load", "relay")
    code = (
        "import sys, taipan.cli\n"
        "taipan.cli._parser().format_help()\n"
        f"for name in {(*families, 'relay_peers', 'common')!r}:\n"
        "    __import__('taipan.bench.' + name)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_committed_row_breaks_physics():
    """tests/perf/results.jsonl holds no decode row whose step beats its floor and no generate
    row faster than its hardware limit (the bench refuses to write one; this also catches a row
    added by hand)."""
    from taipan.bench.decode import decode_invalid
    from taipan.bench.generate import generate_invalid

    path = os.path.join(os.path.dirname(__file__), "perf", "results.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]

    def why(row: dict) -> str | None:
        workload = row.get("workload", "")
        if workload == "decode":
            return decode_invalid(row)
        return generate_invalid(row) if workload.startswith("generate-") else None

    bad = [(i + 1, row.get("date"), why(row)) for i, row in enumerate(rows) if why(row)]
    assert not bad, bad


@pytest.mark.slow  # (the mechanism is tests/test_rl.py's; this checks the bench's row)
def test_weight_sync_workload_row_on_cpu(tmp_path):
    """A trainer's weights into taipan over gloo (CPU), beside the raw broadcast of the same
    buckets: every round's version lands, and greedy tokens equal the trainer's HF model's; then
    the same through a checkpoint on disk (--sync-path)."""
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "weight-sync", "--model", "random:tiny", "--bucket-mb", "1"),
        *("--sync-rounds", "2", "--sync-path"),
    )
    assert row["workload"] == "weight-sync" and row["rounds"] == 2 and row["buckets"] >= 1
    assert row["greedy_equal_rounds"] == 2 and "invalid" not in row
    assert row["path_greedy_equal"] is True  # (the same weights through a checkpoint on disk)
    for key in ("broadcast_s", "update_s", "paused_s", "transfer_s", "link_GBps", "path_update_s"):
        assert row[key] > 0, key
    assert row["update_s"] >= row["paused_s"] >= row["transfer_s"]


def test_structured_workload_row_on_cpu(tmp_path):
    """json_schema streams beside unconstrained ones: both generate exactly --output-len tokens
    per stream (the schema cannot end sooner), the grammar bound (the text opens a JSON object),
    and the row has both rates, the cost and the engine's steps."""
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "structured", "--model", "random:tiny", "--num-prompts", "2"),
        *("--output-len", "4"),
    )
    assert row["workload"] == "structured" and row["batch"] == 2 and row["output_len"] == 4
    assert row["invariants_hold"] is True and '"minItems": 4' in row["schema"]
    assert row["grammar_mode"] == "check"
    for mode in ("unconstrained", "json_schema", "unconstrained_whole", "json_schema_whole"):
        assert row[f"{mode}_output_tok_s"] > 0 and row[f"{mode}_steps"] >= 4
        assert row[f"{mode}_void_rows"] >= 0
    assert row["unconstrained_void_rows"] == row["unconstrained_whole_void_rows"] == 0
    for whole in ("", "_whole"):
        free, json_ = (
            row[f"unconstrained{whole}_output_tok_s"],
            row[f"json_schema{whole}_output_tok_s"],
        )
        assert row[f"structured_cost{whole}"] == pytest.approx(1 - json_ / free, abs=1e-3)


def test_structured_workload_draws_at_a_temperature(tmp_path):
    """`--temperature 1`: the streams draw (an RL rollout's sampling) and still generate
    exactly --output-len tokens each; the row names the temperature; a negative one is
    refused."""
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "structured", "--model", "random:tiny", "--num-prompts", "2"),
        *("--output-len", "4", "--temperature", "1"),
    )
    assert row["temperature"] == 1.0 and row["invariants_hold"] is True
    assert row["json_schema_output_tok_s"] > 0 and row["json_schema_steps"] >= 4
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--workload", "structured"]
    bad = subprocess.run(
        [*cmd, "--model", "random:tiny", "--temperature", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "--temperature must be >= 0" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow
def test_weight_sync_workload_in_flight_on_cpu(tmp_path):
    """--in-flight: push_weights(in_flight=True) with the runtime RUNNING, no pause around it."""
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "weight-sync", "--model", "random:tiny", "--bucket-mb", "1"),
        *("--sync-rounds", "2", "--in-flight"),
    )
    assert row["in_flight"] is True and row["greedy_equal_rounds"] == 2 and "invalid" not in row
    assert row["update_s"] >= row["transfer_s"] > 0


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_weight_sync_workload_on_two_gpus(tmp_path):
    """issue 26's acceptance row at 1B (the 8B row is the device script's): NCCL from cuda:0
    into taipan on cuda:1."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    [row] = _bench_rows(
        tmp_path,
        *("--workload", "weight-sync", "--model", "random:llama-1b", "--device", "cuda:1"),
        *("--dtype", "bfloat16", "--sync-rounds", "2"),
        timeout=900,
    )
    assert row["link_GBps"] > 10 and "invalid" not in row
    assert row["update_vs_broadcast"] > 0.5


def test_spec_workload_rows_on_cpu(tmp_path):
    """Speculative decoding off vs on (n-gram, k = 2) on the input-grounded and the free
    workload: a row each, every prompt's greedy token ids equal off and on, the rates and their
    ratio, and the drafter's counters over the timed pass; the chained side (--spec-chain)
    too, and the speculating sides' batch limit (--spec-off-above: one request at a time
    stays under it)."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "spec", "--model", "random:tiny", "--num-prompts", "2"),
        *("--output-len", "8", "--spec-tokens", "2", "--spec-chain", "4"),
        *("--spec-off-above", "1"),
    )
    assert all(row["speculative_disable_by_batch_size"] == 1 for row in rows)
    for row in rows:
        assert row["speculative_chain_steps"] == 4 and row["chain_outputs_equal"] is True
        assert row["chain_equals_on"] is True and row["chain_output_tok_s"] > 0
        want = row["chain_output_tok_s"] / row["off_output_tok_s"]
        assert row["chain_speedup"] == pytest.approx(want, rel=1e-3)
        assert row["chain_chains"] >= 0 and row["chain_steps"] <= row["off_steps"]
    assert sum(row["chain_chains"] for row in rows) > 0
    assert "chained x4" in spec_summary(rows[0])
    assert [row["scenario"] for row in rows] == ["grounded", "free"]
    for row in rows:
        assert row["workload"] == "spec" and row["batch"] == 1 and row["output_len"] == 8
        assert row["outputs_equal"] is True and row["prompts_unequal"] == 0
        assert row["num_speculative_tokens"] == 2 and len(row["accepted_per_position"]) == 2
        assert row["off_output_tok_s"] > 0 and row["on_output_tok_s"] > 0
        want = row["on_output_tok_s"] / row["off_output_tok_s"]
        assert row["speedup"] == pytest.approx(want, rel=1e-3)
        assert row["off_steps"] >= 2 * 8 and 0 < row["on_steps"] <= row["off_steps"]
        drafted, accepted = row["spec_draft_tokens"], row["spec_accepted_tokens"]
        assert 0 <= accepted <= drafted and sum(row["accepted_per_position"]) == accepted
        if row["spec_verify_rows"]:
            want = (accepted + row["spec_verify_rows"]) / row["spec_verify_rows"]
            assert row["mean_accepted_length"] == pytest.approx(want, rel=1e-3)
    assert sum(row["spec_draft_tokens"] for row in rows) > 0
    for row in rows:  # (what a step costs the device; a verify forward where rows verified)
        assert row["off_device_step_ms"] > 0
        if row["spec_verify_rows"]:
            want = row["on_verify_step_ms"] / row["off_device_step_ms"]
            assert row["verify_vs_plain_device"] == pytest.approx(want, rel=1e-3)
        if row["chain_verify_rows"]:
            assert row["chain_verify_step_ms"] > 0
    # The human line names the drafter (the row's method when no draft model is named).
    assert "(ngram k=2)" in spec_summary(rows[0])
    assert "(mtp k=2)" in spec_summary({**rows[0], "speculative_method": "mtp"})
    # The family imports no torch (as the others, test_the_cli_and_the_workload_families_...).
    code = "import sys, taipan.bench.spec\nassert 'torch' not in sys.modules\n"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow  # (tests/test_e2e_speculative_draft.py runs draft models by default)
def test_spec_workload_with_a_self_draft_on_cpu(tmp_path):
    """`--spec-draft self:1`: the target's first layer drafts (speculative_method
    draft_model); outputs equal, and the row names the drafter."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "spec", "--model", "random:tiny", "--num-prompts", "1"),
        *("--output-len", "8", "--spec-tokens", "2", "--spec-draft", "self:1"),
    )
    for row in rows:
        assert row["outputs_equal"] is True and row["speculative_method"] == "draft_model"
        assert row["speculative_model"] == "self:1" and row["spec_draft_tokens"] > 0


@pytest.mark.slow  # (tests/test_e2e_mtp.py serves MTP drafts by default)
def test_spec_workload_with_an_mtp_head_on_cpu(tmp_path):
    """`--spec-method mtp` on a checkpoint with a (random) MTP head: outputs equal, the row
    names the drafter, drafts were verified."""
    from tests.random_qwen3_next import add_mtp_head, make_random_qwen3_next

    path = make_random_qwen3_next(str(tmp_path / "q3n"), "moe")
    add_mtp_head(path)
    rows = _bench_rows(
        tmp_path,
        *("--workload", "spec", "--model", path, "--num-prompts", "1"),
        *("--output-len", "8", "--spec-tokens", "2", "--spec-method", "mtp"),
    )
    for row in rows:
        assert row["outputs_equal"] is True and row["speculative_method"] == "mtp"
        assert row["spec_draft_tokens"] > 0
