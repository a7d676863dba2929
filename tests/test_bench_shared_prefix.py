"""`taipan bench --workload shared-prefix`: prefix caching off vs on through the real runtime on
the tiny random-weight model (CPU), and the bookkeeping of a mismatch (stubbed)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from taipan import bench
from taipan.bench import shared_prefix
from taipan.models import has_mamba_layers

N, PREFIX, BLOCK = 3, 32, 16


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_shared_prefix_rows_on_cpu(tmp_path):
    """One row per scenario; greedy outputs equal with caching on and off, nothing cached with
    it off, and with it on every request after the first shares the prefix's blocks."""
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--workload", "shared-prefix"]
    cmd += ["--model", "random:tiny", "--num-prompts", str(N), "--prefix-len", str(PREFIX)]
    cmd += ["--output-len", "4", "--set", f"block_size_tokens={BLOCK}"]
    done = subprocess.run(
        [*cmd, "--json", "--results", str(results)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["scenario"] for r in rows] == ["system", "samples"]
    prompts = shared_prefix.shared_prefix_prompts(N, PREFIX, seed=0, tag=0)
    for row in rows:
        for key in ("date", "machine", "command", "model", "device", "dtype", "gpu", "batch"):
            assert key in row, key
        assert row["workload"] == "shared-prefix" and row["model"] == "tiny-shape"
        assert row["outputs_equal"] is True and row["outputs_identical"] == f"{N}/{N}"
        assert row["off_repeat_identical"].endswith(f"/{N}")
        total = sum(map(len, prompts[row["scenario"]]))
        assert row["off_prompt_tokens_cached"] == 0 and row["off_hit_rate"] == 0
        assert row["off_prompt_tokens_computed"] == total
        assert row["on_prompt_tokens_cached"] > 0
        assert row["on_prompt_tokens_computed"] < row["off_prompt_tokens_computed"]
        assert row["on_prompt_tokens_computed"] + row["on_prompt_tokens_cached"] == total
        # The engine's counters agree with the completions' num_cached_tokens.
        assert row["on_engine_prefill_tokens"] == row["on_prompt_tokens_computed"]
        assert row["on_engine_hit_rate"] == row["on_hit_rate"] > 0
        for setting in ("off", "on"):
            assert row[f"{setting}_ttft_mean_s"] > 0 and row[f"{setting}_output_tok_s"] > 0
        assert row["ttft_speedup"] > 0 and row["throughput_speedup"] > 0
    # A block-aligned system prompt: each later request shares all of it, and no more.
    assert rows[0]["on_prompt_tokens_cached"] == (N - 1) * PREFIX
    assert rows[1]["on_prompt_tokens_cached"] >= (N - 1) * PREFIX


def test_shared_prefix_mismatch_fails_the_run(tmp_path, monkeypatch, capsys):
    """Outputs that change with caching on: `outputs_equal` false, a stderr line, exit 1."""
    off_figures = {"ttft_mean_s": 2.0, "ttft_p50_s": 2.0, "output_tok_s": 10.0}
    off = (off_figures, [[1, 2], [3, 4]], [[1, 2], [3, 4]])
    on = ({"ttft_mean_s": 1.0, "ttft_p50_s": 0.5, "output_tok_s": 20.0}, [[1, 2], [3, 5]], None)
    row = shared_prefix._shared_prefix_row({"scenario": "system"}, off, on)
    assert row["outputs_equal"] is False and row["outputs_identical"] == "1/2"
    assert row["ttft_speedup"] == 2.0 and row["ttft_p50_speedup"] == 4.0
    assert row["throughput_speedup"] == 2.0
    assert row["off_repeat_identical"] == "2/2"
    err = capsys.readouterr().err
    assert "FAILED: shared-prefix system: only 1/2" in err

    monkeypatch.setattr(shared_prefix, "shared_prefix_workload", lambda args: [dict(row)])
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--workload", "shared-prefix", "--json"])
    args.results = str(tmp_path / "results.jsonl")
    assert bench.run(args) == 1
    assert json.loads((tmp_path / "results.jsonl").read_text())["outputs_equal"] is False


def test_shared_prefix_outputs_are_not_compared_where_they_do_not_reproduce(capsys):
    """bf16 on a random model: caching off, the same prompts run twice already differ, so the
    on/off comparison says nothing: `outputs_equal` is None, a note, and no failure."""
    figures = {"ttft_mean_s": 1.0, "ttft_p50_s": 1.0, "output_tok_s": 10.0}
    off = (figures, [[1, 2], [3, 4]], [[1, 2], [3, 9]])
    on = (figures, [[1, 2], [3, 5]], None)
    row = shared_prefix._shared_prefix_row({"scenario": "samples"}, off, on)
    assert row["outputs_equal"] is None and row["off_repeat_identical"] == "1/2"
    err = capsys.readouterr().err
    assert "not compared" in err and "FAILED" not in err


@pytest.mark.slow  # (the default run stays under ~15 min on the 2-core CI box)
def test_shared_prefix_on_a_hybrid_uses_mamba_snapshots(tmp_path):
    """A tiny NemotronH: with caching on (KV + Mamba snapshots) later requests skip prompt
    tokens, outputs equal caching off, and HF's batch-1 figures ride along in the row."""
    from tests.random_nemotron_h import make_random_nemotron_h

    model = make_random_nemotron_h(str(tmp_path / "nh"), pattern="M-*-M-")
    assert has_mamba_layers(model) and not has_mamba_layers(str(tmp_path))
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--workload", "shared-prefix"]
    cmd += ["--model", model, "--num-prompts", str(N), "--prefix-len", str(PREFIX)]
    cmd += ["--output-len", "4", "--set", f"block_size_tokens={BLOCK}", "--hf-prompts", "2"]
    done = subprocess.run(
        [*cmd, "--json", "--results", str(results)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    for row in rows:
        assert row["hybrid"] is True and row["mamba_gb"] == 0.01
        assert row["outputs_equal"] is True
        assert row["off_prompt_tokens_cached"] == 0 and row["on_prompt_tokens_cached"] > 0
        assert row["hf_prompts"] == 2 and row["hf_ttft_mean_s"] > 0 and row["hf_output_tok_s"] > 0
    # The first request snapshots only its own last boundary (inside its question); the second
    # shares the 2 prefix blocks but finds no state there, computes them and snapshots its
    # divergence point, 32, while the third waits for that snapshot and restores it.
    assert rows[0]["on_prompt_tokens_cached"] == (N - 2) * PREFIX
