"""`taipan bench --json` runs both sides in one process and appends its row to the results file."""

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
