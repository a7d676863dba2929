"""`taipan bench --workload http-load` (issue 11's load acceptance, tiny): 16 concurrent streams
of which a seeded 20 % hang up after 2 text chunks, through the OpenAI server's process and
then through AsyncClient, on the default model with the engine holding 8 requests at a time
(the rest wait in its queue). Zero 5xx, nothing failed, every other request complete, the
dropped ones aborted (the engine idle right after the last completion although each asked for
its whole context), every KV block back, the server's queue empty, and the row complete."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from taipan import bench
from taipan.bench import http_load

N, OUTPUT_LEN = 16, 4


@pytest.mark.slow  # (15 s; make test-slow)
def test_http_load_keeps_its_invariants(tmp_path, model_path):
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--workload", "http-load"]
    cmd += ["--model", model_path, "--num-prompts", str(N), "--output-len", str(OUTPUT_LEN)]
    cmd += ["--set", "max_requests=8", "--json", "--results", str(results)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    # The server cleans up after every hang-up: no task left pending, no error unretrieved.
    assert "never retrieved" not in done.stderr and "pending" not in done.stderr, done.stderr
    [row] = [json.loads(line) for line in results.read_text().splitlines()]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == row
    assert row["workload"] == "http-load" and row["num_requests"] == N
    assert row["invariants_hold"] is True and row["violations"] == []
    drops = round(0.2 * N)
    assert row["dropped_requests"] == drops and row["drop_after"] == 2
    assert row["http_5xx"] == 0 and row["http_in_flight_after"] == 0
    for side in ("http", "client"):
        assert row[f"{side}_failed"] == 0, row[f"{side}_first_error"]
        assert row[f"{side}_completed"] == N - drops and row[f"{side}_dropped"] == drops
        assert row[f"{side}_blocks_free_after"] == row[f"{side}_blocks_free_before"] > 0
        assert row[f"{side}_steps_after_load"] <= OUTPUT_LEN  # the drops were aborted
        assert row[f"{side}_requests_s"] > 0 and row[f"{side}_seconds"] > 0
        assert 0 < row[f"{side}_ttft_p50_s"] <= row[f"{side}_ttft_p99_s"]
    assert row["http_vs_client_requests_s"] > 0
    for key in ("date", "machine", "command", "model", "device", "dtype", "max_queued"):
        assert key in row, key


def test_broken_invariants_are_named():
    """The checks themselves: every broken invariant of a side is a line naming it."""
    jobs = [http_load.Job("p", 4, drop=i == 0) for i in range(5)]
    good = {
        "5xx": 0, "failed": 0, "first_error": None, "completed": 4, "dropped": 1,
        "blocks_free_before": 10, "blocks_free_after": 10, "idle_after_s": 0.1,
        "steps_after_load": 1, "in_flight_after": 0.0,
    }  # fmt: skip
    assert http_load._violations("http", good, jobs, 4) == []
    bad = {**good, "5xx": 1, "completed": 3, "blocks_free_after": 9, "steps_after_load": 50}
    bad["in_flight_after"] = 2.0
    found = http_load._violations("http", bad, jobs, 4)
    assert len(found) == 5 and all(v.startswith("http: ") for v in found)
    assert any("1 responses were 5xx" in v for v in found)
    assert any("3 of 4 requests completed" in v for v in found)
    assert any("10 before, 9 after" in v for v in found)
    assert any("50 steps" in v for v in found)
    assert any("holds 2.0 choices" in v for v in found)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--drop-share", "1"], "--drop-share"),
        (["--drop-after", "0"], "--drop-after"),
        (["--num-prompts", "0"], "--num-prompts"),
    ],
)
def test_bad_http_load_arguments(argv, message):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--workload", "http-load", *argv])
    with pytest.raises(ValueError, match=message):
        http_load._check_args(args)
