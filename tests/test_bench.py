"""`taipan bench --json` runs both sides in one process and appends its row to the results file."""

from __future__ import annotations

import json
import subprocess
import sys


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
    # HF runs one left-padded batch: padding can flip a near-tie, so only the count is fixed.
    same, total = map(int, row["identical_outputs"].split("/"))
    assert total == 2 and 0 <= same <= 2
    assert json.loads(results.read_text().splitlines()[-1]) == row
