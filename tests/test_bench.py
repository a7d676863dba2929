"""`taipan bench --json` runs both sides in one process and appends its rows to the results file:
the `generate` workload on the default model, `decode` and `offline` on a tiny random-weight
model (CPU), and both of those at small sizes on CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from taipan import bench


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
    assert row["identical_expected"] == math.ceil(bench.EXPECTED_IDENTICAL_SHARE["float32"] * 2)
    assert same >= row["identical_expected"]
    assert "identical_warning" not in row and "taipan bench: warning" not in done.stderr
    assert json.loads(results.read_text().splitlines()[-1]) == row


def test_bench_warns_below_expected_identical(tmp_path, monkeypatch, capsys):
    """Fewer identical continuations than the dtype's floor: a stderr line and a flag in the row.
    Both sides are stubbed: this checks the bookkeeping, not the models."""
    import taipan.models
    import taipan.ops.bench

    ours = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    hf = [[1, 2, 3], [4, 5, 0], [7, 0, 9], [1, 1, 1]]  # 2 of 4 identical; fp32 expects 3
    monkeypatch.setattr(taipan.models, "resolve", lambda name: ("stub", "stub.gguf"))
    monkeypatch.setattr(bench, "_ours", lambda args, prompts: (1.0, [[5]] * 4, ours))
    monkeypatch.setattr(taipan.ops.bench, "hf_generate", lambda args, path, ids: (2.0, hf))
    monkeypatch.setattr(
        taipan.ops.bench, "hardware_limit", lambda args, path, n: {"hw_limit_output_tok_s": 1.0}
    )
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--num-prompts", "4", "--output-len", "3", "--json"])
    args.results = str(tmp_path / "results.jsonl")
    args.model, args.dtype, args.device = "stub", "float32", "cpu"
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
    """One row per batch: ours and HF step times from T1/TN, the floor and the ratios. On the
    CPU there is one eager run of ours and no static-cache HF mode; each row says so."""
    rows = _bench_rows(
        tmp_path,
        *("--workload", "decode", "--model", "random:tiny", "--batches", "2,1"),
        *("--output-len", "4", "--prompt-len", "8", "--copy-gib", "0.0625"),
    )
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["workload"] == "decode" and row["model"] == "tiny-shape"
        assert row["gpu"] is None and row["output_len"] == 4 and row["prompt_len"] == 8
        assert "graphs_skipped" in row and "hf_static_skipped" in row
        assert row["ours_step_ms"] == row["ours_eager_ms"] and "ours_graphs_ms" not in row
        # (TN > T1 is not asserted: 4 steps of a tiny model are within this machine's noise)
        assert row["ours_eager_tn_s"] > 0 and row["ours_eager_t1_s"] > 0
        assert row["hf_best"] == "hf" and row["hf_best_ms"] == row["hf_ms"]
        assert row["ours_vs_hf"] == pytest.approx(row["hf_ms"] / row["ours_step_ms"], rel=1e-3)
        assert row["floor_ms"] > 0 and row["copy_gb_s"] > 0 and row["copy_gib"] == 0.0625
        assert row["step_vs_floor"] == pytest.approx(
            row["ours_step_ms"] / row["floor_ms"], rel=1e-3
        )
        assert 0 <= row["steps_graphed_share"] <= 1 and row["gpu_idle_share"] <= 1
        # weights once (tied: the embedding is the LM head) + the batch's KV at mid-generation
        assert row["weight_bytes"] == 4 * row["params"]
        assert row["kv_bytes"] == row["batch"] * (8 + 4 / 2) * 2 * 2 * 2 * 16 * 4


def test_offline_workload_row_on_cpu(tmp_path):
    """ShareGPT-like lengths, every request exactly its own output length on both sides; HF
    timed on the first 4 of 6 requests, and ours again on those for the ratio."""
    from taipan.workloads import sharegpt_like

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
    for mode in ("hf_generate", "hf_continuous"):
        assert row[f"{mode}_output_tok_s"] > 0
    best = row["hf_best_output_tok_s"]
    assert best == max(row["hf_generate_output_tok_s"], row["hf_continuous_output_tok_s"])
    assert row["ours_vs_hf"] == pytest.approx(row["ours_k_output_tok_s"] / best, rel=1e-3)


def test_sharegpt_like_lengths_are_seeded_and_clipped():
    from taipan.workloads import sharegpt_like

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
