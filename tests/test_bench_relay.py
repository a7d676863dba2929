"""`taipan bench --workload relay` (issue 24 item 5, tiny): the real coordinator process between
synthetic engine processes and client processes, no model, no GPU. Every request gets exactly
its tokens in order, and the engines', the clients' and the coordinator's counts add up."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from taipan.bench import relay
from taipan.bench.relay_peers import TokenFrames
from taipan.messages.codec import encode_frame
from taipan.messages.requests import RequestOutput

REQUESTS, OUTPUT_LEN, BATCH, CLIENTS = 24, 12, 8, 2


def bench(tmp_path, *extra: str) -> list[dict]:
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "taipan.cli", "bench", "--workload", "relay"]
    cmd += ["--num-requests", str(REQUESTS), "--output-len", str(OUTPUT_LEN), "--batch"]
    cmd += [str(BATCH), "--clients", str(CLIENTS), "--json", "--results", str(results), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.strip().splitlines()] == rows
    return rows


def check_counts(row: dict, engines: int) -> None:
    requests = engines * REQUESTS
    assert row["workload"] == "relay" and row["synthetic_engines"] is True
    assert row["engines"] == engines and row["clients"] == CLIENTS and row["batch"] == BATCH
    assert row["invariants_hold"] is True and "broken" not in row
    assert row["num_requests"] == requests and row["output_tokens"] == requests * OUTPUT_LEN
    assert row["output_tok_s"] > 0 and row["seconds"] > 0
    assert 0 < row["entries_per_step"] <= BATCH
    # Clients say Hello: one StepOutputs per engine step and client, never one per request.
    steps, got = row["engine_steps"], row["client_messages"]
    assert got["ModelInfo"] == CLIENTS and "RequestOutput" not in got
    assert steps <= got["StepOutputs"] <= steps * CLIENTS
    # In: submissions, StepOutputs, heartbeats; out: EngineSubmits, client messages, answers.
    assert row["coordinator_msgs_in"] >= requests + steps
    assert row["coordinator_msgs_out"] >= requests + got["StepOutputs"]
    assert row["coordinator_cpu_share"] >= 0 and row["coordinator_tok_per_cpu_s"] > 0
    assert row["target_tok_s"] == 120_000 and row["target_steps_s"] == 468.8
    for key in ("date", "machine", "command"):
        assert key in row, key


def test_streamed_relay_keeps_its_invariants(tmp_path):
    rows = bench(tmp_path, "--num-engines", "1,2")
    assert [row["engines"] for row in rows] == [1, 2]
    for row in rows:
        check_counts(row, row["engines"])
        assert row["stream"] is True
        # Every token in an output of its own: 12 steps a request at least.
        assert row["relayed_outputs"] == row["output_tokens"]
        assert row["engine_steps"] >= OUTPUT_LEN * row["num_requests"] / BATCH


def test_unstreamed_relay_sends_one_output_per_request(tmp_path):
    [row] = bench(tmp_path, "--num-engines", "1", "--no-stream")
    check_counts(row, 1)
    assert row["stream"] is False
    # Only the steps that end requests report: one output per request in all.
    assert row["relayed_outputs"] == REQUESTS < row["output_tokens"]


@pytest.mark.parametrize(
    "request_id, token, prompt, generated",
    [(1, 0, 1, 1), (2**40 + 3, 32767, 4096, 511), (2**63 - 1, 255, 300, 70000), (127, 128, 0, 0)],
)
def test_token_frames_are_what_encode_frame_writes(request_id, token, prompt, generated):
    frames = TokenFrames()
    for _ in range(2):  # the second time from its caches
        got = frames.frame(request_id, token, prompt, generated)
        tokens = np.array([token], np.int32)
        want = RequestOutput(request_id, tokens, False, None, None, prompt, generated)
        assert got == encode_frame(want)


def test_broken_counts_are_named():
    args = argparse.Namespace(batch=4, steps_per_s=0.0)
    spec = {"output_len": 3, "stream": True}
    client = {
        "start": 0.0, "end": 1.0, "cpu_seconds": 0.5, "requests": 2, "failed": 0,
        "problems": [], "tokens": 6, "outputs": 6, "received": {"StepOutputs": 3},
    }  # fmt: skip
    engine = {"steps": 3, "entries": 6, "tokens": 6, "submits": 2, "heartbeats": 1}
    row = relay._row(args, spec, 1, [client], [engine], [0.1, 0.2], 1.0)
    assert row["invariants_hold"] is True and row["coordinator_cpu_share"] == 0.1
    assert row["coordinator_msgs_in"] == 2 + 3 + 1 and row["coordinator_msgs_out"] == 2 + 3
    lost = {**client, "failed": 1, "problems": ["5 tokens"], "tokens": 5, "outputs": 5}
    row = relay._row(args, spec, 1, [lost], [engine], [0.1, 0.2], 1.0)
    assert row["invariants_hold"] is False and row["problems"] == ["5 tokens"]
    assert row["broken"] == [
        "every request complete and in order",
        "clients got every token",
        "engines made every token",
        "every engine output relayed",
    ]
