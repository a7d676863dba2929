"""Record a real session (`--record`), then `taipan replay --check` it, intact and altered."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.actors.record import Recorder, read_log
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages import decode, encode
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.gpu import StepResult
from taipan.messages.requests import SamplingParams, StepOutputs
from tests.conftest import TEST_CONFIG


def _record(tmp_path_factory, model_path, **config):
    rec = tmp_path_factory.mktemp("rec")
    with Runtime(model_path, InferenceConfig(**TEST_CONFIG, **config), record_dir=str(rec)) as rt:
        with Client(rt.address) as c:
            c.generate(
                [f"Count to {i}:" for i in range(6)], SamplingParams(max_tokens=20, temperature=0)
            )
            c.generate(["One more"], SamplingParams(max_tokens=5, temperature=0.7, seed=3))
    return rec


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_path):
    return _record(tmp_path_factory, model_path)  # steps do not overlap by default on CPU


@pytest.fixture(scope="module")
def recorded_overlap(tmp_path_factory, model_path):
    return _record(tmp_path_factory, model_path, overlap_steps=True)


def test_check_passes_with_overlapping_steps(recorded_overlap):
    done = replay(recorded_overlap, "--check", "--actor", "engine-0", "--actor", "allocator-0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine-0: ok" in done.stdout


def replay(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "taipan.cli", "replay", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_actor_is_recorded(recorded):
    names = sorted(p.stem for p in recorded.glob("*.tplog"))
    assert names == ["allocator-0", "coordinator", "engine-0", "gpu-0"]


def test_check_passes_on_recorded_session(recorded):
    # The gpu log has no checker: a plain --check says so and exits 3 ...
    done = replay(recorded, "--check")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "gpu-0: not checked" in done.stdout and "1 actor(s) not checked (gpu-0)" in done.stderr
    # round_robin, no prefix caching: every EngineSubmit re-routed (tests/test_coordinator_check.py)
    assert "coordinator: ok, 7 submissions routed as recorded" in done.stdout
    assert "allocator-0: ok" in done.stdout
    assert "engine-0: ok" in done.stdout and "steps re-planned" in done.stdout
    # ... --allow-unchecked accepts that, and checking only the deciding actors is a pass.
    assert replay(recorded, "--check", "--allow-unchecked").returncode == 0
    done = replay(recorded, "--check", "--actor", "engine-0", "--actor", "allocator-0")
    assert done.returncode == 0, done.stdout + done.stderr


def test_step_timeline_lays_out_every_step(recorded, capsys):
    """tests/perf/step_timeline.py (a device helper) reads the gpu actor's log: every step of
    the session, each with its plan in before its result out."""
    from tests.perf import step_timeline

    steps = step_timeline.steps_of(recorded / "gpu-0.tplog")
    results = [
        r for r in read_log(recorded / "gpu-0.tplog")
        if r.direction == "out" and isinstance(decode(r.frames), StepResult)
    ]  # fmt: skip
    assert len(steps) == len(results) > 0
    assert all(s["result_out"] >= s["plan_in"] and s["device"] > 0 for s in steps)
    assert {s["kind"] for s in steps} >= {"decode", "mixed"}
    step_timeline.main(str(recorded))
    assert "decode" in capsys.readouterr().out


def test_timeline_filters_by_actor_and_type(recorded):
    done = replay(recorded, "--actor", "coordinator", "--type", "SubmitRequest")
    assert done.returncode == 0
    lines = [x for x in done.stdout.splitlines() if x.strip()]
    assert len(lines) == 7 and all("SubmitRequest" in x for x in lines)


def test_timeline_finds_a_requests_output_inside_its_step_batch(recorded):
    done = replay(recorded, "--actor", "engine-0", "--request", "3", "--type", "RequestOutput")
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stdout.splitlines() if x.strip()]
    # Not streamed: one terminal output, in one StepOutputs, shown under it and alone.
    assert len(lines) == 2 and "StepOutputs request_ids=int64[" in lines[0]
    assert "↳ RequestOutput request_id=3 " in lines[1] and "finished=True" in lines[1]


def test_each_step_sends_the_coordinator_at_most_one_message(recorded):
    """Between two steps' plans the engine sends the coordinator one StepOutputs at most,
    however many requests the step served (no abort or refusal in this session)."""
    sent, per_step, outputs = [], 0, 0
    for r in read_log(recorded / "engine-0.tplog"):
        if r.direction != "out":
            continue
        msg = decode([bytes(f) for f in r.frames])
        if type(msg).__name__ == "StepPlan":
            sent.append(per_step)
            per_step = 0
        elif isinstance(msg, StepOutputs):
            per_step += 1
            outputs += len(msg.request_ids)
    sent.append(per_step)
    assert max(sent) == 1 and outputs == 7  # seven requests, not streamed: one output each


def test_check_fails_on_altered_allocator_log(recorded, tmp_path):
    altered = tmp_path / "altered"
    changed = False
    with Recorder(altered, "allocator-0") as out:
        for r in read_log(recorded / "allocator-0.tplog"):
            frames = [bytes(f) for f in r.frames]
            msg = decode(frames)
            if not changed and r.direction == "out" and isinstance(msg, BlockOpsReply):
                if len(msg.block_ids):
                    ids = np.asarray(msg.block_ids).copy()
                    ids[0] += 1
                    frames = encode(dataclasses.replace(msg, block_ids=ids))
                    changed = True
            out.write(r.direction, r.channel, r.peer, frames, r.time)
    assert changed
    done = replay(altered, "--check")
    assert done.returncode == 1
    assert "allocator-0" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def _copy_altering(src, dst, name: str, alter) -> bool:
    """Copy log `name` from src to dst; `alter(record, msg)` returns new frames for the first
    record it wants changed (None: keep). Other logs are not copied. Returns whether one was."""
    changed = False
    with Recorder(dst, name) as out:
        for r in read_log(src / f"{name}.tplog"):
            frames = [bytes(f) for f in r.frames]
            if not changed:
                new = alter(r, decode(frames))
                if new is not None:
                    frames, changed = new, True
            out.write(r.direction, r.channel, r.peer, frames, r.time)
    (dst / "config.json").write_text((src / "config.json").read_text())
    return changed


@pytest.mark.parametrize("log", ["recorded", "recorded_overlap"])
def test_engine_check_fails_when_a_sampled_token_is_altered(log, request, tmp_path):
    recorded = request.getfixturevalue(log)

    def alter(r, msg):
        if r.direction == "in" and isinstance(msg, StepResult) and (msg.token_ids >= 0).any():
            tokens = msg.token_ids.copy()
            tokens[np.flatnonzero(tokens >= 0)[0]] += 1
            return encode(dataclasses.replace(msg, token_ids=tokens))
        return None

    assert _copy_altering(recorded, tmp_path, "engine-0", alter)
    done = replay(tmp_path, "--check")
    assert done.returncode == 1, done.stdout
    assert "engine-0: DIVERGES" in done.stdout
    # Without overlap the next plan carries the token; with it the next plan takes the token on
    # the device, so the change shows in what the engine sent that request.
    want = "the engine sent" if log == "recorded_overlap" else "StepPlan differs"
    assert want in done.stdout, done.stdout
    assert "Traceback" not in done.stderr


def test_engine_check_needs_the_config(recorded, tmp_path):
    assert not _copy_altering(recorded, tmp_path, "engine-0", lambda r, m: None)
    (tmp_path / "config.json").unlink()
    done = replay(tmp_path, "--check")
    assert done.returncode == 3 and "engine-0: not checked (no config.json" in done.stdout
    assert replay(tmp_path, "--check", "--allow-unchecked").returncode == 0
